// HostBufferPool: buffers are reused by size class, registered with the backend once, unregistered
// when freed (past the idle cap, or when the last lease of a destroyed pool returns), and stay
// private to their lease under concurrent use.
#include "server/shard/host_buffer_pool.h"

#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <thread>
#include <vector>

#include "gtest/gtest.h"

namespace moe {
namespace {

// Records registrations; refuses them when `refuse` is set.
class RecordingBackend final : public ExpertBackend {
 public:
  absl::string_view name() const override { return "recording"; }
  std::string device() const override { return "none"; }
  absl::Status CheckSupported(const ExpertLayer&) const override { return absl::OkStatus(); }
  absl::Status PrepareLayer(int, const ExpertLayer&) override { return absl::OkStatus(); }
  absl::Status Run(int, const ExpertLayer&, const ExpertsRequest&) override {
    return absl::UnimplementedError("not used");
  }
  absl::Status RegisterHostMemory(void* data, size_t bytes) override {
    absl::MutexLock lock(&mu);
    if (refuse) return absl::ResourceExhaustedError("refused");
    EXPECT_EQ(registered.count(data), 0u) << "registered twice";
    registered[data] = bytes;
    ++registrations;
    return absl::OkStatus();
  }
  void UnregisterHostMemory(void* data) override {
    absl::MutexLock lock(&mu);
    registered.erase(data);
  }
  size_t live() {
    absl::MutexLock lock(&mu);
    return registered.size();
  }

  absl::Mutex mu;
  bool refuse = false;
  std::map<void*, size_t> registered;
  int registrations = 0;
};

TEST(HostBufferPoolTest, ReusesBuffersOfTheSameSizeClass) {
  RecordingBackend backend;
  HostBufferPool pool(&backend);
  uint8_t* first = nullptr;
  {
    HostBufferPool::Lease a = pool.Acquire(100 << 10);
    ASSERT_FALSE(a.empty());
    EXPECT_EQ(a.capacity(), size_t{128} << 10);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(a.data()) % 4096, 0u);
    std::memset(a.data(), 1, a.capacity());
    first = a.data();
    EXPECT_EQ(backend.registered.at(first), size_t{128} << 10);
  }
  HostBufferPool::Lease b = pool.Acquire(70 << 10);  // same class: the same buffer
  EXPECT_EQ(b.data(), first);
  HostBufferPool::Lease c = pool.Acquire(1 << 20);  // another class: a new one
  EXPECT_NE(c.data(), first);
  EXPECT_EQ(c.capacity(), size_t{1} << 20);
  const HostBufferPoolStats s = pool.stats();
  EXPECT_EQ(s.allocations, 2);
  EXPECT_EQ(s.reuses, 1);
  EXPECT_EQ(s.registered, 2);
  EXPECT_EQ(s.lent_bytes, (size_t{128} << 10) + (size_t{1} << 20));
  EXPECT_EQ(s.idle_bytes, 0u);
  EXPECT_EQ(backend.registrations, 2);
}

TEST(HostBufferPoolTest, SmallBuffersAreNotRegistered) {
  RecordingBackend backend;
  HostBufferPool pool(&backend);
  HostBufferPool::Lease a = pool.Acquire(1000);
  ASSERT_FALSE(a.empty());
  EXPECT_EQ(a.capacity(), 4096u);
  EXPECT_EQ(backend.registrations, 0);
  EXPECT_EQ(pool.stats().registered, 0);
}

TEST(HostBufferPoolTest, IdleCapFreesAndUnregistersTheRest) {
  RecordingBackend backend;
  HostBufferPoolOptions options;
  options.max_idle_bytes = size_t{256} << 10;
  HostBufferPool pool(&backend, options);
  {
    HostBufferPool::Lease a = pool.Acquire(256 << 10);
    HostBufferPool::Lease b = pool.Acquire(256 << 10);
    EXPECT_NE(a.data(), b.data());
    EXPECT_EQ(backend.live(), 2u);
  }
  const HostBufferPoolStats s = pool.stats();
  EXPECT_EQ(s.frees, 1);
  EXPECT_EQ(s.idle_bytes, size_t{256} << 10);
  EXPECT_EQ(s.lent_bytes, 0u);
  EXPECT_EQ(backend.live(), 1u);  // the idle one stays registered
}

TEST(HostBufferPoolTest, BuffersNeverKeptAreNotRegistered) {
  RecordingBackend backend;
  HostBufferPoolOptions options;
  options.max_idle_bytes = 0;
  HostBufferPool pool(&backend, options);
  { HostBufferPool::Lease a = pool.Acquire(1 << 20); }
  HostBufferPool::Lease b = pool.Acquire(1 << 20);
  ASSERT_FALSE(b.empty());
  EXPECT_EQ(backend.registrations, 0);
  EXPECT_EQ(pool.stats().allocations, 2);
  EXPECT_EQ(pool.stats().frees, 1);
}

TEST(HostBufferPoolTest, RefusedRegistrationStillLendsTheBuffer) {
  RecordingBackend backend;
  backend.refuse = true;
  HostBufferPool pool(&backend);
  HostBufferPool::Lease a = pool.Acquire(512 << 10);
  ASSERT_FALSE(a.empty());
  std::memset(a.data(), 7, a.capacity());
  EXPECT_EQ(pool.stats().allocations, 1);
  EXPECT_EQ(pool.stats().registered, 0);
}

TEST(HostBufferPoolTest, LeaseOutlivesThePool) {
  RecordingBackend backend;
  HostBufferPool::Lease kept;
  {
    HostBufferPool pool(&backend);
    { HostBufferPool::Lease idle = pool.Acquire(1 << 20); }
    kept = pool.Acquire(2 << 20);
    EXPECT_EQ(backend.live(), 2u);
  }
  ASSERT_FALSE(kept.empty());
  std::memset(kept.data(), 3, kept.capacity());  // still ours
  EXPECT_EQ(backend.live(), 2u);  // the pool's state lives on with the lease
  kept = HostBufferPool::Lease();
  EXPECT_EQ(backend.live(), 0u);  // the last lease took the idle buffers down with it
}

TEST(HostBufferPoolTest, LeasesStayPrivateUnderConcurrentUse) {
  RecordingBackend backend;
  HostBufferPoolOptions options;
  options.max_idle_bytes = size_t{1} << 20;
  HostBufferPool pool(&backend, options);
  constexpr int kThreads = 8;
  constexpr int kRounds = 300;
  std::vector<std::thread> threads;
  std::vector<int> corrupted(kThreads, 0);
  for (int id = 0; id < kThreads; ++id) {
    threads.emplace_back([&, id] {
      for (int r = 0; r < kRounds; ++r) {
        const size_t bytes = size_t{1} << (12 + (id + r) % 7);
        HostBufferPool::Lease lease = pool.Acquire(bytes);
        if (lease.empty()) {
          ++corrupted[id];
          continue;
        }
        std::memset(lease.data(), id + 1, bytes);
        std::this_thread::yield();
        for (size_t i = 0; i < bytes; i += 509) {
          if (lease.data()[i] != id + 1) {
            ++corrupted[id];
            break;
          }
        }
      }
    });
  }
  for (std::thread& t : threads) t.join();
  for (int id = 0; id < kThreads; ++id) EXPECT_EQ(corrupted[id], 0) << "thread " << id;
  const HostBufferPoolStats s = pool.stats();
  EXPECT_EQ(s.lent_bytes, 0u);
  EXPECT_LE(s.idle_bytes, options.max_idle_bytes);
  EXPECT_EQ(s.allocations + s.reuses, kThreads * kRounds);
  EXPECT_GT(s.reuses, 0);
}

}  // namespace
}  // namespace moe
