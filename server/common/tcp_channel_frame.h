// Wire format of the direct TCP request channel (proto/moe/v1/tcp.proto), shared by the shard's
// end (server/shard/tcp_channel) and the client's (client/tcp_channel), with the blocking socket
// I/O both use. All integers are little-endian.
//
//   hello (client -> shard, once): kTcpChannelMagic (8 bytes), the ticket (32 bytes)
//   request:  [u32 kTcpRequestMagic][u32 header_len][u64 payload_len]
//             header: a serialized moe.v1.ForwardRequest whose hidden_states.data has dtype and
//             shape but no data; payload: those data bytes
//   response: [i32 status_code][u32 header_len][u64 payload_len]
//             status 0: header = a serialized moe.v1.ForwardResponse whose output has dtype and
//             shape, payload = the output bytes; otherwise header = the error message, no
//             payload
// The shard answers the hello with a response (status 0, or PERMISSION_DENIED and a close). A
// request the shard cannot frame (bad magic, a length over its limits) gets an error response
// and the connection is closed; a well-framed request that fails validation gets an error
// response and the connection keeps serving. One request in flight per connection.
//
// Thread-safety: stateless functions.
#ifndef MOE_SERVER_COMMON_TCP_CHANNEL_FRAME_H_
#define MOE_SERVER_COMMON_TCP_CHANNEL_FRAME_H_

#include <sys/uio.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace moe {

inline constexpr char kTcpChannelMagic[8] = {'M', 'O', 'E', 'T', 'C', 'P', '0', '1'};
inline constexpr size_t kTcpChannelTicketBytes = 32;
inline constexpr size_t kTcpHelloBytes = sizeof(kTcpChannelMagic) + kTcpChannelTicketBytes;
inline constexpr uint32_t kTcpRequestMagic = 0x514F454Du;  // "MEOQ" as bytes 4D 45 4F 51
inline constexpr size_t kTcpPrefixBytes = 16;
// Largest request or response header (a request's routes travel in it: 16 MiB is ~2M routes).
inline constexpr uint32_t kTcpMaxHeaderBytes = 16u << 20;

struct TcpFramePrefix {
  uint32_t word = 0;  // kTcpRequestMagic in a request, the status code in a response
  uint32_t header_len = 0;
  uint64_t payload_len = 0;
};

void EncodeTcpPrefix(const TcpFramePrefix& prefix, uint8_t out[kTcpPrefixBytes]);
TcpFramePrefix DecodeTcpPrefix(const uint8_t in[kTcpPrefixBytes]);

// The shard's checks of a request prefix, before it allocates anything for the frame:
// INVALID_ARGUMENT without the request magic (the stream is out of step), RESOURCE_EXHAUSTED for
// a header over kTcpMaxHeaderBytes or a payload over `max_payload_bytes`. Any error ends the
// connection (the frame's length cannot be trusted).
[[nodiscard]] absl::Status CheckTcpRequestPrefix(const TcpFramePrefix& prefix,
                                                 uint64_t max_payload_bytes);
// The client's checks of a response prefix: OK for an answer (word 0) whose header is within
// kTcpMaxHeaderBytes, or for an error frame (word = an absl status code 1..16, a message of at
// most kTcpMaxHeaderBytes, no payload); INTERNAL for anything else (the stream is out of step).
[[nodiscard]] absl::Status CheckTcpResponsePrefix(const TcpFramePrefix& prefix);
// The status an error frame carries (`prefix` passed CheckTcpResponsePrefix, word != 0).
absl::Status TcpErrorStatus(const TcpFramePrefix& prefix, std::string message);

// Waits until `fd` is ready for `events` (POLLIN, POLLOUT) or `deadline` passes
// (DEADLINE_EXCEEDED); returns at once without a deadline (the blocking call that follows waits).
[[nodiscard]] absl::Status WaitReady(int fd, short events, absl::Time deadline);

// Reads exactly `n` bytes from the blocking socket `fd`. UNAVAILABLE when the peer closed the
// connection or it failed; DEADLINE_EXCEEDED when `deadline` passed first (InfiniteFuture: no
// limit). After an error the stream position is unknown: close the connection.
[[nodiscard]] absl::Status ReadExactly(int fd, void* dst, size_t n, absl::Time deadline);
// Polls `fd` (non-blocking receives) for up to `spin` for the first bytes of `n`, so that a
// waiter whose answer comes soon does not sleep in the kernel and pay a wake-up; returns how many
// bytes arrived meanwhile (0 .. n; read the rest with ReadExactly). UNAVAILABLE when the peer
// closed the connection or it failed. spin <= 0: returns 0 at once. With `yield_to` set, it
// also stops polling as soon as that counter is positive (other work wants the core).
[[nodiscard]] absl::StatusOr<size_t> ReceiveSpinning(int fd, void* dst, size_t n,
                                                     absl::Duration spin,
                                                     const std::atomic<int>* yield_to = nullptr);
// Writes every byte of `iov` (modified as it goes) to `fd`, with the errors of ReadExactly. No
// SIGPIPE on a closed peer.
[[nodiscard]] absl::Status WriteAll(int fd, iovec* iov, int iov_count, absl::Time deadline);

}  // namespace moe

#endif  // MOE_SERVER_COMMON_TCP_CHANNEL_FRAME_H_
