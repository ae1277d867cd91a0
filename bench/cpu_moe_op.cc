#include "bench/cpu_moe_op.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>

#include "kernels/cpu/quantize_rows.h"

namespace moe::bench {

const char kDefinitions[] =
    "problem_d: one MXFP4 expert matrix product as a MoE op (ggml MUL_MAT_ID: E=32, top-4, "
    "2880x2880 weight per expert, fp32 activations, output [tokens,4,2880], no activation or "
    "combine), the op ggml's test-backend-ops times (1.47 ms at 1 token, 412 ms at 512 tokens on "
    "this machine per shared/spec/performance.md). Timed (wall clock, median of runs, p10/p90 "
    "for the spread): route grouping + activation quantization + all products. "
    "gflops = 2*tokens*4*2880*2880 / median time. 1 token: gbs = the 4 active experts' packed "
    "bytes (4.41 MB each: 2880*2880/2 values + 2880*90 UE8M0 scales) / time; weights=cold rotates "
    "through disjoint expert groups (weights come from DRAM), weights=warm repeats one route set "
    "(an op benchmark's setting: the 17.6 MB stay in the 32 MB L3); every cold round also reads "
    "17.6 MB of a 512 MB buffer with all threads, floor_ms is the median of those reads and "
    "floor_over_time the median per-round ratio floor/op (1.0 = at the DRAM read floor of that "
    "moment). 512 tokens: random distinct top-4 per token (all 32 experts active), int16 and int8 "
    "kernels alternating round by round; kernels=int8 gives experts with more than 4 routes int8 "
    "activations (W4A8). cpu_median_ms: process CPU time per run (all threads, spin-waits "
    "included); gflops_per_cpu_second = flops / that, the rate the cores delivered while this "
    "process held them (the machine is shared: wall time also counts other processes). "
    "expert_mlp: the full expert MLP (w13 GEMM, SWIGLUOAI with biases, interleaved gate/up, w2 "
    "GEMM, top-4 weighted combine) through CpuBackend::Run vs RunExpertsReference, "
    "activations=int16 (default) or int8-w13, gflops counting 3 matrix products per route, "
    "gbs_active_experts = active experts' w13+w2 packed bytes (13.22 MB each) / time; 1-token "
    "points rotate the experts (cold).";

namespace {

float Dot(const float* a, const float* b, int64_t n) {
  constexpr int kLanes = 8;
  float partial[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int l = 0; l < kLanes; ++l) partial[l] += a[i + l] * b[i + l];
  }
  for (int l = 0; i < n; ++i, ++l) partial[l] += a[i] * b[i];
  float sum = 0.f;
  for (int l = 0; l < kLanes; ++l) sum += partial[l];
  return sum;
}

template <typename V>
auto* Grow(V& v, int64_t n) {
  if (static_cast<int64_t>(v.size()) < n) v.resize(static_cast<size_t>(n));
  return v.data();
}

}  // namespace

MoeMatmul::MoeMatmul(const std::vector<WeightMatrix>& experts, cpu::ThreadPool& pool,
                     const cpu::CpuKernels& kernels, bool int8)
    : pool_(pool), kernels_(kernels), int8_(int8) {
  rows_ = experts[0].rows;
  cols_ = experts[0].cols;
  block_ = experts[0].format == WeightFormat::kMxfp4 ? 32 : 16;
  packed_.resize(experts.size());
  pool_.ParallelFor(pool_.num_threads(), [&](int i, int n) {
    const cpu::Range mine = cpu::EvenSplit(static_cast<int64_t>(experts.size()), i, n);
    for (int64_t e = mine.begin; e < mine.end; ++e) {
      packed_[e] = *cpu::PackFp4Matrix(experts[e], cpu::RowPairing::kPlain,
                                       GateUpLayout::kConcatenated, 1.f, 1.f, nullptr);
    }
  });
  for (const cpu::PackedFp4Matrix& m : packed_) refs_.push_back(m.ref());
}

void MoeMatmul::Run(const float* x, const int32_t* ids, int64_t tokens, int64_t top_k) {
  const int64_t experts = static_cast<int64_t>(refs_.size());
  route_begin_.assign(experts + 1, 0);
  for (int64_t i = 0; i < tokens * top_k; ++i) ++route_begin_[ids[i] + 1];
  for (int64_t e = 0; e < experts; ++e) route_begin_[e + 1] += route_begin_[e];
  fill_.assign(route_begin_.begin(), route_begin_.end() - 1);
  int32_t* input_row = Grow(input_row_, tokens * top_k);
  int32_t* route_of = Grow(route_of_, tokens * top_k);
  for (int64_t i = 0; i < tokens * top_k; ++i) {
    const int32_t r = static_cast<int32_t>(fill_[ids[i]]++);
    input_row[r] = static_cast<int32_t>(i / top_k);
    route_of[i] = r;
  }
  int16_t* q = Grow(x_q_, tokens * cols_);
  float* scales = Grow(x_scales_, tokens * (cols_ / block_));
  int8_t* q8 = int8_ ? Grow(x_q8_, tokens * cols_) : nullptr;
  float* scales8 = int8_ ? Grow(x_scales8_, tokens * (cols_ / block_)) : nullptr;
  int32_t* bias8 = int8_ ? Grow(x_bias8_, tokens * (cols_ / block_)) : nullptr;
  const int threads = pool_.num_threads();
  cpu::PlanGemm(route_begin_, rows_ / cpu::kGroupRows, threads * cpu::kItemsPerThread, &plan_);
  int64_t most = 0;
  for (int64_t e = 0; e < experts; ++e)
    most = std::max(most, route_begin_[e + 1] - route_begin_[e]);
  const int64_t panel_cols = cpu::PanelCols(cols_, block_);
  panels_.resize(threads);
  panel_scales_.resize(threads);
  acc_.resize(threads);
  scratch_.resize(threads);
  for (int i = 0; i < threads; ++i) {
    scratch_[i] = cpu::Fp4Scratch{Grow(panels_[i], panel_cols * cpu::kGroupRows),
                                  Grow(panel_scales_[i], panel_cols / 16 * cpu::kGroupRows),
                                  Grow(acc_[i], most * cpu::kGroupRows)};
  }
  cpu::Fp4GemmParams p;
  p.experts = refs_.data();
  p.route_begin = route_begin_.data();
  p.input_row = input_row;
  p.input = q;
  p.input_stride = cols_;
  p.input_scales = scales;
  p.input_scale_stride = cols_ / block_;
  p.input8 = q8;
  p.input8_scales = scales8;
  p.input8_bias = bias8;
  p.out = Grow(out_, tokens * top_k * rows_);
  p.out_stride = rows_;
  p.items = plan_.items.data();
  p.num_items = static_cast<int32_t>(plan_.items.size());
  p.next_item = &plan_.next;
  p.scratch = scratch_.data();
  p.panel_cols = panel_cols;
  pool_.ParallelFor(threads, [&](int i, int n) {
    const cpu::Range mine = cpu::EvenSplit(tokens, i, n);
    for (int64_t t = mine.begin; t < mine.end; ++t) {
      const int64_t blocks = cols_ / block_;
      cpu::QuantizeRowInt16(x + t * cols_, cols_, block_, q + t * cols_, scales + t * blocks);
      if (int8_) {
        cpu::QuantizeRowInt8(x + t * cols_, cols_, block_, q8 + t * cols_, scales8 + t * blocks,
                             bias8 + t * blocks);
      }
    }
  });
  pool_.ParallelFor(threads, [&](int i, int) { kernels_.fp4_gemm(p, i); });
}

double MoeMatmul::CheckAgainstReference(const std::vector<WeightMatrix>& experts, const float* x,
                                        const int32_t* ids, int64_t tokens, int64_t top_k) {
  Run(x, ids, tokens, top_k);
  const std::vector<float> want = ReferenceMoeMatmul(experts, x, ids, tokens, top_k);
  double d2 = 0, r2 = 0;
  for (int64_t i = 0; i < tokens * top_k; ++i) {
    const float* got = out_.data() + route_of_[i] * rows_;
    for (int64_t n = 0; n < rows_; ++n) {
      const double d = got[n] - want[i * rows_ + n];
      d2 += d * d;
      r2 += double(want[i * rows_ + n]) * want[i * rows_ + n];
    }
  }
  return std::sqrt(d2 / r2);
}

std::vector<float> ReferenceMoeMatmul(const std::vector<WeightMatrix>& experts, const float* x,
                                      const int32_t* ids, int64_t tokens, int64_t top_k) {
  const int64_t rows = experts[0].rows, cols = experts[0].cols;
  std::vector<float> out(tokens * top_k * rows);
  std::vector<float> dense(rows * cols);
  for (size_t e = 0; e < experts.size(); ++e) {
    bool used = false;
    for (int64_t i = 0; i < tokens * top_k; ++i) used |= ids[i] == static_cast<int32_t>(e);
    if (!used) continue;
    DequantizeRows(experts[e], 0, rows, 1.f, dense.data());
    for (int64_t i = 0; i < tokens * top_k; ++i) {
      if (ids[i] != static_cast<int32_t>(e)) continue;
      for (int64_t n = 0; n < rows; ++n) {
        out[i * rows + n] = Dot(&dense[n * cols], x + (i / top_k) * cols, cols);
      }
    }
  }
  return out;
}

float SumFloats(const float* p, size_t n) {
  __m256 s0 = _mm256_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
  for (size_t i = 0; i + 32 <= n; i += 32) {
    s0 = _mm256_add_ps(s0, _mm256_loadu_ps(p + i));
    s1 = _mm256_add_ps(s1, _mm256_loadu_ps(p + i + 8));
    s2 = _mm256_add_ps(s2, _mm256_loadu_ps(p + i + 16));
    s3 = _mm256_add_ps(s3, _mm256_loadu_ps(p + i + 24));
  }
  const __m256 s = _mm256_add_ps(_mm256_add_ps(s0, s1), _mm256_add_ps(s2, s3));
  float lanes[8];
  _mm256_storeu_ps(lanes, s);
  float sum = 0.f;
  for (float v : lanes) sum += v;
  return sum;
}

}  // namespace moe::bench
