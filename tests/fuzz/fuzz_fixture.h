// The fixed model and placements the request fuzzers stage against, and the invariants every
// successfully staged request must satisfy (checked after each accepted input, so the fuzzers
// find wrong answers as well as crashes).
//
// Callers: the forward_* fuzz targets and the seed generator (make_seeds.cc). Thread-safety: the
// fixture is built once and read-only afterwards. Ownership: placements are shared, immutable.
#ifndef MOE_TESTS_FUZZ_FUZZ_FIXTURE_H_
#define MOE_TESTS_FUZZ_FUZZ_FIXTURE_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "absl/strings/string_view.h"
#include "moe/v1/shard.pb.h"
#include "server/shard/placement.h"
#include "server/shard/request.h"

namespace moe::fuzz {

// Small enough that every staged tensor is tiny, large enough for MXFP8 (H % 128) and NVFP4
// (H % 64) payloads and for two ranks with redundant slots.
inline constexpr int32_t kLayers = 2;
inline constexpr int32_t kExperts = 8;
inline constexpr int32_t kTopK = 2;
inline constexpr int64_t kHidden = 128;
inline constexpr int64_t kIntermediate = 64;
// Rank-major, two ranks of five slots; slots 8 and 9 replicate experts 1 and 5 (layer 0) and
// experts 6 and 2 (layer 1).
inline constexpr int32_t kPhysical = 10;

ServedModel FuzzModel();

struct FuzzPlacements {
  std::shared_ptr<const ShardPlacement> standalone;
  std::shared_ptr<const ShardPlacement> rank0;  // of the replicated 2-rank map
  std::shared_ptr<const ShardPlacement> rank1;
  std::vector<const ShardPlacement*> all() const {
    return {standalone.get(), rank0.get(), rank1.get()};
  }
};

// Built on first use; aborts if the fixed map does not build (a fixture bug, not an input).
const FuzzPlacements& Placements();

// Aborts with a message on stderr when an accepted request was staged inconsistently: shapes and
// dtypes of every staged tensor, ids in range and routed to a replica of the requested expert,
// local ids matching the placement, finite weights, padded tokens dropped.
void CheckStagedInvariants(const v1::ForwardRequest& request, const ServedModel& model,
                           const ShardPlacement& placement, const StagedRequest& staged);

// Stages `request` under every placement and checks the invariants of each accepted result. All
// placements must agree on acceptance (validation does not depend on the placement).
// `hidden_payload`: the hidden-state bytes that travelled beside the header (ForwardRaw frames,
// TCP channel frames), as StageForwardRequest takes them.
void StageEverywhere(const v1::ForwardRequest& request,
                     std::optional<absl::string_view> hidden_payload = std::nullopt);

}  // namespace moe::fuzz

#endif  // MOE_TESTS_FUZZ_FUZZ_FIXTURE_H_
