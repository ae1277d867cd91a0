// The FP4 expert GEMM kernels (fp4_gemm.h), written once over the vector primitives of simd_*.h
// and compiled once per instruction set: each per-ISA unit defines MOE_CPU_ISA, includes its
// simd header and this file, and exports RunFp4Gemm<Isa>. Everything here lives in that unit's
// own namespace, so no inline function or template instance is shared across instruction sets.
//
// Stages, per 16-row group: decode (64-byte chunk -> 4 int16 pair vectors per half), multiply
// (vpmaddwd / vpdpwssd into exact int32 block sums), scale (fp32, once per block) and the
// epilogue (row scale, bias, store or gated activation).
#ifndef MOE_KERNELS_CPU_FP4_GEMM_IMPL_H_
#define MOE_KERNELS_CPU_FP4_GEMM_IMPL_H_

#include <cstdint>

#include "kernels/cpu/fp4_gemm.h"

#ifndef MOE_CPU_ISA
#error "define MOE_CPU_ISA and include the simd header of that instruction set first"
#endif

namespace moe::cpu::MOE_CPU_ISA {

using VI = Simd::VI;
using VF = Simd::VF;
constexpr int kH = Simd::kHalves;
constexpr int kL = Simd::kLanes;             // rows per half
constexpr int kPairInt16s = 2 * kGroupRows;  // one k-pair of a group in the panel

// ---- Decode -------------------------------------------------------------------------------------

struct Decoder {
  VI table = Simd::CodeTable();
  VI low = Simd::LowNibbleMask();

  // units[u * kH + h] = k-pair u of half h of the chunk, int16 pairs in int32 lanes.
  void Chunk(const uint8_t* chunk, VI* units) const {
    for (int h = 0; h < kH; ++h) {
      const VI v = Simd::LoadI(chunk + h * Simd::kVecBytes);
      const VI lo = Simd::Lookup(table, Simd::And(v, low));
      const VI hi = Simd::Lookup(table, Simd::And(Simd::ShiftRight4(v), low));
      units[0 * kH + h] = Simd::HighBytesLow(lo);
      units[1 * kH + h] = Simd::HighBytesHigh(lo);
      units[2 * kH + h] = Simd::HighBytesLow(hi);
      units[3 * kH + h] = Simd::HighBytesHigh(hi);
    }
  }
};

// Block scales of one group and block (16 raw bytes) as floats, per half.
inline void BlockScales(const Fp4MatrixRef& m, const uint8_t* bytes, VF* out) {
  for (int h = 0; h < kH; ++h) {
    out[h] = m.nvfp4 ? Simd::E4m3(bytes + h * kL) : Simd::Ue8m0(bytes + h * kL);
  }
}

// acc += float(sum) * (weight scale * activation scale): the one rounding point per block,
// shared by both paths so that they agree bit for bit.
inline VF ScaleBlock(VI sum, VF weight_scale, float activation_scale, VF acc) {
  return Simd::Fma(Simd::ToFloat(sum), Simd::Mul(weight_scale, Simd::Set1F(activation_scale)), acc);
}

// ---- Epilogue -----------------------------------------------------------------------------------

inline void Epilogue(const Fp4GemmParams& p, const Fp4MatrixRef& m, int64_t g, int64_t route,
                     const VF* acc) {
  float* out = p.out + route * p.out_stride;
  VF v[kH];
  for (int h = 0; h < kH; ++h) {
    const int64_t row = g * kGroupRows + h * kL;
    const VF scale = Simd::LoadF(m.row_scale + row);
    v[h] = m.bias != nullptr ? Simd::Fma(acc[h], scale, Simd::LoadF(m.bias + row))
                             : Simd::Mul(acc[h], scale);
  }
  if (p.epilogue == Fp4Epilogue::kStore) {
    for (int h = 0; h < kH; ++h) Simd::StoreF(out + g * kGroupRows + h * kL, v[h]);
    return;
  }
  alignas(64) float rows[kGroupRows];
  for (int h = 0; h < kH; ++h) Simd::StoreF(rows + h * kL, v[h]);
  constexpr int kHalf = kGroupRows / 2;
  p.gated_fn(p.gated_ctx, rows, rows + kHalf, kHalf, out + g * kHalf);
}

// Input row pointers of routes [r, r + T), offset by `col` columns and `block` blocks.
template <int T>
struct Inputs {
  const int16_t* x[T];
  const float* scale[T];

  Inputs(const Fp4GemmParams& p, int64_t r, int64_t col, int64_t block) {
    for (int t = 0; t < T; ++t) {
      const int64_t row = p.input_row != nullptr ? p.input_row[r + t] : r + t;
      x[t] = p.input + row * p.input_stride + col;
      scale[t] = p.input_scales + row * p.input_scale_stride + block;
    }
  }
};

// A compile-time route count for the register tiles.
template <int N>
struct Routes {
  static constexpr int kValue = N;
};

// Calls fn(Routes<n>()) for 1 <= n <= N.
template <int N, typename Fn>
void WithRoutes(int64_t n, Fn&& fn) {
  if constexpr (N > 1) {
    if (n < N) {
      WithRoutes<N - 1>(n, fn);
      return;
    }
  }
  fn(Routes<N>());
}

// ---- Weight streaming (few tokens) --------------------------------------------------------------

// Independent int32 partial sums per route and half in the streaming loop: the k-pairs of a chunk
// go round-robin into StreamParts(T * kH) chains so that at least 4 multiply-adds are in flight
// (one chain of vpdpwssd, 5 cycles each, held 1 token to a quarter of the issue rate). Integer
// sums, so the split changes no bit of the result.
constexpr int StreamParts(int chains) { return chains >= 4 ? 1 : (chains >= 2 ? 2 : 4); }

// How far ahead of the chunk being decoded the decode loops (streaming and panel) ask for weights:
// 64 chunks, 4 KiB. On a Sapphire Rapids-class guest the hardware prefetchers alone left one
// token at ~1.8x the read floor; 32 to 256 chunks ahead all brought it to ~1.0x (NOTES-cpu.md,
// 2026-12-08; bench/probes/fp4_stream_prefetch.cc). Past a group's end the lines are the next
// group's of the same matrix (contiguous); past a matrix's end the hint is dropped or fetches a
// line nobody reads.
constexpr int64_t kWeightPrefetchChunks = 64;

// acc[t] = sum over blocks of group g for T routes; each chunk decoded once for all T.
template <int T>
void StreamGroup(const Fp4MatrixRef& m, int64_t g, const Inputs<T>& in, VF (&acc)[T][kH]) {
  constexpr int kParts = StreamParts(T * kH);
  const Decoder decode;
  const int64_t chunks = m.cols / kChunkCols;
  const int chunks_per_block = m.block / kChunkCols;
  const uint8_t* codes = m.codes + g * chunks * kChunkBytes;
  const uint8_t* scales = m.scales + g * (m.cols / m.block) * kGroupRows;
  for (int t = 0; t < T; ++t) {
    for (int h = 0; h < kH; ++h) acc[t][h] = Simd::ZeroF();
  }
  for (int64_t b = 0, c = 0; c < chunks; ++b) {
    VI sum[kParts][T][kH];
    for (int q = 0; q < kParts; ++q) {
      for (int t = 0; t < T; ++t) {
        for (int h = 0; h < kH; ++h) sum[q][t][h] = Simd::ZeroI();
      }
    }
    for (int i = 0; i < chunks_per_block; ++i, ++c) {
      VI units[4 * kH];
      Simd::Prefetch(codes + (c + kWeightPrefetchChunks) * kChunkBytes);
      decode.Chunk(codes + c * kChunkBytes, units);
      for (int u = 0; u < 4; ++u) {
        VI(&part)[T][kH] = sum[u % kParts];
        for (int t = 0; t < T; ++t) {
          const VI pair = Simd::BroadcastPair(in.x[t] + c * kChunkCols + 2 * u);
          for (int h = 0; h < kH; ++h) {
            part[t][h] = Simd::DotAcc(part[t][h], pair, units[u * kH + h]);
          }
        }
      }
    }
    for (int q = 1; q < kParts; ++q) {
      for (int t = 0; t < T; ++t) {
        for (int h = 0; h < kH; ++h) sum[0][t][h] = Simd::AddI32(sum[0][t][h], sum[q][t][h]);
      }
    }
    VF weight_scale[kH];
    BlockScales(m, scales + b * kGroupRows, weight_scale);
    for (int t = 0; t < T; ++t) {
      for (int h = 0; h < kH; ++h) {
        acc[t][h] = ScaleBlock(sum[0][t][h], weight_scale[h], in.scale[t][b], acc[t][h]);
      }
    }
  }
}

template <int T>
void StreamRoutes(const Fp4GemmParams& p, const Fp4MatrixRef& m, const GemmWorkItem& item,
                  int64_t r) {
  const Inputs<T> in(p, r, 0, 0);
  for (int64_t g = item.begin; g < item.end; ++g) {
    VF acc[T][kH];
    StreamGroup<T>(m, g, in, acc);
    for (int t = 0; t < T; ++t) Epilogue(p, m, g, r + t, acc[t]);
  }
}

inline void RunStreamItem(const Fp4GemmParams& p, const GemmWorkItem& item) {
  const Fp4MatrixRef& m = p.experts[item.expert];
  const int64_t end = p.route_begin[item.expert + 1];
  for (int64_t r = p.route_begin[item.expert]; r < end; r += kStreamTokens) {
    WithRoutes<kStreamTokens>(
        end - r, [&](auto routes) { StreamRoutes<decltype(routes)::kValue>(p, m, item, r); });
  }
}

// ---- Panel (many tokens) ------------------------------------------------------------------------

// Decodes the block scales of chunks [c0, c0 + n) of group g into [blocks][16] floats.
inline void DecodePanelScales(const Fp4MatrixRef& m, int64_t g, int64_t c0, int64_t n,
                              float* scales) {
  const int chunks_per_block = m.block / kChunkCols;
  const int64_t blocks_per_row = m.cols / m.block;
  const uint8_t* bytes = m.scales + (g * blocks_per_row + c0 / chunks_per_block) * kGroupRows;
  for (int64_t b = 0; b < n / chunks_per_block; ++b) {
    VF s[kH];
    BlockScales(m, bytes + b * kGroupRows, s);
    for (int h = 0; h < kH; ++h) Simd::StoreF(scales + b * kGroupRows + h * kL, s[h]);
  }
}

// Decodes chunks [c0, c0 + n) of group g into an int16 panel: k-pair major, kPairInt16s per
// pair. REQUIRES: c0 and n whole blocks.
inline void DecodePanel16(const Fp4MatrixRef& m, int64_t g, int64_t c0, int64_t n, int16_t* panel) {
  const Decoder decode;
  const uint8_t* codes = m.codes + (g * (m.cols / kChunkCols) + c0) * kChunkBytes;
  for (int64_t i = 0; i < n; ++i) {
    VI units[4 * kH];
    Simd::Prefetch(codes + (i + kWeightPrefetchChunks) * kChunkBytes);
    decode.Chunk(codes + i * kChunkBytes, units);
    for (int u = 0; u < 4; ++u) {
      for (int h = 0; h < kH; ++h) {
        Simd::StoreI(panel + (i * 4 + u) * kPairInt16s + h * 2 * kL, units[u * kH + h]);
      }
    }
  }
}

// The int8 panel: per 4 columns, 64 bytes (one int32 lane of 4 biased codes per row).
inline void DecodePanel8(const Fp4MatrixRef& m, int64_t g, int64_t c0, int64_t n, uint8_t* panel) {
  const VI table = Simd::BiasedCodeTable();
  const VI low = Simd::LowNibbleMask();
  const uint8_t* codes = m.codes + (g * (m.cols / kChunkCols) + c0) * kChunkBytes;
  for (int64_t i = 0; i < n; ++i) {
    Simd::Prefetch(codes + (i + kWeightPrefetchChunks) * kChunkBytes);
    for (int h = 0; h < kH; ++h) {
      const VI v = Simd::LoadI(codes + i * kChunkBytes + h * Simd::kVecBytes);
      const VI lo = Simd::Lookup(table, Simd::And(v, low));
      const VI hi = Simd::Lookup(table, Simd::And(Simd::ShiftRight4(v), low));
      Simd::StoreI(panel + (2 * i) * kChunkBytes + h * Simd::kVecBytes, Simd::RowQuads(lo));
      Simd::StoreI(panel + (2 * i + 1) * kChunkBytes + h * Simd::kVecBytes, Simd::RowQuads(hi));
    }
  }
}

// acc[t][0, 16) += the panel's blocks for T routes, int16 activations.
template <int T>
void PanelTile16(const int16_t* panel, const float* scales, int64_t blocks, int block,
                 const Inputs<T>& in, float* acc) {
  const int pairs = block / 2;
  for (int64_t b = 0; b < blocks; ++b) {
    VI sum[T][kH];
    for (int t = 0; t < T; ++t) {
      for (int h = 0; h < kH; ++h) sum[t][h] = Simd::ZeroI();
    }
    const int16_t* w = panel + b * pairs * kPairInt16s;
    const int64_t col = b * block;
    for (int q = 0; q < pairs; ++q) {
      VI wv[kH];
      for (int h = 0; h < kH; ++h) wv[h] = Simd::LoadI(w + q * kPairInt16s + h * 2 * kL);
      for (int t = 0; t < T; ++t) {
        const VI pair = Simd::BroadcastPair(in.x[t] + col + 2 * q);
        for (int h = 0; h < kH; ++h) sum[t][h] = Simd::DotAcc(sum[t][h], pair, wv[h]);
      }
    }
    for (int h = 0; h < kH; ++h) {
      const VF weight_scale = Simd::LoadF(scales + b * kGroupRows + h * kL);
      for (int t = 0; t < T; ++t) {
        float* a = acc + t * kGroupRows + h * kL;
        Simd::StoreF(a, ScaleBlock(sum[t][h], weight_scale, in.scale[t][b], Simd::LoadF(a)));
      }
    }
  }
}

// Input pointers of int8 activations for routes [r, r + T).
template <int T>
struct Inputs8 {
  const int8_t* x[T];
  const float* scale[T];
  const int32_t* bias[T];

  Inputs8(const Fp4GemmParams& p, int64_t r, int64_t col, int64_t block) {
    for (int t = 0; t < T; ++t) {
      const int64_t row = p.input_row != nullptr ? p.input_row[r + t] : r + t;
      x[t] = p.input8 + row * p.input_stride + col;
      scale[t] = p.input8_scales + row * p.input_scale_stride + block;
      bias[t] = p.input8_bias + row * p.input_scale_stride + block;
    }
  }
};

// Exact int32 sums of one block for one route, both halves, int8 activations, without a fused
// byte dot product: int16 sums of 4 quads (fp4_gemm.h bounds them), then one widening.
inline void BlockSums8(const uint8_t* w, int quads, const int8_t* x, VI* sum) {
  constexpr int kQuadsPerSum = 4;
  for (int h = 0; h < kH; ++h) sum[h] = Simd::ZeroI();
  for (int q0 = 0; q0 < quads; q0 += kQuadsPerSum) {
    VI pairs[kH];
    for (int q = q0; q < q0 + kQuadsPerSum; ++q) {
      const VI xq = Simd::BroadcastQuad(x + 4 * q);
      for (int h = 0; h < kH; ++h) {
        const VI p = Simd::BytePairs(Simd::LoadI(w + q * kChunkBytes + h * Simd::kVecBytes), xq);
        pairs[h] = q == q0 ? p : Simd::AddI16(pairs[h], p);
      }
    }
    for (int h = 0; h < kH; ++h) sum[h] = Simd::AccumulatePairs(sum[h], pairs[h]);
  }
}

// acc[0, 16) += one block's exact sums of one route, int8 activations.
inline void ScaleBlock8(const VI* sum, const float* weight_scales, float activation_scale,
                        int32_t bias, float* acc) {
  // The row scale expects the int16 path's codes, which sit 2^8 higher.
  const float scale = activation_scale * 256.f;
  const VI excess = Simd::Set1I32(bias);
  for (int h = 0; h < kH; ++h) {
    float* a = acc + h * kL;
    const VF weight_scale = Simd::LoadF(weight_scales + h * kL);
    Simd::StoreF(a, ScaleBlock(Simd::SubI32(sum[h], excess), weight_scale, scale, Simd::LoadF(a)));
  }
}

// acc[t][0, 16) += the panel's blocks for T routes, int8 activations. With a fused byte dot
// product (VNNI) the T routes share each weight load in a register tile; without one, routes go
// one at a time (weights reloaded from L1), which leaves registers for the int16 partial sums
// (measured on Zen 3: faster than two routes sharing the loads).
template <int T>
void PanelTile8(const uint8_t* panel, const float* scales, int64_t blocks, int block,
                const Inputs8<T>& in, float* acc) {
  const int quads = block / 4;
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* w = panel + b * quads * kChunkBytes;
    const float* weight_scales = scales + b * kGroupRows;
    if constexpr (Simd::kFusedDot8) {
      VI sum[T][kH];
      for (int t = 0; t < T; ++t) {
        for (int h = 0; h < kH; ++h) sum[t][h] = Simd::ZeroI();
      }
      for (int q = 0; q < quads; ++q) {
        VI wv[kH];
        for (int h = 0; h < kH; ++h) wv[h] = Simd::LoadI(w + q * kChunkBytes + h * Simd::kVecBytes);
        for (int t = 0; t < T; ++t) {
          const VI xq = Simd::BroadcastQuad(in.x[t] + b * block + 4 * q);
          for (int h = 0; h < kH; ++h) sum[t][h] = Simd::DotAccU8S8(sum[t][h], wv[h], xq);
        }
      }
      for (int t = 0; t < T; ++t) {
        ScaleBlock8(sum[t], weight_scales, in.scale[t][b], in.bias[t][b], acc + t * kGroupRows);
      }
    } else {
      for (int t = 0; t < T; ++t) {
        VI sum[kH];
        BlockSums8(w, quads, in.x[t] + b * block, sum);
        ScaleBlock8(sum, weight_scales, in.scale[t][b], in.bias[t][b], acc + t * kGroupRows);
      }
    }
  }
}

// Routes [begin, end) of one panel (chunks [c0, c0 + n)), register tile by register tile.
inline void PanelRoutes(const Fp4GemmParams& p, const Fp4MatrixRef& m, int64_t begin, int64_t end,
                        int64_t c0, int64_t n, const Fp4Scratch& scratch) {
  const int64_t blocks = n * kChunkCols / m.block;
  const int64_t col = c0 * kChunkCols, block0 = col / m.block;
  for (int64_t r = begin; r < end; r += Simd::kPanelTokens) {
    float* acc = scratch.acc + (r - begin) * kGroupRows;
    WithRoutes<Simd::kPanelTokens>(end - r, [&](auto routes) {
      constexpr int kT = decltype(routes)::kValue;
      if (p.input8 != nullptr) {
        PanelTile8<kT>(reinterpret_cast<const uint8_t*>(scratch.panel), scratch.panel_scales,
                       blocks, m.block, Inputs8<kT>(p, r, col, block0), acc);
      } else {
        PanelTile16<kT>(scratch.panel, scratch.panel_scales, blocks, m.block,
                        Inputs<kT>(p, r, col, block0), acc);
      }
    });
  }
}

inline void RunPanelItem(const Fp4GemmParams& p, const GemmWorkItem& item,
                         const Fp4Scratch& scratch) {
  const Fp4MatrixRef& m = p.experts[item.expert];
  const int64_t begin = p.route_begin[item.expert], end = p.route_begin[item.expert + 1];
  const int64_t chunks = m.cols / kChunkCols;
  const int chunks_per_block = m.block / kChunkCols;
  int64_t panel_chunks = p.panel_cols / kChunkCols / chunks_per_block * chunks_per_block;
  if (panel_chunks < chunks_per_block) panel_chunks = chunks_per_block;
  for (int64_t g = item.begin; g < item.end; ++g) {
    for (int64_t i = 0; i < (end - begin) * kGroupRows; ++i) scratch.acc[i] = 0.f;
    for (int64_t c0 = 0; c0 < chunks; c0 += panel_chunks) {
      const int64_t n = chunks - c0 < panel_chunks ? chunks - c0 : panel_chunks;
      if (p.input8 != nullptr) {
        DecodePanel8(m, g, c0, n, reinterpret_cast<uint8_t*>(scratch.panel));
      } else {
        DecodePanel16(m, g, c0, n, scratch.panel);
      }
      DecodePanelScales(m, g, c0, n, scratch.panel_scales);
      PanelRoutes(p, m, begin, end, c0, n, scratch);
    }
    for (int64_t r = begin; r < end; ++r) {
      VF acc[kH];
      for (int h = 0; h < kH; ++h) {
        acc[h] = Simd::LoadF(scratch.acc + (r - begin) * kGroupRows + h * kL);
      }
      Epilogue(p, m, g, r, acc);
    }
  }
}

// ---- Entry --------------------------------------------------------------------------------------

inline void RunFp4Gemm(const Fp4GemmParams& p, int thread_index) {
  for (;;) {
    const int32_t i = __atomic_fetch_add(p.next_item, 1, __ATOMIC_RELAXED);
    if (i >= p.num_items) return;
    const GemmWorkItem& item = p.items[i];
    if (item.panel) {
      RunPanelItem(p, item, p.scratch[thread_index]);
    } else {
      RunStreamItem(p, item);
    }
  }
}

}  // namespace moe::cpu::MOE_CPU_ISA

#endif  // MOE_KERNELS_CPU_FP4_GEMM_IMPL_H_
