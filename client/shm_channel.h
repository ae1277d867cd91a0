// Client end of a same-host shared-memory request channel (protocol:
// server/common/shm_channel_layout.h). Open() creates a POSIX shared-memory object holding the
// channel's control block followed by a data area, registers it with the shard and opens the
// channel; the caller then writes hidden states into data(), and Forward() posts a request whose
// tensor ranges are offsets into data(), waits on the response futex and returns the response
// header (the output bytes are in data() at the range the request named). No gRPC call per
// request: for decode steps of a frontend on the same machine.
//
// Thread-safety: Forward calls on one channel are serialized (one request in flight); use one
// channel per frontend thread. Ownership: owns the shared-memory object; the destructor closes the
// channel, unregisters and unlinks it.
#ifndef MOE_CLIENT_SHM_CHANNEL_H_
#define MOE_CLIENT_SHM_CHANNEL_H_

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "grpcpp/grpcpp.h"
#include "moe/v1/shm.grpc.pb.h"
#include "server/common/shm_channel_layout.h"

namespace moe {

class ShmChannel {
 public:
  // `data_bytes`: size of the data area (hidden states + outputs of the largest request).
  static absl::StatusOr<std::unique_ptr<ShmChannel>> Open(std::shared_ptr<grpc::Channel> channel,
                                                          uint64_t data_bytes,
                                                          absl::Duration rpc_timeout =
                                                              absl::Seconds(10));
  ~ShmChannel();
  ShmChannel(const ShmChannel&) = delete;
  ShmChannel& operator=(const ShmChannel&) = delete;

  absl::Span<uint8_t> data() { return absl::Span<uint8_t>(base_ + data_offset_, data_bytes_); }
  const std::string& region_id() const { return key_; }

  // Runs `request`: its hidden_states and output ranges are offsets into data() (region ids are
  // filled in here). Returns the shard's status; DEADLINE_EXCEEDED when no answer came within
  // `timeout` (the channel stays usable: a late answer is recognized by its sequence number).
  absl::Status Forward(v1::ShmForwardRequest request, v1::ForwardResponse* response,
                       absl::Duration timeout = absl::Seconds(30));

  // How long Forward may poll for the answer before it sleeps on the futex (default
  // kShmChannelSpin, 50 us: a one-token round trip then takes microseconds rather than a futex
  // wake-up). It polls only while the previous answer came within that time (and every 16th
  // request otherwise, to notice when answers are quick again), so requests that take longer, or
  // a host with more waiting clients than cores, mostly fall back to the futex alone. Zero never
  // polls.
  void set_spin(absl::Duration spin) ABSL_LOCKS_EXCLUDED(mu_);

 private:
  ShmChannel() = default;

  std::unique_ptr<v1::SharedMemoryShard::Stub> stub_;
  absl::Duration rpc_timeout_;
  std::string key_;
  std::string channel_id_;
  uint8_t* base_ = nullptr;
  uint64_t map_bytes_ = 0;
  uint64_t data_offset_ = 0;
  uint64_t data_bytes_ = 0;
  bool registered_ = false;
  absl::Mutex mu_;
  uint32_t seq_ ABSL_GUARDED_BY(mu_) = 0;
  std::chrono::microseconds spin_ ABSL_GUARDED_BY(mu_) = kShmChannelSpin;
  // Post-to-answer time of the previous request (zero before the first).
  std::chrono::steady_clock::duration last_wait_ ABSL_GUARDED_BY(mu_){};
  int unpolled_ ABSL_GUARDED_BY(mu_) = 0;  // requests since the last poll
  std::string scratch_ ABSL_GUARDED_BY(mu_);
};

}  // namespace moe

#endif  // MOE_CLIENT_SHM_CHANNEL_H_
