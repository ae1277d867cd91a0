// CudaExpertBackend: ExpertBackend over expert_runner.h. Host code (abseil allowed), no device
// code. Each Run copies the inputs to one device buffer on a private stream (batches up to
// CudaBackendOptions::pinned_staging_bytes through one pinned host buffer, which copy kernels
// move to and from the device up to kernel_copy_max_bytes and the copy engine above; larger ones
// straight from the caller's pageable memory), runs the kernels (as a CUDA graph for shapes seen
// before, see graph_max_tokens; such a graph holds the copy kernels too) and returns after the
// output is back in the caller's memory.
//
// Device weights are kept per (layer index, host weights): during a two-phase placement switch
// the shard serves the old and the new map version at once, so PrepareLayer for the new version
// must not replace the copy the old one is still running with. Up to kVersionsPerLayer copies per
// layer; Run picks the one uploaded from the same host weights (their addresses identify them)
// and holds a reference while it runs, so evicting a version never frees memory in use.
#include "kernels/cuda/cuda_backend.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <deque>
#include <memory>
#include <map>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "glog/logging.h"
#include "kernels/cpu/thread_pool.h"
#include "kernels/cuda/device.h"
#include "kernels/cuda/expert_kernels.h"
#include "kernels/cuda/expert_plan.h"
#include "kernels/cuda/expert_runner.h"

namespace moe {
namespace {

using cuda::CudaStatus;
using cuda::DeviceBuffer;

using RunClock = std::chrono::steady_clock;

// Nanoseconds from `since` to now, added to *sum; returns now.
RunClock::time_point AddElapsed(RunClock::time_point since, int64_t* sum) {
  const RunClock::time_point now = RunClock::now();
  *sum += std::chrono::duration_cast<std::chrono::nanoseconds>(now - since).count();
  return now;
}

// What identifies the host weights a device copy was uploaded from: format, shapes and the
// addresses of every expert's packed values (read as numbers, never dereferenced).
struct HostIdentity {
  WeightFormat format = WeightFormat::kMxfp4;
  int64_t hidden = 0, inter = 0;
  std::vector<const void*> values;

  static HostIdentity Of(const ExpertLayer& layer) {
    HostIdentity id{layer.format, layer.hidden, layer.intermediate, {}};
    for (const auto* list : {&layer.experts, &layer.shared_experts}) {
      for (const ExpertWeights& e : *list) {
        id.values.push_back(e.w13.values.data);
        id.values.push_back(e.w2.values.data);
      }
    }
    return id;
  }
  bool operator==(const HostIdentity&) const = default;
};

struct DeviceVersion {
  HostIdentity host;
  std::unique_ptr<cuda::DeviceExpertLayer> device;
};

class CudaExpertBackend final : public ExpertBackend {
 public:
  // One lane per stream in `streams` (owned from here on).
  CudaExpertBackend(const CudaBackendOptions& options, const std::vector<cudaStream_t>& streams)
      : options_(options) {
    for (cudaStream_t stream : streams) {
      auto lane = std::make_unique<Lane>();
      lane->stream = stream;
      cuda::ExpertRunner& runner = lane->runner;
      runner.set_poison_scratch(options.poison_scratch);
      runner.set_gemm_variant(options.gemm_variant);
      if (options.wgmma_min_tokens >= 0) runner.set_wgmma_min_tokens(options.wgmma_min_tokens);
      runner.set_direct_routes(options.direct_routes);
      runner.set_l2_prefetch(options.l2_prefetch);
      runner.set_fold_grouped(options.fold_grouped);
      runner.set_hidden_in_place(options.wgmma_byte_savers);
      runner.set_y_bf16(options.wgmma_byte_savers);
      runner.set_wgmma_l2_ahead(options.wgmma_l2_ahead);
      runner.set_wgmma_persistent(options.wgmma_persistent);
      runner.set_fused_layer(options.fused_layer);
      runner.set_item_ready(options.item_ready);
      runner.set_acc_scale(options.acc_scale);
      runner.set_programmatic_launch(options.programmatic_launch);
      lanes_.push_back(std::move(lane));
    }
    const int hardware = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
    copy_pool_ = std::make_unique<cpu::ThreadPool>(
        std::clamp(options_.copy_threads > 0 ? options_.copy_threads : std::min(8, hardware), 1,
                   64));
    int can_map = 0;
    can_map_host_ = cudaDeviceGetAttribute(&can_map, cudaDevAttrCanMapHostMemory,
                                           options_.device) == cudaSuccess &&
                    can_map != 0;
    cudaGetLastError();  // clears a non-sticky error of the query
    if (options_.upload_threads <= 0) {
      options_.upload_threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
    }
  }
  ~CudaExpertBackend() override {
    cudaSetDevice(options_.device);
    for (const std::unique_ptr<Lane>& lane : lanes_) {
      absl::MutexLock lock(&lane->mu);
      ClearGraphs(*lane);
      if (lane->pinned != nullptr) cudaFreeHost(lane->pinned);
      for (cudaEvent_t e : lane->copy_events) cudaEventDestroy(e);
    }
    {
      // Memory still registered stays the caller's; only its pinning ends here.
      absl::MutexLock lock(&registered_mu_);
      for (const auto& [base, range] : registered_) {
        cudaHostUnregister(reinterpret_cast<void*>(base));
      }
      registered_.clear();
    }
    {
      absl::MutexLock lock(&layers_mu_);
      layers_.clear();
    }
    for (const std::unique_ptr<Lane>& lane : lanes_) cudaStreamDestroy(lane->stream);
  }

  // Every lane's, added up.
  CudaBackendCounters counters() const {
    CudaBackendCounters n;
    for (const std::unique_ptr<Lane>& lane : lanes_) {
      absl::MutexLock lock(&lane->mu);
      Add(lane->counters, n);
      n.fused_layer_launches += lane->runner.fused_layer_launches();
      n.item_ready_launches += lane->runner.item_ready_launches();
    }
    LanesFreed();
    absl::MutexLock registered(&registered_mu_);
    n.registered_bytes = static_cast<int64_t>(registered_total_);
    return n;
  }
  int MaxConcurrentRuns() const override { return static_cast<int>(lanes_.size()); }

  // Device copies kept per layer index (the shard keeps up to 4 map versions).
  static constexpr size_t kVersionsPerLayer = 4;

  absl::string_view name() const override { return "cuda"; }
  std::string device() const override { return cuda::DeviceDescription(options_.device); }

  absl::Status CheckSupported(const ExpertLayer& layer) const override {
    if (layer.format != WeightFormat::kMxfp4 && layer.format != WeightFormat::kNvfp4) {
      return absl::FailedPreconditionError(absl::StrCat(
          "cuda backend: weight format ", WeightFormatName(layer.format),
          " is not supported (MXFP4 and NVFP4 only)"));
    }
    const size_t slots = layer.experts.size() + layer.shared_experts.size();
    if (slots == 0 || slots > static_cast<size_t>(cuda::kMaxPrologueSlots)) {
      return absl::FailedPreconditionError(absl::StrCat(
          "cuda backend: ", slots, " expert slots in a layer; 1..", cuda::kMaxPrologueSlots,
          " supported"));
    }
    return absl::OkStatus();
  }

  absl::Status PrepareLayer(int layer_index, const ExpertLayer& layer) override {
    if (absl::Status s = ValidateExpertLayer(layer); !s.ok()) return s;
    if (absl::Status s = CheckSupported(layer); !s.ok()) return s;
    if (absl::Status s = CudaStatus(cudaSetDevice(options_.device), "cudaSetDevice"); !s.ok()) {
      return s;
    }
    HostIdentity host = HostIdentity::Of(layer);
    {
      // The same weights again: replace their copy (freed here) before uploading.
      absl::MutexLock lock(&layers_mu_);
      std::erase_if(layers_[layer_index], [&](const auto& v) { return v->host == host; });
    }
    // Its allocations and copies not while a lane captures (capture_mu_, taken per call, so a
    // capture waits for one copy at most, not for the whole repacking).
    absl::StatusOr<std::unique_ptr<cuda::DeviceExpertLayer>> d = cuda::UploadExpertLayer(
        layer, options_.device, options_.upload_threads, &capture_mu_);
    if (!d.ok()) return d.status();
    // Freed under capture_mu_ too, wherever its last reference goes (an evicted version, or the
    // end of the Run that still used it).
    std::shared_ptr<const DeviceVersion> version(
        new DeviceVersion{std::move(host), *std::move(d)},
        [this](const DeviceVersion* v) {
          absl::MutexLock capture(&capture_mu_);
          delete v;
        });
    // Graphs captured against an evicted or replaced copy would read freed memory: Run drops them
    // all when this changes.
    layers_generation_.fetch_add(1);
    absl::MutexLock lock(&layers_mu_);
    std::deque<std::shared_ptr<const DeviceVersion>>& versions = layers_[layer_index];
    versions.push_front(std::move(version));
    // The oldest goes; a Run still using it holds its own reference.
    if (versions.size() > kVersionsPerLayer) versions.pop_back();
    return absl::OkStatus();
  }

  absl::Status Run(int layer_index, const ExpertLayer& layer,
                   const ExpertsRequest& request) override {
    return RunImpl(layer_index, layer, request, nullptr);
  }
  // Takes the parts where the batch is moved by copy kernels and every part is registered,
  // mapped host memory at 16-byte aligned addresses and sizes (registered_kernel_copies): one
  // copy kernel gathers the hidden rows into the device arena, one scatters the output rows.
  absl::Status RunParts(int layer_index, const ExpertLayer& layer, const ExpertsRequest& request,
                        absl::Span<const TensorView> hidden_parts,
                        absl::Span<const TensorView> out_parts) override {
    // Cheap refusals first, before any planning: the caller then merges the parts.
    std::vector<cuda::CopyPart> probe;
    if (!options_.registered_kernel_copies ||
        !MappedParts(hidden_parts, nullptr, /*gather=*/true, &probe) ||
        !MappedParts(out_parts, nullptr, /*gather=*/false, &probe)) {
      return absl::UnimplementedError(
          "cuda backend: these row parts are not all registered, mapped and aligned");
    }
    const RowParts parts{hidden_parts, out_parts};
    return RunImpl(layer_index, layer, request, &parts);
  }

  int DeviceForTensors() const override { return options_.device; }
  absl::Status RegisterHostMemory(void* data, size_t bytes) override;
  void UnregisterHostMemory(void* data) override;

 private:
  struct RowParts {
    absl::Span<const TensorView> hidden, out;
  };
  // Captured graphs by shape key (valid while the lane's graph_* fields below are unchanged).
  struct Graph {
    cudaGraphExec_t exec = nullptr;
    uint64_t last_use = 0;
  };
  // What one Run at a time uses: a stream, the runner (its scratch), the device arena, the pinned
  // buffer and the graphs captured against them. Runs on different lanes overlap: one lane's host
  // work (checks, plan, copies, launches) runs while another's kernels use the GPU.
  struct Lane {
    absl::Mutex mu;
    cudaStream_t stream = nullptr;
    cuda::ExpertRunner runner ABSL_GUARDED_BY(mu);
    DeviceBuffer arena ABSL_GUARDED_BY(mu);
    uint8_t* pinned ABSL_GUARDED_BY(mu) = nullptr;  // cudaHostAlloc'd, pinned_bytes long
    // The same memory as the device addresses it (mapped): the copy kernels' side of it. Null
    // where the device cannot map host memory (then the copy engine moves every batch).
    uint8_t* pinned_device ABSL_GUARDED_BY(mu) = nullptr;
    size_t pinned_bytes ABSL_GUARDED_BY(mu) = 0;
    // Captured graphs by shape key, and how often each shape ran (a shape is captured on its
    // second batch; kNoGraph after a failed capture).
    std::unordered_map<std::string, Graph> graphs ABSL_GUARDED_BY(mu);
    std::unordered_map<std::string, int> seen ABSL_GUARDED_BY(mu);
    uint64_t uses ABSL_GUARDED_BY(mu) = 0;
    // (arena pointer, pinned buffer, runner scratch generation, layers generation) the graphs
    // were captured with.
    const void* graph_arena ABSL_GUARDED_BY(mu) = nullptr;
    const void* graph_pinned ABSL_GUARDED_BY(mu) = nullptr;
    uint64_t graph_scratch ABSL_GUARDED_BY(mu) = 0;
    uint64_t graph_layers ABSL_GUARDED_BY(mu) = 0;
    CudaBackendCounters counters ABSL_GUARDED_BY(mu);
    std::vector<cudaEvent_t> copy_events ABSL_GUARDED_BY(mu);  // one per output piece
  };
  // A free lane, locked: the first one free; when all are busy, the first to be released.
  Lane& AcquireLane() ABSL_NO_THREAD_SAFETY_ANALYSIS;
  // Wakes AcquireLane's waiters: called after a lane's mutex was unlocked.
  void LanesFreed() const;
  // Grows the lane's device arena to `bytes_needed` and, when `pinned`, its pinned buffer too
  // (under capture_mu_; nothing to do, and no lock, once they are large enough).
  absl::Status GrowBuffers(Lane& lane, size_t bytes_needed, bool pinned)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(lane.mu);
  static void Add(const CudaBackendCounters& a, CudaBackendCounters& sum);
  // Run, or RunParts with `parts` (else null).
  absl::Status RunImpl(int layer_index, const ExpertLayer& layer, const ExpertsRequest& request,
                       const RowParts* parts);
  // The copies of `views`, in order, between their mapped host addresses and the device arena
  // region at `device` (to the arena when `gather`, from it otherwise; null `device`: only the
  // checks, nothing filled). False where one is not registered and mapped whole, or not 16-byte
  // aligned in address and size, or there are more than cuda::kMaxCopyParts.
  bool MappedParts(absl::Span<const TensorView> views, uint8_t* device, bool gather,
                   std::vector<cuda::CopyPart>* copies) const;
  // Whether [data, data + bytes) lies inside one registered range.
  bool InRegistered(const void* data, size_t bytes) const ABSL_LOCKS_EXCLUDED(registered_mu_) {
    return FindRegistered(data, bytes, nullptr);
  }
  // Whether [data, data + bytes) lies inside one registered range; then *device (when not null)
  // is where the device addresses `data`, or null where the range is not mapped. The address
  // stays valid while the Run's lane is held (UnregisterHostMemory takes every lane first).
  bool FindRegistered(const void* data, size_t bytes, uint8_t** device) const
      ABSL_LOCKS_EXCLUDED(registered_mu_);
  absl::StatusOr<std::shared_ptr<const DeviceVersion>> Prepared(int layer_index,
                                                                const ExpertLayer& layer)
      ABSL_LOCKS_EXCLUDED(layers_mu_);
  // Where a Run's tensors sit in the device arena (and, when staged, in the pinned buffer):
  // hidden | ids | weights | mask | out, each at a 256-byte boundary.
  struct ArenaLayout {
    size_t hidden = 0, ids = 0, weights = 0, mask = 0, out = 0;
    size_t in_bytes = 0;  // the inputs' span
    size_t total = 0;
  };
  static ArenaLayout Layout(const ExpertsRequest& request, bool with_mask);
  // How a pinned batch moves between the pinned buffer and the device arena: by the copy engine,
  // by copy kernels (LaunchCopyBytes: the SMs read and write the mapped host memory), or by copy
  // kernels enqueued with the batch's kernels (one piece, a graphed shape: inside its graph).
  enum class Moves { kCopyEngine, kKernels, kKernelsWithBatch };
  // The copy kernels of a kKernelsWithBatch batch (out_bytes 0: the kernels write the output
  // into the pinned buffer themselves, CudaBackendOptions::pinned_direct_output).
  struct BatchMoves {
    const uint8_t* in_from = nullptr;
    uint8_t* in_to = nullptr;
    size_t in_bytes = 0;
    const uint8_t* out_from = nullptr;
    uint8_t* out_to = nullptr;
    size_t out_bytes = 0;
  };
  // Where a Run's hidden states come from: through the pinned buffer (or a pageable copy), by
  // one copy straight from registered host or device memory, or read in place by the kernels
  // (device memory).
  // kMapped: registered host memory that a copy kernel reads through its device mapping
  // (registered_kernel_copies).
  // kGathered: RunParts' rows, gathered by one copy kernel after CopyIn.
  enum class HiddenFrom { kStaged, kCopied, kInPlace, kMapped, kGathered };
  // Copies the inputs into the device arena (through the pinned buffer when `pinned`; with
  // kKernelsWithBatch only into the pinned buffer), the hidden states as `hidden` says (kMapped:
  // from `hidden_mapped`, the device's address of them).
  absl::Status CopyIn(Lane& lane, const ExpertsRequest& request, bool with_mask,
                      const ArenaLayout& at, bool pinned, Moves moves, HiddenFrom hidden,
                      const uint8_t* hidden_mapped) ABSL_EXCLUSIVE_LOCKS_REQUIRED(lane.mu);
  // Copies the output back (through the pinned buffer when `pinned`; with kKernelsWithBatch the
  // move to it is already enqueued) and waits for it.
  absl::Status CopyOut(Lane& lane, const ExpertsRequest& request, const ArenaLayout& at,
                       bool pinned, Moves moves) ABSL_EXCLUSIVE_LOCKS_REQUIRED(lane.mu);
  // Pieces of the pinned copies: the host copies one while the DMA engine moves the previous.
  static constexpr size_t kCopyPieceBytes = size_t{4} << 20;
  static constexpr size_t kMaxSeenShapes = 4096;
  // Runs within which a graph counts as in use (the cache's eviction guard, EnqueueKernels).
  static constexpr uint64_t kHotGraphUses = 4 * kMaxCudaGraphs;
  // Lane::seen value of a shape that runs eagerly from now on (its capture failed).
  static constexpr int kNoGraph = -(1 << 30);
  // Captures the kernels of this batch into *exec (instantiated); nothing runs.
  absl::Status Capture(Lane& lane, const cuda::DeviceExpertLayer& layer,
                       const cuda::DeviceBatch& batch, const cuda::RoutePlan& plan,
                       const BatchMoves* moves, cudaGraphExec_t* exec)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(lane.mu);
  // The batch's kernels, between its copy kernels when `moves` is not null.
  absl::Status EnqueueBatch(Lane& lane, const cuda::DeviceExpertLayer& layer,
                            const cuda::DeviceBatch& batch, const cuda::RoutePlan& plan,
                            const BatchMoves* moves) ABSL_EXCLUSIVE_LOCKS_REQUIRED(lane.mu);
  // Enqueues the kernels (and `moves`): eagerly, or through a graph captured for the batch's
  // shape.
  // `in_place`: the batch reads or writes device tensors of the caller in place (their
  // addresses are part of its graph's shape).
  absl::Status EnqueueKernels(Lane& lane, const cuda::DeviceExpertLayer& layer,
                              const cuda::DeviceBatch& batch, const cuda::RoutePlan& plan,
                              const BatchMoves* moves, bool in_place)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(lane.mu);
  static void ClearGraphs(Lane& lane) ABSL_EXCLUSIVE_LOCKS_REQUIRED(lane.mu);
  // Whether batches of this plan's size run as CUDA graphs (CudaBackendOptions::graph_max_tokens).
  bool Graphed(const cuda::RoutePlan& plan) const {
    return options_.graph_max_tokens > 0 && plan.tokens <= options_.graph_max_tokens;
  }

  CudaBackendOptions options_;
  // Held while a lane captures a CUDA graph, and by everything that may synchronize the device
  // or change its memory map meanwhile on another thread: device and pinned allocation and
  // freeing (scratch, arenas, pinned buffers, layer copies), host memory registration, graph
  // destruction. A device-wide synchronization during another thread's capture crashed the
  // driver on the H200 (SIGSEGV in cuCtxSynchronize) or failed with "operation not permitted
  // when stream is capturing". Taken after a lane's mutex and after layers_mu_, before
  // registered_mu_; once a lane's buffers and graphs are warm, a Run does not take it.
  absl::Mutex capture_mu_;
  absl::Mutex layers_mu_;
  std::map<int, std::deque<std::shared_ptr<const DeviceVersion>>> layers_
      ABSL_GUARDED_BY(layers_mu_);
  // CudaBackendOptions::concurrent_runs lanes (fixed after construction).
  std::vector<std::unique_ptr<Lane>> lanes_;
  // Lane releases so far: AcquireLane waits for the count to move when every lane was busy.
  // Bumped (LanesFreed) after every unlock of a lane's mutex outside the destructor.
  mutable absl::Mutex lane_free_mu_;
  mutable uint64_t lane_releases_ ABSL_GUARDED_BY(lane_free_mu_) = 0;
  std::atomic<int> runs_in_progress_{0};  // Runs holding a lane
  bool can_map_host_ = false;  // cudaDevAttrCanMapHostMemory
  std::atomic<uint64_t> layers_generation_{0};
  // Host memory pinned (and mapped) by RegisterHostMemory, by base address. Taken after a lane's
  // mutex where both are held.
  mutable absl::Mutex registered_mu_;
  // A registered range: its length and, where the device maps it, its device address (null:
  // not mapped; the copy kernels then do not touch it).
  struct Registered {
    size_t bytes = 0;
    uint8_t* device = nullptr;
  };
  std::map<uintptr_t, Registered> registered_ ABSL_GUARDED_BY(registered_mu_);
  size_t registered_total_ ABSL_GUARDED_BY(registered_mu_) = 0;
  // Threads of the host copies into and out of the pinned buffers; one lane's copy at a time
  // (copy_pool_mu_) splits across them.
  std::unique_ptr<cpu::ThreadPool> copy_pool_;
  absl::Mutex copy_pool_mu_;
};

// memcpy split between the pool's threads when large enough to pay for waking them (at 368 KB
// per tensor, five threads measured slower than one on the H200's host: 616 vs 505 us per Run).
// `pool_mu` is held while the pool works (one ParallelFor at a time).
void ParallelCopy(cpu::ThreadPool& pool, absl::Mutex& pool_mu, void* dst, const void* src,
                  size_t bytes) {
  constexpr size_t kSplitBytes = size_t{2} << 20;
  if (bytes < kSplitBytes || pool.num_threads() == 1) {
    std::memcpy(dst, src, bytes);
    return;
  }
  absl::MutexLock lock(&pool_mu);
  const int parts = static_cast<int>(std::min<size_t>(pool.num_threads(), bytes / (512 << 10)));
  pool.ParallelFor(parts, [&](int i, int n) {
    // 64-byte aligned cuts.
    const size_t begin = bytes * i / n / 64 * 64;
    const size_t end = i + 1 == n ? bytes : bytes * (i + 1) / n / 64 * 64;
    std::memcpy(static_cast<uint8_t*>(dst) + begin, static_cast<const uint8_t*>(src) + begin,
                end - begin);
  });
}

absl::StatusOr<std::shared_ptr<const DeviceVersion>> CudaExpertBackend::Prepared(
    int layer_index, const ExpertLayer& layer) {
  const HostIdentity host = HostIdentity::Of(layer);
  absl::MutexLock lock(&layers_mu_);
  auto it = layers_.find(layer_index);
  if (it == layers_.end() || it->second.empty()) {
    return absl::FailedPreconditionError(
        absl::StrCat("cuda backend: layer ", layer_index, " was not prepared"));
  }
  for (const std::shared_ptr<const DeviceVersion>& v : it->second) {
    if (v->host == host) return v;
  }
  return absl::FailedPreconditionError(absl::StrCat(
      "cuda backend: layer ", layer_index,
      " was not prepared (PrepareLayer) with these weights"));
}

CudaExpertBackend::ArenaLayout CudaExpertBackend::Layout(const ExpertsRequest& request,
                                                         bool with_mask) {
  ArenaLayout at;
  size_t end = 0;
  const auto take = [&end](const TensorView& view) {
    const size_t here = end;
    end += (static_cast<size_t>(view.NumBytes()) + 255) / 256 * 256;
    return here;
  };
  at.hidden = take(request.hidden_states);
  at.ids = take(request.local_ids);
  at.weights = take(request.topk_weights);
  at.mask = with_mask ? take(request.shared_mask) : end;
  at.in_bytes = end;
  at.out = take(request.out);
  at.total = end;
  return at;
}

absl::Status CudaExpertBackend::CopyIn(Lane& lane, const ExpertsRequest& request,
                                       bool with_mask, const ArenaLayout& at, bool pinned,
                                       Moves moves, HiddenFrom hidden,
                                       const uint8_t* hidden_mapped) {
  const struct {
    size_t offset;
    const TensorView& view;
  } inputs[] = {{at.hidden, request.hidden_states},
                {at.ids, request.local_ids},
                {at.weights, request.topk_weights},
                {at.mask, request.shared_mask}};
  uint8_t* device = lane.arena.as<uint8_t>();
  if (!pinned) {
    for (const auto& in : inputs) {
      if (&in.view == &request.shared_mask && !with_mask) continue;
      if (&in.view == &request.hidden_states && hidden == HiddenFrom::kInPlace) continue;
      if (absl::Status s = CudaStatus(
              cudaMemcpyAsync(device + in.offset, in.view.data,
                              static_cast<size_t>(in.view.NumBytes()), cudaMemcpyDefault,
                              lane.stream),
              "input copy");
          !s.ok()) {
        return s;
      }
    }
    return absl::OkStatus();
  }
  // Registered or device hidden states: one copy-engine transfer straight from the caller's
  // pinned host or device memory (UVA tells which), running while the host fills the pinned
  // buffer with the rest (which starts at the 256-aligned at.ids, past the hidden states: the
  // host never touches them).
  const size_t first = hidden == HiddenFrom::kStaged ? 0 : at.ids;
  if (hidden == HiddenFrom::kCopied) {
    if (absl::Status s = CudaStatus(
            cudaMemcpyAsync(device + at.hidden, request.hidden_states.data,
                            static_cast<size_t>(request.hidden_states.NumBytes()),
                            cudaMemcpyDefault, lane.stream),
            "input copy");
        !s.ok()) {
      return s;
    }
  } else if (hidden == HiddenFrom::kMapped) {
    if (absl::Status s = CudaStatus(
            cuda::LaunchCopyBytes(hidden_mapped, device + at.hidden,
                                  static_cast<size_t>(request.hidden_states.NumBytes()), lane.stream),
            "input copy");
        !s.ok()) {
      return s;
    }
  }
  // Pinned: the inputs' span of the arena layout piece by piece (one piece for small batches),
  // each piece's host-to-device copy running while the host fills the next.
  for (size_t begin = first; begin < at.in_bytes; begin += kCopyPieceBytes) {
    const size_t end = std::min(at.in_bytes, begin + kCopyPieceBytes);
    for (const auto& in : inputs) {
      if (&in.view == &request.shared_mask && !with_mask) continue;
      const size_t lo = std::max(begin, in.offset);
      const size_t hi = std::min(end, in.offset + static_cast<size_t>(in.view.NumBytes()));
      if (lo >= hi) continue;
      ParallelCopy(*copy_pool_, copy_pool_mu_, lane.pinned + lo,
                   static_cast<const uint8_t*>(in.view.data) + (lo - in.offset), hi - lo);
    }
    if (moves == Moves::kKernelsWithBatch) continue;  // enqueued with the kernels
    const cudaError_t moved =
        moves == Moves::kKernels
            ? cuda::LaunchCopyBytes(lane.pinned_device + begin, device + begin, end - begin, lane.stream)
            : cudaMemcpyAsync(device + begin, lane.pinned + begin, end - begin,
                              cudaMemcpyHostToDevice, lane.stream);
    if (absl::Status s = CudaStatus(moved, "input copy"); !s.ok()) return s;
  }
  return absl::OkStatus();
}

absl::Status CudaExpertBackend::CopyOut(Lane& lane, const ExpertsRequest& request,
                                        const ArenaLayout& at, bool pinned, Moves moves) {
  const size_t bytes = static_cast<size_t>(request.out.NumBytes());
  uint8_t* device = lane.arena.as<uint8_t>() + at.out;
  auto* out = static_cast<uint8_t*>(request.out.data);
  RunClock::time_point t = RunClock::now();
  if (!pinned) {
    if (absl::Status s = CudaStatus(
            cudaMemcpyAsync(out, device, bytes, cudaMemcpyDefault, lane.stream), "output copy");
        !s.ok()) {
      return s;
    }
    t = AddElapsed(t, &lane.counters.copy_out_submit_ns);
    const absl::Status synced = CudaStatus(cudaStreamSynchronize(lane.stream), "expert kernels");
    AddElapsed(t, &lane.counters.wait_ns);
    return synced;
  }
  // Every piece's device-to-host copy, each followed by its event; the host empties piece i as
  // soon as its event fires, while the later pieces are still in flight.
  const size_t pieces = (bytes + kCopyPieceBytes - 1) / kCopyPieceBytes;
  while (lane.copy_events.size() < pieces) {
    cudaEvent_t e = nullptr;
    if (absl::Status s =
            CudaStatus(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "copy event");
        !s.ok()) {
      return s;
    }
    lane.copy_events.push_back(e);
  }
  for (size_t i = 0; i < pieces; ++i) {
    const size_t begin = i * kCopyPieceBytes, piece = std::min(kCopyPieceBytes, bytes - begin);
    // kKernelsWithBatch: one piece, its move already enqueued with the kernels.
    const cudaError_t moved =
        moves == Moves::kKernelsWithBatch ? cudaSuccess
        : moves == Moves::kKernels
            ? cuda::LaunchCopyBytes(device + begin, lane.pinned_device + at.out + begin, piece,
                                    lane.stream)
            : cudaMemcpyAsync(lane.pinned + at.out + begin, device + begin, piece,
                              cudaMemcpyDeviceToHost, lane.stream);
    if (absl::Status s = CudaStatus(moved, "output copy"); !s.ok()) return s;
    if (absl::Status s = CudaStatus(cudaEventRecord(lane.copy_events[i], lane.stream), "copy event");
        !s.ok()) {
      return s;
    }
  }
  t = AddElapsed(t, &lane.counters.copy_out_submit_ns);
  for (size_t i = 0; i < pieces; ++i) {
    if (absl::Status s = CudaStatus(cudaEventSynchronize(lane.copy_events[i]), "expert kernels");
        !s.ok()) {
      return s;
    }
    t = AddElapsed(t, &lane.counters.wait_ns);
    const size_t begin = i * kCopyPieceBytes, piece = std::min(kCopyPieceBytes, bytes - begin);
    ParallelCopy(*copy_pool_, copy_pool_mu_, out + begin, lane.pinned + at.out + begin, piece);
    t = AddElapsed(t, &lane.counters.copy_out_host_ns);
  }
  return absl::OkStatus();
}

// The sightings stay: they record shapes, not the pointers the graphs hold, so a shape seen
// before the arena or scratch grew is captured on its next batch (while batch sizes still grow,
// as after a start, every growth would otherwise reset them all). Shapes whose capture failed
// get another try.
void CudaExpertBackend::ClearGraphs(Lane& lane) {
  for (auto& [key, graph] : lane.graphs) cudaGraphExecDestroy(graph.exec);
  lane.graphs.clear();
  std::erase_if(lane.seen, [](const auto& entry) { return entry.second < 0; });
}

absl::Status CudaExpertBackend::EnqueueBatch(Lane& lane, const cuda::DeviceExpertLayer& layer,
                                             const cuda::DeviceBatch& batch,
                                             const cuda::RoutePlan& plan,
                                             const BatchMoves* moves) {
  if (moves != nullptr) {
    if (absl::Status s = CudaStatus(
            cuda::LaunchCopyBytes(moves->in_from, moves->in_to, moves->in_bytes, lane.stream),
            "input copy");
        !s.ok()) {
      return s;
    }
  }
  if (absl::Status s = lane.runner.Enqueue(layer, batch, plan, lane.stream); !s.ok()) return s;
  if (moves == nullptr || moves->out_bytes == 0) return absl::OkStatus();
  return CudaStatus(
      cuda::LaunchCopyBytes(moves->out_from, moves->out_to, moves->out_bytes, lane.stream),
      "output copy");
}

absl::Status CudaExpertBackend::Capture(Lane& lane, const cuda::DeviceExpertLayer& layer,
                                        const cuda::DeviceBatch& batch,
                                        const cuda::RoutePlan& plan, const BatchMoves* moves,
                                        cudaGraphExec_t* exec) {
  // Through instantiation (which may allocate device memory itself): no other lane's thread
  // synchronizes the device meanwhile (capture_mu_).
  absl::MutexLock capture(&capture_mu_);
  if (absl::Status s = CudaStatus(
          cudaStreamBeginCapture(lane.stream, cudaStreamCaptureModeThreadLocal), "graph capture");
      !s.ok()) {
    return s;
  }
  lane.runner.set_programmatic_launch(options_.programmatic_launch &&
                                  options_.graph_programmatic_launch);
  const absl::Status enqueued = EnqueueBatch(lane, layer, batch, plan, moves);
  lane.runner.set_programmatic_launch(options_.programmatic_launch);
  cudaGraph_t graph = nullptr;
  const cudaError_t ended = cudaStreamEndCapture(lane.stream, &graph);
  if (!enqueued.ok() || ended != cudaSuccess || options_.test_fail_graph_capture) {
    if (graph != nullptr) cudaGraphDestroy(graph);
    if (!enqueued.ok()) return enqueued;
    if (ended != cudaSuccess) return CudaStatus(ended, "graph capture");
    return absl::InternalError("graph capture failed (test_fail_graph_capture)");
  }
  const cudaError_t made = cudaGraphInstantiate(exec, graph, 0);
  cudaGraphDestroy(graph);
  return CudaStatus(made, "graph instantiate");
}

absl::Status CudaExpertBackend::EnqueueKernels(Lane& lane, const cuda::DeviceExpertLayer& layer,
                                               const cuda::DeviceBatch& batch,
                                               const cuda::RoutePlan& plan,
                                               const BatchMoves* moves, bool in_place) {
  const bool graphs = Graphed(plan);
  // Graphed shapes round their item grids up, so that routings with nearby item counts share one.
  lane.runner.set_round_item_grid(graphs);
  // Scratch first: allocation is not allowed during capture, and a reallocation invalidates the
  // graphs (they hold the old pointers), as does a new arena or a new layer copy.
  if (!lane.runner.Reserved(layer, plan)) {
    absl::MutexLock capture(&capture_mu_);
    if (absl::Status s = lane.runner.Reserve(layer, plan, lane.stream); !s.ok()) return s;
  }
  if (!graphs) {
    ++lane.counters.eager_runs;
    return EnqueueBatch(lane, layer, batch, plan, moves);
  }
  const uint64_t layers = layers_generation_.load();
  if (lane.graph_arena != lane.arena.get() || lane.graph_pinned != lane.pinned_device ||
      lane.graph_scratch != lane.runner.scratch_generation() || lane.graph_layers != layers) {
    if (!lane.graphs.empty()) ++lane.counters.graph_invalidations;
    {
      // Destroying graphs under capture_mu_ (none to destroy: no lock); failed shapes get
      // another try either way.
      absl::MutexLockMaybe capture(lane.graphs.empty() ? nullptr : &capture_mu_);
      ClearGraphs(lane);
    }
    lane.graph_arena = lane.arena.get();
    lane.graph_pinned = lane.pinned_device;
    lane.graph_scratch = lane.runner.scratch_generation();
    lane.graph_layers = layers;
  }
  // With its copy kernels, a graph also holds where they copy (the arena layout of the shape);
  // with device tensors used in place, their addresses. (Not the arena's own: it only moves when
  // every graph is dropped, and the sightings must outlive that.)
  std::string key = lane.runner.ShapeKey(layer, batch, plan);
  if (in_place) {
    absl::StrAppend(&key, "|at:", reinterpret_cast<uintptr_t>(batch.hidden), ":",
                    reinterpret_cast<uintptr_t>(batch.out));
  }
  if (moves != nullptr) {
    absl::StrAppend(&key, "|moves:", moves->in_bytes, ":", moves->out_to - lane.pinned_device, ":",
                    moves->out_bytes, ":", batch.out == moves->out_to);
  }
  ++lane.uses;
  if (auto it = lane.graphs.find(key); it != lane.graphs.end()) {
    it->second.last_use = lane.uses;
    ++lane.counters.graph_replays;
    return CudaStatus(cudaGraphLaunch(it->second.exec, lane.stream), "graph launch");
  }
  // A server's batch sizes can take many values: the record of shapes seen once stays bounded.
  if (lane.seen.size() >= kMaxSeenShapes) lane.seen.clear();
  int& sightings = lane.seen[key];
  // First batch of this shape (no capture for one-off shapes), or a shape whose capture failed.
  if (sightings++ <= 0) {
    ++lane.counters.eager_runs;
    return EnqueueBatch(lane, layer, batch, plan, moves);
  }
  // A full cache whose least recently used graph ran within the last kHotGraphUses Runs holds a
  // working set at least as large as itself: evicting for this shape would only start a cycle of
  // captures (each dearer than the eager Run it replaces), so the batch runs eagerly and the
  // kept graphs stay. Shapes get in again once some graph has gone cold.
  auto victim = lane.graphs.end();
  if (lane.graphs.size() >= static_cast<size_t>(kMaxCudaGraphs)) {
    victim = lane.graphs.begin();
    for (auto it = lane.graphs.begin(); it != lane.graphs.end(); ++it) {
      if (it->second.last_use < victim->second.last_use) victim = it;
    }
    if (victim->second.last_use + kHotGraphUses > lane.uses) {
      ++lane.counters.graph_refusals;
      ++lane.counters.eager_runs;
      return EnqueueBatch(lane, layer, batch, plan, moves);
    }
  }
  cudaGraphExec_t exec = nullptr;
  if (absl::Status s = Capture(lane, layer, batch, plan, moves, &exec); !s.ok()) {
    // A graph is an optimization: the batch runs eagerly, and this shape always will (until the
    // graphs are dropped). A launch error of the batch itself shows again in the eager run.
    LOG(WARNING) << "cuda backend: no CUDA graph for this batch shape, running it eagerly: " << s;
    cudaGetLastError();  // clears a non-sticky error the capture left
    sightings = kNoGraph;
    ++lane.counters.capture_failures;
    ++lane.counters.eager_runs;
    return EnqueueBatch(lane, layer, batch, plan, moves);
  }
  if (victim != lane.graphs.end()) {
    absl::MutexLock capture(&capture_mu_);
    cudaGraphExecDestroy(victim->second.exec);
    lane.graphs.erase(victim);
  }
  lane.graphs[key] = Graph{exec, lane.uses};
  ++lane.counters.graph_captures;
  return CudaStatus(cudaGraphLaunch(exec, lane.stream), "graph launch");
}

bool CudaExpertBackend::MappedParts(absl::Span<const TensorView> views, uint8_t* device,
                                    bool gather, std::vector<cuda::CopyPart>* copies) const {
  if (views.size() > static_cast<size_t>(cuda::kMaxCopyParts)) return false;
  copies->clear();
  size_t offset = 0;
  for (const TensorView& v : views) {
    const size_t bytes = static_cast<size_t>(v.NumBytes());
    uint8_t* mapped = nullptr;
    if (reinterpret_cast<uintptr_t>(v.data) % 16 != 0 || bytes % 16 != 0 ||
        !FindRegistered(v.data, bytes, &mapped) || mapped == nullptr) {
      return false;
    }
    if (device != nullptr) {  // else only the checks
      copies->push_back(gather ? cuda::CopyPart{mapped, device + offset, bytes}
                               : cuda::CopyPart{device + offset, mapped, bytes});
    }
    offset += bytes;
  }
  return true;
}

absl::Status CudaExpertBackend::RunImpl(int layer_index, const ExpertLayer& layer,
                                        const ExpertsRequest& request, const RowParts* parts) {
  RunClock::time_point t = RunClock::now();
  if (absl::Status s = ValidateExpertsRequest(layer, request); !s.ok()) return s;
  if (parts != nullptr) {
    if (request.hidden_on_device || request.out_on_device) {
      return absl::UnimplementedError("cuda backend: row parts of device tensors");
    }
    for (const auto& [views, whole] : {std::pair{parts->hidden, &request.hidden_states},
                                       std::pair{parts->out, &request.out}}) {
      int64_t rows = 0;
      for (const TensorView& v : views) {
        if (v.dtype != whole->dtype || v.shape.size() != 2 || v.dim(1) != whole->dim(1) ||
            v.data == nullptr) {
          return absl::InvalidArgumentError("cuda backend: a row part differs from its batch");
        }
        rows += v.dim(0);
      }
      if (rows != whole->dim(0)) {
        return absl::InvalidArgumentError(absl::StrCat("cuda backend: row parts hold ", rows,
                                                       " rows for a batch of ", whole->dim(0)));
      }
    }
  }
  absl::StatusOr<std::shared_ptr<const DeviceVersion>> version = Prepared(layer_index, layer);
  if (!version.ok()) return version.status();
  const cuda::DeviceExpertLayer& d = *(*version)->device;
  const int64_t tokens = request.hidden_states.dim(0);
  if (tokens == 0) return absl::OkStatus();
  Lane& lane = AcquireLane();
  if (runs_in_progress_.fetch_add(1) > 0) ++lane.counters.overlapped_runs;
  const absl::Cleanup release = [this, &lane]() ABSL_NO_THREAD_SAFETY_ANALYSIS {
    runs_in_progress_.fetch_sub(1);
    lane.mu.Unlock();
    LanesFreed();
  };
  if (absl::Status s = CudaStatus(cudaSetDevice(options_.device), "cudaSetDevice"); !s.ok()) {
    return s;
  }
  const bool with_mask = request.shared_mask.present() && !layer.shared_experts.empty();
  const cuda::RoutePlan plan = cuda::PlanRoutes(
      request.local_ids.As<const int32_t>(), tokens, request.local_ids.dim(1),
      with_mask ? request.shared_mask.As<const uint8_t>() : nullptr,
      static_cast<int>(layer.experts.size()), static_cast<int>(layer.shared_experts.size()));
  const ArenaLayout at = Layout(request, with_mask);
  const bool pinned = static_cast<int64_t>(at.total) <= options_.pinned_staging_bytes;
  if (absl::Status s = GrowBuffers(lane, at.total, pinned); !s.ok()) return s;
  // Device tensors (ExpertsRequest::hidden_on_device, out_on_device) in this device's memory at
  // 256-byte aligned addresses, as the arena's, are read and written in place by the kernels: no
  // copy at all (a graph then holds their addresses, EnqueueKernels). Others (another GPU's
  // memory, which the kernels would read over the link again and again, or unaligned) move by
  // one device copy each way, which the graphed form's copy kernels (through the pinned buffer)
  // cannot do.
  const bool on_device = request.hidden_on_device || request.out_on_device;
  const auto in_place = [this](const TensorView& v, bool device) {
    if (!device || reinterpret_cast<uintptr_t>(v.data) % 256 != 0) return false;
    cudaPointerAttributes where{};
    if (cudaPointerGetAttributes(&where, v.data) != cudaSuccess) {
      cudaGetLastError();  // clears a non-sticky error
      return false;
    }
    return where.type == cudaMemoryTypeDevice && where.device == options_.device;
  };
  const bool hidden_in_place = in_place(request.hidden_states, request.hidden_on_device);
  const bool out_in_place = in_place(request.out, request.out_on_device);
  const bool device_copies = (request.hidden_on_device && !hidden_in_place) ||
                             (request.out_on_device && !out_in_place);
  Moves moves = Moves::kCopyEngine;
  if (pinned && lane.pinned_device != nullptr &&
      static_cast<int64_t>(at.total) <= options_.kernel_copy_max_bytes) {
    moves = Graphed(plan) && !device_copies && at.in_bytes <= kCopyPieceBytes &&
                    static_cast<size_t>(request.out.NumBytes()) <= kCopyPieceBytes
                ? Moves::kKernelsWithBatch
                : Moves::kKernels;
  }
  // Hidden states and output in registered memory: straight to and from the device (eager
  // pinned batches; larger ones copy every tensor from the caller's memory anyway). Device
  // tensors not used in place always.
  const auto direct = [&](const TensorView& v, bool device, bool used_in_place) {
    if (device) return pinned && !used_in_place;
    const int64_t bytes = v.NumBytes();
    return pinned && moves != Moves::kKernelsWithBatch && options_.max_registered_bytes > 0 &&
           bytes >= options_.registered_direct_min_bytes &&
           InRegistered(v.data, static_cast<size_t>(bytes));
  };
  // Row parts: gathered and scattered by copy kernels through the device's mapping, or not taken
  // (UNIMPLEMENTED: the caller merges them). The request's own hidden and out addresses are only
  // the first part's.
  std::vector<cuda::CopyPart> gather, scatter;
  if (parts != nullptr &&
      (moves != Moves::kKernels || !options_.registered_kernel_copies ||
       !MappedParts(parts->hidden, lane.arena.as<uint8_t>() + at.hidden, /*gather=*/true, &gather) ||
       !MappedParts(parts->out, lane.arena.as<uint8_t>() + at.out, /*gather=*/false, &scatter))) {
    return absl::UnimplementedError(
        "cuda backend: these row parts are not all registered, mapped and aligned, or the batch "
        "is not moved by copy kernels");
  }
  const bool hidden_direct = parts == nullptr && direct(request.hidden_states,
                                                        request.hidden_on_device, hidden_in_place);
  const bool out_direct =
      parts == nullptr && direct(request.out, request.out_on_device, out_in_place);
  // Smaller registered hidden states or output of a batch that copy kernels move: those kernels
  // read or write them in place through the device's mapping (registered_kernel_copies), instead
  // of a host copy into or out of the pinned buffer.
  const auto mapped = [&](const TensorView& v, bool device, bool used_direct) -> uint8_t* {
    if (parts != nullptr || device || used_direct || moves != Moves::kKernels ||
        !options_.registered_kernel_copies ||
        reinterpret_cast<uintptr_t>(v.data) % 16 != 0) {
      return nullptr;
    }
    uint8_t* at_device = nullptr;
    return FindRegistered(v.data, static_cast<size_t>(v.NumBytes()), &at_device) ? at_device
                                                                                 : nullptr;
  };
  uint8_t* const hidden_mapped =
      mapped(request.hidden_states, request.hidden_on_device, hidden_direct);
  uint8_t* const out_mapped = mapped(request.out, request.out_on_device, out_direct);
  const HiddenFrom hidden_from = parts != nullptr            ? HiddenFrom::kGathered
                                 : hidden_in_place           ? HiddenFrom::kInPlace
                                 : hidden_direct             ? HiddenFrom::kCopied
                                 : hidden_mapped != nullptr  ? HiddenFrom::kMapped
                                                             : HiddenFrom::kStaged;
  t = AddElapsed(t, &lane.counters.prepare_ns);
  if (absl::Status s = CopyIn(lane, request, with_mask, at, pinned, moves, hidden_from, hidden_mapped);
      !s.ok()) {
    return s;
  }
  if (hidden_from == HiddenFrom::kGathered) {
    if (absl::Status s = CudaStatus(
            cuda::LaunchCopyParts(gather.data(), static_cast<int>(gather.size()), lane.stream),
            "input copy");
        !s.ok()) {
      return s;
    }
  }
  t = AddElapsed(t, &lane.counters.copy_in_ns);
  uint8_t* device = lane.arena.as<uint8_t>();
  cuda::DeviceBatch batch;
  batch.hidden = hidden_in_place ? request.hidden_states.data : device + at.hidden;
  batch.hidden_bf16 = request.hidden_states.dtype == DType::kBF16;
  batch.ids = reinterpret_cast<const int32_t*>(device + at.ids);
  batch.weights = reinterpret_cast<const float*>(device + at.weights);
  batch.shared_mask = with_mask ? device + at.mask : nullptr;
  batch.out = out_in_place ? static_cast<uint8_t*>(request.out.data) : device + at.out;
  batch.out_bf16 = request.out.dtype == DType::kBF16;
  BatchMoves batch_moves;
  if (moves == Moves::kKernelsWithBatch) {
    // Every kernel only writes the output (prologue zeros, fold or combine), once per element.
    const bool direct = options_.pinned_direct_output && !out_in_place;
    if (direct) batch.out = lane.pinned_device + at.out;
    const size_t first = hidden_in_place ? at.ids : 0;  // what CopyIn put in the pinned buffer
    batch_moves = {lane.pinned_device + first,
                   device + first,
                   at.in_bytes - first,
                   device + at.out,
                   lane.pinned_device + at.out,
                   direct || out_in_place ? 0 : static_cast<size_t>(request.out.NumBytes())};
  }
  if (absl::Status s =
          EnqueueKernels(lane, d, batch, plan, moves == Moves::kKernelsWithBatch ? &batch_moves : nullptr,
                         hidden_in_place || out_in_place);
      !s.ok()) {
    return s;
  }
  AddElapsed(t, &lane.counters.enqueue_ns);
  if (out_in_place) {
    // The kernels wrote it: only the wait.
    t = RunClock::now();
    const absl::Status synced = CudaStatus(cudaStreamSynchronize(lane.stream), "expert kernels");
    AddElapsed(t, &lane.counters.wait_ns);
    if (!synced.ok()) return synced;
  } else if (out_mapped != nullptr || parts != nullptr) {
    // A copy kernel writes it (each part of it) through the device's mapping: only the wait
    // after it.
    t = RunClock::now();
    const cudaError_t moved =
        parts != nullptr
            ? cuda::LaunchCopyParts(scatter.data(), static_cast<int>(scatter.size()), lane.stream)
            : cuda::LaunchCopyBytes(device + at.out, out_mapped,
                                    static_cast<size_t>(request.out.NumBytes()), lane.stream);
    if (absl::Status s = CudaStatus(moved, "output copy"); !s.ok()) return s;
    t = AddElapsed(t, &lane.counters.copy_out_submit_ns);
    const absl::Status synced = CudaStatus(cudaStreamSynchronize(lane.stream), "expert kernels");
    AddElapsed(t, &lane.counters.wait_ns);
    if (!synced.ok()) return synced;
  } else if (absl::Status s = CopyOut(lane, request, at, pinned && !out_direct, moves); !s.ok()) {
    // A registered or device output: one copy into it (CopyOut's unstaged form).
    return s;
  }
  if (pinned) ++lane.counters.pinned_runs;
  if (moves != Moves::kCopyEngine) ++lane.counters.kernel_copy_runs;
  const bool any_mapped = hidden_mapped != nullptr || out_mapped != nullptr || parts != nullptr;
  if (parts != nullptr) ++lane.counters.parts_runs;
  if (hidden_direct || out_direct || hidden_in_place || out_in_place || any_mapped) {
    ++lane.counters.direct_runs;
  }
  if (any_mapped) ++lane.counters.mapped_runs;
  if (on_device) ++lane.counters.device_tensor_runs;
  if (hidden_in_place || out_in_place) ++lane.counters.in_place_runs;
  return absl::OkStatus();
}

absl::Status CudaExpertBackend::GrowBuffers(Lane& lane, size_t bytes_needed, bool pinned) {
  if (lane.arena.get() != nullptr && lane.arena.size() >= bytes_needed &&
      (!pinned || lane.pinned_bytes >= bytes_needed)) {
    return absl::OkStatus();
  }
  absl::MutexLock capture(&capture_mu_);
  if (absl::Status s = lane.arena.Reserve(bytes_needed); !s.ok()) return s;
  if (pinned && lane.pinned_bytes < bytes_needed) {
    if (lane.pinned != nullptr) cudaFreeHost(lane.pinned);
    lane.pinned = nullptr;
    lane.pinned_device = nullptr;
    lane.pinned_bytes = 0;
    // Grown in powers of two (from 1 MB) up to the limit, so it is reallocated rarely.
    size_t bytes = size_t{1} << 20;
    while (bytes < bytes_needed) bytes *= 2;
    bytes = std::min(bytes, static_cast<size_t>(options_.pinned_staging_bytes));
    // Mapped where the device can map host memory, so that the copy kernels can address it;
    // elsewhere the copy engine moves it, as it does larger batches.
    if (absl::Status s = CudaStatus(
            cudaHostAlloc(reinterpret_cast<void**>(&lane.pinned), bytes,
                          can_map_host_ ? cudaHostAllocMapped : cudaHostAllocDefault),
            "pinned staging buffer");
        !s.ok()) {
      lane.pinned = nullptr;
      return s;
    }
    lane.pinned_bytes = bytes;
    void* mapped = nullptr;
    if (can_map_host_ && cudaHostGetDevicePointer(&mapped, lane.pinned, 0) == cudaSuccess) {
      lane.pinned_device = static_cast<uint8_t*>(mapped);
    } else {
      cudaGetLastError();  // clears a non-sticky error
    }
  }
  return absl::OkStatus();
}

CudaExpertBackend::Lane& CudaExpertBackend::AcquireLane() {
  while (true) {
    // Releases counted before the scan: one after it shows in the count, so none is missed.
    uint64_t seen = 0;
    {
      absl::MutexLock lock(&lane_free_mu_);
      seen = lane_releases_;
    }
    for (const std::unique_ptr<Lane>& lane : lanes_) {
      if (lane->mu.TryLock()) return *lane;
    }
    struct Seen {
      const CudaExpertBackend* backend;
      uint64_t releases;
    } wait{this, seen};
    absl::MutexLock lock(&lane_free_mu_);
    lane_free_mu_.Await(absl::Condition(
        +[](Seen* w) ABSL_NO_THREAD_SAFETY_ANALYSIS {
          return w->backend->lane_releases_ != w->releases;
        },
        &wait));
  }
}

void CudaExpertBackend::LanesFreed() const {
  absl::MutexLock lock(&lane_free_mu_);
  ++lane_releases_;
}

void CudaExpertBackend::Add(const CudaBackendCounters& a, CudaBackendCounters& sum) {
  sum.eager_runs += a.eager_runs;
  sum.graph_captures += a.graph_captures;
  sum.graph_replays += a.graph_replays;
  sum.pinned_runs += a.pinned_runs;
  sum.kernel_copy_runs += a.kernel_copy_runs;
  sum.capture_failures += a.capture_failures;
  sum.graph_refusals += a.graph_refusals;
  sum.graph_invalidations += a.graph_invalidations;
  sum.direct_runs += a.direct_runs;
  sum.mapped_runs += a.mapped_runs;
  sum.parts_runs += a.parts_runs;
  sum.device_tensor_runs += a.device_tensor_runs;
  sum.in_place_runs += a.in_place_runs;
  sum.overlapped_runs += a.overlapped_runs;
  sum.prepare_ns += a.prepare_ns;
  sum.copy_in_ns += a.copy_in_ns;
  sum.enqueue_ns += a.enqueue_ns;
  sum.copy_out_submit_ns += a.copy_out_submit_ns;
  sum.wait_ns += a.wait_ns;
  sum.copy_out_host_ns += a.copy_out_host_ns;
}

absl::Status CudaExpertBackend::RegisterHostMemory(void* data, size_t bytes) {
  if (data == nullptr || bytes == 0) {
    return absl::InvalidArgumentError("cuda backend: RegisterHostMemory of an empty range");
  }
  {
    absl::MutexLock lock(&registered_mu_);
    if (registered_total_ + bytes > static_cast<uint64_t>(std::max<int64_t>(
                                        0, options_.max_registered_bytes))) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "cuda backend: registering ", bytes, " bytes would pin more than max_registered_bytes (",
          options_.max_registered_bytes, "; ", registered_total_, " pinned now)"));
    }
  }
  if (absl::Status s = CudaStatus(cudaSetDevice(options_.device), "cudaSetDevice"); !s.ok()) {
    return s;
  }
  // Pinning a large range takes a while: outside the lanes and registered_mu_, so Runs go on
  // meanwhile (only under capture_mu_, so no lane captures a graph meanwhile).
  // Mapped too where the device can map host memory, so that copy kernels can read and write it
  // (registered_kernel_copies).
  const unsigned flags = cudaHostRegisterPortable | (can_map_host_ ? cudaHostRegisterMapped : 0u);
  Registered range{bytes, nullptr};
  {
    absl::MutexLock capture(&capture_mu_);
    if (absl::Status s = CudaStatus(cudaHostRegister(data, bytes, flags), "cudaHostRegister");
        !s.ok()) {
      cudaGetLastError();  // clears a non-sticky error (e.g. already registered)
      return s;
    }
    void* mapped = nullptr;
    if (can_map_host_ && cudaHostGetDevicePointer(&mapped, data, 0) == cudaSuccess) {
      range.device = static_cast<uint8_t*>(mapped);
    } else {
      cudaGetLastError();  // clears a non-sticky error: the range is only pinned
    }
  }
  absl::MutexLock lock(&registered_mu_);
  registered_[reinterpret_cast<uintptr_t>(data)] = range;
  registered_total_ += bytes;
  return absl::OkStatus();
}

void CudaExpertBackend::UnregisterHostMemory(void* data) {
  // Every lane first (in order; a Run holds one): a Run in progress may be reading or writing the
  // range; later ones no longer find it. Runs waiting for a lane are woken once they are released
  // (the cleanup runs after `runs` is destroyed).
  const absl::Cleanup freed = [this] { LanesFreed(); };
  std::vector<std::unique_ptr<absl::MutexLock>> runs;
  for (const std::unique_ptr<Lane>& lane : lanes_) {
    runs.push_back(std::make_unique<absl::MutexLock>(&lane->mu));
  }
  {
    absl::MutexLock lock(&registered_mu_);
    auto it = registered_.find(reinterpret_cast<uintptr_t>(data));
    if (it == registered_.end()) return;
    registered_total_ -= it->second.bytes;
    registered_.erase(it);
  }
  cudaSetDevice(options_.device);
  absl::MutexLock capture(&capture_mu_);
  if (cudaHostUnregister(data) != cudaSuccess) cudaGetLastError();
}

bool CudaExpertBackend::FindRegistered(const void* data, size_t bytes, uint8_t** device) const {
  const auto at = reinterpret_cast<uintptr_t>(data);
  absl::MutexLock lock(&registered_mu_);
  auto it = registered_.upper_bound(at);  // the first range starting after `data`
  if (it == registered_.begin()) return false;
  --it;
  const size_t offset = at - it->first;
  if (offset > it->second.bytes || bytes > it->second.bytes - offset) return false;
  if (device != nullptr) {
    *device = it->second.device != nullptr ? it->second.device + offset : nullptr;
  }
  return true;
}

}  // namespace

CudaBackendCounters GetCudaBackendCounters(const ExpertBackend& backend) {
  const auto* cuda = dynamic_cast<const CudaExpertBackend*>(&backend);
  return cuda != nullptr ? cuda->counters() : CudaBackendCounters{};
}

absl::StatusOr<std::unique_ptr<ExpertBackend>> MakeCudaExpertBackend(
    const CudaBackendOptions& options) {
  if (options.gemm_variant < -1 || options.gemm_variant > cuda::kMaxGemmVariant) {
    return absl::InvalidArgumentError(absl::StrCat("cuda backend: gemm_variant ",
                                                   options.gemm_variant, " is not in 0..",
                                                   cuda::kMaxGemmVariant));
  }
  // The three-way settings: -1 (the measured default), 0 (never) or 1 (always).
  const struct {
    const char* name;
    int value;
  } modes[] = {{"fused_layer", options.fused_layer}, {"item_ready", options.item_ready}};
  for (const auto& m : modes) {
    if (m.value < -1 || m.value > 1) {
      return absl::InvalidArgumentError(absl::StrCat("cuda backend: ", m.name, " ", m.value,
                                                     " is not -1 (default), 0 (off) or 1 (on)"));
    }
  }
  if (options.concurrent_runs < 1 || options.concurrent_runs > kMaxConcurrentCudaRuns) {
    return absl::InvalidArgumentError(absl::StrCat("cuda backend: concurrent_runs ",
                                                   options.concurrent_runs, " is not in 1..",
                                                   kMaxConcurrentCudaRuns));
  }
  std::string why;
  const int count = cuda::DeviceCount(&why);
  if (count == 0) return absl::FailedPreconditionError(absl::StrCat("--backend=cuda: ", why));
  if (options.device < 0 || options.device >= count) {
    return absl::FailedPreconditionError(absl::StrCat("--backend=cuda: --cuda_device=",
                                                      options.device, " requested, ", count,
                                                      " present (numbered from 0)"));
  }
  if (absl::Status s = CudaStatus(cudaSetDevice(options.device), "cudaSetDevice"); !s.ok()) {
    return s;
  }
  std::vector<cudaStream_t> streams;
  for (int i = 0; i < options.concurrent_runs; ++i) {
    cudaStream_t stream = nullptr;
    if (absl::Status s = CudaStatus(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking),
                                    "cudaStreamCreate");
        !s.ok()) {
      for (cudaStream_t made : streams) cudaStreamDestroy(made);
      return s;
    }
    streams.push_back(stream);
  }
  return std::make_unique<CudaExpertBackend>(options, streams);
}

}  // namespace moe
