// Phase order and buffers of one pass (expert_pass.h). Routes are numbered expert by expert, in
// token order inside each expert, so that one expert's intermediate and output rows are
// contiguous; the combine reads them back per token in top-k slot order.
#include "kernels/cpu/expert_pass.h"

#include <algorithm>

#include "kernels/cpu/combine.h"
#include "kernels/cpu/gated_activation.h"
#include "kernels/cpu/quantize_rows.h"

namespace moe::cpu {
namespace {

// Grows `v` to at least n elements (never shrinks, so steady-state passes do not allocate).
template <typename V>
auto* Grow(V& v, int64_t n) {
  if (static_cast<int64_t>(v.size()) < n) v.resize(static_cast<size_t>(n));
  return v.data();
}

// BF16 hidden states are widened in pieces of this many columns (a multiple of 32) for the int8
// copy.
constexpr int64_t kMaxWidenedRow = 1024;

int BlockOf(WeightFormat f) {
  return static_cast<int>(f == WeightFormat::kMxfp4 ? kMxfp4Block : kNvfp4Block);
}

bool IsFp4(WeightFormat f) { return f != WeightFormat::kBf16; }

// Numbers the routes expert by expert; returns how many there are.
int64_t GroupRoutes(const PreparedLayer& p, const PassInput& in, PassWorkspace& ws) {
  const int64_t experts = p.experts + p.shared;
  const int64_t t_count = in.tokens, k_count = in.top_k;
  ws.route_begin.assign(static_cast<size_t>(experts + 1), 0);
  for (int64_t i = 0; i < t_count * k_count; ++i) {
    if (in.ids[i] >= 0) ++ws.route_begin[in.ids[i] + 1];
  }
  const bool any_shared = in.shared_mask != nullptr && p.shared > 0;
  for (int64_t t = 0; any_shared && t < t_count; ++t) {
    for (int64_t s = 0; s < p.shared && in.shared_mask[t] != 0; ++s) {
      ++ws.route_begin[p.experts + s + 1];
    }
  }
  for (int64_t e = 0; e < experts; ++e) ws.route_begin[e + 1] += ws.route_begin[e];
  const int64_t routes = ws.route_begin[experts];
  ws.fill.assign(ws.route_begin.begin(), ws.route_begin.end() - 1);
  int32_t* input_row = Grow(ws.input_row, routes);
  int32_t* route_of = Grow(ws.route_of, t_count * k_count);
  int32_t* shared_route_of = Grow(ws.shared_route_of, t_count * p.shared);
  for (int64_t t = 0; t < t_count; ++t) {
    for (int64_t k = 0; k < k_count; ++k) {
      const int32_t id = in.ids[t * k_count + k];
      int32_t r = -1;
      if (id >= 0) {
        r = static_cast<int32_t>(ws.fill[id]++);
        input_row[r] = static_cast<int32_t>(t);
      }
      route_of[t * k_count + k] = r;
    }
    for (int64_t s = 0; s < p.shared; ++s) {
      int32_t r = -1;
      if (any_shared && in.shared_mask[t] != 0) {
        r = static_cast<int32_t>(ws.fill[p.experts + s]++);
        input_row[r] = static_cast<int32_t>(t);
      }
      shared_route_of[t * p.shared + s] = r;
    }
  }
  return routes;
}

// FP4: int16 per block; BF16 weights: fp32 (only BF16 inputs need a copy).
void StageHidden(const PreparedLayer& p, const PassInput& in, bool int8, ThreadPool& pool,
                 PassWorkspace& ws) {
  const int64_t h = p.hidden;
  if (!IsFp4(p.format)) {
    if (in.x_bf16 == nullptr) return;
    float* x = Grow(ws.x_f32, in.tokens * h);
    pool.ParallelFor(pool.num_threads(), [&](int i, int n) {
      const Range rows = EvenSplit(in.tokens, i, n);
      for (int64_t t = rows.begin; t < rows.end; ++t)
        Bf16RowToFloat(in.x_bf16 + t * h, h, x + t * h);
    });
    return;
  }
  const int block = BlockOf(p.format);
  const int64_t blocks = h / block;
  int16_t* q = Grow(ws.x_q, in.tokens * h);
  float* scales = Grow(ws.x_scales, in.tokens * blocks);
  int8_t* q8 = int8 ? Grow(ws.x_q8, in.tokens * h) : nullptr;
  float* scales8 = int8 ? Grow(ws.x_scales8, in.tokens * blocks) : nullptr;
  int32_t* bias8 = int8 ? Grow(ws.x_bias8, in.tokens * blocks) : nullptr;
  pool.ParallelFor(pool.num_threads(), [&](int i, int n) {
    const Range rows = EvenSplit(in.tokens, i, n);
    float widened[kMaxWidenedRow];
    for (int64_t t = rows.begin; t < rows.end; ++t) {
      const float* x = in.x_f32 + t * h;
      if (in.x_f32 == nullptr) {
        QuantizeBf16RowInt16(in.x_bf16 + t * h, h, block, q + t * h, scales + t * blocks);
        if (!int8) continue;
        for (int64_t c0 = 0; c0 < h; c0 += kMaxWidenedRow) {
          const int64_t n = std::min(kMaxWidenedRow, h - c0);
          Bf16RowToFloat(in.x_bf16 + t * h + c0, n, widened);
          QuantizeRowInt8(widened, n, block, q8 + t * h + c0, scales8 + t * blocks + c0 / block,
                          bias8 + t * blocks + c0 / block);
        }
        continue;
      }
      QuantizeRowInt16(x, h, block, q + t * h, scales + t * blocks);
      if (int8) QuantizeRowInt8(x, h, block, q8 + t * h, scales8 + t * blocks, bias8 + t * blocks);
    }
  });
}

void QuantizeIntermediate(const PreparedLayer& p, int64_t routes, ThreadPool& pool,
                          PassWorkspace& ws) {
  const int64_t inter = p.inter;
  const int block = BlockOf(p.format);
  const int64_t blocks = inter / block;
  int16_t* q = Grow(ws.act_q, routes * inter);
  float* scales = Grow(ws.act_scales, routes * blocks);
  const float* act = ws.act.data();
  pool.ParallelFor(pool.num_threads(), [&](int i, int n) {
    const Range rows = EvenSplit(routes, i, n);
    for (int64_t r = rows.begin; r < rows.end; ++r) {
      QuantizeRowInt16(act + r * inter, inter, block, q + r * inter, scales + r * blocks);
    }
  });
}

// Sizes the per-thread panel scratch for experts of up to `max_routes` routes.
void PrepareScratch(const PreparedLayer& p, int threads, int64_t max_routes, PassWorkspace& ws) {
  const int block = BlockOf(p.format);
  const int64_t cols = std::max(PanelCols(p.hidden, block), PanelCols(p.inter, block));
  ws.panels.resize(threads);
  ws.panel_scales.resize(threads);
  ws.accumulators.resize(threads);
  ws.scratch.resize(threads);
  for (int i = 0; i < threads; ++i) {
    ws.scratch[i] = Fp4Scratch{Grow(ws.panels[i], cols * kGroupRows),
                               Grow(ws.panel_scales[i], cols / 16 * kGroupRows),
                               Grow(ws.accumulators[i], max_routes * kGroupRows)};
  }
}

int64_t MaxRoutesPerExpert(const PassWorkspace& ws) {
  int64_t most = 0;
  for (size_t e = 0; e + 1 < ws.route_begin.size(); ++e) {
    most = std::max(most, ws.route_begin[e + 1] - ws.route_begin[e]);
  }
  return most;
}

struct GemmIo {
  const int32_t* input_row;
  const int16_t* input_q;
  const float* input_scales;
  const int8_t* input_q8;  // null: no int8 copy
  const float* input_scales8;
  const int32_t* input_bias8;
  const float* input_f32;
  int64_t input_cols;
  float* out;
  int64_t out_cols;
  Fp4Epilogue epilogue;
};

void RunFp4Phase(const PreparedLayer& p, const ExpertLayer& layer, const GemmIo& io,
                 const std::vector<Fp4MatrixRef>& matrices, int64_t groups,
                 const CpuKernels& kernels, ThreadPool& pool, PassWorkspace& ws) {
  const int threads = pool.num_threads();
  const int block = BlockOf(p.format);
  PlanGemm(ws.route_begin, groups, threads * kItemsPerThread, &ws.plan);
  PrepareScratch(p, threads, MaxRoutesPerExpert(ws), ws);
  Fp4GemmParams params;
  params.experts = matrices.data();
  params.route_begin = ws.route_begin.data();
  params.input_row = io.input_row;
  params.input = io.input_q;
  params.input_stride = io.input_cols;
  params.input_scales = io.input_scales;
  params.input_scale_stride = io.input_cols / block;
  params.input8 = io.input_q8;
  params.input8_scales = io.input_scales8;
  params.input8_bias = io.input_bias8;
  params.out = io.out;
  params.out_stride = io.out_cols;
  params.epilogue = io.epilogue;
  params.gated_fn = &GatedActivation;
  params.gated_ctx = &layer.activation;
  params.items = ws.plan.items.data();
  params.num_items = static_cast<int32_t>(ws.plan.items.size());
  params.next_item = &ws.plan.next;
  params.scratch = ws.scratch.data();
  params.panel_cols = PanelCols(io.input_cols, block);
  pool.ParallelFor(threads, [&](int i, int) { kernels.fp4_gemm(params, i); });
}

void RunBf16Phase(const ExpertLayer& layer, const GemmIo& io,
                  const std::vector<Bf16MatrixRef>& matrices, int64_t outputs, ThreadPool& pool,
                  PassWorkspace& ws) {
  const int threads = pool.num_threads();
  PlanGemm(ws.route_begin, (outputs + kBf16UnitOutputs - 1) / kBf16UnitOutputs,
           threads * kItemsPerThread, &ws.plan);
  Bf16GemmParams params;
  params.experts = matrices.data();
  params.route_begin = ws.route_begin.data();
  params.input_row = io.input_row;
  params.input = io.input_f32;
  params.input_stride = io.input_cols;
  params.out = io.out;
  params.out_stride = io.out_cols;
  params.epilogue = io.epilogue;
  params.layout = layer.layout;
  params.gated_fn = &GatedActivation;
  params.gated_ctx = &layer.activation;
  params.items = ws.plan.items.data();
  params.num_items = static_cast<int32_t>(ws.plan.items.size());
  params.next_item = &ws.plan.next;
  pool.ParallelFor(threads, [&](int, int) { RunBf16Gemm(params); });
}

void CollectBf16(const ExpertLayer& layer, PassWorkspace& ws) {
  ws.bf16_w13.clear();
  ws.bf16_w2.clear();
  for (const auto* list : {&layer.experts, &layer.shared_experts}) {
    for (const ExpertWeights& e : *list) {
      const float* b13 = e.b13.present() ? e.b13.As<const float>() : nullptr;
      const float* b2 = e.b2.present() ? e.b2.As<const float>() : nullptr;
      ws.bf16_w13.push_back({e.w13.values.As<const uint16_t>(), b13, e.w13.rows, e.w13.cols});
      ws.bf16_w2.push_back({e.w2.values.As<const uint16_t>(), b2, e.w2.rows, e.w2.cols});
    }
  }
}

void RunGemms(const PreparedLayer& p, const ExpertLayer& layer, const PassInput& in,
              const PassOptions& options, int64_t routes, const CpuKernels& kernels,
              ThreadPool& pool, PassWorkspace& ws) {
  const int64_t h = p.hidden, inter = p.inter;
  float* act = Grow(ws.act, routes * inter);
  float* out = Grow(ws.expert_out, routes * h);
  if (IsFp4(p.format)) {
    const GemmIo w13{ws.input_row.data(),
                     ws.x_q.data(),
                     ws.x_scales.data(),
                     options.int8_w13 ? ws.x_q8.data() : nullptr,
                     ws.x_scales8.data(),
                     ws.x_bias8.data(),
                     nullptr,
                     h,
                     act,
                     inter,
                     Fp4Epilogue::kGated};
    RunFp4Phase(p, layer, w13, p.w13_refs, 2 * inter / kGroupRows, kernels, pool, ws);
    QuantizeIntermediate(p, routes, pool, ws);
    const GemmIo w2{nullptr,
                    ws.act_q.data(),
                    ws.act_scales.data(),
                    nullptr,
                    nullptr,
                    nullptr,
                    nullptr,
                    inter,
                    out,
                    h,
                    Fp4Epilogue::kStore};
    RunFp4Phase(p, layer, w2, p.w2_refs, h / kGroupRows, kernels, pool, ws);
    return;
  }
  CollectBf16(layer, ws);
  const float* x = in.x_f32 != nullptr ? in.x_f32 : ws.x_f32.data();
  const GemmIo w13{
      ws.input_row.data(), nullptr, nullptr, nullptr, nullptr, nullptr, x, h, act, inter,
      Fp4Epilogue::kGated};
  RunBf16Phase(layer, w13, ws.bf16_w13, inter, pool, ws);
  const GemmIo w2{nullptr,
                  nullptr,
                  nullptr,
                  nullptr,
                  nullptr,
                  nullptr,
                  act,
                  inter,
                  out,
                  h,
                  Fp4Epilogue::kStore};
  RunBf16Phase(layer, w2, ws.bf16_w2, h, pool, ws);
}

}  // namespace

void RunExpertPass(const PreparedLayer& prepared, const ExpertLayer& layer, const PassInput& input,
                   const PassOptions& options, const CpuKernels& kernels, ThreadPool& pool,
                   PassWorkspace& ws) {
  const int64_t routes = GroupRoutes(prepared, input, ws);
  if (routes > 0) {
    StageHidden(prepared, input, options.int8_w13, pool, ws);
    RunGemms(prepared, layer, input, options, routes, kernels, pool, ws);
  }
  CombineParams combine;
  combine.expert_out = ws.expert_out.data();
  combine.hidden = prepared.hidden;
  combine.tokens = input.tokens;
  combine.top_k = input.top_k;
  combine.route_of = ws.route_of.data();
  combine.weights = input.weights;
  combine.shared = prepared.shared;
  combine.shared_route_of = ws.shared_route_of.data();
  combine.out_f32 = input.out_f32;
  combine.out_bf16 = input.out_bf16;
  // A few tokens' combine is a few microseconds on one core: waking the pool (and leaving its
  // workers spinning) would cost more than it saves. Roughly one thread per 64K output elements.
  const int64_t elements = input.tokens * prepared.hidden;
  const int combine_threads = static_cast<int>(
      std::clamp<int64_t>(elements / 65536, 1, pool.num_threads()));
  pool.ParallelFor(combine_threads, [&](int i, int n) { CombineRoutes(combine, i, n); });
}

}  // namespace moe::cpu
