// Random expert layers and staged requests for the CPU backend's tests and benchmarks: FP4 codes
// drawn uniformly with block scales chosen so that products with unit-variance inputs stay near
// unit variance (the recipe of kernels/experts_test.cc), BF16 weights ~ N(0, 1/fan_in), random
// biases, NVFP4 global scales, and requests with random top-k routes (some not local).
//
// Used by tests and bench/cpu_bench. Thread-safety: plain values. Ownership: OwnedLayer and
// OwnedRequest own the memory their views point at; moving them keeps the views valid.
#ifndef MOE_KERNELS_CPU_RANDOM_LAYER_H_
#define MOE_KERNELS_CPU_RANDOM_LAYER_H_

#include <cstdint>
#include <memory>
#include <vector>

#include "kernels/experts.h"

namespace moe::cpu {

struct RandomLayerSpec {
  WeightFormat format = WeightFormat::kMxfp4;
  GateUpLayout layout = GateUpLayout::kInterleaved;
  ActivationParams activation;
  int64_t hidden = 0;
  int64_t inter = 0;
  int64_t experts = 0;
  int64_t shared = 0;
  bool bias = false;
  uint64_t seed = 1;
};

struct OwnedLayer {
  std::vector<std::unique_ptr<uint8_t[]>> bytes;
  std::vector<std::vector<float>> floats;
  ExpertLayer layer;
};

std::unique_ptr<OwnedLayer> MakeRandomLayer(const RandomLayerSpec& spec);

// One random matrix [rows, cols] of `format` whose buffers `owner` keeps.
WeightMatrix RandomMatrix(WeightFormat format, int64_t rows, int64_t cols, uint64_t seed,
                          OwnedLayer& owner);

struct RandomRequestSpec {
  int64_t tokens = 0;
  int64_t top_k = 1;
  DType in_dtype = DType::kF32;
  DType out_dtype = DType::kF32;
  double not_local = 0.25;   // probability that a route is -1
  bool shared_mask = false;  // send a random mask
  uint64_t seed = 1;
};

struct OwnedRequest {
  int64_t tokens = 0;
  int64_t hidden = 0;
  int64_t top_k = 0;
  DType in_dtype = DType::kF32;
  DType out_dtype = DType::kF32;
  std::vector<float> x_f32;
  std::vector<uint16_t> x_bf16;
  std::vector<int32_t> ids;
  std::vector<float> weights;
  std::vector<uint8_t> mask;  // empty: none
  std::vector<float> out_f32;
  std::vector<uint16_t> out_bf16;

  ExpertsRequest Request();
  // Output element i as a float (BF16 widened).
  float Out(int64_t i) const;
  // Sets every output element to NaN.
  void Poison();
};

// Hidden states ~ N(0, 1); each token's routes are distinct experts in random order, each -1
// with probability not_local; weights uniform in [0, 1).
OwnedRequest MakeRandomRequest(const ExpertLayer& layer, const RandomRequestSpec& spec);

}  // namespace moe::cpu

#endif  // MOE_KERNELS_CPU_RANDOM_LAYER_H_
