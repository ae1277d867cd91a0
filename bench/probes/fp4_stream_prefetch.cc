// Probe (CPU, AVX-512 VNNI): what bounds the 1-token weight stream of the CPU FP4 kernels
// (kernels/cpu/fp4_gemm_impl.h, StreamGroup). The loop body is the kernel's: load a 64-byte chunk
// of E2M1 codes, two nibble lookups, four unpacks to int16 pairs, four vpdpwssd against broadcast
// activation pairs. It times one thread
//   - with the codes in L2 (256 KB, repeated): one int32 chain (as before eb8ffd4) against four
//     independent chains, ns per chunk;
//   - streaming 17.6 MB (problem D's 4 active experts) from DRAM, a fresh slice of a 1 GiB buffer
//     each time: a plain read, one chain, four chains, and four chains with a prefetcht0 of the
//     line 8 ... 256 chunks ahead, ms.
// On the Sapphire Rapids guest of 2026-12-08 (NOTES-cpu.md): L2 9.5-9.7 ns per chunk with one
// chain, 2.9-3.1 with four; DRAM read 1.3-1.75 ms, one chain 3.3-3.6, four 2.9-3.3, four with a
// prefetch 32 to 256 chunks ahead 1.6-2.0 (8 ahead: 2.3-3.3). (GCC 12's -Wall warns of
// uninitialized variables inside its own AVX-512 headers; the command below has no -Wall.)
//
//   g++ -O3 -march=sapphirerapids -o /tmp/fp4_stream_prefetch bench/probes/fp4_stream_prefetch.cc
//   /tmp/fp4_stream_prefetch
#include <immintrin.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t kChunk = 64;

// Sums of one 16-row group over `chunks` chunks; kChains independent accumulators; a prefetch
// kAhead chunks ahead (0: none).
template <int kChains, int kAhead>
__attribute__((noinline)) __m512i Stream(const uint8_t* codes, const int16_t* x, int64_t chunks) {
  const __m512i table = _mm512_broadcast_i32x4(
      _mm_setr_epi8(0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12));
  const __m512i low = _mm512_set1_epi8(0x0F);
  __m512i sum[kChains];
  for (int q = 0; q < kChains; ++q) sum[q] = _mm512_setzero_si512();
  for (int64_t c = 0; c < chunks; ++c) {
    if constexpr (kAhead > 0) {
      _mm_prefetch(reinterpret_cast<const char*>(codes + (c + kAhead) * kChunk), _MM_HINT_T0);
    }
    const __m512i v = _mm512_load_si512(codes + c * kChunk);
    const __m512i lo = _mm512_shuffle_epi8(table, _mm512_and_si512(v, low));
    const __m512i hi = _mm512_shuffle_epi8(table, _mm512_and_si512(_mm512_srli_epi16(v, 4), low));
    const __m512i zero = _mm512_setzero_si512();
    const __m512i units[4] = {_mm512_unpacklo_epi8(zero, lo), _mm512_unpackhi_epi8(zero, lo),
                              _mm512_unpacklo_epi8(zero, hi), _mm512_unpackhi_epi8(zero, hi)};
    for (int u = 0; u < 4; ++u) {
      const __m512i pair = _mm512_broadcastd_epi32(_mm_loadu_si32(x + ((c * 8 + 2 * u) & 4095)));
      sum[u % kChains] = _mm512_dpwssd_epi32(sum[u % kChains], pair, units[u]);
    }
  }
  for (int q = 1; q < kChains; ++q) sum[0] = _mm512_add_epi32(sum[0], sum[q]);
  return sum[0];
}

__attribute__((noinline)) int64_t Read(const uint8_t* p, int64_t bytes) {
  __m512i a = _mm512_setzero_si512();
  for (int64_t i = 0; i < bytes; i += kChunk) a = _mm512_xor_si512(a, _mm512_load_si512(p + i));
  return _mm512_reduce_add_epi64(a);
}

double Ms(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

int main() {
  std::vector<int16_t> x(4096);
  for (auto& e : x) e = static_cast<int16_t>(std::rand());
  __m512i keep = _mm512_setzero_si512();
  int64_t keep_read = 0;

  // L2-resident codes, repeated: issue and latency only.
  {
    constexpr int64_t kBytes = 256 * 1024, kChunks = kBytes / kChunk, kReps = 200;
    auto* codes = static_cast<uint8_t*>(std::aligned_alloc(64, kBytes));
    for (int64_t i = 0; i < kBytes; ++i) codes[i] = static_cast<uint8_t>(std::rand());
    for (int round = 0; round < 3; ++round) {
      const uint8_t* p = codes;
      auto t0 = std::chrono::steady_clock::now();
      for (int r = 0; r < kReps; ++r) {
        asm volatile("" : "+r"(p));  // not hoisted out of the loop
        keep = _mm512_add_epi32(keep, Stream<1, 0>(p, x.data(), kChunks));
      }
      const double one = Ms(t0) * 1e6 / (kReps * kChunks);
      t0 = std::chrono::steady_clock::now();
      for (int r = 0; r < kReps; ++r) {
        asm volatile("" : "+r"(p));
        keep = _mm512_add_epi32(keep, Stream<4, 0>(p, x.data(), kChunks));
      }
      const double four = Ms(t0) * 1e6 / (kReps * kChunks);
      std::printf("L2, ns per chunk: one chain %.2f, four chains %.2f\n", one, four);
    }
    std::free(codes);
  }

  // DRAM: each timing reads a slice no other timing of the round read.
  constexpr int64_t kTotal = int64_t{1} << 30, kSlice = 17600000 / kChunk * kChunk;
  constexpr int64_t kSlices = kTotal / kSlice, kChunks = kSlice / kChunk;
  auto* buffer = static_cast<uint8_t*>(std::aligned_alloc(64, kTotal));
  std::memset(buffer, 0x37, kTotal);
  int64_t next = 0;
  auto timed = [&](auto&& run) {
    const uint8_t* p = buffer + (next++ % kSlices) * kSlice;
    asm volatile("" : "+r"(p));
    const auto t0 = std::chrono::steady_clock::now();
    run(p);
    return Ms(t0);
  };
  auto stream = [&](auto kernel) {
    return timed(
        [&](const uint8_t* p) { keep = _mm512_add_epi32(keep, kernel(p, x.data(), kChunks)); });
  };
  for (int round = 0; round < 5; ++round) {
    const double read = timed([&](const uint8_t* p) { keep_read += Read(p, kSlice); });
    const double one = stream(Stream<1, 0>);
    const double four = stream(Stream<4, 0>);
    const double a8 = stream(Stream<4, 8>), a32 = stream(Stream<4, 32>);
    const double a64 = stream(Stream<4, 64>), a128 = stream(Stream<4, 128>);
    const double a256 = stream(Stream<4, 256>);
    std::printf(
        "DRAM 17.6 MB, ms: read %.2f; one chain %.2f; four %.2f; four + prefetch 8 / 32 / 64 / 128 "
        "/ 256 chunks ahead %.2f / %.2f / %.2f / %.2f / %.2f\n",
        read, one, four, a8, a32, a64, a128, a256);
  }
  std::printf("(checksums %lld %d)\n", static_cast<long long>(keep_read),
              _mm512_reduce_add_epi32(keep));
  std::free(buffer);
  return 0;
}
