// ShmChannelServer: the shard's end of one shared-memory request channel (protocol:
// server/common/shm_channel_layout.h). A dedicated thread waits on the block's request futex,
// copies and parses each posted moe.v1.ShmForwardRequest, runs it through `serve` (the
// SharedMemoryShard Forward path: same validation, batching, load counting) and posts the
// response or error back. Anything the client writes into the block is untrusted: lengths are
// bounded, bytes are copied before parsing, and a bad request gets INVALID_ARGUMENT in the
// block while the channel keeps serving.
//
// Thread-safety: constructed and destroyed by ShmForwardService under its lock. Ownership: holds
// the region's lease (the region cannot be unregistered while the channel is open).
#ifndef MOE_SERVER_SHARD_SHM_CHANNEL_H_
#define MOE_SERVER_SHARD_SHM_CHANNEL_H_

#include <atomic>
#include <functional>
#include <thread>

#include "absl/status/status.h"
#include "moe/v1/shm.pb.h"
#include "server/common/shm_channel_layout.h"
#include "server/shard/shm_registry.h"

namespace moe {

class ShmChannelServer {
 public:
  using ServeFn = std::function<absl::Status(const v1::ShmForwardRequest&, v1::ForwardResponse*)>;

  // Starts serving the block at `block` (inside the region `lease` pins).
  ShmChannelServer(ShmRegistry::Lease lease, ShmChannelBlock* block, ServeFn serve);
  ~ShmChannelServer();  // stops the thread (wakes it) and joins
  ShmChannelServer(const ShmChannelServer&) = delete;
  ShmChannelServer& operator=(const ShmChannelServer&) = delete;

  uint64_t served() const { return served_.load(); }

 private:
  void Loop();
  // Serves the request currently in the block; returns the status it posts.
  void ServeOne(uint32_t seq);

  ShmRegistry::Lease lease_;
  ShmChannelBlock* const block_;
  const ServeFn serve_;
  uint32_t last_seq_;
  std::atomic<bool> stop_{false};
  std::atomic<uint64_t> served_{0};
  std::thread thread_;
};

}  // namespace moe

#endif  // MOE_SERVER_SHARD_SHM_CHANNEL_H_
