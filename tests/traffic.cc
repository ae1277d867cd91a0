#include "tests/traffic.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace moe::testing {
namespace {

// Poll period of WaitForCalls.
constexpr absl::Duration kPoll = absl::Milliseconds(5);
constexpr double kMaxRelativeError = 1e-2;

}  // namespace

Traffic::Traffic(MoeClient* client, const ReferenceModel* reference, TrafficOptions options)
    : client_(client), reference_(reference), options_(std::move(options)) {
  const int layers = static_cast<int>(reference_->config().num_moe_layers());
  const int experts = static_cast<int>(reference_->config().num_experts);
  std::mt19937_64 rng(options_.seed ^ 0x9e3779b97f4a7c15ull);
  popularity_.resize(layers);
  for (auto& order : popularity_) {
    order.resize(experts);
    std::iota(order.begin(), order.end(), 0);
    std::shuffle(order.begin(), order.end(), rng);
  }
  routed_.assign(layers, std::vector<int64_t>(experts, 0));
}

Traffic::~Traffic() { Stop(); }

void Traffic::Start() {
  for (int t = 0; t < options_.threads; ++t) threads_.emplace_back([this, t] { Run(t); });
}

void Traffic::Stop() {
  stop_.store(true);
  for (std::thread& t : threads_) {
    if (t.joinable()) t.join();
  }
}

bool Traffic::WaitForCalls(int64_t n, absl::Duration timeout) const {
  const absl::Time give_up = absl::Now() + timeout;
  while (finished_.load() < n) {
    if (absl::Now() >= give_up) return false;
    absl::SleepFor(kPoll);
  }
  return true;
}

std::vector<CallRecord> Traffic::records() const {
  absl::MutexLock lock(&mu_);
  return records_;
}

std::vector<std::vector<int64_t>> Traffic::routed() const {
  absl::MutexLock lock(&mu_);
  return routed_;
}

void Traffic::Run(int thread) {
  const int layers = static_cast<int>(popularity_.size());
  std::vector<std::vector<int64_t>> routed(layers, std::vector<int64_t>(popularity_[0].size(), 0));
  for (uint64_t call = 0; !stop_.load(); ++call) {
    CallRecord record;
    absl::Status s = OneCall(thread, call, record, routed);
    record.status = s;
    absl::MutexLock lock(&mu_);
    if (s.ok()) {
      for (int l = 0; l < layers; ++l) {
        for (size_t e = 0; e < routed[l].size(); ++e) routed_[l][e] += routed[l][e];
      }
    }
    for (auto& row : routed) std::fill(row.begin(), row.end(), 0);
    records_.push_back(std::move(record));
    finished_.fetch_add(1);
  }
}

absl::Status Traffic::OneCall(int thread, uint64_t call, CallRecord& record,
                              std::vector<std::vector<int64_t>>& routed) {
  const model::ModelConfig& config = reference_->config();
  const int64_t t_count = options_.tokens, h = config.hidden, k = config.top_k;
  const int experts = static_cast<int>(config.num_experts);
  const uint64_t seed = options_.seed * 1'000'003 + static_cast<uint64_t>(thread) * 65'537 + call;
  std::mt19937_64 rng(seed);
  record.layer = static_cast<int>(call % popularity_.size());
  std::vector<double> weight_of_rank(experts);
  for (int r = 0; r < experts; ++r) weight_of_rank[r] = std::pow(r + 1.0, -options_.skew);
  std::discrete_distribution<int> draw(weight_of_rank.begin(), weight_of_rank.end());
  std::uniform_real_distribution<float> uniform(0.1f, 1.f);
  std::vector<int32_t> ids(t_count * k);
  std::vector<float> weights(t_count * k);
  for (int64_t t = 0; t < t_count; ++t) {
    for (int64_t j = 0; j < k; ++j) {
      int32_t e;
      do {
        e = popularity_[record.layer][draw(rng)];
      } while (std::find(&ids[t * k], &ids[t * k + j], e) != &ids[t * k + j]);
      ids[t * k + j] = e;
      weights[t * k + j] = uniform(rng);
      if (!options_.fragile_experts.empty() && options_.fragile_experts[e]) {
        record.touches_fragile = true;
      }
    }
  }
  const std::vector<float> x = Bf16RoundedNormals(t_count * h, seed);
  ForwardOptions fo;
  fo.deadline = options_.call_deadline;
  record.start = absl::Now();
  absl::StatusOr<ForwardResult> result =
      client_->Forward(record.layer, MakeView(DType::kF32, {t_count, h}, x.data()),
                       MakeView(DType::kI32, {t_count, k}, ids.data()),
                       MakeView(DType::kF32, {t_count, k}, weights.data()), fo);
  record.end = absl::Now();
  if (!result.ok()) return result.status();
  record.attempts = result->attempts;
  record.map_version = result->map_version;
  absl::StatusOr<HostTensor> expected = reference_->Run(record.layer, x, ids, weights, k, false);
  if (!expected.ok()) return expected.status();
  const double error =
      RelativeError(result->output.data<float>(), expected->data<float>(), t_count * h);
  if (!(error <= kMaxRelativeError)) {
    return absl::InternalError(absl::StrCat("layer ", record.layer, ": relative error ", error,
                                            " against the CPU reference"));
  }
  for (int32_t e : ids) ++routed[record.layer][e];
  return absl::OkStatus();
}

double BalancednessOf(const std::vector<int64_t>& load, const std::vector<bool>& include) {
  int64_t max_load = 0, sum = 0, n = 0;
  for (size_t i = 0; i < load.size(); ++i) {
    if (i < include.size() && !include[i]) continue;
    max_load = std::max(max_load, load[i]);
    sum += load[i];
    ++n;
  }
  if (max_load == 0 || n == 0) return 1.0;
  return static_cast<double>(sum) / static_cast<double>(n) / static_cast<double>(max_load);
}

}  // namespace moe::testing
