// TokenTable parsing and the per-method role table of auth.h (the end-to-end checks of the
// processor are in tests/security_test.cc and tests/admission_test.cc).
#include "server/common/auth.h"

#include "gtest/gtest.h"

namespace moe {
namespace {

TEST(TokenTableTest, ParsesRolesNamesAndComments) {
  absl::StatusOr<TokenTable> table = TokenTable::Parse(
      "# role token name\n"
      "frontend abc web-1\n"
      "\n"
      "admin  xyz   # trailing comment\n"
      "internal\tk9\tnodes\r\n");
  ASSERT_TRUE(table.ok()) << table.status();
  EXPECT_EQ(table->size(), 3u);
  ASSERT_NE(table->Find("abc"), nullptr);
  EXPECT_EQ(table->Find("abc")->role, Role::kFrontend);
  EXPECT_EQ(table->Find("abc")->client, "web-1");
  ASSERT_NE(table->Find("xyz"), nullptr);
  EXPECT_EQ(table->Find("xyz")->role, Role::kAdmin);
  EXPECT_EQ(table->Find("xyz")->client, "admin-line4");  // default name: role and line
  ASSERT_NE(table->Find("k9"), nullptr);
  EXPECT_EQ(table->Find("k9")->role, Role::kInternal);
  EXPECT_EQ(table->Find("k9")->client, "nodes");
  EXPECT_EQ(table->Find("ab"), nullptr);
  EXPECT_EQ(table->Find(""), nullptr);
}

TEST(TokenTableTest, RejectsBadLinesWithoutEchoingTokens) {
  absl::StatusOr<TokenTable> bad_role = TokenTable::Parse("frontend a\nroot s3cret\n");
  ASSERT_EQ(bad_role.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad_role.status().message().find("line 2"), absl::string_view::npos);
  EXPECT_EQ(bad_role.status().message().find("s3cret"), absl::string_view::npos);
  absl::StatusOr<TokenTable> duplicate = TokenTable::Parse("admin s3cret\nfrontend s3cret\n");
  ASSERT_EQ(duplicate.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(duplicate.status().message().find("s3cret"), absl::string_view::npos);
  EXPECT_EQ(TokenTable::Parse("admin\n").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(TokenTable::Parse("admin a b c\n").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(TokenTable::Parse("# nothing\n").status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(RequirementTest, MethodTable) {
  struct Case {
    const char* method;
    bool is_public;
    Role role;
  };
  const Case cases[] = {
      {"/moe.v1.ExpertShard/Forward", false, Role::kFrontend},
      {"/moe.v1.ExpertShard/ForwardStream", false, Role::kFrontend},
      {"/moe.v1.ExpertShard/ForwardRaw", false, Role::kFrontend},
      {"/moe.v1.ExpertShard/GetInfo", false, Role::kFrontend},
      {"/moe.v1.ExpertShard/GetStats", false, Role::kFrontend},
      {"/moe.v1.ExpertShard/CollectLoad", false, Role::kInternal},
      {"/moe.v1.SharedMemoryShard/Forward", false, Role::kFrontend},
      {"/moe.v1.SharedMemoryShard/RegisterSharedMemory", false, Role::kFrontend},
      {"/moe.v1.SharedMemoryShard/OpenChannel", false, Role::kFrontend},
      {"/moe.v1.SharedMemoryShard/CloseChannel", false, Role::kFrontend},
      {"/moe.v1.SharedMemoryShard/ForwardCuda", false, Role::kFrontend},
      {"/moe.v1.TcpChannelShard/OpenTcpChannel", false, Role::kFrontend},
      {"/moe.v1.Coordinator/GetClusterMap", false, Role::kFrontend},
      {"/moe.v1.Coordinator/WatchClusterMap", false, Role::kFrontend},
      {"/moe.v1.Coordinator/GetLoadStats", false, Role::kFrontend},
      {"/moe.v1.Coordinator/RegisterShard", false, Role::kInternal},
      {"/moe.v1.Coordinator/Heartbeat", false, Role::kInternal},
      {"/moe.v1.Coordinator/Rebalance", false, Role::kAdmin},
      {"/moe.v1.Coordinator/Drain", false, Role::kAdmin},
      {"/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo", false, Role::kAdmin},
      {"/moe.v1.Coordinator/SomethingNew", false, Role::kAdmin},
      {"", false, Role::kAdmin},
      {"/grpc.health.v1.Health/Check", true, Role::kFrontend},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.method);
    const MethodRequirement r = RequirementOf(c.method);
    EXPECT_EQ(r.public_method, c.is_public);
    if (!c.is_public) {
      EXPECT_EQ(r.role, c.role);
    }
  }
  EXPECT_STREQ(RoleName(Role::kInternal), "internal");
  EXPECT_EQ(*ParseRole("admin"), Role::kAdmin);
}

}  // namespace
}  // namespace moe
