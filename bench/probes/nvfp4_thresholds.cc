// Check (CPU only): the NVFP4 staging kernel's E2M1 thresholds from fp32 FMAs with directed
// rounding instead of double products.
//
// The kernel's per-row table (kernels/cuda/staging.cu, BuildScaleTable) holds, for every block
// scale byte b with unit u = fl(E4M3(b) * x_scale) > 0, seven BF16 thresholds made from the exact
// products P = bound_k * u (bound_k = c_k +- 2^-m, c_k in {0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5}):
// fl_rd(P) for the ">" bounds, fl_ru(P) for the ">=" ones. The double path computes P exactly in
// double and rounds it to fp32 with the direction; the fast path computes fma(c_k, u, +-2^-m * u)
// with the direction, which rounds the same exact value once, provided 2^-m * u is exact (no
// underflow: the kernel takes it only for x_scale >= 2^-91). This program compares both for
// every row amax A (all finite positive BF16 values, x_scale = fl(max(A, FLT_MIN) / 2688)) with
// x_scale >= 2^-91 and every scale byte 1..126, and for every fp32 u of eight whole binades.
// Expected output: mismatches 0 (~85 s). Built with -DPROBE_DROP_DELTA (the +-2^-m terms dropped)
// it must report mismatches, which shows the comparison can fail.
//
//   g++ -O2 -mfma -frounding-math -ffp-contract=off -I. -o /tmp/nvfp4_thresholds \
//       bench/probes/nvfp4_thresholds.cc && /tmp/nvfp4_thresholds
#include <cfenv>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <initializer_list>

#include "bench/probes/float_bits.h"

namespace {

using probe::Bits;
using probe::FromBits;

// E4m3ToFloat of formats.cc for bytes 0..126.
float E4m3Value(uint32_t b) {
  const int exponent = (b >> 3) & 0xF;
  const int mantissa = b & 7;
  return exponent == 0 ? std::ldexp(static_cast<float>(mantissa), -9)
                       : std::ldexp(static_cast<float>(8 + mantissa), exponent - 10);
}

constexpr double kBounds[7] = {0.25 + 0x1p-26, 0.75 - 0x1p-25, 1.25 + 0x1p-24, 1.75 - 0x1p-24,
                               2.5 + 0x1p-23,  3.5 - 0x1p-23,  5.0 + 0x1p-22};
constexpr float kMid[7] = {0.25f, 0.75f, 1.25f, 1.75f, 2.5f, 3.5f, 5.f};
constexpr float kDelta[7] = {0x1p-26f, -0x1p-25f, 0x1p-24f, -0x1p-24f,
                             0x1p-23f, -0x1p-23f, 0x1p-22f};

float RoundDouble(double v, bool up) {
  std::fesetround(up ? FE_UPWARD : FE_DOWNWARD);
  volatile double x = v;
  const float f = static_cast<float>(x);
  std::fesetround(FE_TONEAREST);
  return f;
}

float RoundFma(float c, float u, float delta_u, bool up) {
  std::fesetround(up ? FE_UPWARD : FE_DOWNWARD);
  volatile float vc = c, vu = u, vd = delta_u;
  const float f = std::fma(vc, vu, vd);
  std::fesetround(FE_TONEAREST);
  return f;
}

// Mismatching thresholds of unit u (0 or more).
int Check(float u) {
  int bad = 0;
  for (int k = 0; k < 7; ++k) {
    const bool up = k % 2 == 1;  // the ">=" bounds round up, the ">" ones down
    const float exact = RoundDouble(kBounds[k] * static_cast<double>(u), up);
    volatile float vd = kDelta[k], vu = u;
#ifdef PROBE_DROP_DELTA
    const float delta_u = 0.f * vd * vu;  // sanity check of the probe: must report mismatches
#else
    const float delta_u = vd * vu;  // a power of two times u: exact
#endif
    const float fast = RoundFma(kMid[k], u, delta_u, up);
    if (Bits(exact) != Bits(fast)) {
      if (bad == 0) std::printf("mismatch u=%a k=%d double %a fma %a\n", u, k, exact, fast);
      ++bad;
    }
  }
  return bad;
}

}  // namespace

int main() {
  long long units = 0, mismatches = 0, rows = 0;
  for (uint32_t a = 1; a < 0x7F80; ++a) {
    const float row_amax = FromBits(a << 16);
    volatile float denominator = 2688.f;
    const float x_scale = std::fmax(row_amax, FLT_MIN) / denominator;
    if (!(x_scale >= 0x1p-91f && x_scale <= FLT_MAX)) continue;
    ++rows;
    for (uint32_t b = 1; b <= 126; ++b) {
      volatile float e = E4m3Value(b);
      const float u = e * x_scale;
      ++units;
      mismatches += Check(u);
    }
  }
  std::printf("rows %lld, units %lld, mismatches %lld\n", rows, units, mismatches);
  long long binade_units = 0, binade_mismatches = 0;
  for (int exponent : {-100, -60, -10, -1, 0, 1, 40, 120}) {
    for (uint32_t m = 0; m < (1u << 23); m += 1) {
      const float u = std::ldexp(FromBits(0x3F800000u | m), exponent);
      ++binade_units;
      binade_mismatches += Check(u);
    }
  }
  std::printf("whole binades: units %lld, mismatches %lld\n", binade_units, binade_mismatches);
  return mismatches + binade_mismatches == 0 ? 0 : 1;
}
