#include "kernels/sweep_cases.h"

#include <cctype>

namespace moe::sweep {

void PrintTo(const SweepCase& c, std::ostream* os) { *os << c.name; }

std::vector<SweepCase> ComboCases(const std::vector<SweepDims>& dims) {
  static constexpr ActivationKind kActs[] = {ActivationKind::kSilu, ActivationKind::kSwigluOai,
                                             ActivationKind::kSitu, ActivationKind::kGelu,
                                             ActivationKind::kGeluTanh};
  std::vector<SweepCase> cases;
  int i = 0;
  for (WeightFormat f : {WeightFormat::kMxfp4, WeightFormat::kNvfp4, WeightFormat::kBf16}) {
    for (GateUpLayout l : {GateUpLayout::kInterleaved, GateUpLayout::kConcatenated}) {
      for (ActivationKind a : kActs) {
        const SweepDims& s = dims[i % dims.size()];
        cases.push_back({std::string(WeightFormatName(f)) + "_" +
                             (l == GateUpLayout::kInterleaved ? "interleaved" : "concatenated") +
                             "_" + std::string(ActivationKindName(a)) + "_" + std::to_string(i),
                         f, l, a, s.tokens, s.experts, s.k, s.hidden, s.inter, i % 2 == 0, i % 3,
                         i % 4 < 2 ? DType::kF32 : DType::kBF16,
                         i % 5 < 3 ? DType::kF32 : DType::kBF16});
        ++i;
      }
    }
  }
  return cases;
}

std::string SweepCaseName(const testing::TestParamInfo<SweepCase>& info) {
  std::string name = info.param.name;
  for (char& ch : name) {
    if (!std::isalnum(static_cast<unsigned char>(ch))) ch = '_';
  }
  return name;
}

}  // namespace moe::sweep
