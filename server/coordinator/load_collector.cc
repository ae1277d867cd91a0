#include "server/coordinator/load_collector.h"

#include <utility>

#include "absl/synchronization/blocking_counter.h"
#include "absl/time/clock.h"
#include "grpcpp/client_context.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/support/channel_arguments.h"
#include "moe/v1/shard.grpc.pb.h"
#include "server/common/status.h"
#include "server/common/tls.h"

namespace moe {
namespace {

// Everything one in-flight CollectLoad needs to stay alive until its callback runs.
struct PendingCall {
  std::unique_ptr<v1::ExpertShard::Stub> stub;
  grpc::ClientContext context;
  v1::CollectLoadRequest request;
  v1::LoadDelta response;
  grpc::Status status;
};

}  // namespace

LoadCollector::LoadCollector(absl::Duration timeout, int max_message_bytes)
    : timeout_(timeout), max_message_bytes_(max_message_bytes) {}

std::vector<CollectedLoad> LoadCollector::CollectAll(const std::vector<ShardTarget>& targets) {
  std::vector<PendingCall> calls(targets.size());
  absl::BlockingCounter remaining(static_cast<int>(targets.size()));
  const auto deadline = absl::ToChronoTime(absl::Now() + timeout_);
  for (size_t i = 0; i < targets.size(); ++i) {
    PendingCall& call = calls[i];
    call.stub = v1::ExpertShard::NewStub(ChannelFor(targets[i].address));
    call.context.set_deadline(deadline);
    call.stub->async()->CollectLoad(&call.context, &call.request, &call.response,
                                    [&call, &remaining](grpc::Status status) {
                                      call.status = std::move(status);
                                      remaining.DecrementCount();
                                    });
  }
  // Every call carries a deadline, so this wait is bounded by the timeout.
  remaining.Wait();

  std::vector<CollectedLoad> results;
  results.reserve(targets.size());
  for (size_t i = 0; i < targets.size(); ++i) {
    CollectedLoad result{targets[i], std::move(calls[i].response)};
    if (!calls[i].status.ok()) result.delta = FromGrpcStatus(calls[i].status);
    results.push_back(std::move(result));
  }
  return results;
}

std::shared_ptr<grpc::Channel> LoadCollector::ChannelFor(const std::string& address) {
  absl::MutexLock lock(&mu_);
  std::shared_ptr<grpc::Channel>& channel = channels_[address];
  if (channel == nullptr) {
    grpc::ChannelArguments args;
    args.SetMaxReceiveMessageSize(max_message_bytes_);
    args.SetMaxSendMessageSize(max_message_bytes_);
    channel = CreateSecureChannel(address, DefaultChannelSecurity(), args);
  }
  return channel;
}

}  // namespace moe
