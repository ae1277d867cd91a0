// The byte stream of a direct TCP request channel (tcp_channel_frame.h): the connected socket
// itself, or TLS 1.3 (OpenSSL) on top of it. A shard whose gRPC port speaks TLS serves its TCP
// channels with the same certificate; the client verifies that certificate against its CA and
// the host it connected to, as gRPC does. The channel's ticket (from the authenticated
// OpenTcpChannel call) still identifies the caller; TLS keeps the activations and outputs
// private and unaltered on the way.
//
// Sockets stay blocking: reads wait in poll() for the deadline first (a TLS record already
// buffered inside OpenSSL is read without waiting), writes likewise; the TLS handshake is bounded
// by socket timeouts. A TLS read that has started on a record may wait for the rest of that
// record beyond the deadline (a peer that stalls mid-record).
//
// Thread-safety: a TcpStream is used by one thread at a time; TlsContext is immutable and shared.
// Ownership: TcpStream borrows the socket (its owner closes it, after the stream is gone) and
// owns its TLS session.
#ifndef MOE_SERVER_COMMON_TCP_STREAM_H_
#define MOE_SERVER_COMMON_TCP_STREAM_H_

#include <sys/uio.h>

#include <atomic>
#include <cstddef>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"

typedef struct ssl_ctx_st SSL_CTX;
typedef struct ssl_st SSL;
typedef struct ssl_method_st SSL_METHOD;

namespace moe {

// An OpenSSL context, TLS 1.3 only.
class TlsContext {
 public:
  // A server's: its certificate chain and private key (PEM text). INVALID_ARGUMENT naming what
  // OpenSSL refused.
  [[nodiscard]] static absl::StatusOr<std::shared_ptr<const TlsContext>> ForServer(
      const std::string& cert_pem, const std::string& key_pem);
  // A client's: the roots (PEM text) a server's certificate must chain to.
  [[nodiscard]] static absl::StatusOr<std::shared_ptr<const TlsContext>> ForClient(
      const std::string& ca_pem);
  ~TlsContext();
  TlsContext(const TlsContext&) = delete;
  TlsContext& operator=(const TlsContext&) = delete;

  SSL_CTX* ctx() const { return ctx_; }

 private:
  explicit TlsContext(SSL_CTX* ctx) : ctx_(ctx) {}
  static absl::StatusOr<std::shared_ptr<const TlsContext>> Make(const SSL_METHOD* method);
  SSL_CTX* const ctx_;
};

class TcpStream {
 public:
  // The socket as it is.
  explicit TcpStream(int fd) : fd_(fd) {}
  // TLS: the server's handshake on an accepted socket, or the client's (verifying the server's
  // certificate against `host`, a name or an IP address). UNAVAILABLE naming the failure, or
  // DEADLINE_EXCEEDED.
  [[nodiscard]] static absl::StatusOr<std::unique_ptr<TcpStream>> AcceptTls(int fd,
                                                                            const TlsContext& tls,
                                                                            absl::Time deadline);
  [[nodiscard]] static absl::StatusOr<std::unique_ptr<TcpStream>> ConnectTls(
      int fd, const TlsContext& tls, const std::string& host, absl::Time deadline);
  ~TcpStream();
  TcpStream(const TcpStream&) = delete;
  TcpStream& operator=(const TcpStream&) = delete;

  int fd() const { return fd_; }
  bool tls() const { return ssl_ != nullptr; }

  // As the functions of tcp_channel_frame.h of the same names, through TLS when there is.
  [[nodiscard]] absl::Status ReadExactly(void* dst, size_t n, absl::Time deadline);
  [[nodiscard]] absl::Status WriteAll(iovec* iov, int iov_count, absl::Time deadline);
  [[nodiscard]] absl::StatusOr<size_t> ReceiveSpinning(void* dst, size_t n, absl::Duration spin,
                                                       const std::atomic<int>* yield_to = nullptr);

 private:
  TcpStream(int fd, SSL* ssl) : fd_(fd), ssl_(ssl) {}
  // The TLS handshake on `fd`: a client's (verifying the certificate for *host) when host is
  // given, else a server's.
  static absl::StatusOr<std::unique_ptr<TcpStream>> Handshake(int fd, const TlsContext& tls,
                                                              const std::string* host,
                                                              absl::Time deadline);
  // One SSL_read of at most `n` bytes (>= 1 returned); UNAVAILABLE when the peer closed or the
  // connection failed.
  absl::StatusOr<size_t> ReadSome(void* dst, size_t n);
  absl::Status WriteTls(const void* src, size_t n, absl::Time deadline);

  const int fd_;
  SSL* const ssl_ = nullptr;
  std::string scratch_;  // small pieces of a WriteAll gathered into one TLS record
};

}  // namespace moe

#endif  // MOE_SERVER_COMMON_TCP_STREAM_H_
