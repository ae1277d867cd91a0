// Shared-memory Forward against an in-process shard: same answer as Forward; each misuse
// (unregistered region, ranges out of bounds, overflowing or overlapping, a region removed while
// in use, bad registrations) gets its precise error and the shard keeps serving.
#include "server/shard/shm_forward.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "moe/v1/shard.grpc.pb.h"
#include "moe/v1/shm.grpc.pb.h"
#include "server/model/generator.h"
#include "client/raw_forward.h"
#include "client/shm_channel.h"
#include "client/tcp_channel.h"
#include "server/common/shm_channel_layout.h"
#include "server/shard/in_process_shard.h"

namespace moe {
namespace {

constexpr int64_t kHidden = 128;
constexpr int64_t kTokens = 4;
constexpr uint64_t kIn = kTokens * kHidden * 2;    // BF16 hidden states
constexpr uint64_t kOut = kTokens * kHidden * 4;   // F32 output
constexpr uint64_t kRegion = 64 * 1024;

class ShmForwardTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    const std::string dir = absl::StrCat(std::getenv("TEST_TMPDIR"), "/shm_forward_model");
    model::GenerateOptions gen;
    gen.hidden = kHidden;
    ASSERT_TRUE(model::GenerateModel(gen, dir).ok());
    InProcessShardOptions options;
    options.model_dir = dir;
    absl::StatusOr<std::unique_ptr<InProcessShard>> shard = InProcessShard::Start(options);
    ASSERT_TRUE(shard.ok()) << shard.status();
    shard_ = shard->release();
    auto channel = grpc::CreateChannel(shard_->address(), grpc::InsecureChannelCredentials());
    shm_stub_ = v1::SharedMemoryShard::NewStub(channel).release();
    stub_ = v1::ExpertShard::NewStub(channel).release();
  }
  static void TearDownTestSuite() {
    delete shm_stub_;
    delete stub_;
    delete shard_;
  }

  void SetUp() override {
    key_ = absl::StrCat("/moe_shm_test_", getpid());
    const int fd = shm_open(key_.c_str(), O_CREAT | O_RDWR | O_TRUNC, 0600);
    ASSERT_GE(fd, 0);
    ASSERT_EQ(ftruncate(fd, kRegion), 0);
    void* p = mmap(nullptr, kRegion, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    ASSERT_NE(p, MAP_FAILED);
    base_ = static_cast<uint8_t*>(p);
  }
  void TearDown() override {
    munmap(base_, kRegion);
    shm_unlink(key_.c_str());
  }

  static std::unique_ptr<grpc::ClientContext> Context() {
    auto ctx = std::make_unique<grpc::ClientContext>();
    ctx->set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(30)));
    return ctx;
  }

  grpc::Status Register(const std::string& id, const std::string& key, uint64_t size) {
    v1::RegisterSharedMemoryRequest req;
    req.set_region_id(id);
    req.set_shm_key(key);
    req.set_byte_size(size);
    v1::RegisterSharedMemoryResponse resp;
    return shm_stub_->RegisterSharedMemory(Context().get(), req, &resp);
  }
  grpc::Status Unregister(const std::string& id) {
    v1::UnregisterSharedMemoryRequest req;
    req.set_region_id(id);
    v1::UnregisterSharedMemoryResponse resp;
    return shm_stub_->UnregisterSharedMemory(Context().get(), req, &resp);
  }

  // Request of kTokens BF16 tokens routed to (t, t + 4); payload written at region offset 0.
  v1::ShmForwardRequest MakeRequest(const std::string& id, std::string* payload) {
    v1::ShmForwardRequest shm;
    v1::ForwardRequest* req = shm.mutable_request();
    req->set_layer(0);
    req->set_output_dtype(v1::F32);
    v1::HiddenStates* hs = req->mutable_hidden_states();
    hs->set_format(v1::ACTIVATION_BF16);
    hs->mutable_data()->set_dtype(v1::BF16);
    hs->mutable_data()->add_shape(kTokens);
    hs->mutable_data()->add_shape(kHidden);
    payload->resize(kIn);
    for (uint64_t i = 0; i < kIn; i += 2) {
      (*payload)[i] = static_cast<char>(i * 13);
      (*payload)[i + 1] = static_cast<char>(i % 6 == 0 ? 0xbe : 0x3e);  // BF16 about +-0.1..0.5
    }
    std::memcpy(base_, payload->data(), kIn);
    std::vector<int32_t> ids;
    std::vector<float> w;
    for (int t = 0; t < kTokens; ++t) {
      ids.insert(ids.end(), {t, t + 4});
      w.insert(w.end(), {0.5f, 0.5f});
    }
    for (auto [tensor, dtype, bytes] :
         {std::tuple{req->mutable_topk_ids(), v1::I32,
                     std::string(reinterpret_cast<const char*>(ids.data()), ids.size() * 4)},
          std::tuple{req->mutable_topk_weights(), v1::F32,
                     std::string(reinterpret_cast<const char*>(w.data()), w.size() * 4)}}) {
      tensor->set_dtype(dtype);
      tensor->add_shape(kTokens);
      tensor->add_shape(2);
      tensor->set_data(bytes);
    }
    shm.mutable_hidden_states()->set_region_id(id);
    shm.mutable_hidden_states()->set_offset(0);
    shm.mutable_hidden_states()->set_length(kIn);
    shm.mutable_output()->set_region_id(id);
    shm.mutable_output()->set_offset(kIn);
    shm.mutable_output()->set_length(kOut);
    return shm;
  }

  grpc::Status Forward(const v1::ShmForwardRequest& req, v1::ForwardResponse* resp) {
    return shm_stub_->Forward(Context().get(), req, resp);
  }

  // A well-formed request still succeeds.
  void ExpectStillServing(const std::string& id) {
    std::string payload;
    v1::ForwardResponse resp;
    EXPECT_TRUE(Forward(MakeRequest(id, &payload), &resp).ok());
  }

  static InProcessShard* shard_;
  static v1::SharedMemoryShard::Stub* shm_stub_;
  static v1::ExpertShard::Stub* stub_;
  std::string key_;
  uint8_t* base_ = nullptr;
};

InProcessShard* ShmForwardTest::shard_ = nullptr;
v1::SharedMemoryShard::Stub* ShmForwardTest::shm_stub_ = nullptr;
v1::ExpertShard::Stub* ShmForwardTest::stub_ = nullptr;

TEST_F(ShmForwardTest, SameOutputAsProtobufForward) {
  ASSERT_TRUE(Register("a", key_, kRegion).ok());
  std::string payload;
  const v1::ShmForwardRequest shm = MakeRequest("a", &payload);
  v1::ForwardRequest full = shm.request();
  full.mutable_hidden_states()->mutable_data()->set_data(payload);
  v1::ForwardResponse expected;
  ASSERT_TRUE(stub_->Forward(Context().get(), full, &expected).ok());
  ASSERT_EQ(expected.output().data().size(), kOut);
  EXPECT_NE(expected.output().data(), std::string(kOut, '\0'));

  v1::ForwardResponse resp;
  const grpc::Status s = Forward(shm, &resp);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_TRUE(resp.output().data().empty());
  EXPECT_EQ(resp.output().dtype(), v1::F32);
  EXPECT_EQ(std::string(reinterpret_cast<const char*>(base_ + kIn), kOut), expected.output().data());
  EXPECT_TRUE(Unregister("a").ok());
}

TEST_F(ShmForwardTest, UnregisteredRegionIsNotFound) {
  std::string payload;
  v1::ForwardResponse resp;
  const grpc::Status s = Forward(MakeRequest("nope", &payload), &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(s.error_message(), "shared memory region 'nope' is not registered");
  EXPECT_EQ(Unregister("nope").error_code(), grpc::StatusCode::NOT_FOUND);
}

TEST_F(ShmForwardTest, RangesAreChecked) {
  ASSERT_TRUE(Register("b", key_, kRegion).ok());
  std::string payload;
  v1::ForwardResponse resp;
  v1::ShmForwardRequest req = MakeRequest("b", &payload);
  req.mutable_hidden_states()->set_offset(kRegion - 10);  // 10 bytes left, kIn wanted
  grpc::Status s = Forward(req, &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(s.error_message(), absl::StrCat("hidden_states: offset 65526 + length ", kIn,
                                            " exceeds region 'b' of 65536 bytes"));
  req = MakeRequest("b", &payload);
  req.mutable_output()->set_offset(kRegion + 1);  // starts past the end
  s = Forward(req, &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(s.error_message(), absl::StrCat("output: offset 65537 + length ", kOut,
                                            " exceeds region 'b' of 65536 bytes"));
  // offset + length wraps around 2^64 to a small number: still rejected.
  req = MakeRequest("b", &payload);
  req.mutable_output()->set_offset(8);
  req.mutable_output()->set_length(UINT64_MAX - 3);
  s = Forward(req, &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(s.error_message(),
            "output: offset 8 + length 18446744073709551612 exceeds region 'b' of 65536 bytes");
  // Output overlapping the hidden states.
  req = MakeRequest("b", &payload);
  req.mutable_output()->set_offset(kIn - 2);
  s = Forward(req, &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(s.error_message(), absl::StrCat("output: range [1022, +", kOut,
                                            ") overlaps the hidden_states range [0, +1024)"));
  // Lengths that do not match the tensors.
  req = MakeRequest("b", &payload);
  req.mutable_output()->set_length(kOut - 4);
  s = Forward(req, &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(s.error_message(), "output: range of 2044 bytes, the output has 2048");
  req = MakeRequest("b", &payload);
  req.mutable_hidden_states()->set_length(kIn - 2);
  s = Forward(req, &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(s.error_message().find("hidden_states.data"), std::string::npos) << s.error_message();
  ExpectStillServing("b");
  EXPECT_TRUE(Unregister("b").ok());
}

TEST_F(ShmForwardTest, RegionInUseCannotBeUnregistered) {
  ASSERT_TRUE(Register("c", key_, kRegion).ok());
  {
    // A request holds the region (as a Forward does while it runs).
    absl::StatusOr<ShmRegistry::Lease> lease = shard_->shm().registry().Acquire("c");
    ASSERT_TRUE(lease.ok());
    const grpc::Status s = Unregister("c");
    EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
    EXPECT_EQ(s.error_message(),
              "shared memory region 'c' is in use by 1 request(s); unregister it later");
    ExpectStillServing("c");
  }
  EXPECT_TRUE(Unregister("c").ok());
  std::string payload;
  v1::ForwardResponse resp;
  EXPECT_EQ(Forward(MakeRequest("c", &payload), &resp).error_code(), grpc::StatusCode::NOT_FOUND);
}

TEST_F(ShmForwardTest, BadRegistrationsAreRejected) {
  grpc::Status s = Register("d", key_, kRegion + 1);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(s.error_message(), absl::StrCat("byte_size: shared memory '", key_,
                                            "' has 65536 bytes, fewer than 65537"));
  s = Register("d", "/moe_shm_test_missing_object", 16);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(s.error_message(),
            "cannot open shared memory '/moe_shm_test_missing_object': No such file or directory");
  s = Register("d", "/../etc/passwd", 16);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(s.error_message(),
            "shm_key: '/../etc/passwd' is not a POSIX shared-memory name (\"/name\")");
  EXPECT_EQ(Register("d", key_, 0).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(Register("", key_, 16).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  ASSERT_TRUE(Register("d", key_, kRegion).ok());
  s = Register("d", key_, kRegion);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::ALREADY_EXISTS);
  EXPECT_EQ(s.error_message(), "shared memory region 'd' is already registered");
  ExpectStillServing("d");
  EXPECT_TRUE(Unregister("d").ok());
}

// The registry's hooks (how a shard pins regions for a CUDA backend) see each mapping once after it
// is made and once before it goes: not while a lease holds it, after a failed duplicate
// registration, and for the regions left when the registry itself goes.
TEST(ShmRegistryHooksTest, SeeEveryMappingOnce) {
  const std::string key = absl::StrCat("/moe_shm_hooks_test_", getpid());
  const int fd = shm_open(key.c_str(), O_CREAT | O_RDWR | O_TRUNC, 0600);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(ftruncate(fd, kRegion), 0);
  close(fd);
  struct Event {
    bool mapped;
    void* base;
    uint64_t bytes;
  };
  std::vector<Event> events;
  {
    ShmRegistry registry(ShmRegistry::Hooks{
        [&events](void* base, uint64_t bytes) {
          static_cast<volatile uint8_t*>(base)[bytes - 1] = 7;  // mapped and writable already
          events.push_back({true, base, bytes});
        },
        [&events](void* base) {
          EXPECT_EQ(static_cast<volatile uint8_t*>(base)[0], 0);  // still mapped
          events.push_back({false, base, 0});
        }});
    ASSERT_TRUE(registry.Register("a", key, kRegion).ok());
    ASSERT_EQ(events.size(), 1u);
    EXPECT_TRUE(events[0].mapped);
    EXPECT_EQ(events[0].bytes, kRegion);
    {
      absl::StatusOr<ShmRegistry::Lease> lease = registry.Acquire("a");
      ASSERT_TRUE(lease.ok());
      EXPECT_EQ(registry.Unregister("a").code(), absl::StatusCode::kFailedPrecondition);
      EXPECT_EQ(events.size(), 1u);
    }
    ASSERT_TRUE(registry.Unregister("a").ok());
    ASSERT_EQ(events.size(), 2u);
    EXPECT_FALSE(events[1].mapped);
    EXPECT_EQ(events[1].base, events[0].base);

    ASSERT_TRUE(registry.Register("b", key, 4096).ok());
    EXPECT_EQ(registry.Register("b", key, 4096).code(), absl::StatusCode::kAlreadyExists);
    // The duplicate's own mapping came and went; the first one of "b" stays.
    ASSERT_EQ(events.size(), 5u);
    EXPECT_TRUE(events[2].mapped);
    EXPECT_TRUE(events[3].mapped);
    EXPECT_FALSE(events[4].mapped);
    EXPECT_EQ(events[4].base, events[3].base);
    EXPECT_NE(events[3].base, events[2].base);
    EXPECT_TRUE(registry.Acquire("b").ok());
  }
  // The registry went with "b" registered.
  ASSERT_EQ(events.size(), 6u);
  EXPECT_FALSE(events[5].mapped);
  EXPECT_EQ(events[5].base, events[2].base);
  shm_unlink(key.c_str());
}

// ---- Request channels ----------------------------------------------------------------------------

// The client library's channel gives the bytes Forward gives, over many requests.
TEST_F(ShmForwardTest, ChannelAnswersLikeForward) {
  ASSERT_TRUE(Register("e", key_, kRegion).ok());
  std::string payload;
  const v1::ShmForwardRequest shm = MakeRequest("e", &payload);
  v1::ForwardRequest full = shm.request();
  full.mutable_hidden_states()->mutable_data()->set_data(payload);
  v1::ForwardResponse expected;
  ASSERT_TRUE(stub_->Forward(Context().get(), full, &expected).ok());
  EXPECT_TRUE(Unregister("e").ok());

  auto grpc_channel = grpc::CreateChannel(shard_->address(), grpc::InsecureChannelCredentials());
  absl::StatusOr<std::unique_ptr<ShmChannel>> channel = ShmChannel::Open(grpc_channel, 8192);
  ASSERT_TRUE(channel.ok()) << channel.status();
  for (int i = 0; i < 50; ++i) {
    // Half the requests wait on the futex alone, half poll first (the default).
    (*channel)->set_spin(i % 2 == 0 ? absl::ZeroDuration() : absl::Microseconds(50));
    std::memcpy((*channel)->data().data(), payload.data(), kIn);
    std::memset((*channel)->data().data() + kIn, 0xFF, kOut);  // poisoned: NaN if not written
    v1::ShmForwardRequest req = shm;  // ranges [0, kIn) and [kIn, kIn + kOut) of data()
    v1::ForwardResponse resp;
    const absl::Status s = (*channel)->Forward(req, &resp);
    ASSERT_TRUE(s.ok()) << s;
    EXPECT_EQ(resp.output().dtype(), v1::F32);
    ASSERT_EQ(std::string(reinterpret_cast<const char*>((*channel)->data().data() + kIn), kOut),
              expected.output().data())
        << "request " << i;
  }
  // The channel pins its region.
  v1::UnregisterSharedMemoryRequest unreg;
  unreg.set_region_id((*channel)->region_id());
  v1::UnregisterSharedMemoryResponse unreg_resp;
  EXPECT_EQ(shm_stub_->UnregisterSharedMemory(Context().get(), unreg, &unreg_resp).error_code(),
            grpc::StatusCode::FAILED_PRECONDITION);
  channel->reset();  // closes, unregisters, unlinks
  ASSERT_TRUE(Register("e", key_, kRegion).ok());
  ExpectStillServing("e");
  EXPECT_TRUE(Unregister("e").ok());
}

// The poll before the futex wait: it returns as soon as the word changes, and gives up (false)
// once its budget has passed with the word unchanged; a zero budget does not poll at all.
TEST(ShmChannelSpinTest, SpinSeesChangeAndGivesUp) {
  std::atomic<uint32_t> word{7};
  const auto start = std::chrono::steady_clock::now();
  EXPECT_FALSE(SpinWhileEquals(&word, 7, std::chrono::microseconds(2000)));
  EXPECT_GE(std::chrono::steady_clock::now() - start, std::chrono::microseconds(2000));
  EXPECT_FALSE(SpinWhileEquals(&word, 7, std::chrono::microseconds(0)));
  EXPECT_FALSE(SpinWhileEquals(&word, 6, std::chrono::microseconds(0)));  // not even one look
  EXPECT_TRUE(SpinWhileEquals(&word, 6, std::chrono::microseconds(1)));
  std::thread writer([&word] {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
    word.store(8, std::memory_order_release);
  });
  EXPECT_TRUE(SpinWhileEquals(&word, 7, std::chrono::seconds(30)));
  EXPECT_EQ(word.load(), 8u);
  writer.join();
}

// Opening a channel: each bad argument gets its precise status; closing an unknown one NOT_FOUND.
TEST_F(ShmForwardTest, ChannelOpenIsValidated) {
  ASSERT_TRUE(Register("f", key_, kRegion).ok());
  const auto open = [&](const std::string& id, uint64_t offset, v1::OpenChannelResponse* out) {
    v1::OpenChannelRequest req;
    req.set_region_id(id);
    req.set_offset(offset);
    return shm_stub_->OpenChannel(Context().get(), req, out);
  };
  v1::OpenChannelResponse opened;
  grpc::Status s = open("f", 8200, &opened);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(s.error_message(), "offset: 8200 is not 64-byte aligned");
  s = open("f", kRegion - 4096, &opened);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(s.error_message(), absl::StrCat("channel block: offset 61440 + length ",
                                            kShmChannelBlockBytes,
                                            " exceeds region 'f' of 65536 bytes"));
  s = open("nope", 0, &opened);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::NOT_FOUND);
  v1::CloseChannelRequest close;
  close.set_channel_id("channel-999999");
  v1::CloseChannelResponse closed;
  s = shm_stub_->CloseChannel(Context().get(), close, &closed);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(s.error_message(), "channel 'channel-999999' is not open");
  ExpectStillServing("f");
  EXPECT_TRUE(Unregister("f").ok());
}

// Garbage written into the block by a misbehaving client: an oversize length, bytes that do not
// parse, ranges outside the region. Each is answered with INVALID_ARGUMENT in the block, the
// channel keeps serving good requests, and closing it unpins the region.
TEST_F(ShmForwardTest, ChannelSurvivesGarbage) {
  ASSERT_TRUE(Register("g", key_, kRegion).ok());
  // The block in a region of its own, at a 64-byte aligned offset that is not 0.
  constexpr uint64_t kBlockAt = 4096 + 64;
  const std::string block_key = key_ + "_block";
  const uint64_t block_region = kBlockAt + kShmChannelBlockBytes;
  const int fd = shm_open(block_key.c_str(), O_CREAT | O_RDWR | O_TRUNC, 0600);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(ftruncate(fd, static_cast<off_t>(block_region)), 0);
  void* mapped = mmap(nullptr, block_region, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  ASSERT_NE(mapped, MAP_FAILED);
  ASSERT_TRUE(Register("g_block", block_key, block_region).ok());
  auto* block = reinterpret_cast<ShmChannelBlock*>(static_cast<uint8_t*>(mapped) + kBlockAt);
  v1::OpenChannelRequest open;
  open.set_region_id("g_block");
  open.set_offset(kBlockAt);
  v1::OpenChannelResponse opened;
  ASSERT_TRUE(shm_stub_->OpenChannel(Context().get(), open, &opened).ok());
  uint32_t seq = 0;
  // Posts `len` bytes (already in block->request) and waits for the answer.
  const auto post = [&](uint32_t len) {
    block->request_len = len;
    block->request_seq.store(++seq, std::memory_order_release);
    FutexWakeAll(&block->request_seq);
    const absl::Time deadline = absl::Now() + absl::Seconds(20);
    while (block->response_seq.load(std::memory_order_acquire) != seq && absl::Now() < deadline) {
      FutexWait(&block->response_seq, block->response_seq.load(), timespec{0, 10'000'000});
    }
    EXPECT_EQ(block->response_seq.load(), seq);
    return std::pair{block->status_code,
                     std::string(block->response, std::min<uint32_t>(block->response_len,
                                                                     kShmChannelResponseBytes))};
  };
  const auto post_request = [&](const v1::ShmForwardRequest& req) {
    const std::string bytes = req.SerializeAsString();
    std::memcpy(block->request, bytes.data(), bytes.size());
    return post(static_cast<uint32_t>(bytes.size()));
  };
  auto [code, message] = post(kShmChannelRequestBytes + 1);
  EXPECT_EQ(code, static_cast<int>(absl::StatusCode::kInvalidArgument));
  EXPECT_EQ(message, absl::StrCat("channel request_len ", kShmChannelRequestBytes + 1,
                                  " exceeds the 1048576-byte request area"));
  std::memset(block->request, 0xFF, 64);
  std::tie(code, message) = post(64);
  EXPECT_EQ(code, static_cast<int>(absl::StatusCode::kInvalidArgument));
  EXPECT_EQ(message, "channel request (64 bytes) is not a valid ShmForwardRequest");
  std::string payload;
  v1::ShmForwardRequest req = MakeRequest("g", &payload);
  req.mutable_output()->set_offset(kRegion - 8);
  std::tie(code, message) = post_request(req);
  EXPECT_EQ(code, static_cast<int>(absl::StatusCode::kInvalidArgument));
  EXPECT_EQ(message, absl::StrCat("output: offset 65528 + length ", kOut,
                                  " exceeds region 'g' of 65536 bytes"));
  std::tie(code, message) = post_request(MakeRequest("g", &payload));
  EXPECT_EQ(code, 0) << message;
  v1::ForwardResponse resp;
  ASSERT_TRUE(resp.ParseFromString(message));
  EXPECT_EQ(resp.output().dtype(), v1::F32);
  // The block's region is pinned while the channel is open; closing unpins it.
  EXPECT_EQ(Unregister("g_block").error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  v1::CloseChannelRequest close;
  close.set_channel_id(opened.channel_id());
  v1::CloseChannelResponse closed;
  ASSERT_TRUE(shm_stub_->CloseChannel(Context().get(), close, &closed).ok());
  EXPECT_EQ(shm_stub_->CloseChannel(Context().get(), close, &closed).error_code(),
            grpc::StatusCode::NOT_FOUND);
  EXPECT_TRUE(Unregister("g_block").ok());
  EXPECT_TRUE(Unregister("g").ok());
  munmap(mapped, block_region);
  shm_unlink(block_key.c_str());
}

// Every Forward path takes an admission ticket: with the shard's one slot in flight held by
// another client, shared-memory Forward, a shm channel, ForwardCuda, ForwardRaw and a TCP channel
// are all refused with RESOURCE_EXHAUSTED (the channels stay usable), and served once it is free.
TEST_F(ShmForwardTest, EveryForwardPathTakesAnAdmissionTicket) {
  InProcessShardOptions options;
  options.model_dir = absl::StrCat(std::getenv("TEST_TMPDIR"), "/shm_forward_model");
  options.admission.max_inflight_total = 1;
  absl::StatusOr<std::unique_ptr<InProcessShard>> shard = InProcessShard::Start(options);
  ASSERT_TRUE(shard.ok()) << shard.status();
  auto channel = grpc::CreateChannel((*shard)->address(), grpc::InsecureChannelCredentials());
  auto shm_stub = v1::SharedMemoryShard::NewStub(channel);
  v1::RegisterSharedMemoryRequest reg;
  reg.set_region_id("q");
  reg.set_shm_key(key_);
  reg.set_byte_size(kRegion);
  v1::RegisterSharedMemoryResponse reg_resp;
  ASSERT_TRUE(shm_stub->RegisterSharedMemory(Context().get(), reg, &reg_resp).ok());
  std::string payload;
  const v1::ShmForwardRequest shm = MakeRequest("q", &payload);
  absl::StatusOr<std::unique_ptr<ShmChannel>> shm_channel = ShmChannel::Open(channel, 8192);
  ASSERT_TRUE(shm_channel.ok()) << shm_channel.status();
  std::memcpy((*shm_channel)->data().data(), payload.data(), kIn);
  absl::StatusOr<std::unique_ptr<TcpChannel>> tcp = TcpChannel::Open(channel.get(), "127.0.0.1");
  ASSERT_TRUE(tcp.ok()) << tcp.status();
  std::vector<uint8_t> out(kOut);

  // Each path, with the outcome it must have.
  auto run_all = [&](absl::StatusCode want) {
    v1::ForwardResponse resp;
    EXPECT_EQ(static_cast<int>(shm_stub->Forward(Context().get(), shm, &resp).error_code()),
              static_cast<int>(want));
    v1::ShmForwardRequest on_channel = shm;  // ranges of the channel's data area
    EXPECT_EQ((*shm_channel)->Forward(on_channel, &resp).code(), want);
    absl::StatusOr<RawForwardReply> raw =
        ForwardRaw(channel.get(), Context().get(), shm.request(), payload);
    EXPECT_EQ(raw.status().code(), want) << raw.status();
    EXPECT_EQ((*tcp)->Forward(shm.request(), payload, absl::MakeSpan(out)).status().code(), want);
    if (want != absl::StatusCode::kOk) {
      // Refused before the request is even looked at (a GPU-less shard would refuse it later).
      v1::CudaForwardRequest cuda;
      EXPECT_EQ(shm_stub->ForwardCuda(Context().get(), cuda, &resp).error_code(),
                grpc::StatusCode::RESOURCE_EXHAUSTED);
    }
  };
  {
    absl::StatusOr<AdmissionController::Ticket> held = (*shard)->admission().Admit("another");
    ASSERT_TRUE(held.ok());
    run_all(absl::StatusCode::kResourceExhausted);
  }
  run_all(absl::StatusCode::kOk);
  EXPECT_EQ((*shard)->admission().stats().rejected, 5u);
  EXPECT_EQ((*shard)->admission().stats().in_flight, 0);
}

}  // namespace
}  // namespace moe
