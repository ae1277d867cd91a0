#include "kernels/launch.h"

#include <cstdint>

#include "gtest/gtest.h"

namespace moe {
namespace {

struct LimitCase {
  int64_t experts;
  int64_t top_k;
  int64_t expected;
};

TEST(MaxTokensPerLaunchTest, HandValues) {
  const LimitCase cases[] = {
      {128, 4, 130814},  // (65535 - 128) * 8 / 4 = 65407 * 2
      {256, 8, 65279},   // (65535 - 256) * 8 / 8 = 65279
      {8, 1, 300000},    // (65535 - 8) * 8 = 524216, capped at 300000
      {64, 2, 261884},   // (65535 - 64) * 8 / 2 = 65471 * 4
      {384, 8, 65151},   // (65535 - 384) = 65151
      {32, 3, 174674},   // 65503 * 8 = 524024, / 3 = 174674.67 -> 174674
      {65535, 1, 1},     // (65535 - 65535) * 8 = 0 -> at least 1
      {70000, 4, 1},     // negative -> at least 1
      {65534, 16, 1},    // 1 * 8 / 16 = 0 -> at least 1
  };
  for (const LimitCase& c : cases) {
    EXPECT_EQ(MaxTokensPerLaunch(c.experts, c.top_k), c.expected)
        << "E=" << c.experts << " K=" << c.top_k;
  }
}

// Checks that `chunks` tile [0, num_tokens) in order, without gaps or overlap, each chunk non-empty
// and at most `limit` long, all but the last exactly `limit` long.
void ExpectTiling(const std::vector<std::pair<int64_t, int64_t>>& chunks, int64_t num_tokens,
                  int64_t limit) {
  int64_t next = 0;
  for (size_t i = 0; i < chunks.size(); ++i) {
    EXPECT_EQ(chunks[i].first, next) << "chunk " << i;
    EXPECT_LT(chunks[i].first, chunks[i].second) << "chunk " << i;
    EXPECT_LE(chunks[i].second - chunks[i].first, limit) << "chunk " << i;
    if (i + 1 < chunks.size()) {
      EXPECT_EQ(chunks[i].second - chunks[i].first, limit);
    }
    next = chunks[i].second;
  }
  EXPECT_EQ(next, num_tokens);
}

TEST(SplitIntoLaunchChunksTest, CoversExactly) {
  const int64_t experts = 256, top_k = 8, limit = 65279;
  struct Case {
    int64_t tokens;
    size_t num_chunks;
  };
  const Case cases[] = {
      {0, 0}, {1, 1}, {limit, 1}, {limit + 1, 2}, {10 * limit + 3, 11},
  };
  for (const Case& c : cases) {
    const auto chunks = SplitIntoLaunchChunks(c.tokens, experts, top_k);
    EXPECT_EQ(chunks.size(), c.num_chunks) << "T=" << c.tokens;
    ExpectTiling(chunks, c.tokens, limit);
  }
}

TEST(SplitIntoLaunchChunksTest, ExplicitBoundaries) {
  // E = 128, K = 4: limit 130814; T = 2 * 130814 + 5 = 261633.
  const auto chunks = SplitIntoLaunchChunks(261633, 128, 4);
  ASSERT_EQ(chunks.size(), 3u);
  EXPECT_EQ(chunks[0], std::make_pair(int64_t{0}, int64_t{130814}));
  EXPECT_EQ(chunks[1], std::make_pair(int64_t{130814}, int64_t{261628}));
  EXPECT_EQ(chunks[2], std::make_pair(int64_t{261628}, int64_t{261633}));
}

TEST(SplitIntoLaunchChunksTest, CapAppliesToSmallExpertCounts) {
  // E = 8, K = 1: limit 300000; 700000 tokens -> 300000 + 300000 + 100000.
  const auto chunks = SplitIntoLaunchChunks(700000, 8, 1);
  ASSERT_EQ(chunks.size(), 3u);
  EXPECT_EQ(chunks[2], std::make_pair(int64_t{600000}, int64_t{700000}));
  ExpectTiling(chunks, 700000, 300000);
}

TEST(MaxTunedTokensTest, HandValues) {
  EXPECT_EQ(MaxTunedTokens(1024, 4), 8192);   // 4096 < 8192 floor
  EXPECT_EQ(MaxTunedTokens(4096, 2), 8192);   // exactly the floor
  EXPECT_EQ(MaxTunedTokens(4096, 3), 12288);  // 12288 above the floor
  EXPECT_EQ(MaxTunedTokens(16384, 8), 131072);
  EXPECT_EQ(MaxTunedTokens(0, 16), 8192);
}

}  // namespace
}  // namespace moe
