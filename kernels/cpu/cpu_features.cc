// CPUID-based feature detection through the compiler's __builtin_cpu_supports, which also checks
// that the operating system saves the wider register state (XGETBV) before reporting AVX-512.
#include "kernels/cpu/cpu_features.h"

#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace moe::cpu {

CpuFeatures DetectCpuFeatures() {
  __builtin_cpu_init();
  CpuFeatures f;
  f.avx2 = __builtin_cpu_supports("avx2");
  f.fma = __builtin_cpu_supports("fma");
  f.f16c = __builtin_cpu_supports("f16c");
  f.avx512f = __builtin_cpu_supports("avx512f");
  f.avx512bw = __builtin_cpu_supports("avx512bw");
  f.avx512vl = __builtin_cpu_supports("avx512vl");
  f.avx512vnni = __builtin_cpu_supports("avx512vnni");
  f.avx512bf16 = __builtin_cpu_supports("avx512bf16");
  return f;
}

std::string FeatureString(const CpuFeatures& f) {
  std::vector<absl::string_view> names;
  const std::pair<bool, absl::string_view> all[] = {{f.avx2, "avx2"},
                                                    {f.fma, "fma"},
                                                    {f.f16c, "f16c"},
                                                    {f.avx512f, "avx512f"},
                                                    {f.avx512bw, "avx512bw"},
                                                    {f.avx512vl, "avx512vl"},
                                                    {f.avx512vnni, "avx512vnni"},
                                                    {f.avx512bf16, "avx512bf16"}};
  for (const auto& [present, name] : all) {
    if (present) names.push_back(name);
  }
  return absl::StrJoin(names, " ");
}

absl::string_view CpuIsaName(CpuIsa isa) {
  switch (isa) {
    case CpuIsa::kAvx2:
      return "avx2";
    case CpuIsa::kAvx512:
      return "avx512";
    case CpuIsa::kAvx512Vnni:
      return "avx512vnni";
  }
  return "unknown";
}

namespace {

bool Supports(const CpuFeatures& f, CpuIsa isa) {
  const bool avx512 = f.avx512f && f.avx512bw && f.avx512vl;
  switch (isa) {
    case CpuIsa::kAvx2:
      return f.avx2 && f.fma;
    case CpuIsa::kAvx512:
      return avx512;
    case CpuIsa::kAvx512Vnni:
      return avx512 && f.avx512vnni;
  }
  return false;
}

}  // namespace

CpuIsa BestIsa(const CpuFeatures& f) {
  for (CpuIsa isa : {CpuIsa::kAvx512Vnni, CpuIsa::kAvx512}) {
    if (Supports(f, isa)) return isa;
  }
  return CpuIsa::kAvx2;
}

absl::StatusOr<CpuIsa> ChooseIsa(absl::string_view name, const CpuFeatures& f) {
  if (name == "auto") return BestIsa(f);
  for (CpuIsa isa : {CpuIsa::kAvx2, CpuIsa::kAvx512, CpuIsa::kAvx512Vnni}) {
    if (name != CpuIsaName(isa)) continue;
    if (!Supports(f, isa)) {
      return absl::FailedPreconditionError(absl::StrCat(
          "CPU kernels for ", name, " requested, but this processor has only: ", FeatureString(f)));
    }
    return isa;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("unknown CPU instruction set '", name, "' (auto, avx2, avx512, avx512vnni)"));
}

}  // namespace moe::cpu
