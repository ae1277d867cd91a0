// TLS on direct TCP channels (server/common/tcp_stream.h) against an in-process shard whose
// channel port speaks TLS with a throw-away PKI: the answers equal the plaintext channel's at
// sizes that cross the record gathering and write chunking, the client refuses what it cannot
// verify, a plaintext peer on the TLS port is turned away, and polling and Stop work through TLS.
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/time/clock.h"
#include "client/tcp_channel.h"
#include "gtest/gtest.h"
#include "server/common/tcp_channel_frame.h"
#include "server/common/tcp_stream.h"
#include "server/common/tls.h"
#include "server/shard/in_process_shard.h"
#include "server/shard/transport_test_util.h"
#include "tests/local_cluster.h"
#include "tests/security_fixtures.h"

namespace moe::testing {
namespace {

constexpr int64_t kHidden = 128;
constexpr char kModel[] = "tcp_channel_tls_model";

class TcpChannelTlsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    absl::StatusOr<TestPki> pki = GenerateTestPki(FreshTestDir("tcp_channel_tls_pki"));
    ASSERT_TRUE(pki.ok()) << pki.status();
    pki_ = *pki;
    absl::StatusOr<std::shared_ptr<const TlsContext>> server =
        TcpTlsServerFromFiles(pki_.node_cert, pki_.node_key);
    ASSERT_TRUE(server.ok()) << server.status();
    absl::StatusOr<std::shared_ptr<const TlsContext>> client = TcpTlsClientFromFile(pki_.ca);
    ASSERT_TRUE(client.ok()) << client.status();
    client_tls_ = *client;
    InProcessShardOptions options;
    options.tcp_channel_tls = *server;
    absl::StatusOr<std::unique_ptr<InProcessShard>> shard =
        StartTestShard(kModel, kHidden, options);
    ASSERT_TRUE(shard.ok()) << shard.status();
    shard_ = *std::move(shard);
    absl::StatusOr<std::unique_ptr<InProcessShard>> plain = StartTestShard(kModel, kHidden);
    ASSERT_TRUE(plain.ok()) << plain.status();
    plain_ = *std::move(plain);
    grpc_ = grpc::CreateChannel(shard_->address(), grpc::InsecureChannelCredentials());
    plain_grpc_ = grpc::CreateChannel(plain_->address(), grpc::InsecureChannelCredentials());
  }

  absl::StatusOr<std::unique_ptr<TcpChannel>> Open(std::shared_ptr<const TlsContext> tls,
                                                   bool require_tls = false) {
    return TcpChannel::Open(grpc_.get(), "127.0.0.1", absl::Seconds(10), std::move(tls),
                            require_tls);
  }

  TestPki pki_;
  std::shared_ptr<const TlsContext> client_tls_;
  std::unique_ptr<InProcessShard> shard_, plain_;
  std::shared_ptr<grpc::Channel> grpc_, plain_grpc_;
};

TEST_F(TcpChannelTlsTest, SameAnswersAsThePlaintextChannel) {
  absl::StatusOr<std::unique_ptr<TcpChannel>> tls = Open(client_tls_, /*require_tls=*/true);
  ASSERT_TRUE(tls.ok()) << tls.status();
  EXPECT_TRUE((*tls)->tls());
  absl::StatusOr<std::unique_ptr<TcpChannel>> plain =
      TcpChannel::Open(plain_grpc_.get(), "127.0.0.1");
  ASSERT_TRUE(plain.ok()) << plain.status();
  EXPECT_FALSE((*plain)->tls());
  // 1 and 5 tokens: one gathered record; 300: a 77 KB payload of its own; 4100: over 1 MB, two
  // writes.
  for (int64_t tokens : {1, 5, 300, 4100}) {
    SCOPED_TRACE(tokens);
    std::string payload;
    const v1::ForwardRequest header = RoutedBf16Header(tokens, kHidden, &payload);
    std::vector<uint8_t> want(tokens * kHidden * 4), got(want.size(), 0xEE);
    ASSERT_TRUE((*plain)->Forward(header, payload, absl::MakeSpan(want)).ok());
    for (int round = 0; round < 3; ++round) {  // back to back: the shard's thread polls
      absl::StatusOr<v1::ForwardResponse> r = (*tls)->Forward(header, payload, absl::MakeSpan(got));
      ASSERT_TRUE(r.ok()) << r.status();
      EXPECT_EQ(got, want);
    }
  }
  // A validation error comes back through TLS and the connection keeps serving.
  std::string payload;
  const v1::ForwardRequest header = RoutedBf16Header(2, kHidden, &payload);
  std::vector<uint8_t> out(2 * kHidden * 4);
  EXPECT_EQ((*tls)->Forward(header, payload.substr(1), absl::MakeSpan(out)).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE((*tls)->Forward(header, payload, absl::MakeSpan(out)).ok());
  EXPECT_FALSE((*tls)->broken());
}

TEST_F(TcpChannelTlsTest, ClientRefusesWhatItCannotVerify) {
  // No roots at all.
  EXPECT_EQ(Open(nullptr).status().code(), absl::StatusCode::kFailedPrecondition);
  // Roots of another CA: the shard's certificate does not chain to them.
  absl::StatusOr<std::shared_ptr<const TlsContext>> rogue = TcpTlsClientFromFile(pki_.rogue_cert);
  ASSERT_TRUE(rogue.ok()) << rogue.status();
  absl::StatusOr<std::unique_ptr<TcpChannel>> refused = Open(*rogue);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kUnavailable) << refused.status();
  EXPECT_NE(refused.status().message().find("did not verify"), absl::string_view::npos)
      << refused.status();
  // A plaintext shard when TLS is required.
  EXPECT_EQ(TcpChannel::Open(plain_grpc_.get(), "127.0.0.1", absl::Seconds(10), client_tls_,
                             /*require_tls=*/true)
                .status()
                .code(),
            absl::StatusCode::kFailedPrecondition);
  // Garbage for a context.
  EXPECT_EQ(TlsContext::ForClient("not a certificate").status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(TcpTlsServerFromFiles(pki_.node_cert, pki_.rogue_key).status().code(),
            absl::StatusCode::kInvalidArgument);
  // The shard serves on.
  absl::StatusOr<std::unique_ptr<TcpChannel>> ok = Open(client_tls_);
  ASSERT_TRUE(ok.ok()) << ok.status();
}

TEST_F(TcpChannelTlsTest, PlaintextPeerOnTheTlsPortIsTurnedAway) {
  const uint64_t refused_before = shard_->tcp()->refused_connections();
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(shard_->tcp()->port()));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  // A plaintext hello where the ClientHello belongs.
  std::string hello(kTcpChannelMagic, sizeof(kTcpChannelMagic));
  hello += std::string(kTcpChannelTicketBytes, 'x');
  ASSERT_EQ(send(fd, hello.data(), hello.size(), MSG_NOSIGNAL), static_cast<ssize_t>(hello.size()));
  char buf[256];
  ssize_t n;
  while ((n = recv(fd, buf, sizeof(buf), 0)) > 0) {
  }
  close(fd);  // the shard closed first (an alert at most, never a frame)
  for (const absl::Time give_up = absl::Now() + absl::Seconds(10);
       shard_->tcp()->refused_connections() == refused_before && absl::Now() < give_up;
       absl::SleepFor(absl::Milliseconds(5))) {
  }
  EXPECT_EQ(shard_->tcp()->refused_connections(), refused_before + 1);
  absl::StatusOr<std::unique_ptr<TcpChannel>> ok = Open(client_tls_);
  ASSERT_TRUE(ok.ok()) << ok.status();
}

TEST_F(TcpChannelTlsTest, StopClosesTlsConnections) {
  absl::StatusOr<std::unique_ptr<TcpChannel>> c = Open(client_tls_);
  ASSERT_TRUE(c.ok()) << c.status();
  std::string payload;
  const v1::ForwardRequest header = RoutedBf16Header(2, kHidden, &payload);
  std::vector<uint8_t> out(2 * kHidden * 4);
  for (int i = 0; i < 3; ++i) ASSERT_TRUE((*c)->Forward(header, payload, absl::MakeSpan(out)).ok());
  shard_->tcp()->Stop();
  EXPECT_EQ(shard_->tcp()->open_connections(), 0u);
  EXPECT_EQ((*c)->Forward(header, payload, absl::MakeSpan(out)).status().code(),
            absl::StatusCode::kUnavailable);
}

}  // namespace
}  // namespace moe::testing
