// Check (CPU only): the NVFP4 staging kernel's group-scale quotient without a division per group.
//
// StageNvfp4LeanKernel (kernels/cuda/staging.cu) needs sf = E4M3(fl(G / d)) for every group of a
// row, G the group's BF16 amax and d = fl(6 * fl(max(A, FLT_MIN) / 2688)) with A the row's BF16
// amax (so G <= A). It computes r = fl(1 / d) once per row and per group q0 = fl(G * r), then
// q = fl(q0 + fl(G - d * q0) * r) with two FMAs. This program walks every finite positive BF16 A
// and every BF16 G in [0, A] (5.3e8 pairs) and counts where q and fl(G / d) differ, and where
// their E4M3 bytes differ, for rows with d >= 2^-110 (the kernel's fast rows; the others divide).
// Expected output: byte mismatches 0. Takes ~1 s at -O2.
//
//   g++ -O2 -ffp-contract=off -I. -o /tmp/nvfp4_division bench/probes/nvfp4_division.cc
//   /tmp/nvfp4_division
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>

#include "bench/probes/float_bits.h"

namespace {

using probe::Bits;
using probe::FromBits;

// Saturating round-half-even E4M3 byte of a non-negative float (NaN -> 0x7F), as FloatToE4m3.
uint32_t E4m3(float x) {
  if (std::isnan(x)) return 0x7F;
  if (x >= 448.f) return 0x7E;
  int e = -6;
  if (x >= 0.015625f) e = static_cast<int>((Bits(x) >> 23) & 0xFF) - 127;
  const int steps = static_cast<int>(std::nearbyint(x * std::ldexp(1.f, 3 - e)));
  return static_cast<uint32_t>((e + 6) * 8 + steps);
}

}  // namespace

int main() {
  long long pairs = 0, quotient_mismatches = 0, byte_mismatches = 0, slow_rows = 0;
  for (uint32_t a = 1; a < 0x7F80; ++a) {
    const float row_amax = FromBits(a << 16);
    volatile float denominator = 2688.f;  // keep the division at run time
    const float x_scale = std::fmax(row_amax, FLT_MIN) / denominator;
    const float d = 6.f * x_scale;
    if (!(d >= 0x1p-110f && d <= FLT_MAX)) {
      ++slow_rows;
      continue;
    }
    const float r = 1.f / d;
    for (uint32_t g = 0; g <= a; ++g) {
      const float group_amax = FromBits(g << 16);
      const float exact = group_amax / d;
      const float q0 = group_amax * r;
      const float q = std::fma(std::fma(-d, q0, group_amax), r, q0);
      ++pairs;
      if (Bits(q) == Bits(exact)) continue;
      ++quotient_mismatches;
      if (E4m3(q) != E4m3(exact)) {
        if (byte_mismatches < 10) {
          std::printf("mismatch: A=%a G=%a d=%a exact=%a fast=%a\n", row_amax, group_amax, d, exact,
                      q);
        }
        ++byte_mismatches;
      }
    }
  }
  std::printf(
      "pairs %lld, rows dividing exactly %lld, quotient mismatches %lld, "
      "byte mismatches %lld\n",
      pairs, slow_rows, quotient_mismatches, byte_mismatches);
  return byte_mismatches == 0 ? 0 : 1;
}
