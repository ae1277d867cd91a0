// Validation and staging of one ForwardRequest: the single place where request contents from the
// network are checked (INVALID_ARGUMENT naming the field) and turned into what the executor runs:
// hidden states (F32/BF16 in place, quantized ones dequantized to F32), padding applied, EPLB
// logical -> physical remap, local-slot filter.
//
// Called by ExpertShardService for every Forward. Pure apart from its outputs: thread-safe.
#ifndef MOE_SERVER_SHARD_REQUEST_H_
#define MOE_SERVER_SHARD_REQUEST_H_

#include <cstdint>
#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "kernels/tensor.h"
#include "moe/v1/shard.pb.h"
#include "server/shard/placement.h"

namespace moe {

// The model a shard serves, as the request validator needs it.
struct ServedModel {
  std::string fingerprint;
  int32_t num_layers = 0;
  int32_t num_experts = 0;
  int32_t top_k = 0;
  int64_t hidden = 0;
  int64_t intermediate = 0;
};

struct StagedRequest {
  StagedRequest() = default;
  // Movable only: `hidden` may point into `decoded_hidden`, whose buffer a move keeps.
  StagedRequest(StagedRequest&&) = default;
  StagedRequest& operator=(StagedRequest&&) = default;
  StagedRequest(const StagedRequest&) = delete;
  StagedRequest& operator=(const StagedRequest&) = delete;

  int32_t layer = 0;
  int64_t num_tokens = 0;
  // The hidden states as the backend reads them, F32 or BF16 [T, H]. For F32 and BF16 payloads
  // a view over the request's own bytes (the message, the raw frame or the shared-memory range,
  // which must outlive it): the shard does not copy them (except once when they are not aligned
  // to their element size). For MXFP8 / NVFP4 payloads a view over `decoded_hidden`.
  TensorView hidden;
  HostTensor decoded_hidden;  // F32 [T, H] from an MXFP8 / NVFP4 payload, or the aligned copy
  HostTensor physical_ids;  // I32 [T, K], -1 for padding / no route
  HostTensor local_ids;     // I32 [T, K], -1 where the slot is not hosted here
  HostTensor weights;       // F32 [T, K], 0 for padded tokens
  HostTensor shared_mask;   // BOOL [T] when the request carried one
  DType out_dtype = DType::kBF16;
  // Monolithic path: the routing that was applied (for routing replay).
  HostTensor routed_ids;      // I32 [T, K]
  HostTensor routed_weights;  // F32 [T, K]
};

// Validates `request` against `model` (layer range, shapes, dtypes, ids in [-1, E), finite
// weights, payload lengths) and stages it under `placement`. Does not check fingerprint or map
// version (the service does, with FAILED_PRECONDITION).
//
// `hidden_payload`, when given, holds the hidden-state bytes that did not travel inside the
// message (a raw frame's payload, a shared-memory range): hidden_states.data.data must then be
// empty, and the bytes are read in place.
absl::StatusOr<StagedRequest> StageForwardRequest(
    const v1::ForwardRequest& request, const ServedModel& model, const ShardPlacement& placement,
    std::optional<absl::string_view> hidden_payload = std::nullopt);

}  // namespace moe

#endif  // MOE_SERVER_SHARD_REQUEST_H_
