// End-to-end tests through real processes: a moe_coordinator and two moe_shard processes with two
// redundant EPLB slots, serving checkpoints generated into $TEST_TMPDIR.
//
// WorkloadTest runs the demo's verified workload (client/moectl/workload.h) for the gpt-oss MXFP4
// layout, the ModelOpt NVFP4 layout with a shared expert, and an activation override: every output
// is checked there against the in-process CPU reference, and the coordinator's per-expert load
// against the client's own counts. LoadAccountingTest sends fixed top-k ids with known token
// indices and padding, and checks the coordinator's per-slot load against counts derived by hand
// from the replica rule of numerics.md section 4 and the initial placement rule of
// server/coordinator/placement.h.
#include <cstdint>
#include <cstring>
#include <sstream>
#include <string>
#include <vector>

#include "absl/time/clock.h"
#include "client/client.h"
#include "client/moectl/workload.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "kernels/activation.h"
#include "moe/v1/shard.grpc.pb.h"
#include "server/model/generator.h"
#include "server/model/model_config.h"
#include "tests/local_cluster.h"
#include "tests/test_util.h"

namespace moe::testing {
namespace {

// The shards run the default (optimized) CPU backend, whose contract against the reference is
// 1e-2 (performance.md); it lands near 1e-4. A routing, replica or combine error is O(1), so 1e-3
// still catches every mistake these tests are about.
constexpr double kBackendTolerance = 1e-3;

constexpr absl::Duration kCallDeadline = absl::Seconds(30);

struct WorkloadCase {
  std::string name;
  model::GenerateOptions gen;
  std::string weight_format;  // what GetInfo must report
  ActivationKind activation;  // what the checkpoint's config must resolve to
};

std::vector<WorkloadCase> WorkloadCases() {
  model::GenerateOptions mxfp4;
  mxfp4.format = WeightFormat::kMxfp4;
  mxfp4.seed = 11;
  model::GenerateOptions nvfp4;
  nvfp4.format = WeightFormat::kNvfp4;
  nvfp4.n_shared_experts = 1;
  nvfp4.seed = 12;
  model::GenerateOptions gelu = mxfp4;
  gelu.activation = "gelu_tanh";
  gelu.seed = 13;
  return {{"mxfp4_gpt_oss_swigluoai", mxfp4, "mxfp4", ActivationKind::kSwigluOai},
          {"nvfp4_modelopt_silu_shared", nvfp4, "nvfp4", ActivationKind::kSilu},
          {"mxfp4_gelu_tanh_override", gelu, "mxfp4", ActivationKind::kGeluTanh}};
}

void PrintTo(const WorkloadCase& c, std::ostream* os) { *os << c.name; }

class WorkloadTest : public ::testing::TestWithParam<WorkloadCase> {};

TEST_P(WorkloadTest, OutputsMatchReferenceAndLoadCountsMatchExactly) {
  const WorkloadCase& c = GetParam();
  const std::string model_dir = FreshTestDir(c.name);
  ASSERT_TRUE(model::GenerateModel(c.gen, model_dir).ok());
  absl::StatusOr<model::ModelConfig> config = model::LoadModelConfig(model_dir);
  ASSERT_TRUE(config.ok()) << config.status();
  ASSERT_EQ(config->activation.kind, c.activation);
  ASSERT_EQ(config->n_shared_experts, c.gen.n_shared_experts);

  absl::StatusOr<std::unique_ptr<LocalCluster>> cluster =
      LocalCluster::Start({.model_dir = model_dir, .num_shards = 2, .redundant_slots = 2});
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  for (int rank = 0; rank < 2; ++rank) {
    auto stub = v1::ExpertShard::NewStub(MakeChannel((*cluster)->shard_address(rank)));
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + kCallDeadline));
    v1::ShardInfo info;
    ASSERT_TRUE(stub->GetInfo(&ctx, v1::GetInfoRequest(), &info).ok());
    EXPECT_EQ(info.weight_format(), c.weight_format);
    EXPECT_EQ(info.hosted_slots_size(), 5);  // P = 8 + 2 slots, rank-major over 2 shards
  }

  WorkloadOptions options;
  options.coordinator = (*cluster)->coordinator_address();
  options.model_dir = model_dir;
  options.steps = 12;
  options.tokens = 7;
  options.clients = 2;
  options.seed = 5;
  options.connect_wait = absl::Seconds(30);
  std::ostringstream text;
  absl::StatusOr<WorkloadReport> report = RunWorkload(options, text);
  ASSERT_TRUE(report.ok()) << report.status() << "\n" << text.str();
  EXPECT_EQ(report->calls, 12);
  EXPECT_EQ(report->tokens, 12 * 7);
  EXPECT_TRUE(report->load_counts_match) << text.str();
  EXPECT_LE(report->worst_relative_error, 1e-2);
}

INSTANTIATE_TEST_SUITE_P(Layouts, WorkloadTest, ::testing::ValuesIn(WorkloadCases()),
                         [](const auto& info) { return info.param.name; });

// ---- Load accounting against hand-derived counts ----

// h = (t * 2654435769) mod 2^32 (numerics.md section 4), written out here rather than taken from
// kernels/eplb.h.
uint32_t HandHash(int64_t t) {
  return static_cast<uint32_t>((static_cast<uint64_t>(t) * 2654435769ull) & 0xffffffffull);
}

// The slot a route hits: replica h mod replicas among the expert's slots in ascending order.
int ExpectedSlot(const std::vector<int32_t>& physical_to_logical, int32_t logical, int64_t t) {
  if (logical < 0) return -1;
  std::vector<int> slots;
  for (int p = 0; p < static_cast<int>(physical_to_logical.size()); ++p) {
    if (physical_to_logical[p] == logical) slots.push_back(p);
  }
  return slots[HandHash(t) % slots.size()];
}

TEST(HandHashTest, PinnedValues) {
  // Worked by hand: 2654435769 is odd and divisible by 3 (digit sum 51), and 2^32 = 1 mod 3, so
  // h mod 2 = t mod 2 and h mod 3 = -floor(t * 2654435769 / 2^32) mod 3.
  EXPECT_EQ(HandHash(1), 2654435769u);
  EXPECT_EQ(HandHash(2), 1013904242u);  // 5308871538 - 2^32
  const std::vector<uint32_t> mod3 = {0, 0, 2, 2, 1};
  for (int t = 0; t < 5; ++t) EXPECT_EQ(HandHash(t) % 3, mod3[t]) << "t = " << t;
  for (int t = 0; t < 9; ++t) EXPECT_EQ(HandHash(t) % 2, static_cast<uint32_t>(t % 2));
}

struct Batch {
  int64_t k = 2;
  std::vector<int32_t> ids;      // [T, K] logical, -1 = no route
  std::vector<int64_t> indices;  // [T] token index in the sender's batch
  std::vector<uint8_t> padding;  // [T]
  int64_t tokens() const { return static_cast<int64_t>(padding.size()); }
};

// ids with padded rows set to -1: what the reference computes.
std::vector<int32_t> UnpaddedIds(const Batch& b) {
  std::vector<int32_t> ids = b.ids;
  for (int64_t t = 0; t < b.tokens(); ++t) {
    for (int64_t j = 0; j < b.k; ++j) {
      if (b.padding[t]) ids[t * b.k + j] = -1;
    }
  }
  return ids;
}

// Slot counts the shards hosting `ranks` must record for `b` (padding never counts).
void AddExpectedLoad(const Batch& b, const std::vector<int32_t>& p2l,
                     const std::vector<uint32_t>& slot_to_rank, const std::vector<int>& ranks,
                     std::vector<int64_t>& load) {
  for (int64_t t = 0; t < b.tokens(); ++t) {
    if (b.padding[t]) continue;
    for (int64_t j = 0; j < b.k; ++j) {
      const int slot = ExpectedSlot(p2l, b.ids[t * b.k + j], b.indices[t]);
      if (slot < 0) continue;
      for (int r : ranks) {
        if (slot_to_rank[slot] == static_cast<uint32_t>(r)) ++load[slot];
      }
    }
  }
}

class LoadAccountingTest : public ::testing::Test {
 protected:
  // Generates an MXFP4 model with `experts` experts and starts 2 shards with `redundant` slots.
  void StartCluster(int64_t experts, int redundant, uint64_t seed, int heartbeat_ms = 0) {
    model_dir_ = FreshTestDir("load_model");
    model::GenerateOptions gen;
    gen.experts = experts;
    gen.seed = seed;
    ASSERT_TRUE(model::GenerateModel(gen, model_dir_).ok());
    absl::StatusOr<std::unique_ptr<ReferenceModel>> ref = ReferenceModel::Open(model_dir_);
    ASSERT_TRUE(ref.ok()) << ref.status();
    ref_ = *std::move(ref);
    absl::StatusOr<std::unique_ptr<LocalCluster>> cluster = LocalCluster::Start(
        {.model_dir = model_dir_,
         .num_shards = 2,
         .redundant_slots = redundant,
         .heartbeat_ms = heartbeat_ms,
         // Fast heartbeats must not turn a loaded CI machine's scheduling
         // hiccups into shard removals: allow 1 s of silence, no probes.
         .coordinator_flags = heartbeat_ms > 0 ? std::vector<std::string>{"--missed_heartbeats=50",
                                                                          "--health_checks=false"}
                                               : std::vector<std::string>{}});
    ASSERT_TRUE(cluster.ok()) << cluster.status();
    cluster_ = *std::move(cluster);
    map_ = cluster_->client().cluster_map();
  }

  std::vector<int32_t> MapP2L(int layer) const {
    const auto& p = map_.layers(layer).physical_to_logical();
    return {p.begin(), p.end()};
  }
  std::vector<uint32_t> MapSlotToRank() const {
    return {map_.slot_to_rank().begin(), map_.slot_to_rank().end()};
  }

  // Forward through MoeClient (token index = row); checks the combined output.
  void ForwardThroughClient(int layer, const Batch& b, uint64_t seed) {
    const int64_t h = ref_->config().hidden, t_count = b.tokens();
    const std::vector<float> x = Bf16RoundedNormals(t_count * h, seed);
    const std::vector<float> w = RouteWeights(b);
    ForwardOptions fo;
    fo.is_padding = MakeView(DType::kBool, {t_count}, b.padding.data());
    fo.wire_output_dtype = DType::kF32;
    fo.deadline = kCallDeadline;
    absl::StatusOr<ForwardResult> r =
        cluster_->client().Forward(layer, MakeView(DType::kF32, {t_count, h}, x.data()),
                                   MakeView(DType::kI32, {t_count, b.k}, b.ids.data()),
                                   MakeView(DType::kF32, {t_count, b.k}, w.data()), fo);
    ASSERT_TRUE(r.ok()) << r.status();
    absl::StatusOr<HostTensor> want = ref_->Run(layer, x, UnpaddedIds(b), w, b.k, false);
    ASSERT_TRUE(want.ok()) << want.status();
    EXPECT_LE(RelativeError(r->output.data<float>(), want->data<float>(), t_count * h),
              kBackendTolerance);
  }

  // Sends `b` with explicit token indices straight to shard `rank`; returns its F32 output.
  std::vector<float> ForwardToShard(int rank, int layer, const Batch& b,
                                    const std::vector<float>& x) {
    const int64_t h = ref_->config().hidden, t_count = b.tokens();
    v1::ForwardRequest req;
    req.set_model_fingerprint(map_.model().fingerprint());
    req.set_map_version(map_.version());
    req.set_layer(layer);
    req.set_output_dtype(v1::F32);
    req.mutable_hidden_states()->set_format(v1::ACTIVATION_F32);
    SetWireTensor(req.mutable_hidden_states()->mutable_data(), v1::F32, {t_count, h}, RawBytes(x));
    SetWireTensor(req.mutable_topk_ids(), v1::I32, {t_count, b.k}, RawBytes(b.ids));
    SetWireTensor(req.mutable_topk_weights(), v1::F32, {t_count, b.k}, RawBytes(RouteWeights(b)));
    SetWireTensor(req.mutable_token_indices(), v1::I64, {t_count}, RawBytes(b.indices));
    SetWireTensor(req.mutable_is_padding(), v1::BOOL, {t_count}, RawBytes(b.padding));
    auto stub = v1::ExpertShard::NewStub(MakeChannel(cluster_->shard_address(rank)));
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + kCallDeadline));
    v1::ForwardResponse resp;
    const grpc::Status s = stub->Forward(&ctx, req, &resp);
    EXPECT_TRUE(s.ok()) << s.error_message();
    std::vector<float> out(t_count * h);
    if (s.ok() && resp.output().data().size() == out.size() * sizeof(float)) {
      std::memcpy(out.data(), resp.output().data().data(), resp.output().data().size());
    } else {
      ADD_FAILURE() << "shard " << rank << " answered no F32 [" << t_count << ", " << h << "]";
    }
    return out;
  }

  // Distinct weights per route so a route landing twice or never would show in the output.
  static std::vector<float> RouteWeights(const Batch& b) {
    std::vector<float> w(b.ids.size());
    for (size_t i = 0; i < w.size(); ++i) w[i] = 0.25f + 0.125f * static_cast<float>(i % 5);
    return w;
  }

  void ExpectLoad(int layer, const std::vector<int64_t>& slot_load, const std::vector<int32_t>& p2l,
                  const std::vector<uint32_t>& slot_to_rank) {
    absl::StatusOr<v1::LoadStats> stats = cluster_->client().GetLoadStats(/*refresh=*/true);
    ASSERT_TRUE(stats.ok()) << stats.status();
    ASSERT_GT(stats->layers_size(), layer);
    const v1::LayerLoad& got = stats->layers(layer);
    EXPECT_EQ(std::vector<int64_t>(got.slot_load().begin(), got.slot_load().end()), slot_load);
    const int64_t e_count = ref_->config().num_experts;
    std::vector<int64_t> expert_load(e_count, 0), shard_load(2, 0);
    for (size_t p = 0; p < slot_load.size(); ++p) {
      expert_load[p2l[p]] += slot_load[p];
      shard_load[slot_to_rank[p]] += slot_load[p];
    }
    EXPECT_EQ(std::vector<int64_t>(got.expert_load().begin(), got.expert_load().end()),
              expert_load);
    EXPECT_EQ(std::vector<int64_t>(got.shard_load().begin(), got.shard_load().end()), shard_load);
  }

  std::string model_dir_;
  std::unique_ptr<ReferenceModel> ref_;
  std::unique_ptr<LocalCluster> cluster_;
  v1::ClusterMap map_;
};

TEST_F(LoadAccountingTest, TwoRedundantSlotsHandCounted) {
  ASSERT_NO_FATAL_FAILURE(StartCluster(/*experts=*/8, /*redundant=*/2, /*seed=*/21));
  // P = 10; redundant slot 8 + r holds (r * 8 / 2) mod 8: slot 8 -> expert 0, slot 9 -> expert 4.
  // Rank-major: ceil(10 / 2) = 5 slots per rank.
  const std::vector<int32_t> p2l = {0, 1, 2, 3, 4, 5, 6, 7, 0, 4};
  const std::vector<uint32_t> slot_to_rank = {0, 0, 0, 0, 0, 1, 1, 1, 1, 1};
  ASSERT_EQ(map_.num_physical(), 10u);
  ASSERT_EQ(MapSlotToRank(), slot_to_rank);
  for (int l = 0; l < map_.layers_size(); ++l) ASSERT_EQ(MapP2L(l), p2l);

  // Layer 1 through the client (token index = row). Experts 0 and 4 have two replicas, so even
  // rows take their first slot (0, 4) and odd rows the second (8, 9).
  Batch client_batch;
  client_batch.ids = {0,  4,    // t0: slots 0, 4
                      0,  4,    // t1: slots 8, 9
                      4,  7,    // t2: slots 4, 7
                      0,  1,    // t3: padded
                      5,  -1,   // t4: slot 5
                      0,  6,    // t5: slots 8, 6
                      2,  3,    // t6: padded
                      4,  0,    // t7: slots 9, 8
                      -1, -1};  // t8: no route
  client_batch.padding = {0, 0, 0, 1, 0, 0, 1, 0, 0};
  for (int64_t t = 0; t < 9; ++t) client_batch.indices.push_back(t);
  ASSERT_NO_FATAL_FAILURE(ForwardThroughClient(/*layer=*/1, client_batch, /*seed=*/3));

  // Layer 0 straight to each shard with explicit token indices: each shard counts only the
  // slots it hosts, whatever it was sent.
  Batch direct;
  direct.ids = {0, 4,   // t=1000001 (odd): slots 8, 9 (rank 1)
                0, 4,   // t=6 (even): slots 0, 4 (rank 0)
                4, 2,   // t=3 (odd): slot 9 (rank 1), slot 2 (rank 0)
                7, 5};  // t=10: padded
  direct.indices = {1000001, 6, 3, 10};
  direct.padding = {0, 0, 0, 1};
  const std::vector<float> x = Bf16RoundedNormals(4 * ref_->config().hidden, 4);
  const std::vector<float> out0 = ForwardToShard(0, 0, direct, x);
  const std::vector<float> out1 = ForwardToShard(1, 0, direct, x);
  std::vector<float> combined(out0.size());
  for (size_t i = 0; i < out0.size(); ++i) combined[i] = out0[i] + out1[i];
  absl::StatusOr<HostTensor> want =
      ref_->Run(0, x, UnpaddedIds(direct), RouteWeights(direct), 2, false);
  ASSERT_TRUE(want.ok()) << want.status();
  EXPECT_LE(RelativeError(combined.data(), want->data<float>(), combined.size()),
            kBackendTolerance);
  const int64_t h = ref_->config().hidden;
  for (int64_t j = 0; j < h; ++j) {
    EXPECT_EQ(out1[1 * h + j], 0.f) << "t=6 has no route on rank 1";
    EXPECT_EQ(out0[0 * h + j], 0.f) << "t=1000001 has no route on rank 0";
    EXPECT_EQ(out0[3 * h + j], 0.f) << "padded token";
    EXPECT_EQ(out1[3 * h + j], 0.f) << "padded token";
  }

  ExpectLoad(1, {1, 0, 0, 0, 2, 1, 1, 1, 3, 2}, p2l, slot_to_rank);
  ExpectLoad(0, {1, 0, 1, 0, 1, 0, 0, 0, 1, 2}, p2l, slot_to_rank);
  // The same derivation, done by the rule, agrees with the hand counts above.
  std::vector<int64_t> rule_load(10, 0);
  AddExpectedLoad(direct, p2l, slot_to_rank, {0, 1}, rule_load);
  EXPECT_EQ(rule_load, (std::vector<int64_t>{1, 0, 1, 0, 1, 0, 0, 0, 1, 2}));
}

TEST_F(LoadAccountingTest, ThreeReplicasFollowTheHash) {
  // E = 4 with 8 redundant slots: slot 4 + r holds (r * 4 / 8) mod 4 = 0 0 1 1 2 2 3 3, so every
  // expert has three replicas and the choice is h mod 3.
  ASSERT_NO_FATAL_FAILURE(StartCluster(/*experts=*/4, /*redundant=*/8, /*seed=*/22));
  const std::vector<int32_t> p2l = {0, 1, 2, 3, 0, 0, 1, 1, 2, 2, 3, 3};
  const std::vector<uint32_t> slot_to_rank = {0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1};
  ASSERT_EQ(MapSlotToRank(), slot_to_rank);
  ASSERT_EQ(MapP2L(0), p2l);

  Batch b;  // token t routes to experts t mod 4 and (t + 1) mod 4; token 9 is padding
  for (int t = 0; t < 12; ++t) {
    b.ids.push_back(t % 4);
    b.ids.push_back((t + 1) % 4);
    b.indices.push_back(t);
    b.padding.push_back(t == 9);
  }
  ASSERT_NO_FATAL_FAILURE(ForwardThroughClient(/*layer=*/0, b, /*seed=*/6));
  // Worked by hand from h mod 3 = 0 0 2 2 1 0 0 2 2 - 0 0 for t = 0..11 (expert e's replicas
  // are slots {e, 4 + 2e, 5 + 2e}).
  const std::vector<int64_t> hand = {2, 3, 4, 3, 1, 3, 1, 1, 0, 1, 0, 3};
  std::vector<int64_t> rule(12, 0);
  AddExpectedLoad(b, p2l, slot_to_rank, {0, 1}, rule);
  EXPECT_EQ(rule, hand);
  ExpectLoad(0, hand, p2l, slot_to_rank);
  ExpectLoad(1, std::vector<int64_t>(12, 0), p2l, slot_to_rank);
}

// A refresh must include load whose heartbeat is on the wire at that moment. With 20 ms
// heartbeats a Forward + GetLoadStats(refresh) loop catches a heartbeat in flight every few
// hundred iterations; before the shard's load hand-off lock, the shard answered CollectLoad
// without that delta and the refreshed total came up short.
TEST_F(LoadAccountingTest, RefreshIncludesLoadOfHeartbeatsInFlight) {
  ASSERT_NO_FATAL_FAILURE(StartCluster(/*experts=*/8, /*redundant=*/2, /*seed=*/23,
                                       /*heartbeat_ms=*/20));
  const int64_t h = ref_->config().hidden;
  Batch b;  // 8 tokens, 2 routes each, never padded
  for (int t = 0; t < 8; ++t) {
    b.ids.push_back(t);
    b.ids.push_back((t + 3) % 8);
    b.indices.push_back(t);
    b.padding.push_back(0);
  }
  const std::vector<float> x = Bf16RoundedNormals(8 * h, 7);
  const std::vector<float> w = RouteWeights(b);
  int64_t routes = 0;
  int compared = 0;
  for (int i = 0; i < 400; ++i) {
    ForwardOptions fo;
    fo.deadline = kCallDeadline;
    absl::StatusOr<ForwardResult> r = cluster_->client().Forward(
        0, MakeView(DType::kF32, {8, h}, x.data()), MakeView(DType::kI32, {8, 2}, b.ids.data()),
        MakeView(DType::kF32, {8, 2}, w.data()), fo);
    ASSERT_TRUE(r.ok()) << r.status();
    routes += 16;
    absl::StatusOr<v1::LoadStats> stats = cluster_->client().GetLoadStats(/*refresh=*/true);
    ASSERT_TRUE(stats.ok()) << stats.status();
    // A shard the coordinator thought silent for 3 intervals (a starved machine) is skipped by
    // the refresh by design; its counts arrive later, so only iterations with both alive count.
    bool all_alive = stats->shards_size() == 2;
    for (const v1::ShardLoad& s : stats->shards()) all_alive = all_alive && s.alive();
    if (!all_alive) continue;
    ++compared;
    ASSERT_EQ(stats->total_routes(), routes) << "iteration " << i;
  }
  EXPECT_GT(compared, 0);
}

}  // namespace
}  // namespace moe::testing
