// Runtime CPU feature detection and the choice of the instruction set the optimized CPU kernels
// run with: AVX2+FMA is the baseline every build targets (-march=x86-64-v3); AVX-512 (F, BW, VL)
// and AVX-512 VNNI kernels live in translation units compiled for them and are only called when
// the running processor has them.
//
// Called by the CPU backend at construction and by tests (which force the AVX2 path on machines
// that have more). Pure functions; DetectCpuFeatures reads CPUID once per call: thread-safe.
#ifndef MOE_KERNELS_CPU_CPU_FEATURES_H_
#define MOE_KERNELS_CPU_CPU_FEATURES_H_

#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace moe::cpu {

struct CpuFeatures {
  bool avx2 = false;
  bool fma = false;
  bool f16c = false;
  bool avx512f = false;
  bool avx512bw = false;
  bool avx512vl = false;
  bool avx512vnni = false;
  bool avx512bf16 = false;
};

CpuFeatures DetectCpuFeatures();

// "avx2 fma f16c avx512f ..." for logs and benchmark records.
std::string FeatureString(const CpuFeatures& f);

// The instruction-set levels the kernels are built for, in increasing order.
enum class CpuIsa : int { kAvx2 = 0, kAvx512 = 1, kAvx512Vnni = 2 };

absl::string_view CpuIsaName(CpuIsa isa);  // "avx2", "avx512", "avx512vnni"

// Best level `f` supports; kAvx2 also when `f` lacks AVX2 (the binary itself requires it).
CpuIsa BestIsa(const CpuFeatures& f);

// Parses "auto", "avx2", "avx512", "avx512vnni". "auto" picks BestIsa(f). FAILED_PRECONDITION when
// `f` lacks what an explicit name needs, INVALID_ARGUMENT for an unknown name.
absl::StatusOr<CpuIsa> ChooseIsa(absl::string_view name, const CpuFeatures& f);

}  // namespace moe::cpu

#endif  // MOE_KERNELS_CPU_CPU_FEATURES_H_
