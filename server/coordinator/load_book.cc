#include "server/coordinator/load_book.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <utility>

#include "glog/logging.h"
#include "server/coordinator/placement.h"

namespace moe {

LoadBook::LoadBook(LoadBookOptions options, absl::Time now)
    : options_(std::move(options)), epoch_(now) {
  CHECK_GE(options_.num_layers, 1);
  CHECK_GE(options_.num_logical, 1);
  CHECK_GE(options_.num_physical, 1);
  CHECK_GE(options_.num_shards, 1);
  CHECK_GT(options_.bucket, absl::ZeroDuration());
  CHECK_GT(options_.window, absl::ZeroDuration());
  bucket_ =
      std::max(options_.bucket, absl::Ceil(options_.window / kMaxBuckets, absl::Milliseconds(1)));
  num_buckets_ = static_cast<int>(std::ceil(absl::FDivDuration(options_.window, bucket_)));
  num_buckets_ = std::clamp(num_buckets_, 1, kMaxBuckets);
  const size_t layers = static_cast<size_t>(options_.num_layers);
  slot_.assign(layers * options_.num_physical, 0);
  expert_.assign(layers * options_.num_logical, 0);
  shard_.assign(layers * options_.num_shards, 0);
}

int64_t LoadBook::BucketIndex(absl::Time now) const {
  absl::Duration remainder;  // IDivDuration requires somewhere to write it
  return absl::IDivDuration(std::max(now - epoch_, absl::ZeroDuration()), bucket_, &remainder);
}

LoadBook::Bucket& LoadBook::OpenBucket(absl::Time now) {
  const int64_t index = BucketIndex(now);
  if (buckets_.empty() || buckets_.back().index < index) {
    const size_t layers = static_cast<size_t>(options_.num_layers);
    buckets_.push_back({index, std::vector<int64_t>(layers * options_.num_logical, 0),
                        std::vector<int64_t>(layers * options_.num_shards, 0)});
  }
  // A clock that stepped back keeps filling the newest bucket.
  return buckets_.back();
}

bool LoadBook::Add(int rank, const VersionPlacement& placement, absl::Span<const int64_t> counts,
                   absl::Time now) {
  const int num_physical = options_.num_physical;
  CHECK_EQ(counts.size(), slot_.size());
  CHECK_EQ(placement.slot_to_rank.size(), static_cast<size_t>(num_physical));
  CHECK_EQ(placement.physical_to_logical.size(), slot_.size());
  Bucket* bucket = nullptr;
  bool dropped = false;
  for (size_t i = 0; i < counts.size(); ++i) {
    const int64_t count = counts[i];
    if (count == 0) continue;
    const int32_t expert = placement.physical_to_logical[i];
    if (placement.slot_to_rank[i % num_physical] != static_cast<uint32_t>(rank) || expert < 0) {
      dropped = true;
      continue;
    }
    if (bucket == nullptr) bucket = &OpenBucket(now);
    const size_t layer = i / num_physical;
    const size_t e = layer * options_.num_logical + expert;
    const size_t s = layer * options_.num_shards + rank;
    slot_[i] += count;
    expert_[e] += count;
    shard_[s] += count;
    bucket->expert[e] += count;
    bucket->shard[s] += count;
  }
  return dropped;
}

void LoadBook::Advance(absl::Time now, uint64_t map_version, const std::vector<bool>& live_ranks) {
  const int64_t current = BucketIndex(now);
  while (!buckets_.empty() && buckets_.front().index <= current - num_buckets_) {
    buckets_.pop_front();
  }
  // One sample per bucket boundary crossed (a long silence gives one sample, not many).
  if (current == last_sample_index_) return;
  last_sample_index_ = current;
  const std::vector<double> layers =
      LayerBalancedness(Window(now, absl::ZeroDuration()).shard, live_ranks);
  v1::BalancednessSample sample;
  sample.set_unix_millis(absl::ToUnixMillis(now));
  sample.set_map_version(map_version);
  sample.mutable_layer_balancedness()->Add(layers.begin(), layers.end());
  sample.set_mean_balancedness(std::accumulate(layers.begin(), layers.end(), 0.0) /
                               static_cast<double>(layers.size()));
  history_.push_back(std::move(sample));
  while (static_cast<int>(history_.size()) > options_.max_history) history_.pop_front();
}

WindowLoad LoadBook::Window(absl::Time now, absl::Duration length) const {
  int buckets = num_buckets_;
  if (length > absl::ZeroDuration()) {
    buckets = std::clamp(static_cast<int>(std::ceil(absl::FDivDuration(length, bucket_))), 1,
                         num_buckets_);
  }
  WindowLoad out;
  out.length = bucket_ * buckets;
  out.expert.assign(expert_.size(), 0);
  out.shard.assign(shard_.size(), 0);
  const int64_t first = BucketIndex(now) - buckets + 1;
  for (const Bucket& b : buckets_) {
    if (b.index < first) continue;
    for (size_t i = 0; i < out.expert.size(); ++i) out.expert[i] += b.expert[i];
    for (size_t i = 0; i < out.shard.size(); ++i) out.shard[i] += b.shard[i];
  }
  return out;
}

std::vector<double> LoadBook::LayerBalancedness(const std::vector<int64_t>& shard,
                                                const std::vector<bool>& live_ranks) const {
  std::vector<double> out;
  std::vector<int64_t> live;
  for (int l = 0; l < options_.num_layers; ++l) {
    live.clear();
    for (int r = 0; r < options_.num_shards; ++r) {
      if (static_cast<size_t>(r) < live_ranks.size() && live_ranks[r]) {
        live.push_back(shard[static_cast<size_t>(l) * options_.num_shards + r]);
      }
    }
    out.push_back(Balancedness(live));
  }
  return out;
}

void LoadBook::Summarize(absl::Time now, absl::Duration window, const std::vector<bool>& live_ranks,
                         v1::LoadStats* stats) const {
  const WindowLoad w = Window(now, window);
  const std::vector<double> window_balancedness = LayerBalancedness(w.shard, live_ranks);
  const size_t e_count = options_.num_logical, s_count = options_.num_shards;
  const size_t p_count = options_.num_physical;
  int64_t total = 0, window_total = 0;
  for (int l = 0; l < options_.num_layers; ++l) {
    v1::LayerLoad* layer = stats->add_layers();
    layer->set_layer(static_cast<uint32_t>(l));
    const auto row = [l](const std::vector<int64_t>& v, size_t n) {
      return absl::MakeConstSpan(v.data() + l * n, n);
    };
    const absl::Span<const int64_t> experts = row(expert_, e_count);
    const absl::Span<const int64_t> shards = row(shard_, s_count);
    layer->mutable_expert_load()->Add(experts.begin(), experts.end());
    layer->mutable_slot_load()->Add(row(slot_, p_count).begin(), row(slot_, p_count).end());
    layer->mutable_shard_load()->Add(shards.begin(), shards.end());
    layer->set_balancedness(Balancedness(shards));
    layer->mutable_window_expert_load()->Add(row(w.expert, e_count).begin(),
                                             row(w.expert, e_count).end());
    layer->mutable_window_shard_load()->Add(row(w.shard, s_count).begin(),
                                            row(w.shard, s_count).end());
    layer->set_window_balancedness(window_balancedness[l]);
    total += std::accumulate(experts.begin(), experts.end(), int64_t{0});
    window_total +=
        std::accumulate(row(w.expert, e_count).begin(), row(w.expert, e_count).end(), int64_t{0});
  }
  stats->set_total_routes(total);
  stats->set_window_routes(window_total);
  stats->set_window_seconds(absl::ToDoubleSeconds(w.length));
  for (const v1::BalancednessSample& sample : history_) *stats->add_history() = sample;
}

void LoadBook::Totals(std::vector<int64_t>* slot, std::vector<int64_t>* expert,
                      std::vector<int64_t>* shard) const {
  *slot = slot_;
  *expert = expert_;
  *shard = shard_;
}

bool LoadBook::RestoreTotals(std::vector<int64_t> slot, std::vector<int64_t> expert,
                             std::vector<int64_t> shard) {
  if (slot.size() != slot_.size() || expert.size() != expert_.size() ||
      shard.size() != shard_.size()) {
    return false;
  }
  slot_ = std::move(slot);
  expert_ = std::move(expert);
  shard_ = std::move(shard);
  return true;
}

}  // namespace moe
