// Helpers shared by the integration tests: wire tensors built from plain vectors, deterministic
// inputs, and the expected output of a request computed in-process with the CPU reference
// (RunExpertsReference) on the same checkpoint the servers load.
//
// Callers: tests in //tests. Thread-safety: stateless functions; ReferenceModel is immutable after
// Open and may be shared. Ownership: ReferenceModel owns its loaded layers.
#ifndef MOE_TESTS_TEST_UTIL_H_
#define MOE_TESTS_TEST_UTIL_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/tensor.h"
#include "moe/v1/tensor.pb.h"
#include "server/model/model.h"

namespace moe::testing {

// Wire tensor with raw little-endian `bytes` (not checked against the shape: tests send bad ones).
void SetWireTensor(v1::Tensor* t, v1::DType dtype, std::vector<int64_t> shape, std::string bytes);

template <typename T>
std::string RawBytes(const std::vector<T>& values) {
  return std::string(reinterpret_cast<const char*>(values.data()), values.size() * sizeof(T));
}

// `n` normal values with a fixed seed, rounded to BF16 so F32 and BF16 transport agree.
std::vector<float> Bf16RoundedNormals(int64_t n, uint64_t seed);

// sqrt(sum (a - b)^2 / sum b^2) (absolute L2 norm when b is all zeros); +inf for NaN.
double RelativeError(const float* a, const float* b, int64_t n);

// Every layer of a checkpoint with the identity placement (slot e holds expert e).
class ReferenceModel {
 public:
  [[nodiscard]] static absl::StatusOr<std::unique_ptr<ReferenceModel>> Open(const std::string& dir);

  const model::ModelConfig& config() const { return model_->config(); }
  // out[t] = sum over k with ids[t, k] != -1 of weights[t, k] * expert_{ids[t, k]}(x[t]), plus the
  // shared experts for every token when `with_shared` (F32 [T, H]).
  // x: F32 [T, H]; ids: logical I32 [T, K] (-1: no route); weights F32 [T, K].
  [[nodiscard]] absl::StatusOr<HostTensor> Run(int layer, const std::vector<float>& x,
                                               const std::vector<int32_t>& ids,
                                               const std::vector<float>& weights, int64_t k,
                                               bool with_shared) const;

 private:
  ReferenceModel() = default;

  std::unique_ptr<model::ExpertModel> model_;
  std::vector<std::unique_ptr<model::LoadedLayer>> layers_;
};

}  // namespace moe::testing

#endif  // MOE_TESTS_TEST_UTIL_H_
