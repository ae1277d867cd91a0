#include "kernels/cpu/thread_pool.h"

#include <atomic>
#include <mutex>
#include <set>
#include <thread>
#include <vector>

#include "gtest/gtest.h"

namespace moe::cpu {
namespace {

TEST(ThreadPoolTest, RunsEveryIndexOnceOnDistinctThreads) {
  ThreadPool pool(3);
  EXPECT_EQ(pool.num_threads(), 3);
  std::mutex mu;
  std::vector<int> seen;
  std::set<std::thread::id> threads;
  pool.ParallelFor(3, [&](int i, int n) {
    EXPECT_EQ(n, 3);
    std::lock_guard<std::mutex> lock(mu);
    seen.push_back(i);
    threads.insert(std::this_thread::get_id());
  });
  std::sort(seen.begin(), seen.end());
  EXPECT_EQ(seen, (std::vector<int>{0, 1, 2}));
  EXPECT_EQ(threads.size(), 3u);
  EXPECT_TRUE(threads.count(std::this_thread::get_id()));  // the caller is thread 0
}

TEST(ThreadPoolTest, ClampsTheThreadCount) {
  ThreadPool pool(2);
  for (const auto& [requested, expected] : {std::pair{0, 1}, {1, 1}, {2, 2}, {7, 2}}) {
    std::atomic<int> calls{0};
    pool.ParallelFor(requested, [&](int i, int n) {
      EXPECT_EQ(n, expected);
      EXPECT_LT(i, n);
      ++calls;
    });
    EXPECT_EQ(calls.load(), expected) << requested;
  }
  ThreadPool single(1);
  int calls = 0;
  single.ParallelFor(4, [&](int i, int n) {
    EXPECT_EQ(i, 0);
    EXPECT_EQ(n, 1);
    ++calls;
  });
  EXPECT_EQ(calls, 1);
}

// Many short jobs with changing thread counts: a worker that is left out of one job must not run
// the next one twice or miss it, and every write of a job is visible when ParallelFor returns.
TEST(ThreadPoolTest, ManyJobsWithChangingWidths) {
  ThreadPool pool(4);
  std::vector<int64_t> slots(4, 0);
  int64_t expected_total = 0;
  for (int job = 0; job < 4000; ++job) {
    const int width = 1 + job % 4;
    pool.ParallelFor(width, [&](int i, int) { slots[i] += job; });
    expected_total += static_cast<int64_t>(width) * job;
    if (job % 500 == 499) {
      int64_t total = 0;
      for (int64_t s : slots) total += s;
      ASSERT_EQ(total, expected_total) << job;
    }
  }
}

TEST(ThreadPoolTest, DestroysWhileIdle) {
  for (int i = 0; i < 20; ++i) {
    ThreadPool pool(3);
    if (i % 2 == 0) pool.ParallelFor(3, [](int, int) {});
  }
}

}  // namespace
}  // namespace moe::cpu
