#include "tests/fuzz/fuzz_fixture.h"

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "moe/v1/coordinator.pb.h"
#include "server/common/wire.h"

namespace moe::fuzz {
namespace {

// Fixture and invariant failures are bugs: report and abort so libFuzzer records a crash.
[[noreturn]] void Fail(const std::string& what) {
  std::fprintf(stderr, "fuzz invariant violated: %s\n", what.c_str());
  std::abort();
}

void Expect(bool ok, const char* what) {
  if (!ok) Fail(what);
}

void ExpectShape(const HostTensor& t, DType dtype, const Shape& shape, const char* name) {
  if (t.dtype() != dtype || t.shape() != shape) {
    Fail(std::string(name) + ": staged with dtype " + std::string(DTypeName(t.dtype())) +
         " shape " + ShapeString(t.shape()) + ", expected " + std::string(DTypeName(dtype)) + " " +
         ShapeString(shape));
  }
}

// Element i of a wire tensor that validation accepted (so i is in bounds).
template <typename T>
T WireAt(const v1::Tensor& t, int64_t i) {
  T v;
  std::memcpy(&v, t.data().data() + i * sizeof(T), sizeof(T));
  return v;
}

float Bf16BitsToFloat(uint16_t bits) {
  const uint32_t word = uint32_t{bits} << 16;
  float f;
  std::memcpy(&f, &word, sizeof(f));
  return f;
}

bool SameBits(float a, float b) { return std::memcmp(&a, &b, sizeof(a)) == 0; }

v1::ClusterMap ReplicatedMap() {
  v1::ClusterMap map;
  map.set_version(7);
  map.mutable_model()->set_num_layers(kLayers);
  map.mutable_model()->set_num_experts(kExperts);
  map.set_num_physical(kPhysical);
  for (int32_t s = 0; s < kPhysical; ++s) map.add_slot_to_rank(s < kPhysical / 2 ? 0 : 1);
  const int32_t extra[kLayers][2] = {{1, 5}, {6, 2}};
  for (int32_t l = 0; l < kLayers; ++l) {
    v1::LayerPlacementProto* layer = map.add_layers();
    for (int32_t e = 0; e < kExperts; ++e) layer->add_physical_to_logical(e);
    for (int32_t e : extra[l]) layer->add_physical_to_logical(e);
  }
  return map;
}

std::shared_ptr<const ShardPlacement> RankOf(const v1::ClusterMap& map, uint32_t rank) {
  absl::StatusOr<std::shared_ptr<const ShardPlacement>> p =
      ShardPlacement::FromClusterMap(map, rank);
  if (!p.ok()) Fail("fixture map rejected: " + std::string(p.status().message()));
  return *p;
}

// The logical id and weight the request asked for at (t, k), before padding.
struct WantedRoute {
  int64_t logical;
  float weight;
};

WantedRoute RequestedRoute(const v1::ForwardRequest& req, const StagedRequest& staged, int64_t i) {
  if (staged.routed_ids.shape().size() == 2) {
    return {staged.routed_ids.data<int32_t>()[i], staged.routed_weights.data<float>()[i]};
  }
  const v1::Tensor& ids = req.topk_ids();
  const v1::Tensor& w = req.topk_weights();
  const int64_t id = ids.dtype() == v1::I64 ? WireAt<int64_t>(ids, i) : WireAt<int32_t>(ids, i);
  const float weight =
      w.dtype() == v1::BF16 ? Bf16BitsToFloat(WireAt<uint16_t>(w, i)) : WireAt<float>(w, i);
  return {id, weight};
}

void CheckHidden(const v1::ForwardRequest& req, const StagedRequest& staged) {
  const v1::HiddenStates& hs = req.hidden_states();
  const int64_t n = staged.num_tokens * kHidden;
  for (int64_t i = 0; i < n; ++i) {
    if (hs.format() == v1::ACTIVATION_F32) {
      Expect(SameBits(staged.hidden.As<const float>()[i], WireAt<float>(hs.data(), i)),
             "F32 hidden state not staged bit-exactly");
    } else if (hs.format() == v1::ACTIVATION_BF16) {
      Expect(staged.hidden.As<const uint16_t>()[i] == WireAt<uint16_t>(hs.data(), i),
             "BF16 hidden state not staged bit-exactly");
    }
  }
}

void CheckRoutes(const v1::ForwardRequest& req, const ShardPlacement& placement,
                 const StagedRequest& staged) {
  const int64_t t_count = staged.num_tokens;
  const int64_t k = staged.physical_ids.shape()[1];
  const LayerPlacement& layer = placement.layer(staged.layer);
  const absl::Span<const int32_t> expert_map = placement.expert_map();
  const bool has_padding = !IsUnset(req.is_padding());
  for (int64_t t = 0; t < t_count; ++t) {
    const bool padded = has_padding && WireAt<uint8_t>(req.is_padding(), t) != 0;
    for (int64_t i = t * k; i < (t + 1) * k; ++i) {
      const int32_t p = staged.physical_ids.data<int32_t>()[i];
      const int32_t local = staged.local_ids.data<int32_t>()[i];
      const float w = staged.weights.data<float>()[i];
      const WantedRoute want = RequestedRoute(req, staged, i);
      const int64_t logical = padded ? -1 : want.logical;
      if (logical == -1) {
        Expect(p == -1 && local == -1, "an unrouted or padded slot was given an expert");
      } else {
        Expect(p >= 0 && p < layer.num_physical(), "physical id outside the placement");
        Expect(layer.physical_to_logical()[p] == logical, "physical slot holds another expert");
        Expect(local == expert_map[p], "local id disagrees with the placement's expert map");
      }
      Expect(std::isfinite(w), "non-finite staged weight");
      Expect(padded ? w == 0.f : SameBits(w, want.weight), "staged weight differs from request");
    }
  }
}

}  // namespace

ServedModel FuzzModel() {
  ServedModel m;
  m.fingerprint = "fuzz-model";
  m.num_layers = kLayers;
  m.num_experts = kExperts;
  m.top_k = kTopK;
  m.hidden = kHidden;
  m.intermediate = kIntermediate;
  return m;
}

const FuzzPlacements& Placements() {
  static const FuzzPlacements* placements = [] {
    const v1::ClusterMap map = ReplicatedMap();
    return new FuzzPlacements{ShardPlacement::Standalone(kLayers, kExperts, /*version=*/1),
                              RankOf(map, 0), RankOf(map, 1)};
  }();
  return *placements;
}

void CheckStagedInvariants(const v1::ForwardRequest& req, const ServedModel& model,
                           const ShardPlacement& placement, const StagedRequest& staged) {
  Expect(staged.layer >= 0 && staged.layer < model.num_layers, "staged layer out of range");
  Expect(static_cast<uint32_t>(staged.layer) == req.layer(), "staged layer differs from request");
  Expect(staged.out_dtype == (req.output_dtype() == v1::F32 ? DType::kF32 : DType::kBF16),
         "output dtype differs from request");
  const int64_t t = staged.num_tokens;
  // F32 / BF16 payloads are staged as they came, quantized ones dequantized to F32.
  const DType hidden_dtype =
      req.hidden_states().format() == v1::ACTIVATION_BF16 ? DType::kBF16 : DType::kF32;
  Expect(staged.hidden.dtype == hidden_dtype && staged.hidden.shape == Shape{t, model.hidden},
         "hidden: staged with the wrong dtype or shape");
  Expect(staged.physical_ids.shape().size() == 2, "physical_ids is not [T, K]");
  const int64_t k = staged.physical_ids.shape()[1];
  Expect(k >= 1 && k <= model.num_experts, "K outside [1, E]");
  ExpectShape(staged.physical_ids, DType::kI32, {t, k}, "physical_ids");
  ExpectShape(staged.local_ids, DType::kI32, {t, k}, "local_ids");
  ExpectShape(staged.weights, DType::kF32, {t, k}, "weights");
  if (!IsUnset(req.router_logits())) {
    ExpectShape(staged.routed_ids, DType::kI32, {t, k}, "routed_ids");
    ExpectShape(staged.routed_weights, DType::kF32, {t, k}, "routed_weights");
  }
  if (!IsUnset(req.shared_mask())) {
    ExpectShape(staged.shared_mask, DType::kBool, {t}, "shared_mask");
    for (int64_t i = 0; i < t; ++i) {
      Expect(staged.shared_mask.data<bool>()[i] == (WireAt<uint8_t>(req.shared_mask(), i) != 0),
             "shared_mask not copied");
    }
  }
  CheckHidden(req, staged);
  CheckRoutes(req, placement, staged);
}

void StageEverywhere(const v1::ForwardRequest& request,
                     std::optional<absl::string_view> hidden_payload) {
  const ServedModel model = FuzzModel();
  const FuzzPlacements& placements = Placements();
  std::vector<absl::StatusOr<StagedRequest>> results;
  // The invariants read the hidden states from the message: with the payload apart, from a copy
  // that carries it inside.
  std::optional<v1::ForwardRequest> whole;
  for (const ShardPlacement* placement : placements.all()) {
    results.push_back(StageForwardRequest(request, model, *placement, hidden_payload));
    if (results.back().ok()) {
      if (hidden_payload.has_value() && !whole.has_value()) {
        whole = request;
        whole->mutable_hidden_states()->mutable_data()->set_data(std::string(*hidden_payload));
      }
      CheckStagedInvariants(whole.has_value() ? *whole : request, model, *placement,
                            *results.back());
    }
  }
  for (const absl::StatusOr<StagedRequest>& r : results) {
    Expect(r.ok() == results[0].ok(), "acceptance depends on the placement");
    if (!r.ok()) {
      Expect(r.status().code() == absl::StatusCode::kInvalidArgument,
             "a rejected request is not INVALID_ARGUMENT");
      Expect(!r.status().message().empty(), "a rejection without a message");
    }
  }
  // Ranks of one map choose the same replicas: the physical ids do not depend on the rank.
  if (results[1].ok()) {
    const HostTensor& a = results[1]->physical_ids;
    const HostTensor& b = results[2]->physical_ids;
    for (int64_t i = 0; i < a.NumElements(); ++i) {
      Expect(a.data<int32_t>()[i] == b.data<int32_t>()[i],
             "ranks of one map chose different replicas");
    }
  }
}

}  // namespace moe::fuzz
