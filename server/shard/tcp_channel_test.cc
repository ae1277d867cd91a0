// Direct TCP channels against an in-process shard: the same answers as ForwardRaw, one-use
// tickets, validation errors that keep the connection, framing errors that end it, and the shard
// serving on after each of them.
#include "server/shard/tcp_channel.h"

#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/time/clock.h"
#include "client/raw_forward.h"
#include "client/tcp_channel.h"
#include "gtest/gtest.h"
#include "moe/v1/tcp.grpc.pb.h"
#include "server/common/tcp_channel_frame.h"
#include "server/shard/in_process_shard.h"
#include "server/shard/transport_test_util.h"

namespace moe {
namespace {

constexpr int64_t kHidden = 128;
constexpr int64_t kMaxMessage = 1 << 20;
constexpr char kModel[] = "tcp_channel_model";

class TcpChannelTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    InProcessShardOptions options;
    options.max_message_bytes = kMaxMessage;
    absl::StatusOr<std::unique_ptr<InProcessShard>> shard =
        StartTestShard(kModel, kHidden, options);
    ASSERT_TRUE(shard.ok()) << shard.status();
    shard_ = shard->release();
    ASSERT_NE(shard_->tcp(), nullptr);
    grpc::ChannelArguments args;
    args.SetMaxReceiveMessageSize(64 << 20);
    channel_ = new std::shared_ptr<grpc::Channel>(grpc::CreateCustomChannel(
        shard_->address(), grpc::InsecureChannelCredentials(), args));
  }
  static void TearDownTestSuite() {
    delete channel_;
    delete shard_;
  }

  // A BF16 request of `tokens` tokens (transport_test_util.h); the payload apart.
  static v1::ForwardRequest Header(int64_t tokens, std::string* payload) {
    return RoutedBf16Header(tokens, kHidden, payload);
  }

  static std::unique_ptr<TcpChannel> OpenChannel() {
    absl::StatusOr<std::unique_ptr<TcpChannel>> c = TcpChannel::Open(channel_->get(), "127.0.0.1");
    EXPECT_TRUE(c.ok()) << c.status();
    return c.ok() ? *std::move(c) : nullptr;
  }

  // A fresh ticket from the gRPC method.
  static std::string Ticket() {
    auto stub = v1::TcpChannelShard::NewStub(*channel_);
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
    v1::OpenTcpChannelResponse r;
    EXPECT_TRUE(stub->OpenTcpChannel(&ctx, v1::OpenTcpChannelRequest(), &r).ok());
    EXPECT_EQ(r.port(), static_cast<uint32_t>(shard_->tcp()->port()));
    EXPECT_EQ(r.ticket().size(), kTcpChannelTicketBytes);
    EXPECT_GT(r.ticket_ttl_ms(), 0u);
    return r.ticket();
  }

  // A raw socket to the channel port (for frames the client library would never send).
  static int RawConnect() {
    const int fd = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    addr.sin_port = htons(static_cast<uint16_t>(shard_->tcp()->port()));
    EXPECT_EQ(connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
    return fd;
  }
  static void Send(int fd, const std::string& bytes) {
    iovec iov{const_cast<char*>(bytes.data()), bytes.size()};
    ASSERT_TRUE(WriteAll(fd, &iov, 1, absl::Now() + absl::Seconds(10)).ok());
  }
  static std::string Hello(const std::string& ticket) {
    return std::string(kTcpChannelMagic, sizeof(kTcpChannelMagic)) + ticket;
  }
  static std::string Prefix(uint32_t word, uint32_t header_len, uint64_t payload_len) {
    uint8_t raw[kTcpPrefixBytes];
    EncodeTcpPrefix({word, header_len, payload_len}, raw);
    return std::string(reinterpret_cast<const char*>(raw), sizeof(raw));
  }
  // Reads one response: its status (with the message) and payload size.
  static absl::Status ReadResponse(int fd, uint64_t* payload_len = nullptr) {
    const absl::Time deadline = absl::Now() + absl::Seconds(10);
    uint8_t raw[kTcpPrefixBytes];
    if (absl::Status s = ReadExactly(fd, raw, sizeof(raw), deadline); !s.ok()) return s;
    const TcpFramePrefix p = DecodeTcpPrefix(raw);
    std::string text(p.header_len, '\0');
    if (absl::Status s = ReadExactly(fd, text.data(), text.size(), deadline); !s.ok()) return s;
    std::string payload(p.payload_len, '\0');
    if (absl::Status s = ReadExactly(fd, payload.data(), payload.size(), deadline); !s.ok()) {
      return s;
    }
    if (payload_len != nullptr) *payload_len = p.payload_len;
    return p.word == 0 ? absl::OkStatus()
                       : absl::Status(static_cast<absl::StatusCode>(p.word), text);
  }
  // Whether the shard has closed `fd` (the next read sees the end of the stream).
  static bool ClosedByShard(int fd) {
    char byte;
    return ReadExactly(fd, &byte, 1, absl::Now() + absl::Seconds(10)).code() ==
           absl::StatusCode::kUnavailable;
  }

  // A fresh channel still gets correct answers.
  static void ExpectStillServing() {
    std::unique_ptr<TcpChannel> c = OpenChannel();
    ASSERT_NE(c, nullptr);
    std::string payload;
    const v1::ForwardRequest header = Header(3, &payload);
    std::vector<uint8_t> out(3 * kHidden * 4);
    EXPECT_TRUE(c->Forward(header, payload, absl::MakeSpan(out)).ok());
  }

  static InProcessShard* shard_;
  static std::shared_ptr<grpc::Channel>* channel_;
};

InProcessShard* TcpChannelTest::shard_ = nullptr;
std::shared_ptr<grpc::Channel>* TcpChannelTest::channel_ = nullptr;

TEST_F(TcpChannelTest, SameOutputAsForwardRaw) {
  std::unique_ptr<TcpChannel> c = OpenChannel();
  ASSERT_NE(c, nullptr);
  const uint64_t served_before = shard_->tcp()->served();
  for (int64_t tokens : {1, 5, 300}) {
    SCOPED_TRACE(tokens);
    std::string payload;
    const v1::ForwardRequest header = Header(tokens, &payload);
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(30)));
    absl::StatusOr<RawForwardReply> want = ForwardRaw(channel_->get(), &ctx, header, payload);
    ASSERT_TRUE(want.ok()) << want.status();
    ASSERT_NE(want->output, std::string(want->output.size(), '\0'));
    for (int round = 0; round < 2; ++round) {
      std::vector<uint8_t> out(tokens * kHidden * 4, 0xEE);
      absl::StatusOr<v1::ForwardResponse> got = c->Forward(header, payload, absl::MakeSpan(out));
      ASSERT_TRUE(got.ok()) << got.status();
      EXPECT_EQ(std::string(out.begin(), out.end()), want->output);
      EXPECT_EQ(got->request_id(), 42u);
      EXPECT_EQ(got->map_version(), 1u);
      EXPECT_EQ(got->batch_tokens(), static_cast<uint32_t>(tokens));
      EXPECT_TRUE(got->output().data().empty());
      ASSERT_EQ(got->output().shape_size(), 2);
      EXPECT_EQ(got->output().shape(0), tokens);
    }
  }
  EXPECT_EQ(shard_->tcp()->served() - served_before, 6u);
  EXPECT_GT(shard_->tcp()->buffer_stats().reuses, 0);
  EXPECT_FALSE(c->broken());
}

TEST_F(TcpChannelTest, ConcurrentChannelsGetTheirOwnAnswers) {
  constexpr int kThreads = 8, kCalls = 20;
  // Each thread its own token count, so that a mixed-up answer would have the wrong size.
  std::vector<std::string> want(kThreads);
  for (int i = 0; i < kThreads; ++i) {
    std::string payload;
    const v1::ForwardRequest header = Header(1 + i, &payload);
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(30)));
    absl::StatusOr<RawForwardReply> r = ForwardRaw(channel_->get(), &ctx, header, payload);
    ASSERT_TRUE(r.ok()) << r.status();
    want[i] = r->output;
  }
  std::vector<int> wrong(kThreads, 0);
  std::vector<std::thread> threads;
  for (int i = 0; i < kThreads; ++i) {
    threads.emplace_back([&, i] {
      std::unique_ptr<TcpChannel> c = OpenChannel();
      if (c == nullptr) {
        wrong[i] = kCalls;
        return;
      }
      std::string payload;
      const v1::ForwardRequest header = Header(1 + i, &payload);
      std::vector<uint8_t> out(want[i].size());
      for (int call = 0; call < kCalls; ++call) {
        absl::StatusOr<v1::ForwardResponse> r = c->Forward(header, payload, absl::MakeSpan(out));
        if (!r.ok() || std::string(out.begin(), out.end()) != want[i]) ++wrong[i];
      }
    });
  }
  for (std::thread& t : threads) t.join();
  for (int i = 0; i < kThreads; ++i) EXPECT_EQ(wrong[i], 0) << "thread " << i;
}

TEST_F(TcpChannelTest, TicketsAreSingleUseAndUnforgeable) {
  const std::string ticket = Ticket();
  int fd = RawConnect();
  Send(fd, Hello(ticket));
  EXPECT_TRUE(ReadResponse(fd).ok());
  close(fd);
  for (const std::string& t : {ticket, std::string(kTcpChannelTicketBytes, 'x')}) {
    fd = RawConnect();
    Send(fd, Hello(t));
    const absl::Status s = ReadResponse(fd);
    EXPECT_EQ(s.code(), absl::StatusCode::kPermissionDenied) << s;
    EXPECT_TRUE(ClosedByShard(fd));
    close(fd);
  }
  fd = RawConnect();
  Send(fd, std::string("GET / HTTP/1.1\r\n\r\n") + std::string(64, ' '));
  EXPECT_EQ(ReadResponse(fd).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(ClosedByShard(fd));
  close(fd);
  ExpectStillServing();
}

TEST_F(TcpChannelTest, ValidationErrorsKeepTheConnection) {
  std::unique_ptr<TcpChannel> c = OpenChannel();
  ASSERT_NE(c, nullptr);
  std::string payload;
  const v1::ForwardRequest header = Header(4, &payload);
  std::vector<uint8_t> out(4 * kHidden * 4);
  // A payload shorter than the shape says.
  absl::StatusOr<v1::ForwardResponse> r =
      c->Forward(header, absl::string_view(payload).substr(2), absl::MakeSpan(out));
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << r.status();
  EXPECT_NE(r.status().message().find("hidden_states.data"), std::string::npos) << r.status();
  // An id outside the model's experts.
  v1::ForwardRequest bad_ids = header;
  std::string ids = bad_ids.topk_ids().data();
  const int32_t far = 1000;
  std::memcpy(ids.data(), &far, sizeof(far));
  bad_ids.mutable_topk_ids()->set_data(ids);
  EXPECT_EQ(c->Forward(bad_ids, payload, absl::MakeSpan(out)).status().code(),
            absl::StatusCode::kInvalidArgument);
  // The caller's buffer of the wrong size: refused here, the answer drained.
  std::vector<uint8_t> small(10);
  EXPECT_EQ(c->Forward(header, payload, absl::MakeSpan(small)).status().code(),
            absl::StatusCode::kInvalidArgument);
  // A header that carries the payload itself is refused before sending.
  v1::ForwardRequest inline_data = header;
  inline_data.mutable_hidden_states()->mutable_data()->set_data(payload);
  EXPECT_EQ(c->Forward(inline_data, "", absl::MakeSpan(out)).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_FALSE(c->broken());
  EXPECT_TRUE(c->Forward(header, payload, absl::MakeSpan(out)).ok());
}

TEST_F(TcpChannelTest, UnparsableHeaderKeepsTheConnection) {
  const int fd = RawConnect();
  Send(fd, Hello(Ticket()));
  ASSERT_TRUE(ReadResponse(fd).ok());
  const std::string junk(40, '\xff');
  Send(fd, Prefix(kTcpRequestMagic, static_cast<uint32_t>(junk.size()), 3) + junk + "abc");
  const absl::Status s = ReadResponse(fd);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("not a valid ForwardRequest"), std::string::npos) << s;
  // Still in step: a good request on the same connection.
  std::string payload;
  std::string header;
  ASSERT_TRUE(Header(2, &payload).SerializeToString(&header));
  Send(fd, Prefix(kTcpRequestMagic, static_cast<uint32_t>(header.size()), payload.size()) + header +
               payload);
  uint64_t out_len = 0;
  EXPECT_TRUE(ReadResponse(fd, &out_len).ok());
  EXPECT_EQ(out_len, static_cast<uint64_t>(2 * kHidden * 4));
  close(fd);
}

TEST_F(TcpChannelTest, FramingErrorsEndTheConnection) {
  struct Case {
    std::string frame;
    absl::StatusCode code;
  };
  const Case cases[] = {
      {Prefix(0x12345678, 0, 0), absl::StatusCode::kInvalidArgument},
      {Prefix(kTcpRequestMagic, kTcpMaxHeaderBytes + 1, 0), absl::StatusCode::kResourceExhausted},
      {Prefix(kTcpRequestMagic, 10, kMaxMessage + 1), absl::StatusCode::kResourceExhausted},
      {Prefix(kTcpRequestMagic, 10, ~uint64_t{0}), absl::StatusCode::kResourceExhausted},
  };
  for (const Case& c : cases) {
    const int fd = RawConnect();
    Send(fd, Hello(Ticket()));
    ASSERT_TRUE(ReadResponse(fd).ok());
    Send(fd, c.frame);
    const absl::Status s = ReadResponse(fd);
    EXPECT_EQ(s.code(), c.code) << s;
    EXPECT_TRUE(ClosedByShard(fd));
    close(fd);
  }
  ExpectStillServing();
}

TEST_F(TcpChannelTest, ClientWithoutShardSupportGetsUnimplemented) {
  InProcessShardOptions options;
  options.tcp_channel = false;
  absl::StatusOr<std::unique_ptr<InProcessShard>> plain =
      StartTestShard(kModel, kHidden, options);
  ASSERT_TRUE(plain.ok()) << plain.status();
  auto ch = grpc::CreateChannel((*plain)->address(), grpc::InsecureChannelCredentials());
  absl::StatusOr<std::unique_ptr<TcpChannel>> c = TcpChannel::Open(ch.get(), "127.0.0.1");
  EXPECT_EQ(c.status().code(), absl::StatusCode::kUnimplemented) << c.status();
}

TEST_F(TcpChannelTest, StopClosesOpenConnections) {
  absl::StatusOr<std::unique_ptr<InProcessShard>> own = StartTestShard(kModel, kHidden);
  ASSERT_TRUE(own.ok()) << own.status();
  auto ch = grpc::CreateChannel((*own)->address(), grpc::InsecureChannelCredentials());
  absl::StatusOr<std::unique_ptr<TcpChannel>> c = TcpChannel::Open(ch.get(), "127.0.0.1");
  ASSERT_TRUE(c.ok()) << c.status();
  std::string payload;
  const v1::ForwardRequest header = Header(2, &payload);
  std::vector<uint8_t> out(2 * kHidden * 4);
  ASSERT_TRUE((*c)->Forward(header, payload, absl::MakeSpan(out)).ok());
  EXPECT_EQ((*own)->tcp()->open_connections(), 1u);
  (*own)->tcp()->Stop();  // returns with the idle connection closed and its thread joined
  EXPECT_EQ((*own)->tcp()->open_connections(), 0u);
  EXPECT_EQ((*c)->Forward(header, payload, absl::MakeSpan(out)).status().code(),
            absl::StatusCode::kUnavailable);
  EXPECT_TRUE((*c)->broken());
}

// A shard whose connection threads poll for the next request (TcpChannelOptions::spin): answers
// are the same, and Stop ends a connection whose thread is polling.
TEST_F(TcpChannelTest, SpinningConnectionsServeAndStop) {
  InProcessShardOptions options;
  options.tcp_channel_spin = absl::Seconds(10);  // longer than the test: always polling
  absl::StatusOr<std::unique_ptr<InProcessShard>> own = StartTestShard(kModel, kHidden, options);
  ASSERT_TRUE(own.ok()) << own.status();
  auto ch = grpc::CreateChannel((*own)->address(), grpc::InsecureChannelCredentials());
  absl::StatusOr<std::unique_ptr<TcpChannel>> c = TcpChannel::Open(ch.get(), "127.0.0.1");
  ASSERT_TRUE(c.ok()) << c.status();
  std::unique_ptr<TcpChannel> plain = OpenChannel();
  ASSERT_NE(plain, nullptr);
  std::string payload;
  const v1::ForwardRequest header = Header(3, &payload);
  std::vector<uint8_t> want(3 * kHidden * 4), out(want.size());
  ASSERT_TRUE(plain->Forward(header, payload, absl::MakeSpan(want)).ok());
  for (int round = 0; round < 3; ++round) {
    ASSERT_TRUE((*c)->Forward(header, payload, absl::MakeSpan(out)).ok());
    EXPECT_EQ(out, want);
  }
  const absl::Time start = absl::Now();
  (*own)->tcp()->Stop();
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));  // not the 10 s of polling
  EXPECT_EQ((*own)->tcp()->open_connections(), 0u);
  EXPECT_EQ((*c)->Forward(header, payload, absl::MakeSpan(out)).status().code(),
            absl::StatusCode::kUnavailable);
}

}  // namespace
}  // namespace moe
