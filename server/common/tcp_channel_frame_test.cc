#include "server/common/tcp_channel_frame.h"

#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <thread>

#include "absl/time/clock.h"
#include "gtest/gtest.h"

namespace moe {
namespace {

TEST(TcpChannelFrameTest, PrefixIsLittleEndianAndRoundTrips) {
  uint8_t raw[kTcpPrefixBytes];
  EncodeTcpPrefix({kTcpRequestMagic, 0x01020304u, 0x0A0B0C0D0E0F1011ull}, raw);
  const uint8_t want[kTcpPrefixBytes] = {0x4D, 0x45, 0x4F, 0x51, 0x04, 0x03, 0x02, 0x01,
                                         0x11, 0x10, 0x0F, 0x0E, 0x0D, 0x0C, 0x0B, 0x0A};
  EXPECT_EQ(std::memcmp(raw, want, sizeof(raw)), 0);
  const TcpFramePrefix back = DecodeTcpPrefix(raw);
  EXPECT_EQ(back.word, kTcpRequestMagic);
  EXPECT_EQ(back.header_len, 0x01020304u);
  EXPECT_EQ(back.payload_len, 0x0A0B0C0D0E0F1011ull);
}

TEST(TcpChannelFrameTest, RequestPrefixChecksNameTheDefect) {
  EXPECT_TRUE(CheckTcpRequestPrefix({kTcpRequestMagic, kTcpMaxHeaderBytes, 100}, 100).ok());
  const absl::Status magic = CheckTcpRequestPrefix({0x20544547u /* "GET " */, 10, 0}, 100);
  EXPECT_EQ(magic.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(magic.message().find("request magic"), absl::string_view::npos);
  const absl::Status header = CheckTcpRequestPrefix({kTcpRequestMagic, kTcpMaxHeaderBytes + 1, 0}, 100);
  EXPECT_EQ(header.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(header.message().find("request header"), absl::string_view::npos);
  const absl::Status payload = CheckTcpRequestPrefix({kTcpRequestMagic, 10, 101}, 100);
  EXPECT_EQ(payload.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(payload.message().find("100-byte limit"), absl::string_view::npos);
}

TEST(TcpChannelFrameTest, ResponsePrefixChecks) {
  EXPECT_TRUE(CheckTcpResponsePrefix({0, 100, 1 << 20}).ok());
  EXPECT_EQ(CheckTcpResponsePrefix({0, kTcpMaxHeaderBytes + 1, 0}).code(),
            absl::StatusCode::kInternal);
  EXPECT_TRUE(CheckTcpResponsePrefix({3, 20, 0}).ok());
  EXPECT_EQ(CheckTcpResponsePrefix({3, 20, 1}).code(), absl::StatusCode::kInternal);   // payload
  EXPECT_EQ(CheckTcpResponsePrefix({17, 20, 0}).code(), absl::StatusCode::kInternal);  // code
  EXPECT_EQ(CheckTcpResponsePrefix({0xFFFFFFFFu, 20, 0}).code(), absl::StatusCode::kInternal);
  const absl::Status carried = TcpErrorStatus({8, 4, 0}, "full");
  EXPECT_EQ(carried.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(carried.message(), "full");
}

TEST(TcpChannelFrameTest, ReadExactlyAndWriteAllMoveEveryByte) {
  int fds[2];
  ASSERT_EQ(socketpair(AF_UNIX, SOCK_STREAM, 0, fds), 0);
  std::string a(300000, 'a'), b(5, 'b');
  std::thread writer([&] {
    iovec iov[3] = {{a.data(), a.size()}, {nullptr, 0}, {b.data(), b.size()}};
    EXPECT_TRUE(WriteAll(fds[0], iov, 3, absl::InfiniteFuture()).ok());
  });
  std::string got(a.size() + b.size(), '\0');
  ASSERT_TRUE(ReadExactly(fds[1], got.data(), got.size(), absl::Now() + absl::Seconds(10)).ok());
  writer.join();
  EXPECT_EQ(got, a + b);
  // Nothing more arrives: the deadline ends the wait; a closed peer is UNAVAILABLE.
  char one;
  EXPECT_EQ(ReadExactly(fds[1], &one, 1, absl::Now() + absl::Milliseconds(20)).code(),
            absl::StatusCode::kDeadlineExceeded);
  close(fds[0]);
  EXPECT_EQ(ReadExactly(fds[1], &one, 1, absl::InfiniteFuture()).code(),
            absl::StatusCode::kUnavailable);
  close(fds[1]);
}

TEST(TcpChannelFrameTest, ReceiveSpinningTakesWhatArrivesWithinTheSpin) {
  int fds[2];
  ASSERT_EQ(socketpair(AF_UNIX, SOCK_STREAM, 0, fds), 0);
  uint8_t buf[16] = {};
  absl::StatusOr<size_t> got = ReceiveSpinning(fds[1], buf, sizeof(buf), absl::ZeroDuration());
  ASSERT_TRUE(got.ok());
  EXPECT_EQ(*got, 0u);  // no spin: nothing read
  ASSERT_EQ(send(fds[0], "hello", 5, 0), 5);
  got = ReceiveSpinning(fds[1], buf, sizeof(buf), absl::Milliseconds(20));
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(*got, 5u);  // part of the 16, after the spin ran out
  EXPECT_EQ(std::memcmp(buf, "hello", 5), 0);
  const std::string rest(11, 'x');
  ASSERT_EQ(send(fds[0], rest.data(), rest.size(), 0), 11);
  got = ReceiveSpinning(fds[1], buf + 5, 11, absl::Seconds(10));
  ASSERT_TRUE(got.ok());
  EXPECT_EQ(*got, 11u);  // all of it: returns at once
  close(fds[0]);
  EXPECT_EQ(ReceiveSpinning(fds[1], buf, 1, absl::Seconds(10)).status().code(),
            absl::StatusCode::kUnavailable);
  close(fds[1]);
}

// With a counter to yield to: a positive count ends the polling at once (long before the spin
// runs out), one that turns positive while it polls ends it then, and data that is already there
// is still taken.
TEST(TcpChannelFrameTest, ReceiveSpinningYieldsToOtherWork) {
  int fds[2];
  ASSERT_EQ(socketpair(AF_UNIX, SOCK_STREAM, 0, fds), 0);
  uint8_t buf[8] = {};
  std::atomic<int> busy{1};
  absl::Time start = absl::Now();
  absl::StatusOr<size_t> got = ReceiveSpinning(fds[1], buf, sizeof(buf), absl::Seconds(30), &busy);
  ASSERT_TRUE(got.ok());
  EXPECT_EQ(*got, 0u);
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));
  busy = 0;
  std::thread later([&busy] {
    absl::SleepFor(absl::Milliseconds(50));
    busy = 1;
  });
  start = absl::Now();
  got = ReceiveSpinning(fds[1], buf, sizeof(buf), absl::Seconds(30), &busy);
  later.join();
  ASSERT_TRUE(got.ok());
  EXPECT_EQ(*got, 0u);
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(40));  // it polled until the count rose
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));
  ASSERT_EQ(send(fds[0], "abcdefgh", 8, 0), 8);
  got = ReceiveSpinning(fds[1], buf, sizeof(buf), absl::Seconds(30), &busy);
  ASSERT_TRUE(got.ok());
  EXPECT_EQ(*got, 8u);  // what is there is read before the count is looked at
  EXPECT_EQ(std::memcmp(buf, "abcdefgh", 8), 0);
  close(fds[0]);
  close(fds[1]);
}

}  // namespace
}  // namespace moe
