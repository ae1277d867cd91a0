// Launchers and Params structs of the CUDA expert-execution kernels (one MoE layer, FP4 weights):
//   1. prologue  (expert_prologue.cu): groups the routes by expert slot into token tiles ("items")
//      and stages the hidden states as permuted bf16 rows (fp4_fragment.h);
//   2. GEMM1     (expert_gemm.cu, expert_gemm_tiled.cu): act = activation(w13 @ x + b13) per
//      route, bf16, permuted;
//   3. GEMM2     (same): y[route] = w2 @ act + b2, fp32, one row per (token, k) route;
//   4. combine   (expert_combine.cu): out[t] = sum_k w[t, k] * y[t, k] (+ shared experts), in k
//      order, so the result is bitwise repeatable (no atomics anywhere on the data path).
// Every pointer is device memory. Launchers only enqueue on `stream` and return the launch error.
//
// Called by expert_runner.cc. Thread-safety: launchers are reentrant; Params are plain values.
// Host-side header: needs only the CUDA runtime API, no device code, no abseil.
#ifndef MOE_KERNELS_CUDA_EXPERT_KERNELS_H_
#define MOE_KERNELS_CUDA_EXPERT_KERNELS_H_

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

namespace moe::cuda {

enum class Fp4Format : int { kMxfp4 = 0, kNvfp4 = 1 };

// Mirrors moe::ActivationKind (kernels/activation.h); expert_runner.cc checks the values match.
enum class ActKind : int { kSilu = 0, kSwigluOai = 1, kSitu = 2, kGelu = 3, kGeluTanh = 4 };

struct ActivationDesc {
  ActKind kind = ActKind::kSilu;
  float alpha = 1.702f;
  float limit = 7.f;
  float beta = 1.f;
  float linear_beta = 0.f;
};

// One work item of the GEMMs: up to tile_tokens consecutive slots of one expert slot.
struct ExpertItem {
  int32_t expert;      // slot index in [0, num_experts + num_shared)
  int32_t slot_begin;  // first position in slot_token / slot_route
  int32_t count;       // tokens in this item, 1..tile_tokens
  int32_t unused;
};

struct ExpertPrologueParams {
  // Inputs.
  const void* hidden = nullptr;  // [T, H] F32, or BF16 when hidden_bf16
  bool hidden_bf16 = false;
  const int32_t* ids = nullptr;           // [T, K] local slot or -1
  const uint8_t* shared_mask = nullptr;   // [T] or null
  int32_t tokens = 0;                     // T
  int32_t top_k = 0;                      // K
  int32_t hidden_size = 0;                // H
  int32_t hidden_chunks = 0;              // ceil(H / 64)
  int32_t num_experts = 0;                // routed slots E
  int32_t num_shared = 0;                 // shared experts S (slots E .. E+S-1)
  int32_t tile_tokens = 8;                // tokens per item (8 * token groups)
  // Stage the rows in natural K order instead of the per-chunk permutation (ActPermIndex): the
  // wgmma kernel (token groups 16) reads B from shared memory in natural order.
  bool natural_order = false;
  // False: only stage the hidden states (the GEMMs take routes directly, ExpertGemmParams
  // direct_ids), no grouping block; slot_token, slot_route, items and num_items are not written.
  bool group_routes = true;
  // False: the hidden rows are not staged (x_staged is not written) because GEMM1 reads them in
  // place (BF16 rows whose length is a whole number of chunks, natural order: the wgmma kernel).
  bool stage_hidden = true;
  // When GEMM2 folds the combine (ExpertGemmParams::fold_counters), the output rows of tokens
  // with no route at all (every id -1, no marked shared expert) are written here as zeros (no
  // GEMM2 CTA counts for them). Null otherwise.
  void* zero_unrouted_out = nullptr;  // [T, H] F32, or BF16 when zero_unrouted_bf16
  bool zero_unrouted_bf16 = false;
  // Grouping by several blocks (big batches; LaunchExpertPrologue picks how many, up to
  // kMaxGroupBlocks): each block counts a contiguous share of the routes, the last to finish
  // scans the totals and cuts the items, and every block then scatters its share from its own
  // per-slot bases. Scratch (null: one grouping block): group_scratch [2 + (kMaxGroupBlocks + 1)
  // * slots] int32, zero before its first use (words 0-1: the blocks' arrival count, reset by the
  // last block, and a generation the last block advances; then the slot offsets; then the
  // per-block counts).
  int32_t* group_scratch = nullptr;
  int32_t group_blocks = 1;  // set by LaunchExpertPrologue (0 without group_routes)
  // Words set to zero by the prologue (the fused layer kernel's per-route counters,
  // ExpertLayerParams::ready), or null.
  int32_t* zero_words = nullptr;
  int32_t zero_word_count = 0;
  // Factor on the staged hidden rows before their BF16 rounding (2^64 for GEMM1 with
  // ExpertGemmParams::acc_scale; a power of two, so the rows are the same values scaled).
  float x_prescale = 1.f;
  // Outputs.
  uint16_t* x_staged = nullptr;    // [T, hidden_chunks * 64] bf16, permuted per chunk, zero-padded
  int32_t* slot_token = nullptr;   // [routes] token of each grouped slot
  int32_t* slot_route = nullptr;   // [routes] y row of each grouped slot: t*K+k or T*K + s*T + t
  ExpertItem* items = nullptr;     // [>= number of items]
  int32_t* num_items = nullptr;    // [1]
  // The persistent wgmma schedule (ExpertGemmParams::wg_claims), or null: the items again in
  // wg_items, grouped by wgmma width class (WgmmaWidthClass; slot order inside a class), and
  // wg_sched [kWgSchedWords]: the classes' first positions in wg_items, and both GEMMs' claim
  // counters set to zero.
  int32_t* wg_sched = nullptr;
  ExpertItem* wg_items = nullptr;  // [>= number of items]
  // Cut a slot's tokens into ceil(n / tile_tokens) items whose sizes differ by at most one
  // instead of whole tiles and the rest (e.g. 128 + 128 instead of 144 + 112).
  bool even_items = false;
};

// Shared smem-bounded limit of the grouping block (counts, offsets, cursors per slot).
inline constexpr int kMaxPrologueSlots = 4096;
// Grouping blocks of one prologue at most, and the routes each takes at least.
inline constexpr int kMaxGroupBlocks = 32;
inline constexpr int kRoutesPerGroupBlock = 1024;
inline size_t GroupScratchWords(int slots) {
  return 2 + static_cast<size_t>(kMaxGroupBlocks + 1) * static_cast<size_t>(slots);
}

struct ExpertGemmParams {
  // Packed weights (repack.h layout), all expert slots back to back.
  const void* values = nullptr;   // uint4 [slots][tiles][chunks][32]
  const void* scales = nullptr;   // MXFP4: uint32 [slots][tiles][chunks][8]; NVFP4: uint4 [...]
  int64_t values_expert_stride = 0;  // in uint4
  int64_t scales_expert_stride = 0;  // in scale units (uint32 for MXFP4, uint4 for NVFP4)
  int32_t tiles = 0;                 // 16-row tiles per expert
  int32_t chunks = 0;                // 64-element K chunks
  // B operand rows (permuted bf16, `chunks` * 64 elements each).
  const uint16_t* b_rows = nullptr;
  const int32_t* b_row_of_slot = nullptr;  // GEMM1: slot_token; GEMM2: null (row = slot)
  // Schedule.
  const ExpertItem* items = nullptr;
  const int32_t* num_items = nullptr;
  // Epilogue. ep_scale[slot * 3 + {0, 1, 2}] = gate, up, w2 factors (global scale times the
  // exponent offset of the packing).
  const float* ep_scale = nullptr;
  const float* bias_a = nullptr;  // GEMM1: gate bias [slots][I]; GEMM2: b2 [slots][H]
  const float* bias_b = nullptr;  // GEMM1: up bias [slots][I]; GEMM2: unused
  int32_t out_valid = 0;          // GEMM1: I; GEMM2: H (rows that exist)
  int32_t out_cols = 0;           // GEMM1: I padded to 64 (act row length); GEMM2: H
  ActivationDesc act;             // GEMM1 only
  uint16_t* act_out = nullptr;    // GEMM1: [slots][out_cols] bf16, permuted
  float* y_out = nullptr;         // GEMM2: [route rows][H]
  // GEMM2 of the wgmma kernel's variant 0 only (LaunchExpertGemm refuses it elsewhere): y_out
  // holds BF16 values (rounded to nearest even, same row pitch in elements) instead of F32,
  // which halves the y bytes GEMM2 writes and the combine reads.
  bool y_bf16 = false;
  // The wgmma kernel's variant 0: before its epilogue, each CTA asks L2 for the first weight
  // stages of tile blockIdx.x + l2_ahead_tiles, the tile likely to start when it ends, whose
  // first loads nothing overlaps. -1: the device's SM count (one resident CTA per SM); 0: off.
  // A hint only: results do not depend on it.
  int32_t l2_ahead_tiles = 0;
  // Benchmark aid, the wgmma kernel's shared-memory ring variants: thread 0 of each CTA that has
  // an item writes kWgTraceWords words at wg_trace[kWgTraceWords * blockIdx.x]: its SM id, then
  // %globaltimer (ns) at its start (item known), its inputs ready (GEMM2: past its programmatic
  // wait; GEMM1: as the start), its first chunk's B stage ready, its main loop done, its end,
  // its wgmma groups drained (the epilogue's first barrier), its tile staged in shared memory.
  unsigned long long* wg_trace = nullptr;
  // The wgmma kernel's variant 0, persistent (set by the runner when the prologue wrote the
  // schedule: ExpertPrologueParams::wg_sched): this GEMM's claim counters (kWgWidthClasses
  // words, zero at launch), the classes' starts and the items grouped by class. A CTA claims
  // tiles of one width class (c * row blocks + row block of its class's items) until the class
  // runs out, loading each next tile's weights during the current tile's epilogue; the grid is
  // one wave per class (a CTA leaves only when its class is out, and a class's CTAs are all
  // resident until then, one per SM). Null: one tile per CTA (blockIdx.x). With wg_trace, the records are indexed by
  // the tile's position in this order instead of blockIdx.x.
  int32_t* wg_claims = nullptr;
  const int32_t* wg_starts = nullptr;
  const ExpertItem* wg_items = nullptr;
  const int32_t* slot_route = nullptr;  // GEMM2: y row of each slot
  // Direct routes (no grouping; for batches where no expert slot has more than one route): when
  // direct_ids is set, item i is route i of the y rows (t*K+k, then T*K + s*T + t for shared
  // expert s), one token, slot = y row = i, expert ids[i] (or E + s where mask[t] is set; items
  // whose expert is -1 or unmarked do nothing). items, num_items, b_row_of_slot and slot_route
  // are then unused: GEMM1's B row is the route's token, GEMM2's is the slot. GEMM1 reads only
  // ids before its programmatic wait, so it issues its first weight loads while the prologue
  // still stages the activations. Only the streaming kernel (GemmUsesStreamingKernel) has it.
  const int32_t* direct_ids = nullptr;      // [T, K] slot or -1
  const uint8_t* direct_mask = nullptr;     // [T] shared-expert mask or null
  int32_t direct_tokens = 0;                // T
  int32_t direct_top_k = 0;                 // K
  int32_t direct_experts = 0;               // routed slots E (shared slot s is E + s)
  int32_t direct_shared = 0;                // shared slots S that run (0 without a mask)
  // GEMM2 (GemmCanFoldCombine; direct routes, or grouped routes with fold_slot_token): the
  // combine folded in. Each warp that writes a 16-row tile of y rows counts itself, per token of
  // its item, in fold_counters[token * ceil(H / 16) + tile]; the last of the token's routes
  // (fold_ids >= 0, then marked shared experts) adds the y rows of that tile in the combine's
  // order (expert_combine.cu: k order, then shared experts with weight 1, fp32) into out and
  // resets the counter to 0. Deterministic: the order never depends on which CTA is last.
  // fold_counters must be zero before the launch.
  int32_t* fold_counters = nullptr;         // [T * ceil(H / 16)], zero
  const int32_t* fold_ids = nullptr;        // [T, K] slot or -1 (the batch's ids)
  const uint8_t* fold_mask = nullptr;       // [T] shared-expert mask or null
  int32_t fold_tokens = 0;                  // T
  int32_t fold_top_k = 0;                   // K
  int32_t fold_shared = 0;                  // shared slots S that run (0 without a mask)
  const int32_t* fold_slot_token = nullptr; // grouped routes: token of each slot; null if direct
  const float* fold_weights = nullptr;      // [T, K]
  void* fold_out = nullptr;                 // [T, H] F32, or BF16 when fold_out_bf16
  bool fold_out_bf16 = false;
  // Streaming kernel, shared-memory ring variants (4..13): weights_evict_first: the ring's
  // copies carry an L2 evict-first policy (weights are read once; activations, act rows and y
  // stay). Bulk-copy variants (GemmUsesBulkCopies) only: l2_prefetch bits (kL2Prefetch*):
  // kL2PrefetchOwn: each warp asks L2 for its whole weight range at its start
  // (cp.async.bulk.prefetch.L2); kL2PrefetchNext (GEMM1 only): each warp also asks for its share
  // of next_* of the same expert slot (GEMM2's weights, while GEMM1 runs); kL2PrefetchAhead: each
  // warp asks for the group one ring length beyond its ring at every refill. Hints only: results
  // do not depend on them.
  bool weights_evict_first = false;
  int32_t l2_prefetch = 0;
  // MXFP4 on the streaming kernel's variants 6 and 12 with one token group only: the block scale
  // applied to the fp32 accumulators once per 32-K block instead of to the decoded weights
  // (fewer instructions per weight). The B rows must then be staged times 2^64 (the prologue's
  // x_prescale; GEMM1's act_prescale for GEMM2) and acc_unscale be 2^-64. act_prescale and
  // acc_unscale apply to every kernel's epilogue through EpilogueAct / EpilogueY: 1 otherwise.
  bool acc_scale = false;
  float acc_unscale = 1.f;   // epilogue factor on the accumulators
  // 2, 4, 8, 64 and 128 as values the compiler cannot see: the wgmma kernel's E2M1 decode
  // multiplies by them instead of shifting (DequantStepMul, UnpackFragmentWordMul), which puts
  // those operations on the FMA pipe (IMAD) beside the ALU's masks. Leave at these values.
  uint32_t shift_mul[5] = {2u, 4u, 8u, 64u, 128u};
  float act_prescale = 1.f;  // GEMM1: factor on the act values before their BF16 rounding
  // Per-item readiness instead of the grid-wide wait (the mma.sync kernels): GEMM1's warps that
  // write act rows of item i (route i with direct routes) each add 1 to item_ready[32 * i] after
  // their stores (release); GEMM2's CTAs of item i wait until that word reaches
  // item_ready_target (acquire) before reading act rows, instead of griddepcontrol.wait, so
  // GEMM2's CTAs of finished items run while GEMM1's last CTAs stream. Each GEMM2 CTA then adds 1
  // too, and the last of the item's item_ready_waiters CTAs sets the word back to zero. Both
  // GEMMs get the same array (32 words per item), which must be zero before GEMM1 (allocate it
  // zeroed; a batch whose GEMM2 did not run leaves words set). Null: the grid-wide wait.
  int32_t* item_ready = nullptr;
  int32_t item_ready_target = 0;   // GEMM2: GemmItemReadyCount of GEMM1's launch
  int32_t item_ready_waiters = 0;  // GEMM2: GemmItemReadyCount of its own launch
  const void* next_values = nullptr;     // GEMM2's packed values, or null
  const void* next_scales = nullptr;
  int64_t next_values_stride_bytes = 0;  // per expert slot
  int64_t next_scales_stride_bytes = 0;
  int64_t next_values_bytes = 0;         // used bytes per expert slot (tiles * chunks * 512)
  int64_t next_scales_bytes = 0;
};
inline constexpr int kL2PrefetchOwn = 1;
inline constexpr int kL2PrefetchNext = 2;
inline constexpr int kL2PrefetchAhead = 4;

struct ExpertCombineParams {
  const void* y = nullptr;               // [T*K + S*T, H] F32, or BF16 when y_bf16
  bool y_bf16 = false;
  const int32_t* ids = nullptr;          // [T, K]
  const float* weights = nullptr;        // [T, K]
  const uint8_t* shared_mask = nullptr;  // [T] or null
  int32_t tokens = 0;
  int32_t top_k = 0;
  int32_t hidden_size = 0;
  int32_t num_shared = 0;
  void* out = nullptr;  // [T, H] F32, or BF16 when out_bf16
  bool out_bf16 = false;
};

// Launched as a plain kernel: it overwrites scratch the previous batch's kernels read. It lets
// GEMM1 (launched programmatically) start launching at once; GEMM1 waits for its completion.
cudaError_t LaunchExpertPrologue(const ExpertPrologueParams& p, cudaStream_t stream);

inline constexpr int kMaxGemmVariant = 13;
// ExpertRunner / CUDA backend setting (not a GemmLaunch value): pick the variant per batch from
// the format and the routes (ExpertRunner::set_gemm_variant; the measured best, NOTES-cuda.md).
inline constexpr int kAutoGemmVariant = -1;
// GemmLaunch::token_groups of the wgmma kernel (items of up to 144 tokens: at 128 about half the
// slots of a 4096-token batch of problems A and B had a few-token second item, a whole weight pass).
inline constexpr int kWgmmaTokenGroups = 18;
inline constexpr int kWgTraceWords = 8;  // ExpertGemmParams::wg_trace words per CTA
// Width classes of the wgmma kernel: an item of `count` tokens (1..144) runs the body of width
// WgmmaClassWidth(WgmmaWidthClass(count)), class 0 the widest.
inline constexpr int kWgWidthClasses = 9;
constexpr int WgmmaWidthClass(int count) {
  return count > 96 ? 18 - (count + 7) / 8 : count > 64 ? 6 : count > 32 ? 7 : 8;
}
constexpr int WgmmaClassWidth(int width_class) {
  return width_class <= 6 ? 144 - 8 * width_class : width_class == 7 ? 64 : 32;
}
// ExpertPrologueParams::wg_sched words: [kWgSchedClaims + kWgSchedClaimStride g + c] the claim
// counter of GEMM g + 1 for class c; [kWgSchedStarts + c] the first position of class c in
// wg_items (c = 0 .. kWgWidthClasses; the last is the item count).
inline constexpr int kWgSchedClaims = 0;
inline constexpr int kWgSchedClaimStride = 16;
inline constexpr int kWgSchedStarts = 32;
inline constexpr int kWgSchedWords = 48;
static_assert(kWgWidthClasses <= kWgSchedClaimStride &&
              kWgSchedClaims + 2 * kWgSchedClaimStride <= kWgSchedStarts &&
              kWgSchedStarts + kWgWidthClasses + 1 <= kWgSchedWords);
// The wgmma variants whose epilogue goes through shared memory (all but the measured-only 1 and
// 2, whose ring leaves no room for the tile): only these write BF16 y (ExpertGemmParams::y_bf16).
inline bool WgmmaStagesEpilogue(int variant) { return variant != 1 && variant != 2; }

struct GemmLaunch {
  Fp4Format format = Fp4Format::kMxfp4;
  bool gemm1 = true;
  // 1, 2, 4 or 8: the mma.sync kernels; 18 (items of up to 144 tokens): the wgmma kernel
  // (expert_gemm_wgmma.cu), which reads and writes activations in natural K order.
  int token_groups = 1;
  // Tuning, 0..kMaxGemmVariant. token_groups <= 2: 0, 1, 2 = the weight-streaming kernel
  // (expert_gemm.cu: 1 row warp, 1 row warp + L1 warm-up of B, 2 row warps + warm-up), 3 = the
  // tiled kernel. token_groups >= 4: 0, 1, 2 = tiled configurations (expert_gemm_tiled.cu), 3 = the
  // streaming kernel. 4: token_groups <= 2: the streaming kernel with the weights staged through a
  // per-warp shared-memory ring filled by cp.async (more bytes in flight than the register ring of
  // 0..2); token_groups >= 4: as 0. 5: as 4 with two row warps and a 2-way K split (longer streams
  // per warp); 6: as 4 with a deeper ring (12 chunks per warp against 8); 7: four row warps, no K
  // split (each warp streams a whole tile); token_groups >= 4: 4 = the tiled kernel with the
  // weights in a per-warp shared-memory ring filled by bulk copies (4-warp CTAs, 4 per SM at G =
  // 4), 5 = the same with 8-warp CTAs (2 per SM) and empty token groups skipped (G = 8: as 4), 6 =
  // as 4 with groups of 4 chunks, 7 = as 6 with 2 B stages and 5 CTAs per SM (G = 8: as 6), 8 = as
  // 6 without the MMAs of token groups past the item's tokens (the default), 9..13 as 0. 8..13
  // (token_groups <= 2): the ring filled by bulk copies (cp.async.bulk, one request per group of 2
  // or 4 chunks per warp, an mbarrier per ring slot; GemmUsesBulkCopies): 8 = four row warps, no K
  // split, ring of 8 chunks in groups of 2; 9 = two row warps x 2-way K split, 12 chunks; 10 = one
  // row warp x 4-way K split, 12 chunks; 11 = as 8 with 12 chunks in 3 groups of 4; 12 = as 8 with
  // 2 groups of 4 (10 CTAs per SM); 13 = as 12 with 12 CTAs per SM (fewer registers). token_groups
  // 18 (wgmma): 0 = 4 warpgroups x 1 m64 block with a shared-memory weight ring (also 3..13), 1 = 2
  // x 2 with the register ring, 2 = 4 x 1 with the register ring. 0 is the measured best
  // (NOTES-cuda.md; wgmma 0 and 2 tie).
  int variant = 0;
  int num_items = 0;     // the host's count (the device writes the same to *p.num_items)
  // Programmatic dependent launch: the kernel may start before its predecessor in the stream
  // finishes and waits (griddepcontrol.wait) before reading what that predecessor wrote.
  // REQUIRES: the predecessor is the prologue (GEMM1) or GEMM1 (GEMM2).
  bool programmatic = false;
};

// grid = row blocks x num_items CTAs: row blocks = ceil(GEMM rows / rows per CTA), where GEMM1
// rows are 2 * I padded to 64 (every act column is written, zeros past I) and GEMM2 rows are H.
cudaError_t LaunchExpertGemm(const ExpertGemmParams& p, const GemmLaunch& launch,
                             cudaStream_t stream);

// Waves of the grid of a launch of the weight-streaming kernel on the current device (launch
// .num_items items; p.out_cols / out_valid), counted with the CTAs per SM its launch bounds ask
// for (the ring variants 4..13); 0 for the other variants and kernels or when the device query
// fails.
double GemmWaves(const GemmLaunch& launch, const ExpertGemmParams& p);

// Whether GEMM launches like `launch` can take ExpertGemmParams::acc_scale.
inline bool GemmCanScaleAccumulators(const GemmLaunch& launch) {
  return launch.format == Fp4Format::kMxfp4 && launch.token_groups == 1 &&
         (launch.variant == 6 || launch.variant == 12);
}
inline constexpr float kAccScalePrescale = 0x1p64f;
inline constexpr float kAccScaleUnscale = 0x1p-64f;

// ExpertGemmParams::item_ready words are this many apart (one per 128-byte line).
inline constexpr int kItemReadyStride = 32;
// ExpertGemmParams::item_ready: per item, what counts itself in a launch with `launch` and `p`
// (out_cols, out_valid): GEMM1 (launch.gemm1) the warps that write act rows, GEMM2 its CTAs. 0
// where the kernel has no per-item readiness (the wgmma kernel).
int64_t GemmItemReadyCount(const GemmLaunch& launch, const ExpertGemmParams& p);

// Whether (token_groups, variant) runs the weight-streaming kernel (expert_gemm.cu), the only one
// that takes direct routes.
inline bool GemmUsesStreamingKernel(int token_groups, int variant) {
  return token_groups >= 4 ? variant == 3 : variant != 3;
}
// Whether (token_groups, variant) can fold the combine into GEMM2 (warps that each write one
// 16-row tile of y).
inline bool GemmCanFoldCombine(int token_groups, int variant) {
  return token_groups <= 2 &&
         (variant == 0 || variant == 1 || variant == 4 || variant == 6 || variant >= 8);
}
// Whether (token_groups, variant) streams its weights with bulk copies (ExpertGemmParams
// l2_prefetch applies).
inline bool GemmUsesBulkCopies(int token_groups, int variant) {
  return token_groups <= 2 && variant >= 8;
}
inline constexpr int kFoldRowsPerBlock = 16;

// ---- The fused decode layer (expert_layer.cu): a batch of direct routes (at most one route per
// expert slot, ExpertGemmParams direct_ids) runs GEMM1 + activation, GEMM2 and the folded combine
// in one persistent kernel of one CTA per SM, instead of a GEMM1 grid and a GEMM2 grid with a
// kernel boundary between them. In each CTA one producer warp streams the CTA's share of both
// GEMMs' weights (GEMM1's tiles, then GEMM2's) through one ring of shared-memory stages with bulk
// copies, never waiting for the activations, so GEMM2's weights arrive while GEMM1 finishes; the
// consumer warps multiply from shared memory (the hidden rows and, for GEMM2, the act rows of
// every route are copied there once). A per-route counter replaces the kernel boundary: the
// warp that writes a GEMM1 tile's act columns counts it, and GEMM2 starts once every route has
// all of its tiles. Every CTA must be resident at once (cooperative launch). Deterministic: the
// K-split partial sums are added in a fixed order and the combine is FoldCombine's.
struct ExpertLayerParams {
  ExpertGemmParams g1;  // GEMM1 with direct_* set (b_rows: the staged hidden rows)
  ExpertGemmParams g2;  // GEMM2 with direct_* and fold_* set (b_rows: g1.act_out)
  // [ExpertLayerRoutes(...)] per-route counters, zero before the launch (the prologue's
  // zero_words).
  int32_t* ready = nullptr;
  // Benchmark aid, null otherwise: thread 0 of each CTA writes the global timer (ns) at 6 points
  // into trace[cta * 8 + i]: past the programmatic wait for the prologue, hidden rows staged, own
  // GEMM1 rounds done, every route ready, act rows staged, end.
  unsigned long long* trace = nullptr;
};
// Routes of a direct batch: T * K, plus T per shared slot that runs.
inline int ExpertLayerRoutes(int tokens, int top_k, int shared) {
  return tokens * top_k + shared * tokens;
}
inline constexpr int kMaxLayerRoutes = 64;
// Whether LaunchExpertLayer takes a batch of these sizes on the current device (routes up to
// kMaxLayerRoutes; the hidden rows, the act rows and the weight rings fit into one CTA's shared
// memory); *sms (if not null) gets the device's SM count (the kernel's CTAs).
bool ExpertLayerFits(Fp4Format format, int tokens, int routes, int hidden_chunks, int act_cols,
                     int w13_tiles, int w2_tiles, int w2_chunks, int* sms);
// programmatic: as GemmLaunch (the predecessor is the prologue).
cudaError_t LaunchExpertLayer(const ExpertLayerParams& p, Fp4Format format, bool programmatic,
                              cudaStream_t stream);

// Copies `bytes` from `from` to `to` with the SMs, either side possibly pinned host memory mapped
// into the device's address space (CudaExpertBackend's small batches: on the H200 machine a
// copy-engine transfer of a one-token batch took ~6 us each way, a kernel reading or writing the
// pinned memory itself ~2 us; NOTES-cuda.md). Both pointers 16-byte aligned (else
// cudaErrorInvalidValue). A plain launch: it waits for everything before it on the stream.
cudaError_t LaunchCopyBytes(const void* from, void* to, size_t bytes, cudaStream_t stream);

// One copy of LaunchCopyParts.
struct CopyPart {
  const void* from = nullptr;
  void* to = nullptr;
  size_t bytes = 0;
};
inline constexpr int kMaxCopyParts = 32;
// Up to kMaxCopyParts copies as LaunchCopyBytes does them, in one launch (a merged batch's rows
// gathered from or scattered to its requests' mapped host buffers). Every pointer 16-byte aligned
// and every size a multiple of 16 (else cudaErrorInvalidValue, nothing launched).
cudaError_t LaunchCopyParts(const CopyPart* parts, int count, cudaStream_t stream);

// programmatic: as GemmLaunch (the predecessor is GEMM2).
cudaError_t LaunchExpertCombine(const ExpertCombineParams& p, bool programmatic,
                                cudaStream_t stream);

}  // namespace moe::cuda

#endif  // MOE_KERNELS_CUDA_EXPERT_KERNELS_H_
