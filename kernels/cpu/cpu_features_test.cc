#include "kernels/cpu/cpu_features.h"

#include "gtest/gtest.h"

namespace moe::cpu {
namespace {

CpuFeatures Avx2Only() {
  CpuFeatures f;
  f.avx2 = f.fma = f.f16c = true;
  return f;
}

CpuFeatures WithAvx512(bool vnni) {
  CpuFeatures f = Avx2Only();
  f.avx512f = f.avx512bw = f.avx512vl = true;
  f.avx512vnni = vnni;
  return f;
}

TEST(CpuFeaturesTest, ThisMachineHasTheBaseline) {
  const CpuFeatures f = DetectCpuFeatures();  // the binary itself is built for x86-64-v3
  EXPECT_TRUE(f.avx2);
  EXPECT_TRUE(f.fma);
  EXPECT_NE(FeatureString(f).find("avx2 fma"), std::string::npos) << FeatureString(f);
  EXPECT_TRUE(ChooseIsa("avx2", f).ok());
  EXPECT_EQ(*ChooseIsa("auto", f), BestIsa(f));
}

TEST(CpuFeaturesTest, BestIsaNeedsTheWholeAvx512Family) {
  EXPECT_EQ(BestIsa(Avx2Only()), CpuIsa::kAvx2);
  EXPECT_EQ(BestIsa(WithAvx512(false)), CpuIsa::kAvx512);
  EXPECT_EQ(BestIsa(WithAvx512(true)), CpuIsa::kAvx512Vnni);
  CpuFeatures no_bw = WithAvx512(true);
  no_bw.avx512bw = false;
  EXPECT_EQ(BestIsa(no_bw), CpuIsa::kAvx2);
}

TEST(CpuFeaturesTest, ChooseIsa) {
  EXPECT_EQ(*ChooseIsa("avx512", WithAvx512(true)), CpuIsa::kAvx512);
  EXPECT_EQ(*ChooseIsa("avx2", WithAvx512(true)), CpuIsa::kAvx2);  // forcing the baseline
  EXPECT_EQ(*ChooseIsa("auto", WithAvx512(false)), CpuIsa::kAvx512);
  EXPECT_EQ(ChooseIsa("avx512vnni", WithAvx512(false)).status().code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(ChooseIsa("avx512", Avx2Only()).status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(ChooseIsa("neon", Avx2Only()).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(CpuFeaturesTest, Names) {
  EXPECT_EQ(CpuIsaName(CpuIsa::kAvx2), "avx2");
  EXPECT_EQ(CpuIsaName(CpuIsa::kAvx512), "avx512");
  EXPECT_EQ(CpuIsaName(CpuIsa::kAvx512Vnni), "avx512vnni");
  EXPECT_EQ(FeatureString(WithAvx512(true)), "avx2 fma f16c avx512f avx512bw avx512vl avx512vnni");
}

}  // namespace
}  // namespace moe::cpu
