// Executor: requests queued together are merged into one backend batch and each caller gets its
// own rows back; budgets and layer boundaries split batches.
#include "server/shard/executor.h"

#include <algorithm>
#include <initializer_list>
#include <memory>
#include <map>
#include <thread>
#include <vector>

#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"

namespace moe {
namespace {

// Writes out[t, j] = hidden[t, j] * 2 + batch_size and records batch sizes; the first batch
// blocks until released so that later requests queue up behind it.
class FakeBackend final : public ExpertBackend {
 public:
  absl::string_view name() const override { return "fake"; }
  std::string device() const override { return "none"; }
  absl::Status CheckSupported(const ExpertLayer&) const override { return absl::OkStatus(); }
  absl::Status PrepareLayer(int, const ExpertLayer&) override { return absl::OkStatus(); }
  absl::Status Run(int, const ExpertLayer&, const ExpertsRequest& r) override {
    if (!started.HasBeenNotified()) started.Notify();
    if (batches.empty()) release.WaitForNotification();
    const int64_t t = r.hidden_states.dim(0), h = r.hidden_states.dim(1);
    batches.push_back(t);
    device_flags.push_back(r.hidden_on_device && r.out_on_device);
    in_registered.push_back(Registered(r.hidden_states) && Registered(r.out));
    for (int64_t i = 0; i < t * h; ++i) {
      r.out.As<float>()[i] = r.hidden_states.As<const float>()[i] * 2 + static_cast<float>(t);
    }
    return absl::OkStatus();
  }
  // With take_parts: merged batches through RunParts (each part written as Run would write its
  // rows); otherwise the base class's UNIMPLEMENTED, and the executor concatenates them.
  absl::Status RunParts(int layer_index, const ExpertLayer& layer, const ExpertsRequest& r,
                        absl::Span<const TensorView> hidden_parts,
                        absl::Span<const TensorView> out_parts) override {
    if (!take_parts) {
      return ExpertBackend::RunParts(layer_index, layer, r, hidden_parts, out_parts);
    }
    const int64_t t = r.hidden_states.dim(0), h = r.hidden_states.dim(1);
    batches.push_back(t);
    device_flags.push_back(false);
    in_registered.push_back(false);
    std::vector<int64_t> rows;
    for (size_t p = 0; p < hidden_parts.size(); ++p) {
      rows.push_back(hidden_parts[p].dim(0));
      for (int64_t i = 0; i < hidden_parts[p].dim(0) * h; ++i) {
        out_parts[p].As<float>()[i] =
            hidden_parts[p].As<const float>()[i] * 2 + static_cast<float>(t);
      }
    }
    parts_seen.push_back(rows);
    return absl::OkStatus();
  }
  absl::Status RegisterHostMemory(void* data, size_t bytes) override {
    registered[data] = bytes;
    ++registrations;
    return absl::OkStatus();
  }
  void UnregisterHostMemory(void* data) override { registered.erase(data); }
  bool Registered(const TensorView& v) const {
    for (const auto& [base, bytes] : registered) {
      const auto* b = static_cast<const char*>(base);
      const auto* p = static_cast<const char*>(v.data);
      if (p >= b && p + v.NumBytes() <= b + bytes) return true;
    }
    return false;
  }

  absl::Notification started, release;
  std::vector<int64_t> batches;
  std::vector<bool> device_flags;   // per batch: both device flags reached the backend
  std::vector<bool> in_registered;  // per batch: hidden states and output in registered memory
  std::map<void*, size_t> registered;
  int registrations = 0;
  bool take_parts = false;
  std::vector<std::vector<int64_t>> parts_seen;  // rows of each RunParts batch's parts
};

struct Item {
  Item(int64_t t, int64_t h, float value, const ExpertLayer* layer, int layer_index)
      : hidden(DType::kF32, {t, h}),
        ids(DType::kI32, {t, 1}),
        weights(DType::kF32, {t, 1}),
        out(DType::kF32, {t, h}) {
    for (int64_t i = 0; i < t * h; ++i) hidden.data<float>()[i] = value + i;
    work = WorkItem{layer_index,    layer,        hidden.view(), ids.view(),
                    weights.view(), TensorView{}, out.view()};
  }
  HostTensor hidden, ids, weights, out;
  WorkItem work;
};

// Runs `first` on its own thread and waits until the backend holds it (the worker is then busy),
// then queues `items` in this order, each on its own thread once the previous one is in the
// queue (threads started together could queue in any order), and releases the worker. Joins all.
void RunBehindFirst(Executor& executor, FakeBackend& backend, Item& first,
                    std::initializer_list<Item*> items) {
  std::thread t0([&] { EXPECT_TRUE(executor.Run(first.work).ok()); });
  backend.started.WaitForNotification();
  std::vector<std::thread> threads;
  const absl::Time give_up = absl::Now() + absl::Seconds(10);  // bounded waits on the depth
  size_t queued = 0;
  for (Item* item : items) {
    threads.emplace_back([&executor, item] { EXPECT_TRUE(executor.Run(item->work).ok()); });
    ++queued;
    while (executor.queued_requests() < queued && absl::Now() < give_up)
      absl::SleepFor(absl::Milliseconds(1));
  }
  // The worker is released only once all are queued.
  EXPECT_EQ(executor.queued_requests(), items.size());
  backend.release.Notify();
  t0.join();
  for (auto& t : threads) t.join();
}

TEST(ExecutorTest, MergesQueuedRequestsOfTheSameLayer) {
  FakeBackend backend;
  ExpertLayer layer_a, layer_b;
  Executor executor(&backend, ExecutorOptions{.max_batch_tokens = 100});
  Item first(1, 2, 0.f, &layer_a, 0);
  Item a(3, 2, 10.f, &layer_a, 0), b(4, 2, 20.f, &layer_a, 0), c(2, 2, 30.f, &layer_b, 1);
  RunBehindFirst(executor, backend, first, {&a, &b, &c});
  // Batches: {first}, then {a, b} merged (same layer, 7 tokens), then {c} (another layer).
  ASSERT_EQ(backend.batches.size(), 3u);
  // The merged batch's hidden states and output sat in the executor's buffers, registered with
  // the backend (a CUDA backend then skips its staging copies); the callers' own were not.
  EXPECT_EQ(backend.in_registered, (std::vector<bool>{false, true, false}));
  EXPECT_EQ(backend.registrations, 2);
  EXPECT_EQ(backend.batches[0], 1);
  EXPECT_EQ(backend.batches[1], 7);
  EXPECT_EQ(backend.batches[2], 2);
  // Each caller got its own rows: hidden * 2 + batch size.
  for (int64_t i = 0; i < 6; ++i) EXPECT_EQ(a.out.data<float>()[i], (10.f + i) * 2 + 7);
  for (int64_t i = 0; i < 8; ++i) EXPECT_EQ(b.out.data<float>()[i], (20.f + i) * 2 + 7);
  for (int64_t i = 0; i < 4; ++i) EXPECT_EQ(c.out.data<float>()[i], (30.f + i) * 2 + 2);
  const ExecutorStats s = executor.stats();
  EXPECT_EQ(s.requests, 4u);
  EXPECT_EQ(s.batches, 3u);
  EXPECT_EQ(s.merged_batches, 1u);
  EXPECT_EQ(s.max_batch_tokens, 7u);
  EXPECT_EQ(executor.TakeStatsDelta().requests, 4u);
  EXPECT_EQ(executor.TakeStatsDelta().requests, 0u);
}

// A backend that takes a merged batch as its requests' own rows (RunParts) gets them in queue
// order, and no concatenation happens on the host (the merge buffers are never made).
TEST(ExecutorTest, MergedBatchesGoToRunPartsWhereTheBackendTakesThem) {
  FakeBackend backend;
  backend.take_parts = true;
  ExpertLayer layer;
  Executor executor(&backend, ExecutorOptions{.max_batch_tokens = 100});
  Item first(1, 2, 0.f, &layer, 0);
  Item a(3, 2, 10.f, &layer, 0), b(4, 2, 20.f, &layer, 0), c(2, 2, 30.f, &layer, 0);
  RunBehindFirst(executor, backend, first, {&a, &b, &c});
  ASSERT_EQ(backend.batches, (std::vector<int64_t>{1, 9}));
  EXPECT_EQ(backend.parts_seen, (std::vector<std::vector<int64_t>>{{3, 4, 2}}));
  EXPECT_EQ(backend.registrations, 0);
  for (int64_t i = 0; i < 6; ++i) EXPECT_EQ(a.out.data<float>()[i], (10.f + i) * 2 + 9);
  for (int64_t i = 0; i < 8; ++i) EXPECT_EQ(b.out.data<float>()[i], (20.f + i) * 2 + 9);
  for (int64_t i = 0; i < 4; ++i) EXPECT_EQ(c.out.data<float>()[i], (30.f + i) * 2 + 9);
  EXPECT_EQ(executor.stats().merged_batches, 1u);
}

// The merge buffers stay registered from batch to batch and are unregistered (and freed) when
// the executor goes.
TEST(ExecutorTest, MergeBuffersGoWithTheExecutor) {
  FakeBackend backend;
  ExpertLayer layer;
  {
    Executor executor(&backend, ExecutorOptions{.max_batch_tokens = 100});
    Item first(1, 2, 0.f, &layer, 0);
    Item a(2, 2, 10.f, &layer, 0), b(2, 2, 20.f, &layer, 0);
    RunBehindFirst(executor, backend, first, {&a, &b});
    ASSERT_EQ(backend.batches, (std::vector<int64_t>{1, 4}));
    EXPECT_EQ(backend.registered.size(), 2u);
    for (int64_t i = 0; i < 4; ++i) EXPECT_EQ(b.out.data<float>()[i], (20.f + i) * 2 + 4);
  }
  EXPECT_TRUE(backend.registered.empty());
}

// A request with device tensors (a ForwardCuda on a CUDA backend) runs alone, with its flags;
// host requests queued around it still merge with each other.
TEST(ExecutorTest, DeviceTensorRequestsRunAlone) {
  FakeBackend backend;
  ExpertLayer layer;
  Executor executor(&backend, ExecutorOptions{.max_batch_tokens = 100});
  Item first(1, 2, 0.f, &layer, 0);
  Item a(3, 2, 10.f, &layer, 0), d(2, 2, 20.f, &layer, 0), b(4, 2, 30.f, &layer, 0);
  d.work.hidden_on_device = true;  // host memory here: only the flags are under test
  d.work.out_on_device = true;
  RunBehindFirst(executor, backend, first, {&a, &d, &b});
  // {first}, {a, b} merged past d, then {d} alone with its flags.
  ASSERT_EQ(backend.batches, (std::vector<int64_t>{1, 7, 2}));
  EXPECT_EQ(backend.device_flags, (std::vector<bool>{false, false, true}));
  for (int64_t i = 0; i < 4; ++i) EXPECT_EQ(d.out.data<float>()[i], (20.f + i) * 2 + 2);
  EXPECT_EQ(executor.stats().merged_batches, 1u);
}

TEST(ExecutorTest, TokenBudgetSplitsBatches) {
  FakeBackend backend;
  backend.release.Notify();
  ExpertLayer layer;
  Executor executor(&backend, ExecutorOptions{.max_batch_tokens = 4});
  Item a(3, 1, 0.f, &layer, 0), b(3, 1, 0.f, &layer, 0);
  std::thread ta([&] { EXPECT_TRUE(executor.Run(a.work).ok()); });
  std::thread tb([&] { EXPECT_TRUE(executor.Run(b.work).ok()); });
  ta.join();
  tb.join();
  // 3 + 3 > 4: never merged.
  EXPECT_EQ(backend.batches, (std::vector<int64_t>{3, 3}));
  EXPECT_EQ(executor.stats().merged_batches, 0u);
}

// A request whose deadline has passed when its batch is formed is answered DEADLINE_EXCEEDED and
// never reaches the backend; one queued beside it with time left still runs.
TEST(ExecutorTest, DropsExpiredRequestsWhenTheirBatchIsFormed) {
  FakeBackend backend;
  ExpertLayer layer;
  Executor executor(&backend, ExecutorOptions{.max_batch_tokens = 100});
  Item first(1, 2, 0.f, &layer, 0);
  std::thread t0([&] { EXPECT_TRUE(executor.Run(first.work).ok()); });
  backend.started.WaitForNotification();  // the worker is busy with `first`
  Item expired(3, 2, 10.f, &layer, 0), live(2, 2, 20.f, &layer, 0);
  expired.work.deadline = absl::Now() - absl::Milliseconds(1);
  live.work.deadline = absl::Now() + absl::Hours(1);
  absl::Status expired_status, live_status;
  std::thread t1([&] { expired_status = executor.Run(expired.work); });
  std::thread t2([&] { live_status = executor.Run(live.work); });
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  while (executor.queued_requests() < 2 && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(1));
  }
  ASSERT_EQ(executor.queued_requests(), 2u);
  backend.release.Notify();
  t0.join();
  t1.join();
  t2.join();
  EXPECT_EQ(expired_status.code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_TRUE(live_status.ok()) << live_status;
  // Only `first` (1 token) and `live` (2 tokens) ran, in two batches.
  EXPECT_EQ(backend.batches, (std::vector<int64_t>{1, 2}));
  EXPECT_EQ(live.out.data<float>()[0], 20.f * 2 + 2);
  const ExecutorStats stats = executor.stats();
  EXPECT_EQ(stats.requests, 2u);
  EXPECT_EQ(stats.tokens, 3u);
  EXPECT_EQ(stats.expired, 1u);
}

// A backend that runs `lanes` batches at once: each Run waits (up to `hold`) until `overlap`
// Runs are in progress (or all `expected` Runs have started), then writes out = hidden * 2 +
// 1000 * layer index and records the most Runs it saw in progress at once. The first `gated`
// Runs also wait for `release`.
class LaneBackend final : public ExpertBackend {
 public:
  LaneBackend(int lanes, int overlap, absl::Duration hold)
      : lanes_(lanes), overlap_(overlap), hold_(hold) {}
  absl::string_view name() const override { return "lanes"; }
  std::string device() const override { return "none"; }
  int MaxConcurrentRuns() const override { return lanes_; }
  absl::Status CheckSupported(const ExpertLayer&) const override { return absl::OkStatus(); }
  absl::Status PrepareLayer(int, const ExpertLayer&) override { return absl::OkStatus(); }
  absl::Status Run(int layer_index, const ExpertLayer&, const ExpertsRequest& r) override {
    bool gate = false;
    {
      absl::MutexLock lock(&mu_);
      gate = started_++ < gated;
      max_in_flight = std::max(max_in_flight, ++in_flight_);
      batch_tokens.push_back(r.hidden_states.dim(0));
    }
    if (gate) {
      // Held until release, and no longer.
      release.WaitForNotification();
    } else {
      absl::MutexLock lock(&mu_);
      mu_.AwaitWithTimeout(absl::Condition(
                               +[](LaneBackend* b) ABSL_NO_THREAD_SAFETY_ANALYSIS {
                                 return b->in_flight_ >= b->overlap_ ||
                                        (b->expected > 0 && b->started_ >= b->expected);
                               },
                               this),
                           hold_);
    }
    // Read only now: a buffer shared with another batch in progress would hold its rows.
    for (int64_t i = 0; i < r.hidden_states.NumElements(); ++i) {
      r.out.As<float>()[i] =
          r.hidden_states.As<const float>()[i] * 2 + 1000.f * static_cast<float>(layer_index);
    }
    absl::MutexLock lock(&mu_);
    --in_flight_;
    return absl::OkStatus();
  }
  // Runs started so far.
  int started() {
    absl::MutexLock lock(&mu_);
    return started_;
  }

  int gated = 0;  // the first `gated` Runs wait for release (and only for it)
  int expected = 0;
  absl::Notification release;
  int max_in_flight = 0;              // guarded by mu_ (read after the Runs)
  std::vector<int64_t> batch_tokens;  // guarded by mu_ (read after the Runs)

 private:
  const int lanes_, overlap_;
  const absl::Duration hold_;
  absl::Mutex mu_;
  int in_flight_ = 0;
  int started_ = 0;
};

// The executor runs as many batches at once as the backend takes, and never more.
TEST(ExecutorTest, RunsAsManyBatchesAtOnceAsTheBackendTakes) {
  for (int lanes : {1, 2}) {
    // With one lane a Run would wait for a second forever: bounded by a short hold.
    LaneBackend backend(lanes, /*overlap=*/2,
                        lanes == 1 ? absl::Milliseconds(20) : absl::Seconds(30));
    backend.expected = 6;
    ExpertLayer layer;
    Executor executor(&backend, ExecutorOptions{.max_batch_tokens = 1});  // no merging
    std::vector<std::unique_ptr<Item>> items;
    for (int i = 0; i < 6; ++i) {
      items.push_back(std::make_unique<Item>(1, 3, 100.f * static_cast<float>(i), &layer, 0));
    }
    std::vector<std::thread> threads;
    for (auto& item : items) {
      threads.emplace_back([&executor, &item] { EXPECT_TRUE(executor.Run(item->work).ok()); });
    }
    for (auto& t : threads) t.join();
    EXPECT_EQ(backend.max_in_flight, lanes);
    EXPECT_EQ(backend.batch_tokens.size(), items.size());
    for (const auto& item : items) {
      for (int64_t j = 0; j < 3; ++j) {
        EXPECT_EQ(item->out.data<float>()[j], item->hidden.data<float>()[j] * 2);
      }
    }
    EXPECT_EQ(executor.stats().requests, items.size());
  }
}

// Two merged batches running at once each concatenate their rows into their own buffers.
TEST(ExecutorTest, ConcurrentMergedBatchesKeepTheirOwnBuffers) {
  LaneBackend backend(/*lanes=*/2, /*overlap=*/2, absl::Seconds(30));
  backend.gated = 2;
  backend.expected = 4;
  ExpertLayer layer0, layer1;
  Executor executor(&backend, ExecutorOptions{.max_batch_tokens = 100});
  // a and b (of different layers) take both lanes, inline on their callers' threads, and wait
  // for release.
  Item a(1, 4, 0.f, &layer0, 0), b(1, 4, 50.f, &layer1, 1);
  std::thread ta([&] { EXPECT_TRUE(executor.Run(a.work).ok()); });
  std::thread tb([&] { EXPECT_TRUE(executor.Run(b.work).ok()); });
  const absl::Time give_up = absl::Now() + absl::Seconds(30);
  while (backend.started() < 2 && absl::Now() < give_up) absl::SleepFor(absl::Milliseconds(1));
  ASSERT_EQ(backend.started(), 2);
  // Two requests per layer queue behind them; each layer's pair becomes one merged batch once
  // that layer's running batch ends, and the two batches run at once on the two lanes.
  Item c1(2, 4, 100.f, &layer0, 0), c2(3, 4, 200.f, &layer0, 0);
  Item d1(4, 4, 300.f, &layer1, 1), d2(5, 4, 400.f, &layer1, 1);
  std::vector<std::thread> threads;
  size_t queued = 0;
  for (Item* item : {&c1, &d1, &c2, &d2}) {
    threads.emplace_back([&executor, item] { EXPECT_TRUE(executor.Run(item->work).ok()); });
    ++queued;
    while (executor.queued_requests() < queued && absl::Now() < give_up) {
      absl::SleepFor(absl::Milliseconds(1));
    }
  }
  ASSERT_EQ(executor.queued_requests(), 4u);
  backend.release.Notify();
  ta.join();
  tb.join();
  for (auto& t : threads) t.join();
  EXPECT_EQ(backend.max_in_flight, 2);
  std::vector<int64_t> tokens = backend.batch_tokens;
  std::sort(tokens.begin(), tokens.end());
  EXPECT_EQ(tokens, (std::vector<int64_t>{1, 1, 5, 9}));
  for (const Item* item : {&a, &b, &c1, &c2, &d1, &d2}) {
    const float layer = item->work.layer_index * 1000.f;
    for (int64_t i = 0; i < item->hidden.NumElements(); ++i) {
      ASSERT_EQ(item->out.data<float>()[i], item->hidden.data<float>()[i] * 2 + layer)
          << "item of layer " << item->work.layer_index << ", element " << i;
    }
  }
  EXPECT_EQ(executor.stats().merged_batches, 2u);
}

// Merge before overlap: while a layer's batch runs, a free lane does not start another batch of
// that layer (the requests queue and merge into its next batch) unless its queue holds a batch's
// worth of tokens; a request of another layer takes the free lane at once.
TEST(ExecutorTest, MergesBeforeOverlappingOneLayer) {
  LaneBackend backend(/*lanes=*/2, /*overlap=*/1, absl::ZeroDuration());
  backend.gated = 1;  // a holds its lane until release
  ExpertLayer layer0, layer1;
  Executor executor(&backend, ExecutorOptions{.max_batch_tokens = 8});
  const absl::Time give_up = absl::Now() + absl::Seconds(30);
  const auto wait_for = [&](auto done) {
    while (!done() && absl::Now() < give_up) absl::SleepFor(absl::Milliseconds(1));
    return done();
  };
  Item a(1, 4, 0.f, &layer0, 0);
  std::thread ta([&] { EXPECT_TRUE(executor.Run(a.work).ok()); });
  ASSERT_TRUE(wait_for([&] { return backend.started() == 1; }));
  // b and c (layer 0, 2 + 3 tokens: under the budget of 8) wait although a lane is free.
  Item b(2, 4, 100.f, &layer0, 0), c(3, 4, 200.f, &layer0, 0);
  std::thread tb([&] { EXPECT_TRUE(executor.Run(b.work).ok()); });
  ASSERT_TRUE(wait_for([&] { return executor.queued_requests() == 1; }));
  std::thread tc([&] { EXPECT_TRUE(executor.Run(c.work).ok()); });
  ASSERT_TRUE(wait_for([&] { return executor.queued_requests() == 2; }));
  // d, of layer 1, runs on the free lane at once (inline on its thread).
  Item d(1, 4, 300.f, &layer1, 1);
  EXPECT_TRUE(executor.Run(d.work).ok());
  EXPECT_EQ(backend.started(), 2);
  EXPECT_EQ(executor.queued_requests(), 2u);  // b and c still wait for a
  // e (layer 0, 8 tokens) makes layer 0's queue more than a batch (13 tokens, budget 8): the
  // free lane takes b and c (5 tokens; e does not fit with them), then e, while a still runs.
  Item e(8, 4, 400.f, &layer0, 0);
  EXPECT_TRUE(executor.Run(e.work).ok());
  EXPECT_EQ(backend.started(), 4);
  EXPECT_EQ(executor.queued_requests(), 0u);
  backend.release.Notify();
  ta.join();
  tb.join();
  tc.join();
  EXPECT_EQ(backend.batch_tokens, (std::vector<int64_t>{1, 1, 5, 8}));
  EXPECT_EQ(executor.stats().merged_batches, 1u);
  for (const Item* item : {&a, &b, &c, &d, &e}) {
    const float layer = item->work.layer_index * 1000.f;
    for (int64_t i = 0; i < item->hidden.NumElements(); ++i) {
      ASSERT_EQ(item->out.data<float>()[i], item->hidden.data<float>()[i] * 2 + layer);
    }
  }
}

// overlap_min_tokens: once a running layer's queue holds that many tokens, they start on a free
// lane without waiting for its batch.
TEST(ExecutorTest, OverlapMinTokensStartsALargeQueueAtOnce) {
  LaneBackend backend(/*lanes=*/2, /*overlap=*/1, absl::ZeroDuration());
  backend.gated = 1;
  ExpertLayer layer;
  Executor executor(&backend,
                    ExecutorOptions{.max_batch_tokens = 100, .overlap_min_tokens = 4});
  const absl::Time give_up = absl::Now() + absl::Seconds(30);
  Item a(1, 4, 0.f, &layer, 0), b(2, 4, 100.f, &layer, 0), c(3, 4, 200.f, &layer, 0);
  std::thread ta([&] { EXPECT_TRUE(executor.Run(a.work).ok()); });
  while (backend.started() < 1 && absl::Now() < give_up) absl::SleepFor(absl::Milliseconds(1));
  std::thread tb([&] { EXPECT_TRUE(executor.Run(b.work).ok()); });
  while (executor.queued_requests() < 1 && absl::Now() < give_up) {
    absl::SleepFor(absl::Milliseconds(1));
  }
  EXPECT_EQ(backend.started(), 1);  // 2 tokens queued: b waits for a
  EXPECT_TRUE(executor.Run(c.work).ok());  // 5 >= 4: b and c run, while a still holds its lane
  tb.join();
  EXPECT_EQ(backend.started(), 2);
  backend.release.Notify();
  ta.join();
  EXPECT_EQ(backend.batch_tokens, (std::vector<int64_t>{1, 5}));
  for (const Item* item : {&a, &b, &c}) {
    for (int64_t i = 0; i < item->hidden.NumElements(); ++i) {
      ASSERT_EQ(item->out.data<float>()[i], item->hidden.data<float>()[i] * 2);
    }
  }
}

}  // namespace
}  // namespace moe
