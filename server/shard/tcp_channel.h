// TcpChannelService: the shard's end of direct TCP request channels (proto/moe/v1/tcp.proto,
// frames in server/common/tcp_channel_frame.h). OpenTcpChannel (a gRPC call, so it passes the
// shard's TLS and authentication) hands out a single-use ticket; the frontend then connects to
// the channel port, presents the ticket, and sends Forward requests as frames. A thread per
// connection reads each request's payload straight into a pooled host buffer the backend has
// registered (HostBufferPool), runs it through ExpertShardService::ServeForward (the same
// admission quota, under the identity of the OpenTcpChannel call, validation, batching, load
// counting and metrics as Forward) with the output written into
// another pooled buffer, and sends the answer with one gathered write. Per request that is a TCP
// round trip and the bytes, without HTTP/2 framing, protobuf copies of tensors or gRPC's thread
// hand-offs.
//
// Everything a connection sends is untrusted: lengths are bounded before anything is allocated,
// a frame that cannot be parsed ends its connection with an error response, a request that fails
// validation gets the error and the connection keeps serving.
//
// Thread-safety: OpenTcpChannel runs on gRPC threads; Stop may be called from any thread.
// Ownership: borrows `shard` (must outlive the service); owns the listening socket, the
// connections and their threads.
#ifndef MOE_SERVER_SHARD_TCP_CHANNEL_H_
#define MOE_SERVER_SHARD_TCP_CHANNEL_H_

#include <atomic>
#include <cstdint>
#include <list>
#include <map>
#include <memory>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "moe/v1/tcp.grpc.pb.h"
#include "server/common/tcp_stream.h"
#include "server/shard/host_buffer_pool.h"
#include "server/shard/service.h"

namespace moe {

inline constexpr absl::Duration kTcpChannelDefaultSpin = absl::Microseconds(500);

struct TcpChannelOptions {
  std::string host = "127.0.0.1";  // address the channel port binds
  int port = 0;                    // 0 picks a free one (port())
  int64_t max_payload_bytes = int64_t{256} << 20;  // per request (the gRPC message limit)
  absl::Duration ticket_ttl = absl::Seconds(30);
  size_t max_connections = 256;  // each holds a thread
  // Once a frame's prefix has arrived, the rest of it must within this time (a stalled sender
  // cannot hold a connection's buffers forever).
  absl::Duration frame_timeout = absl::Seconds(60);
  // After each answer a connection's thread polls for the next request up to this long before
  // it sleeps in the kernel, when the connection's previous request came within it (and every
  // 16th time regardless, to notice a frontend that speeds up): a frontend that sends again soon,
  // such as a decode step's next layer, saves the thread's wake-up (20-60 us on the H200 host,
  // NOTES-cuda.md), and a slow one costs no polling. A core is busy while it polls. 0: never.
  absl::Duration spin = kTcpChannelDefaultSpin;
  // At most this many connection threads poll at once (the rest sleep at once), so that many
  // frontends cannot keep every core busy polling; 0: a quarter of the machine's cores (at
  // least 1).
  int max_spinning = 0;
  // Whether a polling thread gives way to requests: it polls only while no connection's request
  // is being served and stops as soon as one is (so it never takes a core from the work). -1
  // (default): on machines of fewer than 4 cores, where one polling thread is a large share
  // (on the 2-core VM, 4 clients' p99 was 1.1 ms with a poller against 0.36 ms without); 0:
  // never; 1: always.
  int polling_yields = -1;
  HostBufferPoolOptions buffers;
  // TLS for every data connection (the shard's gRPC certificate; TcpStream::AcceptTls), and
  // OpenTcpChannel tells clients so; null: plaintext. Under TLS a connection over
  // max_connections is closed without an answer (the refusal would need a handshake first).
  std::shared_ptr<const TlsContext> tls;
};

class TcpChannelService final : public v1::TcpChannelShard::Service {
 public:
  // Binds and listens; UNAVAILABLE naming the address when it cannot.
  [[nodiscard]] static absl::StatusOr<std::unique_ptr<TcpChannelService>> Start(
      ExpertShardService* shard, TcpChannelOptions options);
  ~TcpChannelService() override { Stop(); }
  TcpChannelService(const TcpChannelService&) = delete;
  TcpChannelService& operator=(const TcpChannelService&) = delete;

  int port() const { return port_; }
  // Requests answered over every connection so far.
  uint64_t served() const { return served_.load(); }
  // Connections open now.
  size_t open_connections() const ABSL_LOCKS_EXCLUDED(mu_);
  // Connections turned away so far: a bad or used ticket, no hello in time, or the connection
  // limit reached.
  uint64_t refused_connections() const { return refused_.load(); }
  // Connections ended by a frame the shard could not take (bad magic, lengths over the limits,
  // no memory for the payload).
  uint64_t framing_errors() const { return framing_errors_.load(); }
  HostBufferPoolStats buffer_stats() const { return pool_.stats(); }

  grpc::Status OpenTcpChannel(grpc::ServerContext* ctx, const v1::OpenTcpChannelRequest* request,
                              v1::OpenTcpChannelResponse* response) override;

  // Stops accepting, closes every connection (a request being served finishes first) and joins
  // the threads. Idempotent.
  void Stop() ABSL_LOCKS_EXCLUDED(mu_);

 private:
  struct Connection {
    int fd = -1;
    std::thread thread;
    bool done = false;  // the thread has finished (join it)
  };

  TcpChannelService(ExpertShardService* shard, TcpChannelOptions options, int listener, int port);
  void AcceptLoop();
  void Serve(Connection* connection);
  // Checks the hello; returns the identity (auth.h CallerIdentity) of the OpenTcpChannel call
  // that issued the ticket. An error is sent to the peer and ends the connection.
  absl::StatusOr<std::string> Hello(TcpStream& stream);
  // What a connection's thread remembers between requests (for TcpChannelOptions::spin).
  struct ConnectionState {
    absl::Time answered = absl::InfinitePast();  // when the last answer went out
    // From that answer to the next request's prefix (infinite: none yet, so no polling).
    absl::Duration last_gap = absl::InfiniteDuration();
    int unspun = 0;  // requests waited for without polling since the last poll
  };
  // Serves one request of `identity` (under its admission quota); an error return (I/O,
  // framing) ends the connection.
  absl::Status ServeOne(TcpStream& stream, const std::string& identity, ConnectionState& state);
  // What a request's answer carries: the ForwardResponse header and the output's pooled buffer.
  struct Answer {
    std::string header;
    HostBufferPool::Lease output;
    size_t output_bytes = 0;
  };
  // Admits, parses and runs one well-framed request of `identity`.
  absl::Status Handle(const std::string& identity, const std::string& header,
                      absl::string_view payload, Answer& answer);
  // Joins finished connection threads.
  void Reap() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  ExpertShardService* const shard_;
  const TcpChannelOptions options_;
  const int listener_;
  const int port_;
  HostBufferPool pool_;
  std::atomic<uint64_t> served_{0};
  std::atomic<uint64_t> refused_{0};
  std::atomic<uint64_t> framing_errors_{0};
  std::atomic<int> spinning_{0};  // connection threads polling now
  int max_spinning_ = 1;          // TcpChannelOptions::max_spinning, resolved
  bool polling_yields_ = false;   // TcpChannelOptions::polling_yields, resolved
  std::atomic<int> serving_{0};   // requests read and not yet answered
  mutable absl::Mutex mu_;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::list<Connection> connections_ ABSL_GUARDED_BY(mu_);
  struct Issued {
    absl::Time expiry;
    std::string identity;  // of the OpenTcpChannel caller
  };
  std::map<std::string, Issued> tickets_ ABSL_GUARDED_BY(mu_);
  std::thread acceptor_;
};

}  // namespace moe

#endif  // MOE_SERVER_SHARD_TCP_CHANNEL_H_
