// RawForwardService: the raw-buffer Forward of an expert shard (framing: server/common/
// raw_frame.h). It receives the request as a grpc::ByteBuffer (no protobuf parse of the hidden
// states), reads the payload where gRPC received it (one copy only when it arrived split over
// several slices, into a pooled buffer the backend has registered: HostBufferPool), runs it
// through ExpertShardService::ServeForward (the same admission quotas, deadline, validation,
// batching, load counting and metrics as Forward), and answers with a frame whose payload slice wraps the pooled buffer the
// backend wrote the output into (returned to the pool when gRPC has sent it), so the output is
// never copied either. With a CUDA backend both move between those buffers and the device
// without staging copies.
//
// Register it on the same grpc::ServerBuilder as the ExpertShardService (moe_shard does).
// Thread-safety: handlers run concurrently on gRPC's sync threads. Ownership: borrows `shard`,
// which must outlive the server.
#ifndef MOE_SERVER_SHARD_RAW_FORWARD_H_
#define MOE_SERVER_SHARD_RAW_FORWARD_H_

#include "absl/status/status.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/impl/service_type.h"
#include "grpcpp/support/byte_buffer.h"
#include "server/shard/host_buffer_pool.h"
#include "server/shard/service.h"

namespace moe {

class RawForwardService final : public grpc::Service {
 public:
  explicit RawForwardService(ExpertShardService* shard, HostBufferPoolOptions pool = {});

  // One ForwardRaw call: `request` and `response` are raw frames.
  grpc::Status ForwardRaw(grpc::ServerContext* ctx, const grpc::ByteBuffer* request,
                          grpc::ByteBuffer* response);
  // Reuse and registration counts of the payload and output buffers.
  HostBufferPoolStats pool_stats() const { return pool_.stats(); }

 private:
  absl::Status Serve(const grpc::ByteBuffer& request, grpc::ByteBuffer* response,
                     absl::Time deadline);

  ExpertShardService* const shard_;
  HostBufferPool pool_;
};

}  // namespace moe

#endif  // MOE_SERVER_SHARD_RAW_FORWARD_H_
