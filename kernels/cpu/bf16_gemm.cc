// Routes go in tiles of up to 4 so that each widened weight vector feeds 4 FMAs; one unit of 8
// outputs is finished (bias, activation) before the next.
#include "kernels/cpu/bf16_gemm.h"

#include <immintrin.h>

#include <algorithm>
#include <cstring>

namespace moe::cpu {
namespace {

constexpr int kTileRoutes = 4;

float HorizontalSum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

float Bf16Value(uint16_t bits) {
  const uint32_t wide = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &wide, sizeof(f));
  return f;
}

// out[t] = w . x[t] (+ bias) for T routes.
template <int T>
void DotRow(const Bf16MatrixRef& m, int64_t row, const float* const* x, float* out) {
  const uint16_t* w = m.values + row * m.cols;
  __m256 acc[T];
  for (int t = 0; t < T; ++t) acc[t] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 <= m.cols; k += 8) {
    const __m256i wide =
        _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + k)));
    const __m256 wv = _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
    for (int t = 0; t < T; ++t) acc[t] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x[t] + k), acc[t]);
  }
  const float bias = m.bias != nullptr ? m.bias[row] : 0.f;
  for (int t = 0; t < T; ++t) {
    float sum = HorizontalSum(acc[t]);
    for (int64_t j = k; j < m.cols; ++j) sum += Bf16Value(w[j]) * x[t][j];
    out[t] = sum + bias;
  }
}

template <int T>
void RunUnit(const Bf16GemmParams& p, const Bf16MatrixRef& m, int64_t unit, int64_t r,
             const float* const* x) {
  const int64_t first = unit * kBf16UnitOutputs;
  if (p.epilogue == Fp4Epilogue::kStore) {
    const int64_t last = std::min(first + kBf16UnitOutputs, m.rows);
    for (int64_t row = first; row < last; ++row) {
      float y[T];
      DotRow<T>(m, row, x, y);
      for (int t = 0; t < T; ++t) p.out[(r + t) * p.out_stride + row] = y[t];
    }
    return;
  }
  const int64_t inter = m.rows / 2;
  const int n = static_cast<int>(std::min<int64_t>(kBf16UnitOutputs, inter - first));
  float gate[T][kBf16UnitOutputs], up[T][kBf16UnitOutputs];
  for (int i = 0; i < n; ++i) {
    float g[T], u[T];
    DotRow<T>(m, GateRow(p.layout, first + i, inter), x, g);
    DotRow<T>(m, UpRow(p.layout, first + i, inter), x, u);
    for (int t = 0; t < T; ++t) {
      gate[t][i] = g[t];
      up[t][i] = u[t];
    }
  }
  for (int t = 0; t < T; ++t) {
    p.gated_fn(p.gated_ctx, gate[t], up[t], n, p.out + (r + t) * p.out_stride + first);
  }
}

template <int T>
void RunTile(const Bf16GemmParams& p, const GemmWorkItem& item, int64_t r) {
  const float* x[T];
  for (int t = 0; t < T; ++t) {
    const int64_t row = p.input_row != nullptr ? p.input_row[r + t] : r + t;
    x[t] = p.input + row * p.input_stride;
  }
  const Bf16MatrixRef& m = p.experts[item.expert];
  for (int64_t unit = item.begin; unit < item.end; ++unit) RunUnit<T>(p, m, unit, r, x);
}

}  // namespace

void RunBf16Gemm(const Bf16GemmParams& p) {
  for (;;) {
    const int32_t i = __atomic_fetch_add(p.next_item, 1, __ATOMIC_RELAXED);
    if (i >= p.num_items) return;
    const GemmWorkItem& item = p.items[i];
    const int64_t end = p.route_begin[item.expert + 1];
    for (int64_t r = p.route_begin[item.expert]; r < end; r += kTileRoutes) {
      switch (std::min<int64_t>(kTileRoutes, end - r)) {
        case 1:
          RunTile<1>(p, item, r);
          break;
        case 2:
          RunTile<2>(p, item, r);
          break;
        case 3:
          RunTile<3>(p, item, r);
          break;
        default:
          RunTile<kTileRoutes>(p, item, r);
          break;
      }
    }
  }
}

}  // namespace moe::cpu
