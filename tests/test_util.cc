#include "tests/test_util.h"

#include <cmath>
#include <numeric>
#include <random>
#include <utility>

#include "absl/strings/str_cat.h"
#include "kernels/experts.h"
#include "kernels/formats.h"

namespace moe::testing {

void SetWireTensor(v1::Tensor* t, v1::DType dtype, std::vector<int64_t> shape, std::string bytes) {
  t->set_dtype(dtype);
  t->clear_shape();
  for (int64_t d : shape) t->add_shape(d);
  *t->mutable_data() = std::move(bytes);
}

std::vector<float> Bf16RoundedNormals(int64_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.f, 1.f);
  std::vector<float> out(n);
  for (float& v : out) v = Bf16ToFloat(FloatToBf16(normal(rng)));
  return out;
}

double RelativeError(const float* a, const float* b, int64_t n) {
  double num = 0, den = 0;
  for (int64_t i = 0; i < n; ++i) {
    const double d = static_cast<double>(a[i]) - b[i];
    num += d * d;
    den += static_cast<double>(b[i]) * b[i];
  }
  if (std::isnan(num)) return INFINITY;
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

absl::StatusOr<std::unique_ptr<ReferenceModel>> ReferenceModel::Open(const std::string& dir) {
  std::unique_ptr<ReferenceModel> ref(new ReferenceModel());
  absl::StatusOr<std::unique_ptr<model::ExpertModel>> m = model::ExpertModel::Open(dir);
  if (!m.ok()) return m.status();
  ref->model_ = *std::move(m);
  std::vector<int32_t> identity(ref->model_->config().num_experts);
  std::iota(identity.begin(), identity.end(), 0);
  for (int64_t l = 0; l < ref->model_->num_moe_layers(); ++l) {
    absl::StatusOr<std::unique_ptr<model::LoadedLayer>> layer = ref->model_->LoadLayer(l, identity);
    if (!layer.ok()) return layer.status();
    ref->layers_.push_back(*std::move(layer));
  }
  return ref;
}

absl::StatusOr<HostTensor> ReferenceModel::Run(int layer, const std::vector<float>& x,
                                               const std::vector<int32_t>& ids,
                                               const std::vector<float>& weights, int64_t k,
                                               bool with_shared) const {
  if (layer < 0 || layer >= static_cast<int>(layers_.size())) {
    return absl::InvalidArgumentError(absl::StrCat("reference: no layer ", layer));
  }
  const int64_t h = config().hidden;
  const int64_t t_count = static_cast<int64_t>(x.size()) / h;
  std::vector<uint8_t> mask(t_count, 1);
  HostTensor out(DType::kF32, {t_count, h});
  ExpertsRequest request{
      MakeView(DType::kF32, {t_count, h}, x.data()),
      MakeView(DType::kI32, {t_count, k}, ids.data()),
      MakeView(DType::kF32, {t_count, k}, weights.data()),
      with_shared ? MakeView(DType::kBool, {t_count}, mask.data()) : TensorView{}, out.view()};
  if (absl::Status s = RunExpertsReference(layers_[layer]->layer(), request); !s.ok()) return s;
  return out;
}

}  // namespace moe::testing
