// Reference problems of shared/spec/performance.md as host data, with random BF16 batches and
// uniform routes:
//   A: gpt-oss-120b MoE layer (E=128, top-4, H=I=2880, MXFP4 weights with random codes and UE8M0
//      scales around 2^-7, SWIGLUOAI alpha 1.702 limit 7 with biases, interleaved gate/up);
//   B: DeepSeek-V3-shaped (E=256, top-8, H=7168, I=2048, NVFP4 with E4M3 block scales around 1 and
//      per-matrix global scales around 2^-8, SILU, concatenated gate/up, no biases);
//   C: Qwen3-30B-A3B-shaped (E=128, top-8, H=2048, I=768, MXFP4 as in A (performance.md names no
//      format), SILU, concatenated gate/up, no biases).
// Used by the kernel benchmarks. Not thread-safe to share while mutating.
#ifndef MOE_BENCH_BENCH_PROBLEM_H_
#define MOE_BENCH_BENCH_PROBLEM_H_

#include <cstdint>
#include <memory>
#include <random>
#include <vector>

#include "kernels/experts.h"

namespace moe::bench {

inline constexpr int kProblemExperts = 128;
inline constexpr int kProblemTopK = 4;
inline constexpr int64_t kProblemHidden = 2880;
inline constexpr int64_t kProblemInter = 2880;

// Owns the weight bytes that `layer` views.
struct ProblemLayer {
  char name = 'A';
  int top_k = kProblemTopK;
  std::vector<std::vector<uint8_t>> bytes;
  std::vector<std::vector<float>> biases;
  ExpertLayer layer;
};

ProblemLayer MakeProblemA(uint64_t seed);
// `name` is 'A', 'B' or 'C' (anything else: A).
ProblemLayer MakeProblem(char name, uint64_t seed);

// Checkpoint bytes of one expert's matrices (packed values + scales, plus the three 4-byte global
// scales for NVFP4): 13.22 MB for problem A, 24.77 MB for B, 2.51 MB for C.
double ExpertBytes(const ProblemLayer& problem);

// One batch: BF16 hidden states N(0, 1), problem.top_k distinct uniform experts per token,
// weights summing to 1.
struct HostBatch {
  int64_t tokens = 0;
  int64_t top_k = 0;
  int64_t hidden_size = 0;
  std::vector<uint16_t> hidden;
  std::vector<int32_t> ids;
  std::vector<float> weights;

  // A request over these tensors writing BF16 [tokens, hidden] to `out`.
  ExpertsRequest Request(uint16_t* out) const;
};

HostBatch RandomBatch(const ProblemLayer& problem, int64_t tokens, std::mt19937_64& rng);

}  // namespace moe::bench

#endif  // MOE_BENCH_BENCH_PROBLEM_H_
