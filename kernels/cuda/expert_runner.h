// Device-resident expert layers and the enqueueing of one batch through the CUDA expert kernels
// (expert_kernels.h): the launcher layer between the CUDA backend (cuda_backend.cc) and the
// device code. The kernel benchmark uses it directly to capture Enqueue into CUDA graphs.
//
// Thread-safety: a DeviceExpertLayer is immutable after upload and may be shared; an ExpertRunner
// (its scratch) is used by one thread at a time. Ownership: both own their device memory; neither
// keeps a pointer into the host ExpertLayer.
#ifndef MOE_KERNELS_CUDA_EXPERT_RUNNER_H_
#define MOE_KERNELS_CUDA_EXPERT_RUNNER_H_

#include <cuda_runtime_api.h>

#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "kernels/cuda/expert_kernels.h"
#include "kernels/cuda/expert_plan.h"
#include "kernels/experts.h"

namespace moe::cuda {

// INTERNAL naming `what` and the CUDA error, or OK.
absl::Status CudaStatus(cudaError_t err, absl::string_view what);

// Owning device allocation that only grows.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  ~DeviceBuffer();
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  // Makes the buffer at least `bytes` long; the contents are lost when it grows.
  [[nodiscard]] absl::Status Reserve(size_t bytes);
  void* get() const { return ptr_; }
  size_t size() const { return bytes_; }
  template <typename T>
  T* as() const {
    return static_cast<T*>(ptr_);
  }

 private:
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

// One of the two packed GEMM weight sets (repack.h layout), all slots back to back.
struct DeviceGemmWeights {
  DeviceBuffer values;
  DeviceBuffer scales;
  int tiles = 0;
  int chunks = 0;
  int64_t values_stride = 0;  // uint4 per slot
  int64_t scales_stride = 0;  // scale units (uint32 MXFP4, uint4 NVFP4) per slot
};

// A layer on the device: routed experts in slots [0, E), shared experts in [E, E + S).
struct DeviceExpertLayer {
  Fp4Format format = Fp4Format::kMxfp4;
  int64_t hidden = 0;
  int64_t inter = 0;
  int64_t hidden_chunks = 0;  // ceil(H / 64)
  int64_t inter_padded = 0;   // I rounded up to 64
  int num_experts = 0;
  int num_shared = 0;
  ActivationDesc act;
  DeviceGemmWeights w13;
  DeviceGemmWeights w2;
  DeviceBuffer ep_scale;   // f32 [slots][3]: gate, up, w2 epilogue factors
  DeviceBuffer bias_gate;  // f32 [slots][I] (zeros without b13)
  DeviceBuffer bias_up;    // f32 [slots][I]
  DeviceBuffer bias_w2;    // f32 [slots][H] (zeros without b2)

  int64_t device_bytes() const;
};

// Repacks every expert of `layer` (on `threads` host threads) and uploads it to the current
// device. `device_calls`, when not null, is held around each allocation and copy (not the host
// repacking): a caller whose other threads capture CUDA graphs keeps them apart that way.
// REQUIRES: ValidateExpertLayer(layer) is OK. FAILED_PRECONDITION for a format other than
// MXFP4/NVFP4 or more than kMaxPrologueSlots slots.
absl::StatusOr<std::unique_ptr<DeviceExpertLayer>> UploadExpertLayer(
    const ExpertLayer& layer, int device, int threads, absl::Mutex* device_calls = nullptr);

// Device pointers of one batch; shapes as in ExpertsRequest ([T, H], [T, K], [T]).
struct DeviceBatch {
  const void* hidden = nullptr;
  bool hidden_bf16 = false;
  const int32_t* ids = nullptr;
  const float* weights = nullptr;
  const uint8_t* shared_mask = nullptr;  // may be null
  void* out = nullptr;
  bool out_bf16 = false;
};

class ExpertRunner {
 public:
  // Grows the scratch for `plan`; a no-op when it is large enough, so a benchmark can size it
  // before stream capture (allocation is not allowed while capturing). New buffers that the
  // kernels need zeroed are zeroed on `stream` (ordered before what is enqueued there next).
  [[nodiscard]] absl::Status Reserve(const DeviceExpertLayer& layer, const RoutePlan& plan,
                                     cudaStream_t stream);
  // Whether the scratch is already large enough for `plan` (Reserve would allocate nothing).
  bool Reserved(const DeviceExpertLayer& layer, const RoutePlan& plan) const;

  // Enqueues prologue, GEMM1 + activation, GEMM2 and combine on `stream`. `plan` must come from
  // the same routes as batch.ids (PlanRoutes). Nothing is enqueued for zero tokens.
  [[nodiscard]] absl::Status Enqueue(const DeviceExpertLayer& layer, const DeviceBatch& batch,
                                     const RoutePlan& plan, cudaStream_t stream);

  // What the launches of Enqueue(layer, batch, plan) depend on besides the contents of the
  // device buffers: the layer, the shapes, the kernels and variants picked for the plan, the grid
  // and the batch's dtypes. Two batches with equal keys, the same device pointers and the same
  // scratch_generation() enqueue identical launches, so a CUDA graph captured from one replays
  // the other (with the other's inputs in the same buffers).
  std::string ShapeKey(const DeviceExpertLayer& layer, const DeviceBatch& batch,
                       const RoutePlan& plan) const;
  // Incremented whenever Reserve reallocates a scratch buffer (captured graphs then hold stale
  // pointers).
  uint64_t scratch_generation() const { return scratch_generation_; }
  // Grids of grouped routes sized for RoundedItemGrid(plan.num_items) items instead of exactly
  // plan.num_items (the CTAs past the device's item count return at once), so that batches of
  // one size with slightly different routings share a key (and a graph). Off by default.
  void set_round_item_grid(bool on) { round_item_grid_ = on; }
  // items rounded up to a multiple of 2^(floor(log2 items) - 3) above 16 (at most 1/8 more).
  static int64_t RoundedItemGrid(int64_t items);

  // Test aid: fill the intermediate buffers with NaN before each Enqueue, so that an element a
  // kernel forgets to write reaches the output instead of a stale value.
  void set_poison_scratch(bool on) { poison_ = on; }

  // Benchmark aid: when set (5 events), Enqueue records events[0] before the prologue and
  // events[i] after stage i (prologue, GEMM1, GEMM2, combine). Not for stream capture.
  void set_stage_events(cudaEvent_t* events) { stage_events_ = events; }

  // Tuning knobs (benchmarks): programmatic dependent launch between the kernels of a batch
  // (on by default) and the GEMM variant (GemmLaunch::variant, 0 by default).
  void set_programmatic_launch(bool on) { programmatic_ = on; }
  // GemmLaunch::variant, or kAutoGemmVariant (the default): per batch, direct routes (T=1-like
  // batches) -> 6 (deep cp.async ring, 4-way K split, folded combine); otherwise up to 16-token
  // items -> 12 (bulk-copy ring, one whole tile per warp, 10 CTAs per SM); token_groups >= 4 ->
  // 0 (tiled). The ring variants read the weights with an L2 evict-first policy.
  void set_gemm_variant(int variant) { variant_ = variant; }
  // The wgmma kernel (items of up to 144 tokens, expert_gemm_wgmma.cu) runs both GEMMs when the
  // busiest slot has at least this many tokens; 0 never (the mma.sync kernels, as chosen by the
  // plan and the variant). Default kDefaultWgmmaMinTokens: where the plan would use 64-token
  // tiles (at 512 tokens of problem A, ~16-32 per slot, wgmma and the tiled kernel measured
  // the same, 954-971 vs 963-966 us; from 4096 tokens wgmma is 1.6x faster, NOTES-cuda.md).
  static constexpr int kDefaultWgmmaMinTokens = 33;
  void set_wgmma_min_tokens(int tokens) { wgmma_min_tokens_ = tokens; }
  // Direct routes (ExpertGemmParams::direct_ids) when no expert slot of the batch has more than
  // one route and the variant runs the streaming kernel: no grouping, GEMM1 starts its weight
  // loads during the prologue. On by default.
  void set_direct_routes(bool on) { direct_ = on; }
  // With direct routes and a variant that allows it (GemmCanFoldCombine): the combine folded into
  // GEMM2 (ExpertGemmParams::fold_counters), no combine launch. On by default.
  void set_fold_combine(bool on) { fold_ = on; }
  // Also fold the combine with grouped routes through a bulk-copy variant (each warp counts the
  // tokens of its item one after the other). Off by default: measured slower (NOTES-cuda.md).
  void set_fold_grouped(bool on) { fold_grouped_ = on; }
  // Bulk-copy variants (GemmUsesBulkCopies) only: ExpertGemmParams::l2_prefetch bits, or
  // kAutoL2Prefetch (the default): per batch, the measured best (expert_runner.cc). Ring
  // variants 4..13: the L2 evict-first policy on the weight copies
  // (ExpertGemmParams::weights_evict_first, on by default).
  static constexpr int kAutoL2Prefetch = -1;
  void set_l2_prefetch(int bits) { l2_prefetch_ = bits; }
  void set_weights_evict_first(bool on) { evict_first_ = on; }
  // Also the evict-first policy on tiled variant 8's weight copies (the items of 32+ tokens).
  // Off by default: measured equal (A 512: 759.1 vs 760.2 us, NOTES-cuda.md); a bench knob.
  void set_tiled_evict_first(bool on) { tiled_evict_first_ = on; }
  // Batches on the wgmma kernel (its staged-epilogue variants): GEMM1 reads BF16 hidden rows of
  // whole 64-element chunks in place instead of a staged copy (hidden_in_place), and GEMM2 writes
  // y in BF16 for the combine (y_bf16; ExpertGemmParams::y_bf16). Both on by default; bench knobs.
  void set_hidden_in_place(bool on) { hidden_in_place_ = on; }
  void set_y_bf16(bool on) { y_bf16_ = on; }
  // Batches on the wgmma kernel's variant 0: ExpertGemmParams::l2_ahead_tiles = the SM count.
  // Off by default, a bench knob: measured 3.5% slower at problem C 512 (249.5 vs 241.0 us) and
  // within the noise at A 4096 / 8192 (NOTES-cuda.md).
  void set_wgmma_l2_ahead(bool on) { wgmma_l2_ahead_ = on; }
  // Batches on the wgmma kernel's variant 0 (without L2 ahead): persistent CTAs that claim tiles
  // of one width class and load the next tile's first weight stages during the current tile's
  // epilogue (ExpertGemmParams::wg_claims; the prologue writes the schedule). kPersistentAuto
  // (the default): NVFP4 layers only. H200, A-B-A pairs at the power cap (NOTES-cuda.md):
  // problem B 4096 2.2-3.5% faster; problem A (MXFP4) 4096 0.1-1.9% and 8192 0.5-0.8% slower
  // (3.4-4.5% before set_even_items kept an expert's items side by side).
  // kPersistentOn / kPersistentOff: every such batch / none.
  static constexpr int kPersistentAuto = -1;
  static constexpr int kPersistentOff = 0;
  static constexpr int kPersistentOn = 1;
  void set_wgmma_persistent(int mode) { wgmma_persistent_ = mode; }
  // wgmma batches: a slot's tokens cut into items of near-equal size
  // (ExpertPrologueParams::even_items). kPersistentAuto (the default): with persistent CTAs
  // only (there it keeps an expert's items in one width class, side by side: A 8192 persistent
  // +0.5..0.8% instead of +3.4..4.5% against one tile per CTA); kPersistentOn: every wgmma
  // batch; kPersistentOff: none.
  void set_even_items(int mode) { even_items_ = mode; }
  // Direct-route batches (the combine folded, the variant chosen per batch) may run as one fused
  // layer kernel (expert_kernels.h ExpertLayerParams) where it fits: kFusedLayerAuto (the
  // default) when GEMM1's K has at least kFusedLayerMinChunks chunks and the batch's routes
  // stream at least kFusedLayerMinBytesPerSm of weights per SM, kFusedLayerAlways whenever it
  // fits, kFusedLayerOff never. H200, direct batches (NOTES-cuda.md): faster only at problem B's
  // one token (112-chunk K, 1.6 MiB per SM: 79.7 against 83.9 us), even at B 2 (146.8 / 146.1);
  // slower for A (45 chunks) at 1-4 tokens (0.4-1.6 MiB per SM: +3 to +13%) and for C (32).
  static constexpr int kFusedLayerAuto = -1;
  static constexpr int kFusedLayerOff = 0;
  static constexpr int kFusedLayerAlways = 1;
  static constexpr int kFusedLayerMinChunks = 64;
  static constexpr int64_t kFusedLayerMinBytesPerSm = int64_t{3} << 19;  // 1.5 MiB
  void set_fused_layer(int mode) { fused_layer_ = mode; }
  // Two-grid batches on the mma.sync kernels under programmatic launch: GEMM2's CTAs wait per
  // item for GEMM1's warps of that item (ExpertGemmParams::item_ready) instead of for the whole
  // GEMM1 grid. kItemReadyAuto (the default): where GEMM1's grid fills kItemReadyMinWaves to
  // kItemReadyMaxWaves waves (GemmWaves). H200, weight-streaming kernel (NOTES-cuda.md): faster
  // at 0.9-2.9 waves (problem C 8 / 64 tokens 47.8 / 100.5 us against 51.7 / 107.0, A 1 29.4
  // against 30.2, B 8 -1 to -3%), about even at 2.05 (A 8); slower at 0.73 (C 1: 16.7 against
  // 15.7: the fence and the polling where all GEMM1 CTAs end together) and at 11 (B 64: +1 to
  // +5%), no gain at 7.8 (A 64). kItemReadyAlways: every such batch; kItemReadyOff: never.
  static constexpr int kItemReadyAuto = -1;
  static constexpr int kItemReadyOff = 0;
  static constexpr int kItemReadyAlways = 1;
  static constexpr double kItemReadyMinWaves = 0.8;
  static constexpr double kItemReadyMaxWaves = 4.5;
  void set_item_ready(int mode) { item_ready_mode_ = mode; }
  // MXFP4 batches of one token group on variants 6 and 12: the block scale applied to the fp32
  // accumulators (ExpertGemmParams::acc_scale; the staged rows times 2^64). Off by default, a
  // bench knob: H200 (NOTES-cuda.md), variant 12 0.3-1.3% faster (C 8 47.0 against 47.7 us,
  // A 8 / A 64 within the noise), variant 6 3-6% slower (A 1 30.9 against 30.1, C 1 16.8 against
  // 15.8; it spills 4-8 bytes there).
  void set_acc_scale(bool on) { acc_scale_ = on; }
  // GEMM2 launches with per-item readiness so far.
  int64_t item_ready_launches() const { return item_ready_launches_; }
  // Fused layer kernels enqueued so far.
  int64_t fused_layer_launches() const { return fused_layer_launches_; }
  // Benchmark aid: ExpertLayerParams::trace of the fused layer kernel (device memory, 8 words per
  // SM), or null. Not for stream capture.
  void set_layer_trace(unsigned long long* trace) { layer_trace_ = trace; }
  // Benchmark aid: ExpertGemmParams::wg_trace of the wgmma kernel's GEMM1 (at `trace`) and GEMM2
  // (at trace + gemm2_offset words), or null. Device memory of kWgTraceWords words per CTA (per
  // tile with persistent CTAs).
  void set_wgmma_trace(unsigned long long* trace, int64_t gemm2_offset) {
    wgmma_trace_ = trace;
    wgmma_trace_gemm2_ = gemm2_offset;
  }

 private:
  // The per-batch choices of Enqueue, from the plan and the runner's settings.
  struct Decisions {
    bool wgmma = false;
    RoutePlan plan;  // the plan with the kernel's token tile
    bool few = false;
    int variant = 0;
    bool direct = false;
    bool fold = false;
    bool hidden_in_place = false;
    bool l2_ahead = false;
    bool persistent = false;  // the wgmma kernel's persistent CTAs (set_wgmma_persistent)
    bool even_items = false;  // ExpertPrologueParams::even_items (set_even_items)
    bool layer = false;  // the fused layer kernel (LaunchExpertLayer)
    bool acc_scale = false;  // ExpertGemmParams::acc_scale for both GEMMs
    int64_t ready_target = 0;  // > 0: item_ready with this GEMM2 target (GemmItemReadyCount)
    int64_t grid_items = 0;  // GemmLaunch::num_items
  };
  Decisions Decide(const DeviceExpertLayer& layer, const DeviceBatch& batch,
                   const RoutePlan& given_plan) const;
  absl::Status Mark(int stage, cudaStream_t stream) const;

  // What Reserve makes of a plan: the plain scratch buffers' sizes (in PlainScratch's order)
  // and those of the three buffers kept zeroed.
  struct ScratchSizes {
    std::array<size_t, 10> plain{};
    size_t group_scratch = 0, item_ready = 0, fold_counters = 0;
  };
  ScratchSizes Sizes(const DeviceExpertLayer& layer, const RoutePlan& plan) const;
  // The plain scratch buffers of `self` (const or not).
  template <typename Self>
  static auto PlainScratch(Self& self) {
    return std::array{&self.x_staged_, &self.slot_token_, &self.slot_route_, &self.items_,
                      &self.wg_items_, &self.wg_sched_,   &self.num_items_,  &self.act_,
                      &self.y_,        &self.ready_};
  }

  bool round_item_grid_ = false;
  uint64_t scratch_generation_ = 0;

  bool poison_ = false;
  bool programmatic_ = true;
  int variant_ = kAutoGemmVariant;
  int wgmma_min_tokens_ = kDefaultWgmmaMinTokens;
  bool direct_ = true;
  bool fold_ = true;
  bool fold_grouped_ = false;
  int l2_prefetch_ = kAutoL2Prefetch;
  bool evict_first_ = true;
  bool tiled_evict_first_ = false;
  bool hidden_in_place_ = true;
  bool y_bf16_ = true;
  bool wgmma_l2_ahead_ = false;
  int wgmma_persistent_ = kPersistentAuto;
  int even_items_ = kPersistentAuto;
  int item_ready_mode_ = kItemReadyAuto;
  bool acc_scale_ = false;
  int fused_layer_ = kFusedLayerAuto;
  // Set when a cooperative launch of the fused layer kernel was refused (not all of its CTAs
  // could be resident): later batches do not try again.
  bool layer_unavailable_ = false;
  int64_t fused_layer_launches_ = 0;
  int64_t item_ready_launches_ = 0;
  unsigned long long* layer_trace_ = nullptr;
  unsigned long long* wgmma_trace_ = nullptr;
  int64_t wgmma_trace_gemm2_ = 0;
  cudaEvent_t* stage_events_ = nullptr;
  DeviceBuffer x_staged_;
  DeviceBuffer slot_token_;
  DeviceBuffer slot_route_;
  DeviceBuffer items_;
  DeviceBuffer wg_items_;  // ExpertPrologueParams::wg_items
  DeviceBuffer wg_sched_;  // ExpertPrologueParams::wg_sched
  DeviceBuffer num_items_;
  DeviceBuffer act_;
  DeviceBuffer y_;
  DeviceBuffer group_scratch_;  // ExpertPrologueParams::group_scratch, zero when allocated
  DeviceBuffer fold_counters_;  // zero between batches (the folded combine resets what it uses)
  DeviceBuffer ready_;  // ExpertLayerParams::ready (zeroed by each batch's prologue)
  // ExpertGemmParams::item_ready: zero when allocated, and GEMM2 leaves it at zero; dirty when a
  // GEMM2 launch failed after its GEMM1 (cleared before the next batch that uses it).
  DeviceBuffer item_ready_;
  bool item_ready_dirty_ = false;
};

}  // namespace moe::cuda

#endif  // MOE_KERNELS_CUDA_EXPERT_RUNNER_H_
