// Fuzz target forward_structured: the input drives a FuzzedDataProvider that builds a mostly
// well-formed ForwardRequest for the fixture model (every hidden-state format, both routing paths,
// optional padding / token indices / shared mask) out of WireBuilder tensors, which are perturbed
// one time in four. Getting past the byte-count checks at once lets the fuzzer spend its time in
// staging, routing and the EPLB remap; staging runs under every fixture placement.
#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "fuzzer/FuzzedDataProvider.h"
#include "moe/v1/shard.pb.h"
#include "tests/fuzz/fuzz_fixture.h"
#include "tests/fuzz/wire_builder.h"

namespace moe::fuzz {
namespace {

class RequestBuilder {
 public:
  explicit RequestBuilder(FuzzedDataProvider& in) : in_(in), wire_(in) {}

  v1::ForwardRequest Build() {
    v1::ForwardRequest req;
    req.set_layer(in_.ConsumeBool() ? in_.ConsumeIntegral<uint32_t>()
                                    : in_.ConsumeIntegralInRange<uint32_t>(0, kLayers - 1));
    req.set_output_dtype(static_cast<v1::DType>(in_.ConsumeIntegralInRange<int>(0, 8)));
    tokens_ = in_.ConsumeIntegralInRange<int64_t>(0, 6);
    BuildHidden(req.mutable_hidden_states());
    if (in_.ConsumeBool()) {
      BuildMonolithic(req);
    } else {
      const int64_t k = in_.ConsumeBool() ? kTopK : in_.ConsumeIntegralInRange<int64_t>(0, 9);
      Tensor(req.mutable_topk_ids(), in_.ConsumeBool() ? v1::I64 : v1::I32, {tokens_, k},
             Fill::kId);
      Tensor(req.mutable_topk_weights(), in_.ConsumeBool() ? v1::BF16 : v1::F32, {tokens_, k},
             Fill::kWeight);
    }
    if (in_.ConsumeBool()) Tensor(req.mutable_token_indices(), v1::I64, {tokens_}, Fill::kRaw);
    if (in_.ConsumeBool()) Tensor(req.mutable_is_padding(), v1::BOOL, {tokens_}, Fill::kBool);
    if (in_.ConsumeBool()) Tensor(req.mutable_shared_mask(), v1::BOOL, {tokens_}, Fill::kBool);
    return req;
  }

 private:
  void BuildHidden(v1::HiddenStates* hs) {
    const int format = in_.ConsumeIntegralInRange<int>(0, 5);
    hs->set_format(static_cast<v1::ActivationFormat>(format));
    switch (format) {
      case v1::ACTIVATION_BF16:
        Tensor(hs->mutable_data(), v1::BF16, {tokens_, kHidden}, Fill::kRaw);
        break;
      case v1::ACTIVATION_MXFP8:
        Tensor(hs->mutable_data(), v1::E4M3, {tokens_, kHidden}, Fill::kRaw);
        if (in_.ConsumeBool()) {
          Tensor(hs->mutable_scales(), v1::I32, {tokens_, kHidden / 128}, Fill::kRaw);
        } else {
          Tensor(hs->mutable_scales(), v1::F32, {tokens_, kHidden / 32}, Fill::kWeight);
        }
        break;
      case v1::ACTIVATION_NVFP4:
        Tensor(hs->mutable_data(), v1::U8, {tokens_, kHidden / 2}, Fill::kRaw);
        Tensor(hs->mutable_scales(), v1::I32, {tokens_, kHidden / 64}, Fill::kRaw);
        Tensor(hs->mutable_token_scale(), v1::F32, {tokens_}, Fill::kWeight);
        break;
      default:  // F32, and the unknown formats with an F32 payload
        Tensor(hs->mutable_data(), v1::F32, {tokens_, kHidden}, Fill::kRaw);
        break;
    }
  }

  void BuildMonolithic(v1::ForwardRequest& req) {
    Tensor(req.mutable_router_logits(), v1::F32, {tokens_, kExperts}, Fill::kWeight);
    static const char* const kMethods[] = {"",
                                           "default",
                                           "renormalize",
                                           "sigmoid",
                                           "deepseek_v3",
                                           "sigmoid_renorm",
                                           "renormalize_naive"};
    v1::RoutingSpec* spec = req.mutable_routing();
    spec->set_method(in_.ConsumeBool() ? in_.PickValueInArray(kMethods)
                                       : in_.ConsumeRandomLengthString(16));
    spec->set_top_k(in_.ConsumeIntegralInRange<int32_t>(-1, kExperts + 1));
    spec->set_n_group(in_.ConsumeIntegralInRange<int32_t>(-1, kExperts + 1));
    spec->set_topk_group(in_.ConsumeIntegralInRange<int32_t>(-1, kExperts + 1));
    spec->set_routed_scaling_factor(in_.ConsumeBool() ? 2.5f : in_.ConsumeFloatingPoint<float>());
    spec->set_renormalize(in_.ConsumeBool());
  }

  void Tensor(v1::Tensor* t, v1::DType dtype, std::vector<int64_t> shape, Fill fill) {
    wire_.Tensor(t, dtype, std::move(shape), fill);
  }

  FuzzedDataProvider& in_;
  WireBuilder wire_;
  int64_t tokens_ = 0;
};

}  // namespace
}  // namespace moe::fuzz

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  FuzzedDataProvider in(data, size);
  moe::fuzz::RequestBuilder builder(in);
  moe::fuzz::StageEverywhere(builder.Build());
  return 0;
}
