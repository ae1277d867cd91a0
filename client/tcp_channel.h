// Client end of a direct TCP request channel (proto/moe/v1/tcp.proto, frames in
// server/common/tcp_channel_frame.h). Open() asks the shard for a ticket over gRPC (with the
// channel's credentials and deadline), connects a socket of its own to the shard's channel port
// and presents the ticket; Forward() then sends a ForwardRequest header and the hidden-state
// bytes as one frame and reads the answer's output bytes straight into the caller's buffer. No
// gRPC call per request: for decode steps of a frontend on another machine, where gRPC's own
// cost is several TCP round trips.
//
// Thread-safety: Forward calls on one channel are serialized (one request in flight); use one
// channel per frontend thread. A transfer error or a missed deadline breaks the channel (the
// stream position is lost): later calls return UNAVAILABLE and the caller opens a new one.
// Ownership: owns the socket.
#ifndef MOE_CLIENT_TCP_CHANNEL_H_
#define MOE_CLIENT_TCP_CHANNEL_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "grpcpp/grpcpp.h"
#include "moe/v1/shard.pb.h"
#include "server/common/tcp_stream.h"

namespace moe {

class TcpChannel {
 public:
  // `channel` reaches the shard's gRPC port; `host` is the shard's host as this machine reaches
  // it (the channel port is on the same host). `timeout` bounds the ticket call, the connect and
  // the hello. A shard whose channels speak TLS (OpenTcpChannelResponse.tls: its gRPC port has
  // TLS) needs `tls`, the roots its certificate must chain to for `host`: without them
  // FAILED_PRECONDITION, and UNAVAILABLE when the certificate does not verify. `require_tls`
  // refuses a plaintext channel (FAILED_PRECONDITION) before connecting. UNIMPLEMENTED when
  // the shard does not serve TCP channels (moe_shard --tcp_channel), UNAVAILABLE when it cannot
  // be reached; the shard's refusal otherwise.
  [[nodiscard]] static absl::StatusOr<std::unique_ptr<TcpChannel>> Open(
      grpc::ChannelInterface* channel, const std::string& host,
      absl::Duration timeout = absl::Seconds(10),
      std::shared_ptr<const TlsContext> tls = nullptr, bool require_tls = false);
  // Whether the data connection runs TLS.
  bool tls() const { return stream_->tls(); }
  ~TcpChannel();
  TcpChannel(const TcpChannel&) = delete;
  TcpChannel& operator=(const TcpChannel&) = delete;

  // Sends `header` (a ForwardRequest whose hidden_states.data has dtype and shape but no data)
  // and `hidden_payload` (those bytes); the output bytes land in `output`, whose size must equal
  // the output's byte count (INVALID_ARGUMENT otherwise, `output` untouched, the channel still
  // usable). Returns the response header, or the shard's status.
  absl::StatusOr<v1::ForwardResponse> Forward(const v1::ForwardRequest& header,
                                              absl::string_view hidden_payload,
                                              absl::Span<uint8_t> output,
                                              absl::Duration timeout = absl::Seconds(30))
      ABSL_LOCKS_EXCLUDED(mu_);

  // Forward in two halves, so that one thread can have requests in flight on several shards'
  // channels at once (send to each, then receive from each): Send, then Receive, alternately
  // (FAILED_PRECONDITION otherwise). Receive stores the output bytes in `output` (resized) and
  // returns the response header or the shard's status.
  absl::Status Send(const v1::ForwardRequest& header, absl::string_view hidden_payload,
                    absl::Time deadline) ABSL_LOCKS_EXCLUDED(mu_);
  absl::StatusOr<v1::ForwardResponse> Receive(std::string* output, absl::Time deadline)
      ABSL_LOCKS_EXCLUDED(mu_);

  // Whether an earlier failure broke the channel.
  bool broken() const ABSL_LOCKS_EXCLUDED(mu_);

  // How long a receive polls the socket (non-blocking reads) for the answer before it blocks
  // (default kDefaultSpin, 50 us: a decode step's answer then costs no thread wake-up). It polls
  // only while the previous answer came within that time (and every 16th request otherwise), as
  // ShmChannel does. Zero never polls.
  static constexpr absl::Duration kDefaultSpin = absl::Microseconds(50);
  void set_spin(absl::Duration spin) ABSL_LOCKS_EXCLUDED(mu_);

 private:
  TcpChannel(int fd, std::unique_ptr<TcpStream> stream) : fd_(fd), stream_(std::move(stream)) {}
  // Where the output bytes go, given their count (an error leaves them unread: they are drained).
  using OutputSink = std::function<absl::StatusOr<absl::Span<uint8_t>>(uint64_t bytes)>;
  absl::Status SendLocked(const v1::ForwardRequest& header, absl::string_view hidden_payload,
                          absl::Time deadline) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::StatusOr<v1::ForwardResponse> ReceiveLocked(const OutputSink& sink, absl::Time deadline)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Reads the answer's prefix, polling first when the spin rule says so.
  absl::Status ReadPrefix(uint8_t* raw, absl::Time deadline) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Marks the channel broken after a transfer failure (the stream is out of step).
  template <typename T>
  T Checked(T result) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const int fd_;
  std::unique_ptr<TcpStream> stream_;  // over fd_: plain or TLS
  mutable absl::Mutex mu_;
  bool broken_ ABSL_GUARDED_BY(mu_) = false;
  bool awaiting_ ABSL_GUARDED_BY(mu_) = false;  // sent a request whose answer is unread
  absl::Duration spin_ ABSL_GUARDED_BY(mu_) = kDefaultSpin;
  absl::Time sent_at_ ABSL_GUARDED_BY(mu_);
  absl::Duration last_wait_ ABSL_GUARDED_BY(mu_);  // send to answer, previous request
  int unpolled_ ABSL_GUARDED_BY(mu_) = 0;
  std::string scratch_ ABSL_GUARDED_BY(mu_);
};

}  // namespace moe

#endif  // MOE_CLIENT_TCP_CHANNEL_H_
