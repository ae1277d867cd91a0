#include "server/shard/shm_channel.h"

#include <algorithm>
#include <cstring>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"

namespace moe {

ShmChannelServer::ShmChannelServer(ShmRegistry::Lease lease, ShmChannelBlock* block,
                                   ServeFn serve)
    : lease_(std::move(lease)),
      block_(block),
      serve_(std::move(serve)),
      // Requests count from the value at open: the client posts only after OpenChannel returned.
      last_seq_(block->request_seq.load(std::memory_order_acquire)),
      thread_([this] { Loop(); }) {}

ShmChannelServer::~ShmChannelServer() {
  stop_.store(true);
  FutexWakeAll(&block_->request_seq);
  thread_.join();
}

void ShmChannelServer::Loop() {
  // The timed wait bounds how long a stop can go unnoticed if a wake-up is lost.
  const timespec wait{0, 100'000'000};
  while (!stop_.load()) {
    const uint32_t seq = block_->request_seq.load(std::memory_order_acquire);
    if (seq == last_seq_) {
      FutexWait(&block_->request_seq, seq, wait);
      continue;
    }
    last_seq_ = seq;
    ServeOne(seq);
  }
}

void ShmChannelServer::ServeOne(uint32_t seq) {
  // One read of the length, then a private copy: the client may rewrite the block meanwhile.
  const uint32_t len = reinterpret_cast<volatile const uint32_t&>(block_->request_len);
  absl::Status status;
  v1::ForwardResponse response;
  if (len > kShmChannelRequestBytes) {
    status = absl::InvalidArgumentError(absl::StrCat("channel request_len ", len, " exceeds the ",
                                                     kShmChannelRequestBytes,
                                                     "-byte request area"));
  } else {
    std::string bytes(block_->request, len);
    v1::ShmForwardRequest request;
    if (!request.ParseFromString(bytes)) {
      status = absl::InvalidArgumentError(
          absl::StrCat("channel request (", len, " bytes) is not a valid ShmForwardRequest"));
    } else {
      status = serve_(request, &response);
    }
  }
  std::string out;
  if (status.ok()) {
    out = response.SerializeAsString();
    if (out.size() > kShmChannelResponseBytes) {
      status = absl::ResourceExhaustedError(
          absl::StrCat("response header of ", out.size(), " bytes exceeds the channel's ",
                       kShmChannelResponseBytes, "-byte response area; use Forward"));
    }
  }
  if (!status.ok()) out = std::string(status.message().substr(0, kShmChannelResponseBytes));
  std::memcpy(block_->response, out.data(), out.size());
  block_->response_len = static_cast<uint32_t>(out.size());
  block_->status_code = static_cast<int32_t>(status.code());
  served_.fetch_add(1);
  block_->response_seq.store(seq, std::memory_order_release);
  FutexWakeAll(&block_->response_seq);
}

}  // namespace moe
