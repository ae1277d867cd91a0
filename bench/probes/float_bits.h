// Bit-pattern helpers shared by the CPU-only probes (nvfp4_division.cc, nvfp4_thresholds.cc).
#ifndef MOE_BENCH_PROBES_FLOAT_BITS_H_
#define MOE_BENCH_PROBES_FLOAT_BITS_H_

#include <cstdint>
#include <cstring>

namespace probe {

inline float FromBits(uint32_t b) {
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}

inline uint32_t Bits(float f) {
  uint32_t b;
  std::memcpy(&b, &f, 4);
  return b;
}

}  // namespace probe

#endif  // MOE_BENCH_PROBES_FLOAT_BITS_H_
