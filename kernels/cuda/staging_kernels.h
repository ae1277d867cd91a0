// Launcher and Params struct of the GPU activation-staging kernels (staging.cu): BF16 hidden
// states -> MXFP8 (E4M3 + packed UE8M0 scales) or NVFP4 per token (E2M1 + E4M3 block scales + an
// fp32 token scale), fused in the same launch with the EPLB logical -> physical remap and the
// per-slot load recording. Every output is bit-exact with the CPU functions QuantizeMxfp8,
// QuantizeNvfp4PerToken (kernels/staging.h), MapLogicalToPhysical and RecordLoad (kernels/eplb.h).
//
// Called by staging_runner.cc (validation + launch) and through it by tests and benchmarks.
// Thread-safety: the launcher is reentrant; Params are plain values. All pointers are device
// memory. Host-side header: needs only the CUDA runtime API.
#ifndef MOE_KERNELS_CUDA_STAGING_KERNELS_H_
#define MOE_KERNELS_CUDA_STAGING_KERNELS_H_

#include <cuda_runtime_api.h>

#include <cstdint>

namespace moe::cuda {

enum class StagingFormat : int { kMxfp8 = 0, kNvfp4 = 1 };

struct StagingParams {
  StagingFormat format = StagingFormat::kMxfp8;
  // Quantization input: BF16 [tokens, hidden_size]. MXFP8 needs hidden_size % 128 == 0, NVFP4
  // hidden_size % 64 == 0 (one packed scale word each). Nothing is quantized when x is null.
  const uint16_t* x = nullptr;
  int32_t tokens = 0;
  int32_t hidden_size = 0;
  // Outputs. MXFP8: q E4M3 [T, H], scales int32 [T, H/128] (byte g of a word = UE8M0 scale of
  // group 4w+g). NVFP4: q uint8 [T, H/2] (even element in the low nibble), scales int32 [T, H/64]
  // (E4M3 block scales, four per word), token_scale fp32 [T].
  uint8_t* q = nullptr;
  int32_t* scales = nullptr;
  float* token_scale = nullptr;

  // EPLB remap, skipped when topk_ids is null: physical_ids[t, k] = the replica of logical expert
  // topk_ids[t, k] chosen by ReplicaHash(token_indices ? token_indices[t] : t); -1 for ids
  // outside [0, num_logical).
  const int32_t* topk_ids = nullptr;       // [T, K] logical ids (I32; -1 = no route)
  const int64_t* token_indices = nullptr;  // [T] or null
  int32_t top_k = 0;
  const int32_t* logical_to_physical = nullptr;  // [num_logical, max_replicas], -1 padded
  const int32_t* replica_count = nullptr;        // [num_logical]
  int32_t num_logical = 0;
  int32_t max_replicas = 0;
  int32_t* physical_ids = nullptr;  // [T, K]

  // Load recording, skipped when load is null: load[p] += 1 for every route of a token
  // t < num_unpadded with 0 <= p < load_size and (hosted null or hosted[p] != 0).
  unsigned long long* load = nullptr;  // [load_size], int64 counts (accumulated, not reset)
  const uint8_t* hosted = nullptr;     // [load_size] or null
  int32_t load_size = 0;
  int32_t num_unpadded = 0;

  // Launch with programmatic stream serialization (sm_90): the kernel's blocks may be scheduled
  // while the previous kernel in the stream finishes; each block waits for that kernel's
  // completion (griddepcontrol.wait) before its first memory access, so the results do not
  // depend on it. The kernel also lets the next programmatic kernel launch early. Not used for
  // 1024-thread MXFP8 blocks (measured slower with it).
  bool programmatic = true;
  // Tuning: threads per MXFP8 quantization block, 256, 512 or 1024; 0: the measured best (1024
  // from 2^19 chunks of 8 elements, 256 below).
  int32_t mxfp8_block_threads = 0;
  // NVFP4 rows of exactly one tile (H = 2048, 4096, multiples of 1792 up to 7168, and others up
  // to 20480) are staged through shared memory (cp.async; staging.cu, StageNvfp4SharedKernel):
  // on an H100 3.8% faster at 4096 x 7168 than the register kernels (NOTES-cuda.md). false: the
  // register kernels, as every other row shape.
  bool nvfp4_shared_rows = true;
  // Tuning, with nvfp4_shared_rows: chunks of 8 elements per lane, 0 (the launcher's choice, 7 or
  // 4), 4, 7 or 14; a forced count applies where it makes a row one tile of at most 32 warps
  // (H = 7168: 7 warps at 4, 4 at 7, 2 at 14).
  int32_t nvfp4_shared_lane_chunks = 0;
  // Experiment, with nvfp4_shared_rows (not timed on a GPU yet; NOTES-cuda.md, "Session of
  // 2026-12-08"): one-tile rows of at most 20 KiB (H <= 10240) go to a grid of one wave of blocks
  // that loop over rows and copy each next row into a second shared buffer while they encode the
  // current one (StageNvfp4SharedPipelineKernel; 4 or 7 lane chunks). Other rows as without it.
  bool nvfp4_shared_pipeline = false;
  // Tuning, without nvfp4_shared_rows: register cap of the kernel for rows of exactly one tile of
  // 7 lane chunks (H a multiple of 1792 up to 7168): 0 its default (64), or 56, 64 or 72 (fewer
  // registers hold more rows per SM; staging.cu, Nvfp4Shape).
  int32_t nvfp4_one_tile_registers = 0;
};

// Enqueues the fused staging kernel (one launch). REQUIRES: the Params are consistent (see
// staging_runner.h, which checks them).
cudaError_t LaunchStaging(const StagingParams& p, cudaStream_t stream);

}  // namespace moe::cuda

#endif  // MOE_KERNELS_CUDA_STAGING_KERNELS_H_
