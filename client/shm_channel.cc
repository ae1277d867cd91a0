#include "client/shm_channel.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "server/common/status.h"

namespace moe {
namespace {

std::unique_ptr<grpc::ClientContext> Context(absl::Duration timeout) {
  auto ctx = std::make_unique<grpc::ClientContext>();
  ctx->set_deadline(absl::ToChronoTime(absl::Now() + timeout));
  return ctx;
}

ShmChannelBlock* Block(uint8_t* base) { return reinterpret_cast<ShmChannelBlock*>(base); }

}  // namespace

absl::StatusOr<std::unique_ptr<ShmChannel>> ShmChannel::Open(std::shared_ptr<grpc::Channel> channel,
                                                             uint64_t data_bytes,
                                                             absl::Duration rpc_timeout) {
  static std::atomic<uint64_t> counter{0};
  std::unique_ptr<ShmChannel> c(new ShmChannel());
  c->stub_ = v1::SharedMemoryShard::NewStub(channel);
  c->rpc_timeout_ = rpc_timeout;
  c->key_ = absl::StrCat("/moe_channel_", getpid(), "_", counter.fetch_add(1));
  // Block first (page-aligned start), data area after it, page-aligned.
  c->data_offset_ = (kShmChannelBlockBytes + 4095) / 4096 * 4096;
  c->data_bytes_ = data_bytes;
  c->map_bytes_ = c->data_offset_ + data_bytes;
  const int fd = shm_open(c->key_.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  if (fd < 0) {
    return absl::UnavailableError(absl::StrCat("shm_open ", c->key_, ": ", std::strerror(errno)));
  }
  const bool sized = ftruncate(fd, static_cast<off_t>(c->map_bytes_)) == 0;
  void* p = sized ? mmap(nullptr, c->map_bytes_, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0)
                  : MAP_FAILED;
  close(fd);
  if (p == MAP_FAILED) {
    shm_unlink(c->key_.c_str());
    return absl::ResourceExhaustedError(
        absl::StrCat("cannot size or map ", c->map_bytes_, " bytes of shared memory"));
  }
  c->base_ = static_cast<uint8_t*>(p);
  v1::RegisterSharedMemoryRequest reg;
  reg.set_region_id(c->key_);
  reg.set_shm_key(c->key_);
  reg.set_byte_size(c->map_bytes_);
  v1::RegisterSharedMemoryResponse reg_resp;
  if (grpc::Status s = c->stub_->RegisterSharedMemory(Context(rpc_timeout).get(), reg, &reg_resp);
      !s.ok()) {
    return FromGrpcStatus(s);
  }
  c->registered_ = true;
  v1::OpenChannelRequest open;
  open.set_region_id(c->key_);
  open.set_offset(0);
  v1::OpenChannelResponse opened;
  if (grpc::Status s = c->stub_->OpenChannel(Context(rpc_timeout).get(), open, &opened); !s.ok()) {
    return FromGrpcStatus(s);
  }
  c->channel_id_ = opened.channel_id();
  {
    absl::MutexLock lock(&c->mu_);
    c->seq_ = Block(c->base_)->request_seq.load(std::memory_order_acquire);
  }
  return c;
}

ShmChannel::~ShmChannel() {
  if (!channel_id_.empty()) {
    v1::CloseChannelRequest req;
    req.set_channel_id(channel_id_);
    v1::CloseChannelResponse resp;
    stub_->CloseChannel(Context(rpc_timeout_).get(), req, &resp).ok();
  }
  if (registered_) {
    v1::UnregisterSharedMemoryRequest req;
    req.set_region_id(key_);
    v1::UnregisterSharedMemoryResponse resp;
    stub_->UnregisterSharedMemory(Context(rpc_timeout_).get(), req, &resp).ok();
  }
  if (base_ != nullptr) {
    munmap(base_, map_bytes_);
    shm_unlink(key_.c_str());
  }
}

void ShmChannel::set_spin(absl::Duration spin) {
  absl::MutexLock lock(&mu_);
  spin_ = std::chrono::microseconds(
      std::max<int64_t>(0, absl::ToInt64Microseconds(spin)));
}

absl::Status ShmChannel::Forward(v1::ShmForwardRequest request, v1::ForwardResponse* response,
                                 absl::Duration timeout) {
  for (v1::SharedMemoryRef* ref : {request.mutable_hidden_states(), request.mutable_output()}) {
    ref->set_region_id(key_);
    ref->set_offset(ref->offset() + data_offset_);
  }
  absl::MutexLock lock(&mu_);
  scratch_.clear();
  if (!request.SerializeToString(&scratch_) || scratch_.size() > kShmChannelRequestBytes) {
    return absl::InvalidArgumentError(absl::StrCat("request header of ", scratch_.size(),
                                                   " bytes exceeds the channel's ",
                                                   kShmChannelRequestBytes, "-byte request area"));
  }
  ShmChannelBlock* block = Block(base_);
  std::memcpy(block->request, scratch_.data(), scratch_.size());
  block->request_len = static_cast<uint32_t>(scratch_.size());
  const uint32_t seq = ++seq_;
  block->request_seq.store(seq, std::memory_order_release);
  FutexWakeAll(&block->request_seq);
  const auto posted = std::chrono::steady_clock::now();
  const absl::Time deadline = absl::Now() + timeout;
  if (spin_.count() > 0 && (last_wait_ <= spin_ || ++unpolled_ >= 16)) {
    unpolled_ = 0;
    SpinWhileEquals(&block->response_seq, block->response_seq.load(std::memory_order_acquire),
                    spin_);
  }
  while (true) {
    const uint32_t got = block->response_seq.load(std::memory_order_acquire);
    if (got == seq) break;
    const absl::Duration left = deadline - absl::Now();
    if (left <= absl::ZeroDuration()) {
      last_wait_ = std::chrono::steady_clock::now() - posted;
      return absl::DeadlineExceededError(
          absl::StrCat("no answer on shared-memory channel ", channel_id_, " within ",
                       absl::FormatDuration(timeout)));
    }
    FutexWait(&block->response_seq, got, absl::ToTimespec(std::min(left, absl::Milliseconds(100))));
  }
  last_wait_ = std::chrono::steady_clock::now() - posted;
  const uint32_t len = std::min<uint32_t>(block->response_len, kShmChannelResponseBytes);
  const int32_t code = block->status_code;
  if (code != 0) {
    return absl::Status(static_cast<absl::StatusCode>(code), absl::string_view(block->response, len));
  }
  if (!response->ParseFromArray(block->response, static_cast<int>(len))) {
    return absl::InternalError("shard posted an unparsable response on the channel");
  }
  return absl::OkStatus();
}

}  // namespace moe
