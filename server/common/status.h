// The one conversion between absl::Status (used everywhere on the host) and grpc::Status (the RPC
// boundary), in both directions. Stateless: thread-safe.
#ifndef MOE_SERVER_COMMON_STATUS_H_
#define MOE_SERVER_COMMON_STATUS_H_

#include "absl/status/status.h"
#include "grpcpp/support/status.h"

namespace moe {

grpc::Status ToGrpcStatus(const absl::Status& status);
absl::Status FromGrpcStatus(const grpc::Status& status);

}  // namespace moe

#endif  // MOE_SERVER_COMMON_STATUS_H_
