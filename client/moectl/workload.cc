#include "client/moectl/workload.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "client/client.h"
#include "client/moectl/tables.h"
#include "kernels/experts.h"
#include "kernels/formats.h"
#include "server/model/model.h"

namespace moe {
namespace {

constexpr double kMaxRelativeError = 1e-2;

// Everything the workload needs of one layer: full reference weights, router, skew bias.
struct LayerFixture {
  std::unique_ptr<model::LoadedLayer> all_experts;  // identity placement, every expert
  model::RouterWeights router;
  std::vector<float> skew_bias;  // [E]
};

struct Totals {
  absl::Mutex mu;
  std::vector<double> latencies_us;
  std::vector<absl::Time> starts;  // each call's start, in latencies_us's order
  double worst = 0;
  int64_t calls = 0, tokens = 0;
  std::vector<std::vector<int64_t>> expected_load;  // [L][E]
  absl::Status first_error;
};

double RelativeError(const HostTensor& out, const HostTensor& ref) {
  double num = 0, den = 0;
  for (int64_t i = 0; i < ref.NumElements(); ++i) {
    const double d = static_cast<double>(out.data<float>()[i]) - ref.data<float>()[i];
    num += d * d;
    den += static_cast<double>(ref.data<float>()[i]) * ref.data<float>()[i];
  }
  if (std::isnan(num)) return INFINITY;
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

// logits = x @ W^T + skew (router bias is applied by Route itself).
HostTensor Logits(const HostTensor& x, const LayerFixture& f, int64_t e_count) {
  const int64_t t_count = x.shape()[0], h = x.shape()[1];
  HostTensor logits(DType::kF32, {t_count, e_count});
  for (int64_t t = 0; t < t_count; ++t) {
    for (int64_t e = 0; e < e_count; ++e) {
      const float* w = f.router.weight.data<float>() + e * h;
      const float* xr = x.data<float>() + t * h;
      double acc = 0;
      for (int64_t j = 0; j < h; ++j) acc += static_cast<double>(w[j]) * xr[j];
      logits.data<float>()[t * e_count + e] = static_cast<float>(acc) + f.skew_bias[e];
    }
  }
  return logits;
}

absl::Status OneStep(MoeClient& client, const model::ExpertModel& m,
                     const std::vector<LayerFixture>& fixtures, const WorkloadOptions& o, int step,
                     std::mt19937_64& rng, Totals& totals) {
  const model::ModelConfig& cfg = m.config();
  const int layer = step % static_cast<int>(fixtures.size());
  const LayerFixture& f = fixtures[layer];
  const int64_t t_count = o.tokens, h = cfg.hidden;
  std::normal_distribution<float> normal(0.f, 1.f);
  std::uniform_real_distribution<double> uni(0, 1);
  HostTensor x(DType::kF32, {t_count, h}), padding(DType::kBool, {t_count});
  // Inputs rounded to BF16 up front: that is what crosses the wire, so the reference sees it too.
  for (int64_t i = 0; i < t_count * h; ++i) {
    x.data<float>()[i] = Bf16ToFloat(FloatToBf16(normal(rng)));
  }
  for (int64_t t = 0; t < t_count; ++t) padding.data<bool>()[t] = uni(rng) < o.padding_fraction;
  HostTensor ids, weights;
  HostTensor logits = Logits(x, f, cfg.num_experts);
  if (absl::Status s = MoeClient::RouteLogits(f.router.Params(cfg), logits.view(), ids, weights);
      !s.ok()) {
    return s;
  }
  ForwardOptions fo;
  fo.raw_transport = o.raw_transport;
  fo.tcp_channel = o.tcp_channel;
  fo.is_padding = padding.view();
  fo.shared_experts = cfg.n_shared_experts > 0;
  const absl::Time start = absl::Now();
  absl::StatusOr<ForwardResult> result =
      client.Forward(layer, x.view(), ids.view(), weights.view(), fo);
  const double us = absl::ToDoubleMicroseconds(absl::Now() - start);
  if (!result.ok()) return result.status();
  double err = 0;
  const int64_t k = ids.shape()[1];
  HostTensor local(DType::kI32, {t_count, k}), mask(DType::kBool, {t_count});
  for (int64_t t = 0; t < t_count; ++t) {
    mask.data<bool>()[t] = !padding.data<bool>()[t];
    for (int64_t j = 0; j < k; ++j) {
      local.data<int32_t>()[t * k + j] =
          padding.data<bool>()[t] ? -1 : ids.data<int32_t>()[t * k + j];
    }
  }
  if (o.verify) {
    HostTensor ref(DType::kF32, {t_count, h});
    ExpertsRequest req{x.view(), local.view(), weights.view(),
                       fo.shared_experts ? mask.view() : TensorView{}, ref.view()};
    if (absl::Status s = RunExpertsReference(f.all_experts->layer(), req); !s.ok()) return s;
    err = RelativeError(result->output, ref);
    if (!(err <= kMaxRelativeError)) {
      return absl::InternalError(absl::StrFormat(
          "layer %d step %d: relative error %.3g against the CPU reference exceeds %.0e", layer,
          step, err, kMaxRelativeError));
    }
  }
  absl::MutexLock lock(&totals.mu);
  totals.latencies_us.push_back(us);
  totals.starts.push_back(start);
  totals.worst = std::max(totals.worst, err);
  totals.calls += 1;
  totals.tokens += t_count;
  for (int64_t i = 0; i < t_count * k; ++i) {
    const int32_t id = local.data<int32_t>()[i];
    if (id >= 0) totals.expected_load[layer][id] += 1;
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<LayerFixture>> LoadFixtures(const model::ExpertModel& m,
                                                       const WorkloadOptions& o) {
  const int64_t e_count = m.config().num_experts;
  std::vector<int32_t> identity(e_count);
  std::iota(identity.begin(), identity.end(), 0);
  std::vector<LayerFixture> fixtures(m.num_moe_layers());
  std::mt19937_64 rng(o.seed ^ 0x5eed);
  for (int64_t l = 0; l < m.num_moe_layers(); ++l) {
    absl::StatusOr<std::unique_ptr<model::LoadedLayer>> layer = m.LoadLayer(l, identity);
    if (!layer.ok()) return layer.status();
    fixtures[l].all_experts = *std::move(layer);
    absl::StatusOr<model::RouterWeights> router = m.LoadRouter(l);
    if (!router.ok()) return router.status();
    fixtures[l].router = *std::move(router);
    // Zipf-like popularity: the expert of rank r (a random order per layer) gets -skew*log(r+1).
    std::vector<int> order(e_count);
    std::iota(order.begin(), order.end(), 0);
    std::shuffle(order.begin(), order.end(), rng);
    fixtures[l].skew_bias.assign(e_count, 0.f);
    for (int64_t r = 0; r < e_count; ++r) {
      fixtures[l].skew_bias[order[r]] = static_cast<float>(-o.skew * std::log(r + 1.0));
    }
  }
  return fixtures;
}

double Percentile(std::vector<double> v, double q) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, static_cast<size_t>(q * (v.size() - 1) + 0.5))];
}

// Exact comparison of the coordinator's per-expert counts with the client's.
bool LoadMatches(const v1::LoadStats& stats, const Totals& totals, std::ostream& out) {
  bool ok = stats.layers_size() == static_cast<int>(totals.expected_load.size());
  for (int l = 0; ok && l < stats.layers_size(); ++l) {
    const auto& got = stats.layers(l).expert_load();
    const auto& want = totals.expected_load[l];
    ok = got.size() == static_cast<int>(want.size()) &&
         std::equal(want.begin(), want.end(), got.begin());
    if (!ok) out << "load mismatch in layer " << l << "\n";
  }
  return ok;
}

}  // namespace

absl::StatusOr<WorkloadReport> RunWorkload(const WorkloadOptions& o, std::ostream& out) {
  absl::StatusOr<std::unique_ptr<model::ExpertModel>> m = model::ExpertModel::Open(o.model_dir);
  if (!m.ok()) return m.status();
  absl::StatusOr<std::vector<LayerFixture>> fixtures = LoadFixtures(**m, o);
  if (!fixtures.ok()) return fixtures.status();
  ClientOptions client_options;
  client_options.coordinator = o.coordinator;
  client_options.watch_map = o.watch_map;
  absl::StatusOr<std::unique_ptr<MoeClient>> client =
      MoeClient::Connect(client_options, o.connect_wait);
  if (!client.ok()) return client.status();
  // Counts before the run, so a cluster that already served traffic can be checked too.
  absl::StatusOr<v1::LoadStats> before = (*client)->GetLoadStats(/*refresh=*/true);
  if (!before.ok()) return before.status();
  Totals totals;
  totals.expected_load.assign(fixtures->size(), std::vector<int64_t>((*m)->config().num_experts));
  for (int l = 0; l < before->layers_size() && l < static_cast<int>(fixtures->size()); ++l) {
    for (int e = 0; e < before->layers(l).expert_load_size(); ++e) {
      totals.expected_load[l][e] = before->layers(l).expert_load(e);
    }
  }
  const absl::Time start = absl::Now();
  std::vector<std::thread> threads;
  for (int c = 0; c < o.clients; ++c) {
    threads.emplace_back([&, c] {
      std::mt19937_64 rng(o.seed * 7919 + c);
      for (int step = c; step < o.steps; step += o.clients) {
        absl::Status s = OneStep(**client, **m, *fixtures, o, step, rng, totals);
        if (!s.ok()) {
          absl::MutexLock lock(&totals.mu);
          if (totals.first_error.ok()) totals.first_error = s;
          return;
        }
      }
    });
  }
  for (auto& t : threads) t.join();
  WorkloadReport r;
  r.wall_seconds = absl::ToDoubleSeconds(absl::Now() - start);
  if (!totals.first_error.ok()) return totals.first_error;
  r.calls = totals.calls;
  r.tokens = totals.tokens;
  r.worst_relative_error = totals.worst;
  r.p50_us = Percentile(totals.latencies_us, 0.50);
  r.p90_us = Percentile(totals.latencies_us, 0.90);
  r.p99_us = Percentile(totals.latencies_us, 0.99);
  r.max_us = Percentile(totals.latencies_us, 1.0);
  // The slowest calls and when they started: a stall (a placement switch, a shard restart) shows
  // as several slow calls at one time.
  std::vector<size_t> order(totals.latencies_us.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  const size_t shown = std::min<size_t>(3, order.size());
  std::partial_sort(order.begin(), order.begin() + shown, order.end(), [&](size_t a, size_t b) {
    return totals.latencies_us[a] > totals.latencies_us[b];
  });
  for (size_t i = 0; i < shown; ++i) {
    r.slowest.push_back({totals.latencies_us[order[i]],
                         absl::ToDoubleSeconds(totals.starts[order[i]] - start)});
  }
  absl::StatusOr<v1::LoadStats> stats = (*client)->GetLoadStats(/*refresh=*/true);
  if (!stats.ok()) return stats.status();
  r.load_counts_match = LoadMatches(*stats, totals, out);
  if (o.verify) {
    out << absl::StrFormat(
        "verified %d forwards (%d tokens, %d client threads) against the CPU reference: worst "
        "relative error %.3g (limit %.0e)\n",
        r.calls, r.tokens, o.clients, r.worst_relative_error, kMaxRelativeError);
  } else {
    out << absl::StrFormat("ran %d forwards (%d tokens, %d client threads), outputs not checked\n",
                           r.calls, r.tokens, o.clients);
  }
  out << absl::StrFormat(
      "throughput %.1f forwards/s, %.0f tokens/s; latency p50 %.0f us, p90 %.0f us, p99 %.0f us, "
      "max %.0f us\n",
      r.calls / r.wall_seconds, r.tokens / r.wall_seconds, r.p50_us, r.p90_us, r.p99_us, r.max_us);
  if (!r.slowest.empty()) {
    out << "slowest calls:";
    for (const WorkloadReport::SlowCall& c : r.slowest) {
      out << absl::StrFormat(" %.0f us at %.3f s", c.us, c.at_seconds);
    }
    out << " (after the start)\n";
  }
  out << FormatLoadTable(*stats);
  out << "coordinator load counts "
      << (r.load_counts_match ? "match the client's routed counts exactly\n" : "DO NOT MATCH\n");
  if (!r.load_counts_match) return absl::InternalError("load counts differ");
  return r;
}

}  // namespace moe
