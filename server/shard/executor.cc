#include "server/shard/executor.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace moe {
namespace {

bool SameBatch(const WorkItem& a, const WorkItem& b) {
  // Device tensors cannot be concatenated on the host.
  if (a.hidden_on_device || a.out_on_device || b.hidden_on_device || b.out_on_device) return false;
  return a.layer == b.layer && a.layer_index == b.layer_index &&
         a.local_ids.dim(1) == b.local_ids.dim(1) && a.hidden.dtype == b.hidden.dtype &&
         a.out.dtype == b.out.dtype &&
         a.shared_mask.present() == b.shared_mask.present();
}

// Concatenates the rows of `part` views into `dst` (same dtype and trailing dims).
void CopyRows(const std::vector<const TensorView*>& parts, const TensorView& dst) {
  auto* out = static_cast<std::byte*>(dst.data);
  for (const TensorView* v : parts) {
    std::memcpy(out, v->data, v->NumBytes());
    out += v->NumBytes();
  }
}

ExecutorStats Minus(const ExecutorStats& a, const ExecutorStats& b) {
  ExecutorStats d;
  d.requests = a.requests - b.requests;
  d.tokens = a.tokens - b.tokens;
  d.batches = a.batches - b.batches;
  d.merged_batches = a.merged_batches - b.merged_batches;
  d.max_batch_tokens = a.max_batch_tokens;
  d.errors = a.errors - b.errors;
  d.compute_seconds = a.compute_seconds - b.compute_seconds;
  d.expired = a.expired - b.expired;
  return d;
}

}  // namespace

Executor::Executor(ExpertBackend* backend, ExecutorOptions options)
    : backend_(backend),
      options_(options),
      lanes_(std::max(1, backend->MaxConcurrentRuns())),
      merges_(static_cast<size_t>(lanes_)) {
  {
    absl::MutexLock lock(&mu_);
    for (MergeBuffers& m : merges_) merge_free_.push_back(&m);
  }
  for (int i = 0; i < lanes_; ++i) workers_.emplace_back([this] { WorkerLoop(); });
}

Executor::~Executor() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  for (std::thread& worker : workers_) worker.join();
  for (MergeBuffers& m : merges_) {
    Release(m.hidden);
    Release(m.out);
  }
}

void* Executor::Reserve(MergeBuffer& buffer, size_t bytes) {
  if (buffer.bytes >= bytes) return buffer.data;
  // Whole pages, at least 1 MiB, doubling: regrown (and re-registered) rarely.
  constexpr size_t kPage = 4096;
  size_t size = std::max<size_t>({size_t{1} << 20, 2 * buffer.bytes, bytes});
  size = (size + kPage - 1) / kPage * kPage;
  Release(buffer);
  void* data = nullptr;
  if (posix_memalign(&data, kPage, size) != 0) return nullptr;
  buffer = {data, size};
  // An optimization only: unregistered memory is staged as any other.
  (void)backend_->RegisterHostMemory(data, size);
  return data;
}

void Executor::Release(MergeBuffer& buffer) {
  if (buffer.data == nullptr) return;
  backend_->UnregisterHostMemory(buffer.data);
  std::free(buffer.data);
  buffer = {};
}

absl::Status Executor::Run(const WorkItem& item) {
  Pending pending{&item};
  absl::MutexLock lock(&mu_);
  if (stopping_) return absl::UnavailableError("shard executor is shutting down");
  if (queue_.empty() && running_ < lanes_ && options_.max_batch_wait <= absl::ZeroDuration() &&
      MayStart(item, item.hidden.dim(0))) {
    // The backend has a free lane and nobody waits to be merged with: run on this thread.
    // Handing the item to a worker would cost two thread wake-ups (tens of microseconds on a
    // busy host), more than a one-token decode step's transfer.
    std::vector<Pending*> batch{&pending};
    RunLocked(batch);
    return pending.status;
  }
  queue_.push_back(&pending);
  mu_.Await(absl::Condition(
      +[](Pending* p) { return p->done; }, &pending));
  return pending.status;
}

bool Executor::MayStart(const WorkItem& item, int64_t queued_tokens) const {
  if (queued_tokens >= std::min(options_.max_batch_tokens, options_.overlap_min_tokens)) {
    return true;
  }
  for (const WorkItem* lead : running_leads_) {
    if (SameBatch(*lead, item)) return false;
  }
  return true;
}

std::deque<Executor::Pending*>::iterator Executor::NextStartable() {
  // Kinds already found waiting for their running batch: each kind's queue is summed once.
  std::vector<const WorkItem*> waiting;
  for (auto it = queue_.begin(); it != queue_.end(); ++it) {
    const WorkItem& item = *(*it)->item;
    int64_t tokens = item.hidden.dim(0);
    if (MayStart(item, tokens)) return it;
    if (std::any_of(waiting.begin(), waiting.end(),
                    [&](const WorkItem* w) { return SameBatch(*w, item); })) {
      continue;
    }
    // The first queued request of a running kind: does what is queued of its kind fill a batch?
    for (auto other = std::next(it); other != queue_.end(); ++other) {
      if (SameBatch(item, *(*other)->item)) tokens += (*other)->item->hidden.dim(0);
    }
    if (MayStart(item, tokens)) return it;
    waiting.push_back(&item);
  }
  return queue_.end();
}

std::vector<Executor::Pending*> Executor::TakeBatch(std::deque<Pending*>::iterator lead) {
  std::vector<Pending*> batch{*lead};
  queue_.erase(lead);
  int64_t tokens = batch[0]->item->hidden.dim(0);
  for (auto it = queue_.begin(); it != queue_.end();) {
    const WorkItem& w = *(*it)->item;
    if (SameBatch(*batch[0]->item, w) && tokens + w.hidden.dim(0) <= options_.max_batch_tokens) {
      tokens += w.hidden.dim(0);
      batch.push_back(*it);
      it = queue_.erase(it);
    } else {
      ++it;
    }
  }
  return batch;
}

void Executor::DropExpired(std::vector<Pending*>& batch) {
  const absl::Time now = absl::Now();
  std::vector<Pending*> live;
  for (Pending* p : batch) {
    if (p->item->deadline < now) {
      p->status = absl::DeadlineExceededError("deadline passed before the request could run");
      p->done = true;
      ++stats_.expired;
    } else {
      live.push_back(p);
    }
  }
  batch.swap(live);
}

void Executor::WorkerLoop() {
  absl::MutexLock lock(&mu_);
  while (true) {
    // Only while a lane is free (batches run inline by callers count too) and a queued request
    // may lead a batch (merge before overlap).
    mu_.Await(absl::Condition(
        +[](Executor* e) ABSL_NO_THREAD_SAFETY_ANALYSIS {
          return (e->stopping_ && e->queue_.empty()) ||
                 (e->running_ < e->lanes_ && e->NextStartable() != e->queue_.end());
        },
        this));
    if (queue_.empty()) return;  // stopping with nothing left
    if (options_.max_batch_wait > absl::ZeroDuration() && queue_.size() == 1) {
      mu_.AwaitWithTimeout(
          absl::Condition(
              +[](Executor* e) ABSL_NO_THREAD_SAFETY_ANALYSIS { return e->queue_.size() > 1; },
              this),
          options_.max_batch_wait);
    }
    // Meanwhile another worker may have taken the queue, or every lane.
    const auto lead = NextStartable();
    if (running_ >= lanes_ || lead == queue_.end()) continue;
    std::vector<Pending*> batch = TakeBatch(lead);
    RunLocked(batch);
  }
}

void Executor::RunLocked(std::vector<Pending*>& batch) {
  DropExpired(batch);
  if (batch.empty()) return;
  ++running_;
  running_leads_.push_back(batch[0]->item);
  MergeBuffers* merge = merge_free_.back();  // one per lane: never empty here
  merge_free_.pop_back();
  mu_.Unlock();
  const absl::Time start = absl::Now();
  const absl::Status status = RunBatch(batch, *merge);
  const absl::Duration compute = absl::Now() - start;
  uint64_t tokens = 0;
  for (Pending* p : batch) tokens += p->item->hidden.dim(0);
  // Outside the lock: the observer must not delay callers queueing their next requests.
  if (options_.observer != nullptr) {
    options_.observer->OnBatch(static_cast<int64_t>(tokens), static_cast<int64_t>(batch.size()),
                               compute);
  }
  mu_.Lock();
  merge_free_.push_back(merge);
  --running_;
  running_leads_.erase(std::find(running_leads_.begin(), running_leads_.end(), batch[0]->item));
  Account(batch, status, compute);
}

void Executor::Account(const std::vector<Pending*>& batch, const absl::Status& status,
                       absl::Duration compute) {
  uint64_t tokens = 0;
  for (Pending* p : batch) tokens += p->item->hidden.dim(0);
  for (Pending* p : batch) {
    p->status = status;
    p->done = true;
  }
  stats_.requests += batch.size();
  stats_.tokens += tokens;
  stats_.batches += 1;
  stats_.merged_batches += batch.size() > 1 ? 1 : 0;
  stats_.max_batch_tokens = std::max<uint64_t>(stats_.max_batch_tokens, tokens);
  stats_.errors += status.ok() ? 0 : batch.size();
  stats_.compute_seconds += absl::ToDoubleSeconds(compute);
}

absl::Status Executor::RunBatch(const std::vector<Pending*>& batch, MergeBuffers& merge) {
  const WorkItem& first = *batch[0]->item;
  if (batch.size() == 1) {
    return backend_->Run(first.layer_index, *first.layer,
                         ExpertsRequest{first.hidden, first.local_ids, first.topk_weights,
                                        first.shared_mask, first.out, first.hidden_on_device,
                                        first.out_on_device});
  }
  int64_t tokens = 0;
  std::vector<const TensorView*> hidden, ids, weights, mask;
  for (Pending* p : batch) {
    tokens += p->item->hidden.dim(0);
    hidden.push_back(&p->item->hidden);
    ids.push_back(&p->item->local_ids);
    weights.push_back(&p->item->topk_weights);
    mask.push_back(&p->item->shared_mask);
  }
  const int64_t h = first.hidden.dim(1), k = first.local_ids.dim(1);
  HostTensor all_ids = HostTensor::Uninitialized(DType::kI32, {tokens, k});
  HostTensor all_weights = HostTensor::Uninitialized(DType::kF32, {tokens, k});
  HostTensor all_mask;
  CopyRows(ids, all_ids.view());
  CopyRows(weights, all_weights.view());
  if (first.shared_mask.present()) {
    all_mask = HostTensor(DType::kBool, {tokens});
    CopyRows(mask, all_mask.view());
  }
  // First the requests' own hidden-state and output rows, where the backend takes them as they
  // are (RunParts: e.g. a CUDA backend's copy kernels gather and scatter them in registered
  // memory): no concatenation on the host.
  {
    std::vector<TensorView> hidden_parts, out_parts;
    for (Pending* p : batch) {
      hidden_parts.push_back(p->item->hidden);
      out_parts.push_back(p->item->out);
    }
    const ExpertsRequest parted{
        TensorView{first.hidden.dtype, {tokens, h}, first.hidden.data}, all_ids.view(),
        all_weights.view(), first.shared_mask.present() ? all_mask.view() : TensorView{},
        TensorView{first.out.dtype, {tokens, h}, first.out.data}};
    const absl::Status status =
        backend_->RunParts(first.layer_index, *first.layer, parted, hidden_parts, out_parts);
    if (!absl::IsUnimplemented(status)) return status;
  }
  // Every buffer is overwritten entirely (rows copied in, the backend writes every output). The
  // hidden states and output go into the registered merge buffers.
  const TensorView all_hidden{
      first.hidden.dtype, {tokens, h},
      Reserve(merge.hidden, static_cast<size_t>(tokens * h) * DTypeSize(first.hidden.dtype))};
  const TensorView all_out{
      first.out.dtype, {tokens, h},
      Reserve(merge.out, static_cast<size_t>(tokens * h) * DTypeSize(first.out.dtype))};
  if (all_hidden.data == nullptr || all_out.data == nullptr) {
    return absl::ResourceExhaustedError(
        absl::StrCat("shard executor: no memory for a merged batch of ", tokens, " tokens"));
  }
  CopyRows(hidden, all_hidden);
  absl::Status status = backend_->Run(
      first.layer_index, *first.layer,
      ExpertsRequest{all_hidden, all_ids.view(), all_weights.view(),
                     first.shared_mask.present() ? all_mask.view() : TensorView{}, all_out});
  if (!status.ok()) return status;
  const auto* src = static_cast<const std::byte*>(all_out.data);
  for (Pending* p : batch) {
    std::memcpy(p->item->out.data, src, p->item->out.NumBytes());
    src += p->item->out.NumBytes();
  }
  return absl::OkStatus();
}

size_t Executor::queued_requests() const {
  absl::MutexLock lock(&mu_);
  return queue_.size();
}

ExecutorStats Executor::stats() const {
  absl::MutexLock lock(&mu_);
  return stats_;
}

ExecutorStats Executor::TakeStatsDelta() {
  absl::MutexLock lock(&mu_);
  ExecutorStats delta = Minus(stats_, taken_);
  taken_ = stats_;
  return delta;
}

}  // namespace moe
