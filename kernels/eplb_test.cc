#include "kernels/eplb.h"

#include <cstdint>
#include <functional>
#include <limits>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace moe {
namespace {

using ::testing::ElementsAre;
using ::testing::ElementsAreArray;

constexpr absl::StatusCode kInvalid = absl::StatusCode::kInvalidArgument;

template <typename T>
TensorView View(DType dtype, Shape shape, std::vector<T>& v) {
  return MakeView(dtype, std::move(shape), v.data());
}

// Slots: 0 -> e1, 1 -> e0, 2 -> e2, 3 -> e1, 4 -> e0, 5 -> e2, 6 -> e2, 7 -> e0.
// Expert 0: slots {1, 4, 7} (3 replicas); expert 1: {0, 3} (2); expert 2: {2, 5, 6} (3).
const std::vector<int32_t> kP2L = {1, 0, 2, 1, 0, 2, 2, 0};

// value() aborts the test binary if Create rejects the placement.
LayerPlacement Placement() { return LayerPlacement::Create(kP2L, 3).value(); }

TEST(LayerPlacementTest, CreateBuildsAscendingPaddedRows) {
  const LayerPlacement p = Placement();
  EXPECT_EQ(p.num_logical(), 3);
  EXPECT_EQ(p.num_physical(), 8);
  EXPECT_EQ(p.max_replicas(), 3);
  EXPECT_THAT(p.logical_to_physical(), ElementsAre(1, 4, 7,    // expert 0
                                                   0, 3, -1,   // expert 1, padded
                                                   2, 5, 6));  // expert 2
  EXPECT_THAT(p.replica_count(), ElementsAre(3, 2, 3));
  EXPECT_THAT(p.physical_to_logical(), ElementsAreArray(kP2L));
}

TEST(LayerPlacementTest, Identity) {
  const LayerPlacement p = LayerPlacement::Identity(4);
  EXPECT_EQ(p.num_logical(), 4);
  EXPECT_EQ(p.num_physical(), 4);
  EXPECT_EQ(p.max_replicas(), 1);
  EXPECT_THAT(p.logical_to_physical(), ElementsAre(0, 1, 2, 3));
  EXPECT_THAT(p.replica_count(), ElementsAre(1, 1, 1, 1));
  EXPECT_THAT(p.physical_to_logical(), ElementsAre(0, 1, 2, 3));
  for (uint32_t h : {0u, 1u, 2654435769u, 0xFFFFFFFFu}) EXPECT_EQ(p.MapToPhysical(2, h), 2);
}

TEST(LayerPlacementTest, VacantSlotsHoldNothingAndAreNeverChosen) {
  // Slots 1 and 4 are vacant: expert 0 keeps slots {0, 3}, expert 1 only slot 2.
  const std::vector<int32_t> p2l = {0, -1, 1, 0, -1};
  absl::StatusOr<LayerPlacement> p = LayerPlacement::Create(p2l, 2);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_THAT(p->replica_count(), ElementsAre(2, 1));
  EXPECT_THAT(p->logical_to_physical(), ElementsAre(0, 3, 2, -1));
  // h even -> replica 0, odd -> replica 1 for expert 0; expert 1 always slot 2.
  EXPECT_EQ(p->MapToPhysical(0, 4), 0);
  EXPECT_EQ(p->MapToPhysical(0, 7), 3);
  EXPECT_EQ(p->MapToPhysical(1, 7), 2);
  // Only vacant slots for an expert: it has no slot.
  EXPECT_EQ(LayerPlacement::Create(std::vector<int32_t>{0, -1}, 2).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(LayerPlacementTest, CreateRejectsBadInputs) {
  const std::vector<std::pair<std::vector<int32_t>, int32_t>> bad = {
      {{0, 1}, 0},      // no logical experts
      {{0, 1}, -2},     // negative count
      {{}, 1},          // expert 0 has no slot
      {{0, -2, 1}, 2},  // negative entry other than -1 (vacant)
      {{0, 2, 1}, 2},   // entry >= E
      {{0, 0, 2}, 3},   // expert 1 missing
  };
  for (const auto& [p2l, num_logical] : bad) {
    EXPECT_EQ(LayerPlacement::Create(p2l, num_logical).status().code(), kInvalid)
        << "E=" << num_logical << " P=" << p2l.size();
  }
}

TEST(ReplicaHashTest, HandValues) {
  // h = t * 2654435769 mod 2^32.
  EXPECT_EQ(ReplicaHash(0), 0u);
  EXPECT_EQ(ReplicaHash(1), 2654435769u);
  EXPECT_EQ(ReplicaHash(2), 1013904242u);  // 5308871538 - 4294967296
  EXPECT_EQ(ReplicaHash(3), 3668340011u);  // 7963307307 - 4294967296
  EXPECT_EQ(ReplicaHash(4), 2027808484u);  // 10617743076 - 2 * 4294967296
  EXPECT_EQ(ReplicaHash(5), 387276957u);   // 13272178845 - 3 * 4294967296
}

// Replica indices of the hand hashes (h mod 2 and h mod 3, from the digit sums for mod 3):
//   t: 0  1  2  3  4  5
//   2: 0  1  0  1  0  1
//   3: 0  0  2  2  1  0
TEST(LayerPlacementTest, MapToPhysicalHandValues) {
  const LayerPlacement p = Placement();
  const uint32_t h[] = {0u, 2654435769u, 1013904242u, 3668340011u, 2027808484u, 387276957u};
  const int32_t expert0[] = {1, 1, 7, 7, 4, 1};  // slots {1, 4, 7}[h mod 3]
  const int32_t expert1[] = {0, 3, 0, 3, 0, 3};  // slots {0, 3}[h mod 2]
  const int32_t expert2[] = {2, 2, 6, 6, 5, 2};  // slots {2, 5, 6}[h mod 3]
  for (int t = 0; t < 6; ++t) {
    EXPECT_EQ(p.MapToPhysical(0, h[t]), expert0[t]) << "t=" << t;
    EXPECT_EQ(p.MapToPhysical(1, h[t]), expert1[t]) << "t=" << t;
    EXPECT_EQ(p.MapToPhysical(2, h[t]), expert2[t]) << "t=" << t;
  }
  EXPECT_EQ(p.MapToPhysical(-1, 0), -1);
  EXPECT_EQ(p.MapToPhysical(3, 0), -1);
  EXPECT_EQ(LayerPlacement().MapToPhysical(0, 0), -1);  // empty placement
}

TEST(MapLogicalToPhysicalTest, RowIndexIsTheTokenByDefault) {
  const LayerPlacement p = Placement();
  // Every token routes to experts 0, 1, 2: all three slots of a token share its h.
  std::vector<int32_t> ids = {0, 1, 2, 0, 1, 2, 0, 1, 2, 0, 1, 2};
  std::vector<int32_t> out(12, -9);
  ASSERT_TRUE(MapLogicalToPhysical(p, View(DType::kI32, {4, 3}, ids), TensorView(),
                                   View(DType::kI32, {4, 3}, out))
                  .ok());
  EXPECT_THAT(out, ElementsAre(1, 0, 2,    // t = 0
                               1, 3, 2,    // t = 1
                               7, 0, 6,    // t = 2
                               7, 3, 6));  // t = 3
}

TEST(MapLogicalToPhysicalTest, TokenIndicesAndI64Ids) {
  const LayerPlacement p = Placement();
  // clang-format off
  std::vector<int64_t> ids = {0, 1, 2,                   // token 4
                              0, 1, 2,                   // token 5
                              2, -1, 3,                  // token 2
                              int64_t{1} << 33, -7, 1};  // token 3
  // clang-format on
  std::vector<int64_t> token_indices = {4, 5, 2, 3};
  std::vector<int32_t> out(12, -9);
  ASSERT_TRUE(MapLogicalToPhysical(p, View(DType::kI64, {4, 3}, ids),
                                   View(DType::kI64, {4}, token_indices),
                                   View(DType::kI32, {4, 3}, out))
                  .ok());
  EXPECT_THAT(out, ElementsAre(4, 0, 5,      // t = 4: mod 3 = 1, mod 2 = 0
                               1, 3, 2,      // t = 5: mod 3 = 0, mod 2 = 1
                               6, -1, -1,    // t = 2: -1 and E = 3 map to -1
                               -1, -1, 3));  // t = 3: 2^33 and -7 map to -1
}

TEST(MapLogicalToPhysicalTest, AllSlotsOfATokenShareTheHash) {
  const LayerPlacement p = Placement();
  // Token 2 (h mod 3 = 2): every route to expert 0 takes slot 7, every route to expert 2 slot 6.
  std::vector<int32_t> ids = {0, 0, 2, 2};
  std::vector<int64_t> token = {2};
  std::vector<int32_t> out(4, -9);
  ASSERT_TRUE(MapLogicalToPhysical(p, View(DType::kI32, {1, 4}, ids), View(DType::kI64, {1}, token),
                                   View(DType::kI32, {1, 4}, out))
                  .ok());
  EXPECT_THAT(out, ElementsAre(7, 7, 6, 6));
}

TEST(MapLogicalToPhysicalTest, EverySlotHoldsItsLogicalExpert) {
  // 40 slots over 16 experts (24 replicas spread unevenly), many tokens: the chosen slot always
  // holds the routed expert, and every replica of a replicated expert gets used.
  std::vector<int32_t> p2l(40);
  for (int32_t s = 0; s < 40; ++s) p2l[s] = s < 16 ? 15 - s : (s * 7) % 5;
  const LayerPlacement p = LayerPlacement::Create(p2l, 16).value();
  const int64_t tokens = 300, top_k = 4;
  std::vector<int32_t> ids(tokens * top_k), out(tokens * top_k);
  for (int64_t i = 0; i < tokens * top_k; ++i) ids[i] = static_cast<int32_t>((i * 5 + i / 7) % 16);
  ASSERT_TRUE(MapLogicalToPhysical(p, View(DType::kI32, {tokens, top_k}, ids), TensorView(),
                                   View(DType::kI32, {tokens, top_k}, out))
                  .ok());
  std::vector<int> used(40, 0);
  for (int64_t i = 0; i < tokens * top_k; ++i) {
    ASSERT_GE(out[i], 0);
    ASSERT_LT(out[i], 40);
    EXPECT_EQ(p2l[out[i]], ids[i]) << "i=" << i;
    ++used[out[i]];
  }
  for (int32_t s = 0; s < 40; ++s) EXPECT_GT(used[s], 0) << "slot " << s << " never chosen";
}

TEST(MapLogicalToPhysicalTest, ZeroTokens) {
  std::vector<int32_t> none;
  EXPECT_TRUE(MapLogicalToPhysical(Placement(), View(DType::kI32, {0, 2}, none), TensorView(),
                                   View(DType::kI32, {0, 2}, none))
                  .ok());
}

TEST(MapLogicalToPhysicalTest, InvalidArguments) {
  const LayerPlacement p = Placement();
  std::vector<int32_t> ids(6), out(6);
  std::vector<float> f32(6);
  std::vector<int64_t> out64(6), indices = {0, 1}, negative = {0, -1}, short_indices = {0};
  std::vector<int32_t> indices32 = {0, 1};
  struct Case {
    const char* what;
    TensorView ids, indices, out;
  };
  const Case cases[] = {
      {"ids F32", View(DType::kF32, {2, 3}, f32), TensorView(), View(DType::kI32, {2, 3}, out)},
      {"ids rank 1", View(DType::kI32, {6}, ids), TensorView(), View(DType::kI32, {2, 3}, out)},
      {"out I64", View(DType::kI32, {2, 3}, ids), TensorView(), View(DType::kI64, {2, 3}, out64)},
      {"out shape", View(DType::kI32, {2, 3}, ids), TensorView(), View(DType::kI32, {3, 2}, out)},
      {"out null", View(DType::kI32, {2, 3}, ids), TensorView(),
       MakeView<int32_t>(DType::kI32, {2, 3}, nullptr)},
      {"indices I32", View(DType::kI32, {2, 3}, ids), View(DType::kI32, {2}, indices32),
       View(DType::kI32, {2, 3}, out)},
      {"indices length", View(DType::kI32, {2, 3}, ids), View(DType::kI64, {1}, short_indices),
       View(DType::kI32, {2, 3}, out)},
      {"negative index", View(DType::kI32, {2, 3}, ids), View(DType::kI64, {2}, negative),
       View(DType::kI32, {2, 3}, out)},
  };
  for (const Case& c : cases) {
    EXPECT_EQ(MapLogicalToPhysical(p, c.ids, c.indices, c.out).code(), kInvalid) << c.what;
  }
  EXPECT_TRUE(MapLogicalToPhysical(p, View(DType::kI32, {2, 3}, ids),
                                   View(DType::kI64, {2}, indices), View(DType::kI32, {2, 3}, out))
                  .ok());
}

// The mapped ids of RowIndexIsTheTokenByDefault plus a padded fourth row and a -1.
std::vector<int32_t> LoadIds() { return {1, 0, 2, 1, 3, 2, 7, -1, 6, 7, 3, 6}; }

TEST(RecordLoadTest, CountsUnpaddedRows) {
  std::vector<int32_t> ids = LoadIds();
  std::vector<int64_t> load(8, 0);
  // Rows 0..2: slot 0 x1, 1 x2, 2 x2, 3 x1, 6 x1, 7 x1; the -1 is skipped; row 3 is padding.
  ASSERT_TRUE(RecordLoad(View(DType::kI32, {4, 3}, ids), 3, {}, absl::MakeSpan(load)).ok());
  EXPECT_THAT(load, ElementsAre(1, 2, 2, 1, 0, 0, 1, 1));
  // Recording adds: all four rows now (row 3 adds 7, 3, 6).
  ASSERT_TRUE(RecordLoad(View(DType::kI32, {4, 3}, ids), 4, {}, absl::MakeSpan(load)).ok());
  EXPECT_THAT(load, ElementsAre(2, 4, 4, 3, 0, 0, 3, 3));
}

TEST(RecordLoadTest, HostedFilterAndShortLoad) {
  std::vector<int32_t> ids = LoadIds();
  const bool hosted[] = {false, true, true, false, false, false, true, false};
  std::vector<int64_t> load(8, 0);
  ASSERT_TRUE(RecordLoad(View(DType::kI32, {4, 3}, ids), 4, hosted, absl::MakeSpan(load)).ok());
  EXPECT_THAT(load, ElementsAre(0, 2, 2, 0, 0, 0, 2, 0));
  // Slots past load.size() are ignored: only 0..3 are counted.
  std::vector<int64_t> short_load(4, 0);
  ASSERT_TRUE(RecordLoad(View(DType::kI32, {4, 3}, ids), 4, {}, absl::MakeSpan(short_load)).ok());
  EXPECT_THAT(short_load, ElementsAre(1, 2, 2, 2));
  // num_unpadded = 0 counts nothing.
  std::vector<int64_t> none(8, 0);
  ASSERT_TRUE(RecordLoad(View(DType::kI32, {4, 3}, ids), 0, {}, absl::MakeSpan(none)).ok());
  EXPECT_THAT(none, ElementsAre(0, 0, 0, 0, 0, 0, 0, 0));
}

TEST(RecordLoadTest, InvalidArguments) {
  std::vector<int32_t> ids = LoadIds();
  std::vector<int64_t> ids64(12), load(8);
  const bool hosted3[] = {true, true, true};
  EXPECT_EQ(RecordLoad(View(DType::kI64, {4, 3}, ids64), 4, {}, absl::MakeSpan(load)).code(),
            kInvalid);
  EXPECT_EQ(RecordLoad(View(DType::kI32, {12}, ids), 4, {}, absl::MakeSpan(load)).code(), kInvalid);
  EXPECT_EQ(RecordLoad(View(DType::kI32, {4, 3}, ids), -1, {}, absl::MakeSpan(load)).code(),
            kInvalid);
  EXPECT_EQ(RecordLoad(View(DType::kI32, {4, 3}, ids), 5, {}, absl::MakeSpan(load)).code(),
            kInvalid);
  EXPECT_EQ(RecordLoad(View(DType::kI32, {4, 3}, ids), 4, hosted3, absl::MakeSpan(load)).code(),
            kInvalid);
  EXPECT_THAT(load, ElementsAre(0, 0, 0, 0, 0, 0, 0, 0));  // rejected calls record nothing
}

TEST(GlobalToLocalTest, MapsAndLeavesInputAlone) {
  // This shard hosts slots 4..7 as local 0..3, and slot 1 as local 4.
  const std::vector<int32_t> expert_map = {-1, 4, -1, -1, 0, 1, 2, 3};
  std::vector<int32_t> physical = {1, 0, 5, 7, -1, 9, 4, 8, 6};
  const std::vector<int32_t> original = physical;
  std::vector<int32_t> local(9, -9);
  ASSERT_TRUE(GlobalToLocal(View(DType::kI32, {3, 3}, physical), expert_map,
                            View(DType::kI32, {3, 3}, local))
                  .ok());
  EXPECT_THAT(local, ElementsAre(4, -1, 1,    // slots 1, 0 (not hosted), 5
                                 3, -1, -1,   // 7, -1, 9 (out of range)
                                 0, -1, 2));  // 4, 8 (out of range), 6
  EXPECT_EQ(physical, original);
}

TEST(GlobalToLocalTest, InvalidArguments) {
  const std::vector<int32_t> expert_map = {0, 1, -1};
  std::vector<int32_t> physical = {0, 1, 2, 0}, local(4), local6(6);
  std::vector<int64_t> local64(4);
  auto in = View(DType::kI32, {2, 2}, physical);
  EXPECT_EQ(GlobalToLocal(in, expert_map, View(DType::kI32, {2, 3}, local6)).code(), kInvalid);
  EXPECT_EQ(GlobalToLocal(in, expert_map, View(DType::kI64, {2, 2}, local64)).code(), kInvalid);
  EXPECT_EQ(GlobalToLocal(View(DType::kI64, {2, 2}, local64), expert_map,
                          View(DType::kI32, {2, 2}, local))
                .code(),
            kInvalid);
  // Writing into the input itself (or an overlapping buffer) would modify it.
  EXPECT_EQ(GlobalToLocal(in, expert_map, in).code(), kInvalid);
  std::vector<int32_t> shared(6, 0);
  EXPECT_EQ(GlobalToLocal(MakeView(DType::kI32, {2, 2}, shared.data()), expert_map,
                          MakeView(DType::kI32, {2, 2}, shared.data() + 2))
                .code(),
            kInvalid);
  const std::vector<int32_t> bad_map = {0, -2, 1};
  EXPECT_EQ(GlobalToLocal(in, bad_map, View(DType::kI32, {2, 2}, local)).code(), kInvalid);
}

TEST(CountTokensPerExpertTest, HandCounts) {
  std::vector<int32_t> local = {0, 2, -1, 2, 2, 5, 1, -1, 0};
  int32_t counts[3] = {77, 77, 77};  // overwritten, not added to
  ASSERT_TRUE(CountTokensPerExpert(View(DType::kI32, {3, 3}, local), counts).ok());
  EXPECT_THAT(counts, ElementsAre(2, 1, 3));  // 5 and the -1s are skipped
}

TEST(CountTokensPerExpertTest, InvalidArguments) {
  std::vector<int64_t> ids64(4);
  std::vector<int32_t> ids(4);
  int32_t counts[2];
  EXPECT_EQ(CountTokensPerExpert(View(DType::kI64, {2, 2}, ids64), counts).code(), kInvalid);
  EXPECT_EQ(CountTokensPerExpert(View(DType::kI32, {4}, ids), counts).code(), kInvalid);
}

TEST(MaskedAmaxTest, SkipsRowsWithoutRoutes) {
  // Row 1 has no route, so its 1e30 is stale padding and must not count: amax = |-3| = 3.
  std::vector<float> x = {1, -2, 1e30f, 5, -3, 0.5f};
  std::vector<int32_t> ids = {0, -1, -1, -1, 1, 2};
  auto amax = MaskedAmax(View(DType::kF32, {3, 2}, x), View(DType::kI32, {3, 2}, ids));
  ASSERT_TRUE(amax.ok()) << amax.status();
  EXPECT_EQ(*amax, 3.f);
  // No routed row at all: 0.
  std::vector<int32_t> none(6, -1);
  amax = MaskedAmax(View(DType::kF32, {3, 2}, x), View(DType::kI32, {3, 2}, none));
  ASSERT_TRUE(amax.ok());
  EXPECT_EQ(*amax, 0.f);
}

TEST(MaskedAmaxTest, Bf16Input) {
  // BF16 bits: 1.0 = 0x3F80, -2.0 = 0xC000, 2^127 = 0x7F00, 5.0 = 0x40A0, -3.5 = 0xC060,
  // 0.5 = 0x3F00. Rows: [1, -2] routed, [2^127, 5] not routed, [-3.5, 0.5] routed -> 3.5.
  std::vector<uint16_t> x = {0x3F80, 0xC000, 0x7F00, 0x40A0, 0xC060, 0x3F00};
  std::vector<int32_t> ids = {-1, 3, -1, -1, 0, -1};
  auto amax = MaskedAmax(View(DType::kBF16, {3, 2}, x), View(DType::kI32, {3, 2}, ids));
  ASSERT_TRUE(amax.ok()) << amax.status();
  EXPECT_EQ(*amax, 3.5f);
}

TEST(MaskedAmaxTest, InvalidArguments) {
  std::vector<float> x(6);
  std::vector<int32_t> x32(6), ids(6);
  std::vector<int64_t> ids64(6);
  struct Case {
    const char* what;
    TensorView x, ids;
  };
  const Case cases[] = {
      {"x I32", View(DType::kI32, {3, 2}, x32), View(DType::kI32, {3, 2}, ids)},
      {"x rank 3", View(DType::kF32, {3, 2, 1}, x), View(DType::kI32, {3, 2}, ids)},
      {"token mismatch", View(DType::kF32, {2, 3}, x), View(DType::kI32, {3, 2}, ids)},
      {"ids I64", View(DType::kF32, {3, 2}, x), View(DType::kI64, {3, 2}, ids64)},
      {"ids rank 1", View(DType::kF32, {3, 2}, x), View(DType::kI32, {6}, ids)},
  };
  for (const Case& c : cases) {
    EXPECT_EQ(MaskedAmax(c.x, c.ids).status().code(), kInvalid) << c.what;
  }
}

TEST(MaskedAmaxBatchedTest, SkipsRowsPastCount) {
  // x [2 experts, capacity 3, H 2]; expert 0 received 1 row, expert 1 received 2.
  std::vector<float> x = {0.5f,  -1.5f,   // e0 r0: counted
                          9e9f,  1.f,     // e0 r1: stale
                          -8e9f, 0.f,     // e0 r2: stale
                          2.f,   -2.25f,  // e1 r0: counted
                          1.f,   0.f,     // e1 r1: counted
                          -7e9f, 3.f};    // e1 r2: stale
  const int32_t counts[] = {1, 2};
  auto amax = MaskedAmaxBatched(View(DType::kF32, {2, 3, 2}, x), counts);
  ASSERT_TRUE(amax.ok()) << amax.status();
  EXPECT_EQ(*amax, 2.25f);
  const int32_t empty[] = {0, 0};
  amax = MaskedAmaxBatched(View(DType::kF32, {2, 3, 2}, x), empty);
  ASSERT_TRUE(amax.ok());
  EXPECT_EQ(*amax, 0.f);
  // BF16: [e0: 0.25 | 2^127], [e1: -6 | 5] with counts {1, 1} -> 6 (bits 0x3E80, 0x7F00, 0xC0C0,
  // 0x40A0).
  std::vector<uint16_t> xb = {0x3E80, 0x7F00, 0xC0C0, 0x40A0};
  const int32_t ones[] = {1, 1};
  amax = MaskedAmaxBatched(View(DType::kBF16, {2, 2, 1}, xb), ones);
  ASSERT_TRUE(amax.ok());
  EXPECT_EQ(*amax, 6.f);
}

TEST(MaskedAmaxBatchedTest, InvalidArguments) {
  std::vector<float> x(12);
  std::vector<int32_t> x32(12);
  const int32_t ok_counts[] = {1, 2};
  const int32_t three[] = {1, 1, 1};
  const int32_t too_many[] = {4, 0};
  const int32_t negative[] = {0, -1};
  EXPECT_TRUE(MaskedAmaxBatched(View(DType::kF32, {2, 3, 2}, x), ok_counts).ok());
  EXPECT_EQ(MaskedAmaxBatched(View(DType::kF32, {2, 3, 2}, x), three).status().code(), kInvalid);
  EXPECT_EQ(MaskedAmaxBatched(View(DType::kF32, {2, 3, 2}, x), too_many).status().code(), kInvalid);
  EXPECT_EQ(MaskedAmaxBatched(View(DType::kF32, {2, 3, 2}, x), negative).status().code(), kInvalid);
  EXPECT_EQ(MaskedAmaxBatched(View(DType::kF32, {6, 2}, x), ok_counts).status().code(), kInvalid);
  EXPECT_EQ(MaskedAmaxBatched(View(DType::kI32, {2, 3, 2}, x32), ok_counts).status().code(),
            kInvalid);
}

}  // namespace
}  // namespace moe
