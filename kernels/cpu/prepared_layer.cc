#include "kernels/cpu/prepared_layer.h"

#include <utility>

#include "absl/synchronization/mutex.h"
#include "kernels/cpu/cpu_heuristics.h"

namespace moe::cpu {
namespace {

std::vector<const void*> Fingerprint(const ExpertLayer& layer) {
  std::vector<const void*> f;
  for (const auto* list : {&layer.experts, &layer.shared_experts}) {
    for (const ExpertWeights& e : *list) {
      f.push_back(e.w13.values.data);
      f.push_back(e.w2.values.data);
    }
  }
  return f;
}

const float* BiasOf(const TensorView& bias) {
  return bias.present() ? bias.As<const float>() : nullptr;
}

absl::Status PackExpert(const ExpertLayer& layer, const ExpertWeights& w, PackedFp4Matrix* w13,
                        PackedFp4Matrix* w2) {
  absl::StatusOr<PackedFp4Matrix> a =
      PackFp4Matrix(w.w13, RowPairing::kGateUp, layer.layout, w.w13_gate_global_scale,
                    w.w13_up_global_scale, BiasOf(w.b13));
  if (!a.ok()) return a.status();
  absl::StatusOr<PackedFp4Matrix> b = PackFp4Matrix(
      w.w2, RowPairing::kPlain, layer.layout, w.w2_global_scale, w.w2_global_scale, BiasOf(w.b2));
  if (!b.ok()) return b.status();
  *w13 = *std::move(a);
  *w2 = *std::move(b);
  return absl::OkStatus();
}

}  // namespace

bool PreparedLayer::Matches(const ExpertLayer& layer) const {
  return layer.format == format && layer.hidden == hidden && layer.intermediate == inter &&
         static_cast<int64_t>(layer.experts.size()) == experts &&
         static_cast<int64_t>(layer.shared_experts.size()) == shared &&
         Fingerprint(layer) == fingerprint;
}

absl::StatusOr<std::unique_ptr<PreparedLayer>> PrepareCpuLayer(const ExpertLayer& layer,
                                                               ThreadPool& pool) {
  if (absl::Status s = ValidateExpertLayer(layer); !s.ok()) return s;
  auto prepared = std::make_unique<PreparedLayer>();
  PreparedLayer& p = *prepared;
  p.format = layer.format;
  p.hidden = layer.hidden;
  p.inter = layer.intermediate;
  p.experts = static_cast<int64_t>(layer.experts.size());
  p.shared = static_cast<int64_t>(layer.shared_experts.size());
  p.fingerprint = Fingerprint(layer);
  if (layer.format == WeightFormat::kBf16) return prepared;

  const int64_t total = p.experts + p.shared;
  p.w13.resize(total);
  p.w2.resize(total);
  absl::Mutex mu;
  absl::Status status;
  pool.ParallelFor(pool.num_threads(), [&](int thread, int threads) {
    const Range mine = EvenSplit(total, thread, threads);
    for (int64_t e = mine.begin; e < mine.end; ++e) {
      const ExpertWeights& w =
          e < p.experts ? layer.experts[e] : layer.shared_experts[e - p.experts];
      absl::Status s = PackExpert(layer, w, &p.w13[e], &p.w2[e]);
      if (!s.ok()) {
        absl::MutexLock lock(&mu);
        status.Update(s);
      }
    }
  });
  if (!status.ok()) return status;
  for (int64_t e = 0; e < total; ++e) {
    p.w13_refs.push_back(p.w13[e].ref());
    p.w2_refs.push_back(p.w2[e].ref());
  }
  return prepared;
}

}  // namespace moe::cpu
