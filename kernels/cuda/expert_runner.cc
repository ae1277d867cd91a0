#include "kernels/cuda/expert_runner.h"

#include <algorithm>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/cuda/repack.h"

namespace moe::cuda {
namespace {

static_assert(static_cast<int>(ActKind::kSilu) == static_cast<int>(ActivationKind::kSilu));
static_assert(static_cast<int>(ActKind::kSwigluOai) ==
              static_cast<int>(ActivationKind::kSwigluOai));
static_assert(static_cast<int>(ActKind::kSitu) == static_cast<int>(ActivationKind::kSitu));
static_assert(static_cast<int>(ActKind::kGelu) == static_cast<int>(ActivationKind::kGelu));
static_assert(static_cast<int>(ActKind::kGeluTanh) ==
              static_cast<int>(ActivationKind::kGeluTanh));

int64_t RoundUp(int64_t a, int64_t b) { return (a + b - 1) / b * b; }

ActivationDesc ToDesc(const ActivationParams& p) {
  ActivationDesc d;
  d.kind = static_cast<ActKind>(static_cast<int>(p.kind));
  d.alpha = p.alpha;
  d.limit = p.limit;
  d.beta = p.beta;
  d.linear_beta = p.linear_beta;
  return d;
}

// Host-side results of packing one slot, copied to the device by the caller.
struct SlotEpilogue {
  float* ep_scale;   // 3 floats
  float* bias_gate;  // [I]
  float* bias_up;    // [I]
  float* bias_w2;    // [H]
};

void FillEpilogue(const ExpertLayer& layer, const ExpertWeights& w, const PackedScaleInfo& w13,
                  const PackedScaleInfo& w2, const SlotEpilogue& out) {
  out.ep_scale[0] = w13.epilogue_factor * w.w13_gate_global_scale;
  out.ep_scale[1] = w13.epilogue_factor * w.w13_up_global_scale;
  out.ep_scale[2] = w2.epilogue_factor * w.w2_global_scale;
  const int64_t inter = layer.intermediate;
  const float* b13 = w.b13.present() ? w.b13.As<const float>() : nullptr;
  const float* b2 = w.b2.present() ? w.b2.As<const float>() : nullptr;
  for (int64_t j = 0; j < inter; ++j) {
    out.bias_gate[j] = b13 != nullptr ? b13[GateRow(layer.layout, j, inter)] : 0.f;
    out.bias_up[j] = b13 != nullptr ? b13[UpRow(layer.layout, j, inter)] : 0.f;
  }
  for (int64_t h = 0; h < layer.hidden; ++h) out.bias_w2[h] = b2 != nullptr ? b2[h] : 0.f;
}

// Packs and uploads slots tid, tid + threads, ... of the layer.
absl::Status UploadSlots(const ExpertLayer& layer, DeviceExpertLayer& d, int device, int tid,
                         int threads, std::vector<float>& ep_scale, std::vector<float>& bias_gate,
                         std::vector<float>& bias_up, std::vector<float>& bias_w2,
                         absl::Mutex* device_calls) {
  if (absl::Status s = CudaStatus(cudaSetDevice(device), "cudaSetDevice"); !s.ok()) return s;
  const PackedShape s13 = W13PackedShape(layer.hidden, layer.intermediate);
  const PackedShape s2 = W2PackedShape(layer.hidden, layer.intermediate);
  std::vector<uint32_t> v13(s13.value_words()), c13(s13.scale_words(layer.format));
  std::vector<uint32_t> v2(s2.value_words()), c2(s2.scale_words(layer.format));
  const int slots = d.num_experts + d.num_shared;
  for (int slot = tid; slot < slots; slot += threads) {
    const ExpertWeights& w = slot < d.num_experts ? layer.experts[slot]
                                                  : layer.shared_experts[slot - d.num_experts];
    PackedScaleInfo i13, i2;
    if (absl::Status s = PackW13(w.w13, layer.layout, absl::MakeSpan(v13), absl::MakeSpan(c13),
                                 &i13);
        !s.ok()) {
      return s;
    }
    if (absl::Status s = PackW2(w.w2, absl::MakeSpan(v2), absl::MakeSpan(c2), &i2); !s.ok()) {
      return s;
    }
    const struct {
      const DeviceBuffer& buf;
      const std::vector<uint32_t>& host;
    } copies[] = {{d.w13.values, v13}, {d.w13.scales, c13}, {d.w2.values, v2}, {d.w2.scales, c2}};
    for (const auto& c : copies) {
      const size_t bytes = c.host.size() * sizeof(uint32_t);
      char* dst = c.buf.as<char>() + bytes * slot;
      absl::MutexLockMaybe lock(device_calls);
      if (absl::Status s = CudaStatus(
              cudaMemcpy(dst, c.host.data(), bytes, cudaMemcpyHostToDevice), "weight upload");
          !s.ok()) {
        return s;
      }
    }
    const int64_t inter = layer.intermediate, hidden = layer.hidden;
    FillEpilogue(layer, w, i13, i2,
                 SlotEpilogue{&ep_scale[3 * slot], &bias_gate[inter * slot],
                              &bias_up[inter * slot], &bias_w2[hidden * slot]});
  }
  return absl::OkStatus();
}

absl::Status Upload(DeviceBuffer& buf, const std::vector<float>& host) {
  const size_t bytes = host.size() * sizeof(float);
  if (absl::Status s = buf.Reserve(bytes); !s.ok()) return s;
  return CudaStatus(cudaMemcpy(buf.get(), host.data(), bytes, cudaMemcpyHostToDevice),
                    "epilogue upload");
}

void SetGemmShape(const PackedShape& shape, WeightFormat format, DeviceGemmWeights& w) {
  w.tiles = static_cast<int>(shape.tiles);
  w.chunks = static_cast<int>(shape.chunks);
  w.values_stride = shape.value_words() / 4;
  w.scales_stride =
      format == WeightFormat::kNvfp4 ? shape.scale_words(format) / 4 : shape.scale_words(format);
}

}  // namespace

absl::Status CudaStatus(cudaError_t err, absl::string_view what) {
  if (err == cudaSuccess) return absl::OkStatus();
  return absl::InternalError(absl::StrCat(what, ": ", cudaGetErrorString(err)));
}

DeviceBuffer::~DeviceBuffer() {
  if (ptr_ != nullptr) cudaFree(ptr_);
}

absl::Status DeviceBuffer::Reserve(size_t bytes) {
  if (bytes <= bytes_ && ptr_ != nullptr) return absl::OkStatus();
  if (ptr_ != nullptr) cudaFree(ptr_);
  ptr_ = nullptr;
  bytes_ = 0;
  const size_t want = std::max<size_t>(bytes, 256);
  if (absl::Status s = CudaStatus(cudaMalloc(&ptr_, want), absl::StrCat("cudaMalloc(", want, ")"));
      !s.ok()) {
    ptr_ = nullptr;
    return s;
  }
  bytes_ = want;
  return absl::OkStatus();
}

int64_t DeviceExpertLayer::device_bytes() const {
  const DeviceBuffer* all[] = {&w13.values, &w13.scales, &w2.values, &w2.scales,
                               &ep_scale,   &bias_gate,  &bias_up,   &bias_w2};
  int64_t total = 0;
  for (const DeviceBuffer* b : all) total += static_cast<int64_t>(b->size());
  return total;
}

absl::StatusOr<std::unique_ptr<DeviceExpertLayer>> UploadExpertLayer(
    const ExpertLayer& layer, int device, int threads, absl::Mutex* device_calls) {
  if (layer.format != WeightFormat::kMxfp4 && layer.format != WeightFormat::kNvfp4) {
    return absl::FailedPreconditionError(absl::StrCat(
        "cuda backend: ", WeightFormatName(layer.format), " weights are not supported (FP4 only)"));
  }
  const int slots = static_cast<int>(layer.experts.size() + layer.shared_experts.size());
  if (slots == 0 || slots > kMaxPrologueSlots) {
    return absl::FailedPreconditionError(absl::StrCat(
        "cuda backend: ", slots, " expert slots per layer; 1..", kMaxPrologueSlots, " supported"));
  }
  auto d = std::make_unique<DeviceExpertLayer>();
  // On failure what was allocated is freed under `device_calls` too.
  const auto fail = [&](absl::Status s) {
    absl::MutexLockMaybe lock(device_calls);
    d.reset();
    return s;
  };
  d->format = layer.format == WeightFormat::kMxfp4 ? Fp4Format::kMxfp4 : Fp4Format::kNvfp4;
  d->hidden = layer.hidden;
  d->inter = layer.intermediate;
  d->hidden_chunks = (layer.hidden + 63) / 64;
  d->inter_padded = RoundUp(layer.intermediate, 64);
  d->num_experts = static_cast<int>(layer.experts.size());
  d->num_shared = static_cast<int>(layer.shared_experts.size());
  d->act = ToDesc(layer.activation);
  const PackedShape s13 = W13PackedShape(layer.hidden, layer.intermediate);
  const PackedShape s2 = W2PackedShape(layer.hidden, layer.intermediate);
  SetGemmShape(s13, layer.format, d->w13);
  SetGemmShape(s2, layer.format, d->w2);
  const struct {
    DeviceBuffer& buf;
    int64_t words;
  } sizes[] = {{d->w13.values, s13.value_words()},
               {d->w13.scales, s13.scale_words(layer.format)},
               {d->w2.values, s2.value_words()},
               {d->w2.scales, s2.scale_words(layer.format)}};
  for (const auto& s : sizes) {
    absl::Status st;
    {
      absl::MutexLockMaybe lock(device_calls);
      st = s.buf.Reserve(static_cast<size_t>(s.words) * 4 * slots);
    }
    if (!st.ok()) return fail(st);
  }
  std::vector<float> ep_scale(3 * slots), bias_gate(layer.intermediate * slots),
      bias_up(layer.intermediate * slots), bias_w2(layer.hidden * slots);
  threads = std::max(1, std::min(threads, slots));
  std::vector<absl::Status> status(threads);
  std::vector<std::thread> workers;
  for (int tid = 0; tid < threads; ++tid) {
    workers.emplace_back([&, tid] {
      status[tid] = UploadSlots(layer, *d, device, tid, threads, ep_scale, bias_gate, bias_up,
                                bias_w2, device_calls);
    });
  }
  for (std::thread& w : workers) w.join();
  for (const absl::Status& s : status) {
    if (!s.ok()) return fail(s);
  }
  for (const auto& [buf, host] :
       {std::pair<DeviceBuffer*, const std::vector<float>*>{&d->ep_scale, &ep_scale},
        {&d->bias_gate, &bias_gate},
        {&d->bias_up, &bias_up},
        {&d->bias_w2, &bias_w2}}) {
    absl::Status s;
    {
      absl::MutexLockMaybe lock(device_calls);
      s = Upload(*buf, *host);
    }
    if (!s.ok()) return fail(s);
  }
  return d;
}

namespace {

// Grows `buf` to `bytes` when it is smaller (or unallocated) and zeroes the new allocation on
// `stream` (stream-ordered: no device-wide synchronization, which a CUDA graph capture on another
// thread's stream does not survive); the kernels keep what they use of it at zero from then on.
absl::Status ReserveZeroed(DeviceBuffer& buf, size_t bytes, cudaStream_t stream, const char* what) {
  if (buf.size() >= bytes && buf.get() != nullptr) return absl::OkStatus();
  if (absl::Status s = buf.Reserve(bytes); !s.ok()) return s;
  return CudaStatus(cudaMemsetAsync(buf.get(), 0, buf.size(), stream), what);
}

}  // namespace

ExpertRunner::ScratchSizes ExpertRunner::Sizes(const DeviceExpertLayer& layer,
                                               const RoutePlan& plan) const {
  const size_t routes = static_cast<size_t>(std::max<int64_t>(plan.slotted_routes, 1));
  ScratchSizes z;
  z.plain = {
      static_cast<size_t>(plan.tokens * layer.hidden_chunks * 64 * 2),  // x_staged_
      routes * 4,                                                       // slot_token_
      routes * 4,                                                       // slot_route_
      static_cast<size_t>(std::max<int64_t>(
          round_item_grid_ ? RoundedItemGrid(plan.num_items) : plan.num_items, 1)) *
          sizeof(ExpertItem),                                                        // items_
      static_cast<size_t>(std::max<int64_t>(plan.num_items, 1)) * sizeof(ExpertItem),  // wg_items_
      kWgSchedWords * sizeof(int32_t),                                               // wg_sched_
      4,                                                                             // num_items_
      // act_: direct routes use one act row per y row.
      std::max<size_t>(routes, static_cast<size_t>(std::max<int64_t>(plan.y_rows, 1))) *
          static_cast<size_t>(layer.inter_padded) * 2,
      static_cast<size_t>(std::max<int64_t>(plan.y_rows, 1) * layer.hidden) * 4,  // y_
      kMaxLayerRoutes * sizeof(int32_t),                                         // ready_
  };
  z.group_scratch = GroupScratchWords(layer.num_experts + layer.num_shared) * 4;
  z.item_ready = static_cast<size_t>(kItemReadyStride) *
                 static_cast<size_t>(std::max<int64_t>(
                     {RoundedItemGrid(plan.num_items), plan.num_items, plan.y_rows, 1})) *
                 4;
  z.fold_counters = static_cast<size_t>(plan.tokens) *
                    static_cast<size_t>((layer.hidden + kFoldRowsPerBlock - 1) / kFoldRowsPerBlock) *
                    4;
  return z;
}

bool ExpertRunner::Reserved(const DeviceExpertLayer& layer, const RoutePlan& plan) const {
  const ScratchSizes z = Sizes(layer, plan);
  const auto plain = PlainScratch(*this);
  for (size_t i = 0; i < plain.size(); ++i) {
    if (plain[i]->get() == nullptr || plain[i]->size() < z.plain[i]) return false;
  }
  const auto big_enough = [](const DeviceBuffer& b, size_t bytes) {
    return b.get() != nullptr && b.size() >= bytes;
  };
  return big_enough(group_scratch_, z.group_scratch) && big_enough(item_ready_, z.item_ready) &&
         big_enough(fold_counters_, z.fold_counters);
}

absl::Status ExpertRunner::Reserve(const DeviceExpertLayer& layer, const RoutePlan& plan,
                                   cudaStream_t stream) {
  const ScratchSizes z = Sizes(layer, plan);
  const auto plain = PlainScratch(*this);
  for (size_t i = 0; i < plain.size(); ++i) {
    const void* before = plain[i]->get();
    if (absl::Status s = plain[i]->Reserve(z.plain[i]); !s.ok()) return s;
    if (plain[i]->get() != before) ++scratch_generation_;
  }
  const void* group_before = group_scratch_.get();
  const void* fold_before = fold_counters_.get();
  if (absl::Status s = ReserveZeroed(group_scratch_, z.group_scratch, stream, "group scratch");
      !s.ok()) {
    return s;
  }
  const void* item_ready_before = item_ready_.get();
  if (absl::Status s = ReserveZeroed(item_ready_, z.item_ready, stream, "item ready counts");
      !s.ok()) {
    return s;
  }
  if (item_ready_.get() != item_ready_before) {
    ++scratch_generation_;
    item_ready_dirty_ = false;
  }
  if (absl::Status s = ReserveZeroed(fold_counters_, z.fold_counters, stream, "fold counters");
      !s.ok()) {
    return s;
  }
  if (group_scratch_.get() != group_before || fold_counters_.get() != fold_before) {
    ++scratch_generation_;
  }
  return absl::OkStatus();
}

absl::Status ExpertRunner::Mark(int stage, cudaStream_t stream) const {
  if (stage_events_ == nullptr) return absl::OkStatus();
  return CudaStatus(cudaEventRecord(stage_events_[stage], stream), "stage event");
}

namespace {

ExpertPrologueParams PrologueParams(const DeviceExpertLayer& layer, const DeviceBatch& batch,
                                    const RoutePlan& plan) {
  ExpertPrologueParams p;
  p.hidden = batch.hidden;
  p.hidden_bf16 = batch.hidden_bf16;
  p.ids = batch.ids;
  p.shared_mask = plan.num_shared > 0 ? batch.shared_mask : nullptr;
  p.tokens = static_cast<int32_t>(plan.tokens);
  p.top_k = static_cast<int32_t>(plan.top_k);
  p.hidden_size = static_cast<int32_t>(layer.hidden);
  p.hidden_chunks = static_cast<int32_t>(layer.hidden_chunks);
  p.num_experts = layer.num_experts;
  p.num_shared = plan.num_shared;
  p.tile_tokens = 8 * plan.token_groups;
  return p;
}

// The parts of the GEMM parameters both GEMMs share.
ExpertGemmParams GemmParams(const DeviceGemmWeights& w, const DeviceExpertLayer& layer,
                            const ExpertItem* items, const int32_t* num_items) {
  ExpertGemmParams p;
  p.values = w.values.get();
  p.scales = w.scales.get();
  p.values_expert_stride = w.values_stride;
  p.scales_expert_stride = w.scales_stride;
  p.tiles = w.tiles;
  p.chunks = w.chunks;
  p.items = items;
  p.num_items = num_items;
  p.ep_scale = layer.ep_scale.as<float>();
  return p;
}

}  // namespace

int64_t ExpertRunner::RoundedItemGrid(int64_t items) {
  if (items <= 16) return items;
  int log2 = 0;
  while ((items >> (log2 + 1)) != 0) ++log2;
  const int64_t step = int64_t{1} << (log2 - 3);
  return (items + step - 1) / step * step;
}

ExpertRunner::Decisions ExpertRunner::Decide(const DeviceExpertLayer& layer,
                                             const DeviceBatch& batch,
                                             const RoutePlan& given_plan) const {
  Decisions d;
  // The wgmma kernel's larger items: never more items than the given plan, so the scratch sized
  // for it (Reserve before capture) suffices.
  d.wgmma = wgmma_min_tokens_ > 0 && given_plan.max_count >= wgmma_min_tokens_ &&
            given_plan.token_groups <= kWgmmaTokenGroups;
  d.plan = d.wgmma ? WithTokenGroups(given_plan, kWgmmaTokenGroups) : given_plan;
  const RoutePlan& plan = d.plan;
  d.few = direct_ && plan.max_count <= 1 && plan.token_groups == 1;
  d.variant = variant_;
  if (d.variant == kAutoGemmVariant) {
    // Items of 32+ tokens: the tiled kernel with the bulk weight ring in groups of 4, empty
    // token groups skipped (A 512: 736 us against 785 without the skip and 915 for the register
    // ring, NOTES-cuda.md).
    d.variant = plan.token_groups >= 4 ? 8 : d.few ? 6 : 12;
  }
  d.direct = d.few && GemmUsesStreamingKernel(plan.token_groups, d.variant);
  // Folded combine: direct routes; grouped routes (bulk-copy variants only) when asked
  // (set_fold_grouped: measured slower, e.g. problem C at 64 tokens 153.7 vs 125.9 us).
  d.fold = fold_ && GemmCanFoldCombine(plan.token_groups, d.variant) &&
           (d.direct || (fold_grouped_ && GemmUsesBulkCopies(plan.token_groups, d.variant)));
  // The wgmma kernel reads B rows in natural order, so BF16 hidden rows of whole chunks serve as
  // GEMM1's B rows in place: the prologue then stages nothing and only groups the routes.
  d.hidden_in_place = d.wgmma && hidden_in_place_ && batch.hidden_bf16 &&
                      layer.hidden == layer.hidden_chunks * 64 &&
                      reinterpret_cast<uintptr_t>(batch.hidden) % 16 == 0;
  d.l2_ahead = d.wgmma && wgmma_l2_ahead_ && WgmmaStagesEpilogue(d.variant);
  d.persistent = d.wgmma && !d.l2_ahead && WgmmaStagesEpilogue(d.variant) &&
                 (wgmma_persistent_ == kPersistentOn ||
                  (wgmma_persistent_ == kPersistentAuto && layer.format == Fp4Format::kNvfp4));
  d.even_items = d.wgmma && (even_items_ == kPersistentOn ||
                             (even_items_ == kPersistentAuto && d.persistent));
  if (fused_layer_ != kFusedLayerOff && !layer_unavailable_ && variant_ == kAutoGemmVariant &&
      d.direct && d.fold) {
    const int routes = ExpertLayerRoutes(static_cast<int>(plan.tokens),
                                         static_cast<int>(plan.top_k), plan.num_shared);
    int sms = 0;
    d.layer = ExpertLayerFits(layer.format, static_cast<int>(plan.tokens), routes,
                              layer.w13.chunks, static_cast<int>(layer.inter_padded),
                              layer.w13.tiles, layer.w2.tiles, layer.w2.chunks, &sms);
    if (d.layer && fused_layer_ == kFusedLayerAuto) {
      // Weight bytes one route streams: both GEMMs' codes and scales of one expert slot.
      const int64_t scale_bytes = layer.format == Fp4Format::kMxfp4 ? 4 : 16;
      const int64_t per_route = (layer.w13.values_stride + layer.w2.values_stride) * 16 +
                                (layer.w13.scales_stride + layer.w2.scales_stride) * scale_bytes;
      d.layer = layer.w13.chunks >= kFusedLayerMinChunks &&
                routes * per_route >= kFusedLayerMinBytesPerSm * std::max(sms, 1);
    }
  }
  {
    GemmLaunch g;
    g.format = layer.format;
    g.token_groups = plan.token_groups;
    g.variant = d.variant;
    d.acc_scale = acc_scale_ && !d.layer && !d.wgmma && GemmCanScaleAccumulators(g);
  }
  d.grid_items = d.direct              ? plan.y_rows
                 : round_item_grid_ ? RoundedItemGrid(plan.num_items)
                                    : plan.num_items;
  if (item_ready_mode_ != kItemReadyOff && programmatic_ && stage_events_ == nullptr &&
      !d.wgmma) {
    GemmLaunch g1;
    g1.format = layer.format;
    g1.token_groups = plan.token_groups;
    g1.variant = d.variant;
    g1.num_items = static_cast<int>(d.grid_items);
    ExpertGemmParams rows;
    rows.out_cols = static_cast<int32_t>(layer.inter_padded);
    d.ready_target = GemmItemReadyCount(g1, rows);
    if (item_ready_mode_ == kItemReadyAuto) {
      const double waves = GemmWaves(g1, rows);
      if (waves < kItemReadyMinWaves || waves > kItemReadyMaxWaves) d.ready_target = 0;
    }
  }
  return d;
}

std::string ExpertRunner::ShapeKey(const DeviceExpertLayer& layer, const DeviceBatch& batch,
                                   const RoutePlan& plan) const {
  const Decisions d = Decide(layer, batch, plan);
  return absl::StrCat(reinterpret_cast<uintptr_t>(&layer), ":", plan.tokens, ":", plan.top_k,
                      ":", plan.num_shared, ":", d.plan.token_groups, ":", d.variant, ":",
                      d.wgmma, d.few, d.direct, d.fold, d.hidden_in_place, d.l2_ahead,
                      d.persistent, d.even_items, d.layer,
                      ":", d.ready_target, ":", d.acc_scale, ":",
                      d.grid_items, ":", batch.hidden_bf16, batch.out_bf16,
                      batch.shared_mask != nullptr);
}

absl::Status ExpertRunner::Enqueue(const DeviceExpertLayer& layer, const DeviceBatch& batch,
                                   const RoutePlan& given_plan, cudaStream_t stream) {
  if (given_plan.tokens == 0) return absl::OkStatus();
  if (absl::Status s = Reserve(layer, given_plan, stream); !s.ok()) return s;
  const Decisions d = Decide(layer, batch, given_plan);
  const RoutePlan& plan = d.plan;
  const bool wgmma = d.wgmma;
  if (poison_) {
    for (DeviceBuffer* b : {&x_staged_, &act_, &y_}) {
      if (absl::Status s = CudaStatus(cudaMemsetAsync(b->get(), 0xFF, b->size(), stream),
                                      "poison scratch");
          !s.ok()) {
        return s;
      }
    }
  }
  if (absl::Status s = Mark(0, stream); !s.ok()) return s;
  const int variant = d.variant;
  const bool direct = d.direct;
  const bool fold = d.fold;
  ExpertPrologueParams pro = PrologueParams(layer, batch, plan);
  pro.group_routes = !direct;
  if (fold) {
    pro.zero_unrouted_out = batch.out;
    pro.zero_unrouted_bf16 = batch.out_bf16;
  }
  pro.x_staged = x_staged_.as<uint16_t>();
  pro.slot_token = slot_token_.as<int32_t>();
  pro.slot_route = slot_route_.as<int32_t>();
  pro.items = items_.as<ExpertItem>();
  pro.group_scratch = group_scratch_.as<int32_t>();
  pro.num_items = num_items_.as<int32_t>();
  pro.natural_order = wgmma;
  if (d.persistent) {
    pro.wg_sched = wg_sched_.as<int32_t>();
    pro.wg_items = wg_items_.as<ExpertItem>();
  }
  pro.even_items = d.even_items;
  if (d.layer) {
    pro.zero_words = ready_.as<int32_t>();
    pro.zero_word_count = ExpertLayerRoutes(pro.tokens, pro.top_k, plan.num_shared);
  }
  const bool hidden_in_place = d.hidden_in_place;
  pro.stage_hidden = !hidden_in_place;
  if (d.acc_scale) pro.x_prescale = kAccScalePrescale;
  const bool l2_ahead = d.l2_ahead;
  if (absl::Status s = CudaStatus(LaunchExpertPrologue(pro, stream), "expert prologue");
      !s.ok()) {
    return s;
  }
  if (absl::Status s = Mark(1, stream); !s.ok()) return s;

  GemmLaunch launch;
  launch.format = layer.format;
  launch.token_groups = plan.token_groups;
  launch.variant = variant;
  launch.num_items = static_cast<int>(d.grid_items);
  // Stage events sit between the kernels, so the kernels cannot overlap while they are timed.
  launch.programmatic = programmatic_ && stage_events_ == nullptr;
  ExpertGemmParams g1 = GemmParams(layer.w13, layer, pro.items, pro.num_items);
  if (direct) {
    g1.direct_ids = batch.ids;
    g1.direct_mask = pro.shared_mask;
    g1.direct_tokens = pro.tokens;
    g1.direct_top_k = pro.top_k;
    g1.direct_experts = layer.num_experts;
    g1.direct_shared = plan.num_shared;
  }
  g1.b_rows = hidden_in_place ? static_cast<const uint16_t*>(batch.hidden)
                              : x_staged_.as<uint16_t>();
  g1.b_row_of_slot = slot_token_.as<int32_t>();
  if (l2_ahead) g1.l2_ahead_tiles = -1;
  g1.bias_a = layer.bias_gate.as<float>();
  g1.bias_b = layer.bias_up.as<float>();
  g1.out_valid = static_cast<int32_t>(layer.inter);
  g1.out_cols = static_cast<int32_t>(layer.inter_padded);
  g1.act = layer.act;
  g1.act_out = act_.as<uint16_t>();
  // The shared-memory ring variants read the weights with an L2 evict-first policy: 4..13 for
  // 1-2 token groups (measured 3-8% faster at 8-64 tokens, NOTES-cuda.md) and tiled 4..7 (A 512
  // variant 6: 795 vs 811 us). Tiled variant 8, the default, runs without it unless asked
  // (set_tiled_evict_first): measured equal (A 512: 759.1 vs 760.2 us).
  g1.weights_evict_first =
      evict_first_ && variant >= 4 &&
      (plan.token_groups <= 2 || variant <= 7 || tiled_evict_first_);
  if (GemmUsesBulkCopies(plan.token_groups, variant)) {
    const DeviceGemmWeights& w2 = layer.w2;
    const int64_t scale_bytes = layer.format == Fp4Format::kMxfp4 ? 4 : 16;
    // Auto: none. Every prefetch measured slower (T=1: GEMM2's weights into L2 during GEMM1
    // +3.7 us; 8 tokens +17-28 us; one ring ahead +0.5-14% at 8-64 tokens).
    const int bits = l2_prefetch_ == kAutoL2Prefetch ? 0 : l2_prefetch_;
    g1.l2_prefetch = bits;
    if ((bits & kL2PrefetchNext) != 0) {
      g1.next_values = w2.values.get();
      g1.next_scales = w2.scales.get();
      g1.next_values_stride_bytes = w2.values_stride * 16;
      g1.next_scales_stride_bytes = w2.scales_stride * scale_bytes;
      g1.next_values_bytes = static_cast<int64_t>(w2.tiles) * w2.chunks * 512;
      g1.next_scales_bytes = static_cast<int64_t>(w2.tiles) * w2.chunks * 8 * scale_bytes;
    }
  }
  ExpertGemmParams g2 = GemmParams(layer.w2, layer, pro.items, pro.num_items);
  g2.direct_ids = g1.direct_ids;
  g2.direct_mask = g1.direct_mask;
  g2.direct_tokens = g1.direct_tokens;
  g2.direct_top_k = g1.direct_top_k;
  g2.direct_experts = g1.direct_experts;
  g2.direct_shared = g1.direct_shared;
  if (fold) {
    g2.fold_counters = fold_counters_.as<int32_t>();
    g2.fold_weights = batch.weights;
    g2.fold_out = batch.out;
    g2.fold_out_bf16 = batch.out_bf16;
    g2.fold_ids = batch.ids;
    g2.fold_mask = pro.shared_mask;
    g2.fold_tokens = pro.tokens;
    g2.fold_top_k = pro.top_k;
    g2.fold_shared = plan.num_shared;
    if (!direct) g2.fold_slot_token = slot_token_.as<int32_t>();
  }
  g2.b_rows = act_.as<uint16_t>();
  g2.weights_evict_first = g1.weights_evict_first;
  g2.l2_prefetch = g1.l2_prefetch & ~kL2PrefetchNext;
  g2.bias_a = layer.bias_w2.as<float>();
  g2.out_valid = static_cast<int32_t>(layer.hidden);
  g2.out_cols = static_cast<int32_t>(layer.hidden);
  g2.y_out = y_.as<float>();
  g2.y_bf16 = wgmma && y_bf16_ && WgmmaStagesEpilogue(variant);
  g2.l2_ahead_tiles = g1.l2_ahead_tiles;
  if (d.persistent) {
    g1.wg_claims = pro.wg_sched + kWgSchedClaims;
    g2.wg_claims = pro.wg_sched + kWgSchedClaims + kWgSchedClaimStride;
    g1.wg_starts = g2.wg_starts = pro.wg_sched + kWgSchedStarts;
    g1.wg_items = g2.wg_items = pro.wg_items;
  }
  if (wgmma && wgmma_trace_ != nullptr) {
    g1.wg_trace = wgmma_trace_;
    g2.wg_trace = wgmma_trace_ + wgmma_trace_gemm2_;
  }
  g2.slot_route = slot_route_.as<int32_t>();
  if (d.acc_scale) {  // GEMM1's B rows (staged times 2^64) and its act rows for GEMM2 alike
    g1.acc_scale = g2.acc_scale = true;
    g1.acc_unscale = g2.acc_unscale = kAccScaleUnscale;
    g1.act_prescale = kAccScalePrescale;
  }
  if (d.ready_target > 0) {  // the fused layer kernel ignores them (it has its own counters)
    GemmLaunch launch2 = launch;
    launch2.gemm1 = false;
    g1.item_ready = g2.item_ready = item_ready_.as<int32_t>();
    g2.item_ready_target = static_cast<int32_t>(d.ready_target);
    g2.item_ready_waiters = static_cast<int32_t>(GemmItemReadyCount(launch2, g2));
    if (item_ready_dirty_) {  // an earlier batch's GEMM2 did not run: its words may be set
      if (absl::Status s = CudaStatus(
              cudaMemsetAsync(item_ready_.get(), 0, item_ready_.size(), stream), "item ready");
          !s.ok()) {
        return s;
      }
      item_ready_dirty_ = false;
    }
  }
  if (d.layer) {
    ExpertLayerParams lp;
    lp.g1 = g1;
    lp.g2 = g2;
    lp.ready = ready_.as<int32_t>();
    lp.trace = layer_trace_;
    const cudaError_t err = LaunchExpertLayer(lp, layer.format, launch.programmatic, stream);
    if (err == cudaSuccess) {
      ++fused_layer_launches_;
      for (int stage = 2; stage <= 4; ++stage) {
        if (absl::Status s = Mark(stage, stream); !s.ok()) return s;
      }
      return absl::OkStatus();
    }
    if (err != cudaErrorCooperativeLaunchTooLarge) return CudaStatus(err, "fused layer");
    // Fewer SMs than the kernel's CTAs are available to this context (e.g. an MPS limit): this
    // batch and every later one take the two GEMM grids, whose inputs the prologue staged alike
    // (the counters it zeroed go unused).
    (void)cudaGetLastError();
    layer_unavailable_ = true;
  }
  if (absl::Status s = CudaStatus(
          LaunchExpertGemm(g1, launch, stream), "GEMM1");
      !s.ok()) {
    return s;
  }
  if (absl::Status s = Mark(2, stream); !s.ok()) return s;
  launch.gemm1 = false;
  if (absl::Status s = CudaStatus(
          LaunchExpertGemm(g2, launch, stream), "GEMM2");
      !s.ok()) {
    item_ready_dirty_ = d.ready_target > 0;
    return s;
  }
  if (d.ready_target > 0) ++item_ready_launches_;
  if (absl::Status s = Mark(3, stream); !s.ok()) return s;
  if (fold) return Mark(4, stream);

  ExpertCombineParams c;
  c.y = y_.get();
  c.y_bf16 = g2.y_bf16;
  c.ids = batch.ids;
  c.weights = batch.weights;
  c.shared_mask = pro.shared_mask;
  c.tokens = pro.tokens;
  c.top_k = pro.top_k;
  c.hidden_size = pro.hidden_size;
  c.num_shared = plan.num_shared;
  c.out = batch.out;
  c.out_bf16 = batch.out_bf16;
  if (absl::Status s =
          CudaStatus(LaunchExpertCombine(c, launch.programmatic, stream), "expert combine");
      !s.ok()) {
    return s;
  }
  return Mark(4, stream);
}

}  // namespace moe::cuda
