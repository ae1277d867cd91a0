// CudaExpertBackend keeps device weights per (layer index, host weights): two versions of one
// layer prepared one after the other (what a shard does during a two-phase placement switch) both
// stay runnable, each against its own CPU reference; re-preparing the same weights replaces their
// copy; weights never prepared are refused; requests from several threads while a new version is
// uploaded all match. Needs a GPU (tag "gpu"): skipped without one.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "kernels/cpu/random_layer.h"
#include "kernels/cuda/cuda_backend.h"
#include "kernels/cuda/device.h"
#include "kernels/experts.h"

namespace moe {
namespace {

using cpu::MakeRandomLayer;
using cpu::MakeRandomRequest;
using cpu::OwnedLayer;
using cpu::OwnedRequest;

std::unique_ptr<ExpertBackend> Backend() {
  absl::StatusOr<std::unique_ptr<ExpertBackend>> b = MakeCudaExpertBackend({});
  if (!b.ok()) return nullptr;
  return *std::move(b);
}

std::unique_ptr<OwnedLayer> Layer(uint64_t seed) {
  cpu::RandomLayerSpec spec;
  spec.format = WeightFormat::kMxfp4;
  spec.hidden = 256;
  spec.inter = 128;
  spec.experts = 8;
  spec.bias = true;
  spec.seed = seed;
  return MakeRandomLayer(spec);
}

// ||got - want|| / ||want|| over the output (the metric of experts_cuda_test); infinity on NaN.
double RelErr(const OwnedRequest& got, const OwnedRequest& want, int64_t n) {
  double diff = 0, norm = 0;
  for (int64_t i = 0; i < n; ++i) {
    const double w = want.Out(i), g = got.Out(i);
    if (std::isnan(g)) return INFINITY;
    diff += (g - w) * (g - w);
    norm += w * w;
  }
  return std::sqrt(diff / std::max(norm, 1e-30));
}

// Runs `layer` on the backend and on the reference with the same random request (`spec`).
double RunAndCompare(ExpertBackend& backend, int layer_index, const OwnedLayer& layer,
                     const cpu::RandomRequestSpec& spec, absl::Status* status) {
  OwnedRequest got = MakeRandomRequest(layer.layer, spec);
  OwnedRequest want = got;
  got.Poison();
  want.Poison();
  *status = backend.Run(layer_index, layer.layer, got.Request());
  if (!status->ok()) return INFINITY;
  EXPECT_TRUE(RunExpertsReference(layer.layer, want.Request()).ok());
  return RelErr(got, want, spec.tokens * layer.layer.hidden);
}

// The same for 19 tokens, top-4, F32.
double RunAndCompare(ExpertBackend& backend, int layer_index, const OwnedLayer& layer,
                     uint64_t seed, absl::Status* status) {
  cpu::RandomRequestSpec spec;
  spec.tokens = 19;
  spec.top_k = 4;
  spec.seed = seed;
  return RunAndCompare(backend, layer_index, layer, spec, status);
}

// `spec`'s batch run by `b` from ordinary memory, its output checked within 1e-2 of the CPU
// reference; returned with that output for bit comparisons.
OwnedRequest RunPlain(ExpertBackend& b, const OwnedLayer& layer,
                      const cpu::RandomRequestSpec& spec) {
  OwnedRequest plain = MakeRandomRequest(layer.layer, spec);
  OwnedRequest want = plain;
  plain.Poison();
  want.Poison();
  EXPECT_TRUE(b.Run(0, layer.layer, plain.Request()).ok());
  EXPECT_TRUE(RunExpertsReference(layer.layer, want.Request()).ok());
  EXPECT_LE(RelErr(plain, want, spec.tokens * layer.layer.hidden), 1e-2);
  return plain;
}

// How the backend moved a batch (counter deltas of one Run).
struct Moved {
  bool direct = false;
  bool mapped = false;
};

// Runs `spec`'s batch (RunPlain) and again with its hidden states at base + in_at and its output
// at base + out_at (either -1: the request's own memory); expects the same bits.
Moved RunPlacedAgainstPlain(ExpertBackend& b, const OwnedLayer& layer,
                            const cpu::RandomRequestSpec& spec, uint8_t* base, int64_t in_at,
                            int64_t out_at) {
  OwnedRequest plain = RunPlain(b, layer, spec);
  OwnedRequest placed = plain;  // the same inputs
  placed.Poison();
  ExpertsRequest r = placed.Request();
  if (in_at >= 0) {
    std::memcpy(base + in_at, r.hidden_states.data,
                static_cast<size_t>(r.hidden_states.NumBytes()));
    r.hidden_states.data = base + in_at;
  }
  if (out_at >= 0) {
    std::memset(base + out_at, 0xFF, static_cast<size_t>(r.out.NumBytes()));  // NaN
    r.out.data = base + out_at;
  }
  const CudaBackendCounters before = GetCudaBackendCounters(b);
  const absl::Status s = b.Run(0, layer.layer, r);
  EXPECT_TRUE(s.ok()) << s;
  const CudaBackendCounters after = GetCudaBackendCounters(b);
  const void* got = out_at >= 0 ? static_cast<const void*>(base + out_at) : r.out.data;
  EXPECT_EQ(std::memcmp(got, plain.Request().out.data, static_cast<size_t>(r.out.NumBytes())), 0)
      << "T=" << spec.tokens << " in_at " << in_at << " out_at " << out_at;
  return {after.direct_runs > before.direct_runs, after.mapped_runs > before.mapped_runs};
}

TEST(CudaBackendVersionsTest, TwoVersionsOfALayerServeSideBySide) {
  std::unique_ptr<ExpertBackend> backend = Backend();
  if (backend == nullptr) GTEST_SKIP() << "no CUDA device";
  const std::unique_ptr<OwnedLayer> v1 = Layer(11), v2 = Layer(22), never = Layer(33);
  ASSERT_TRUE(backend->PrepareLayer(0, v1->layer).ok());
  absl::Status s;
  EXPECT_LE(RunAndCompare(*backend, 0, *v1, 1, &s), 1e-2);
  ASSERT_TRUE(s.ok()) << s;
  ASSERT_TRUE(backend->PrepareLayer(0, v2->layer).ok());  // the new version of layer 0
  for (uint64_t seed = 2; seed < 6; ++seed) {
    EXPECT_LE(RunAndCompare(*backend, 0, *v1, seed, &s), 1e-2) << "old version, seed " << seed;
    ASSERT_TRUE(s.ok()) << s;
    EXPECT_LE(RunAndCompare(*backend, 0, *v2, seed, &s), 1e-2) << "new version, seed " << seed;
    ASSERT_TRUE(s.ok()) << s;
  }
  // Same weights again: replaced, not duplicated; still correct.
  ASSERT_TRUE(backend->PrepareLayer(0, v1->layer).ok());
  EXPECT_LE(RunAndCompare(*backend, 0, *v1, 7, &s), 1e-2);
  ASSERT_TRUE(s.ok()) << s;
  RunAndCompare(*backend, 0, *never, 8, &s);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  RunAndCompare(*backend, 5, *v1, 9, &s);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
}

TEST(CudaBackendVersionsTest, RunsDuringAnUploadStayCorrect) {
  std::unique_ptr<ExpertBackend> backend = Backend();
  if (backend == nullptr) GTEST_SKIP() << "no CUDA device";
  const std::unique_ptr<OwnedLayer> old_layer = Layer(44);
  std::vector<std::unique_ptr<OwnedLayer>> new_layers;
  for (uint64_t seed = 50; seed < 56; ++seed) new_layers.push_back(Layer(seed));
  ASSERT_TRUE(backend->PrepareLayer(1, old_layer->layer).ok());
  std::thread uploader([&] {
    // Keeps uploading new versions (evicting older ones past the limit, never old_layer's
    // latest copy... which may be evicted too: then Run must refuse, not read freed memory).
    for (const auto& l : new_layers) EXPECT_TRUE(backend->PrepareLayer(1, l->layer).ok());
  });
  int ok = 0, refused = 0;
  for (uint64_t seed = 100; seed < 140; ++seed) {
    absl::Status s;
    const double err = RunAndCompare(*backend, 1, *old_layer, seed, &s);
    if (s.ok()) {
      EXPECT_LE(err, 1e-2) << "seed " << seed;
      ++ok;
    } else {
      EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
      ++refused;
    }
  }
  uploader.join();
  EXPECT_GT(ok, 0);
  // Six newer versions of layer 1 were uploaded with room for four: the old one is gone.
  absl::Status s;
  RunAndCompare(*backend, 1, *old_layer, 200, &s);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_LE(RunAndCompare(*backend, 1, *new_layers.back(), 201, &s), 1e-2);
  EXPECT_TRUE(s.ok()) << s;
  std::printf("during upload: %d runs ok, %d refused after eviction\n", ok, refused);
}

// A shape's second batch is captured as a CUDA graph and later batches of that shape replay it
// with their own inputs: every Run matches the CPU reference, the captured Run is bitwise the
// eager one, and the counters show captures and replays. Direct routes (T = 1), grouped items
// (T = 7), the tiled kernel and the wgmma kernel (T = 64 over 8 experts: ~32 routes per slot,
// wgmma from 33); pinned or pageable copies, poisoned scratch or not, BF16 or F32 in and out,
// the direct batches through the fused layer kernel (a cooperative launch) or the two GEMMs.
class GraphReplayTest
    : public ::testing::TestWithParam<std::tuple<bool, bool, bool, bool, bool>> {};

TEST_P(GraphReplayTest, ServesNewInputs) {
  const auto [pinned, poison, f32, programmatic, fused] = GetParam();
  CudaBackendOptions options;
  options.fused_layer = fused ? 1 : 0;
  options.graph_max_tokens = 512;  // every size below through graphs (the default stops at 8)
  options.programmatic_launch = programmatic;
  options.graph_programmatic_launch = programmatic;
  if (!pinned) options.pinned_staging_bytes = 0;
  options.poison_scratch = poison;
  absl::StatusOr<std::unique_ptr<ExpertBackend>> made = MakeCudaExpertBackend(options);
  if (!made.ok()) GTEST_SKIP() << made.status();
  ExpertBackend* b = made->get();
  const std::unique_ptr<OwnedLayer> layer = Layer(77);
  {
    ASSERT_TRUE(b->PrepareLayer(2, layer->layer).ok());
    for (int64_t tokens : {1, 2, 7, 64}) {
      cpu::RandomRequestSpec spec;
      spec.tokens = tokens;
      spec.top_k = 4;
      spec.in_dtype = f32 ? DType::kF32 : DType::kBF16;
      spec.out_dtype = f32 ? DType::kF32 : DType::kBF16;
      spec.not_local = tokens == 7 ? 0.25 : 0.0;
      std::vector<uint16_t> eager_out;
      for (int run = 0; run < 6; ++run) {
        // Runs 0-2: one routing (eager, captured, replayed); run 2 with new hidden states and
        // weights. Runs 3-5: new routings of the same size (replayed when the rounded item
        // grid matches, captured otherwise).
        spec.seed = 1000 * tokens + (run < 2 ? 0 : run);
        OwnedRequest got = MakeRandomRequest(layer->layer, spec);
        if (run == 2) {
          const OwnedRequest routes = MakeRandomRequest(layer->layer, [&] {
            cpu::RandomRequestSpec first = spec;
            first.seed = 1000 * tokens;
            return first;
          }());
          got.ids = routes.ids;  // same routing as runs 0-1, new values
        }
        OwnedRequest want = got;
        got.Poison();
        want.Poison();
        ASSERT_TRUE(b->Run(2, layer->layer, got.Request()).ok());
        ASSERT_TRUE(RunExpertsReference(layer->layer, want.Request()).ok());
        EXPECT_LE(RelErr(got, want, tokens * layer->layer.hidden), 1e-2)
            << "T=" << tokens << " run " << run;
        std::vector<uint16_t> bits = got.out_bf16;
        if (f32) {
          bits.resize(got.out_f32.size() * 2);
          std::memcpy(bits.data(), got.out_f32.data(), bits.size() * 2);
        }
        if (run == 0) {
          eager_out = bits;
        } else if (run == 1) {
          EXPECT_EQ(bits, eager_out) << "captured run differs, T=" << tokens;
        }
      }
    }
    const CudaBackendCounters n = GetCudaBackendCounters(*b);
    std::printf("graphs: eager %lld, captures %lld, replays %lld, pinned %lld\n",
                static_cast<long long>(n.eager_runs), static_cast<long long>(n.graph_captures),
                static_cast<long long>(n.graph_replays), static_cast<long long>(n.pinned_runs));
    EXPECT_GE(n.graph_captures, 4);  // one per token count at least
    EXPECT_GE(n.graph_replays, 4);   // run 2 of each token count at least
    EXPECT_EQ(n.eager_runs + n.graph_captures + n.graph_replays, 24);
    EXPECT_EQ(n.pinned_runs, pinned ? 24 : 0);
    // Every batch here is far below kernel_copy_max_bytes: the pinned ones move by copy kernels.
    EXPECT_EQ(n.kernel_copy_runs, pinned ? 24 : 0);
    // Forced on, the fused kernel runs every direct batch (T = 1 always has distinct experts).
    if (fused) {
      EXPECT_GE(n.fused_layer_launches, 2);  // T = 1: the eager run and the capture
    } else {
      EXPECT_EQ(n.fused_layer_launches, 0);
    }
  }
}

// Inputs and outputs over one copy piece (4 MB): the pinned copies go piece by piece, the host
// filling or emptying one piece while the DMA engine (or a copy kernel, when kernel_copy_max_bytes
// allows the batch) moves another; pageable copies in one go.
TEST(CudaBackendVersionsTest, LargeBatchesCopyPieceByPiece) {
  const std::unique_ptr<OwnedLayer> layer = Layer(88);
  const struct {
    int64_t pinned_bytes, kernel_copy_bytes;
  } forms[] = {{int64_t{64} << 20, 0}, {int64_t{64} << 20, int64_t{64} << 20}, {0, 0}};
  for (const auto [pinned_bytes, kernel_copy_bytes] : forms) {
    CudaBackendOptions options;
    options.pinned_staging_bytes = pinned_bytes;
    options.kernel_copy_max_bytes = kernel_copy_bytes;
    absl::StatusOr<std::unique_ptr<ExpertBackend>> made = MakeCudaExpertBackend(options);
    if (!made.ok()) GTEST_SKIP() << made.status();
    ExpertBackend& b = **made;
    ASSERT_TRUE(b.PrepareLayer(0, layer->layer).ok());
    for (uint64_t seed : {5, 6}) {
      cpu::RandomRequestSpec spec;
      spec.tokens = 4608;  // F32 [4608, 256]: 4.7 MB in and out
      spec.top_k = 4;
      spec.seed = seed;
      absl::Status s;
      EXPECT_LE(RunAndCompare(b, 0, *layer, spec, &s), 1e-2)
          << "pinned " << pinned_bytes << " kernel copies " << kernel_copy_bytes << " seed "
          << seed;
      ASSERT_TRUE(s.ok()) << s;
    }
    EXPECT_EQ(GetCudaBackendCounters(b).pinned_runs, pinned_bytes > 0 ? 2 : 0);
    EXPECT_EQ(GetCudaBackendCounters(b).kernel_copy_runs, kernel_copy_bytes > 0 ? 2 : 0);
  }
}

// Host memory registered with RegisterHostMemory (a shard does it for shared-memory regions):
// eager batches whose hidden states or output lie inside it move them straight between it and the
// device. Every form gives the bits of the same batch in ordinary memory (and those match the CPU
// reference); a range that runs past the registered memory, graphed batches and batches after
// UnregisterHostMemory are staged as usual; double and oversized registrations are refused.
TEST(CudaBackendVersionsTest, RegisteredHostMemoryIsUsedInPlace) {
  const std::unique_ptr<OwnedLayer> layer = Layer(123);
  CudaBackendOptions options;
  options.registered_direct_min_bytes = 4096;
  absl::StatusOr<std::unique_ptr<ExpertBackend>> made = MakeCudaExpertBackend(options);
  if (!made.ok()) GTEST_SKIP() << made.status();
  ExpertBackend& b = **made;
  ASSERT_TRUE(b.PrepareLayer(0, layer->layer).ok());
  // The first kRegion bytes of a larger allocation are registered.
  constexpr size_t kRegion = size_t{8} << 20;
  void* raw = nullptr;
  ASSERT_EQ(posix_memalign(&raw, 4096, kRegion + (size_t{1} << 20)), 0);
  std::unique_ptr<void, decltype(&std::free)> region(raw, &std::free);
  auto* base = static_cast<uint8_t*>(raw);
  ASSERT_TRUE(b.RegisterHostMemory(base, kRegion).ok());
  EXPECT_EQ(GetCudaBackendCounters(b).registered_bytes, static_cast<int64_t>(kRegion));
  // The same range again: refused (the first registration stays).
  EXPECT_FALSE(b.RegisterHostMemory(base, kRegion).ok());

  // Whether the backend counted the placed Run as a direct one.
  const auto run_in_region = [&](const cpu::RandomRequestSpec& spec, int64_t in_at,
                                 int64_t out_at) {
    return RunPlacedAgainstPlain(b, *layer, spec, base, in_at, out_at).direct;
  };
  cpu::RandomRequestSpec spec;
  spec.tokens = 40;  // F32 [40, 256]: 40 KB in and out
  spec.top_k = 4;
  const int64_t kOut = int64_t{4} << 20;
  for (const auto& [dtype_in, dtype_out] :
       {std::pair{DType::kF32, DType::kF32}, std::pair{DType::kBF16, DType::kBF16}}) {
    spec.in_dtype = dtype_in;
    spec.out_dtype = dtype_out;
    ++spec.seed;
    EXPECT_TRUE(run_in_region(spec, 0, kOut));
    ++spec.seed;
    EXPECT_TRUE(run_in_region(spec, 4096 + 64, -1));  // hidden only, not page-aligned
    ++spec.seed;
    EXPECT_TRUE(run_in_region(spec, -1, kOut + 16));  // output only
  }
  spec.in_dtype = DType::kF32;
  spec.out_dtype = DType::kF32;
  // An output ending exactly at the registered memory's end: in place. Hidden states that run
  // past it and an output wholly past it: staged.
  const int64_t end = static_cast<int64_t>(kRegion);
  ++spec.seed;
  EXPECT_TRUE(run_in_region(spec, -1, end - spec.tokens * layer->layer.hidden * 4));
  ++spec.seed;
  EXPECT_FALSE(run_in_region(spec, end - 100, end + 65536));
  // Graphed batches (two tokens) read the pinned buffer: staged, and correct.
  cpu::RandomRequestSpec small = spec;
  small.tokens = 2;
  for (int i = 0; i < 3; ++i) {
    ++small.seed;
    EXPECT_FALSE(run_in_region(small, 0, kOut));
  }
  b.UnregisterHostMemory(base);
  EXPECT_EQ(GetCudaBackendCounters(b).registered_bytes, 0);
  b.UnregisterHostMemory(base);  // unknown now: no-op
  ++spec.seed;
  EXPECT_FALSE(run_in_region(spec, 0, kOut));

  options.max_registered_bytes = int64_t{1} << 20;
  absl::StatusOr<std::unique_ptr<ExpertBackend>> capped = MakeCudaExpertBackend(options);
  ASSERT_TRUE(capped.ok());
  EXPECT_EQ((*capped)->RegisterHostMemory(base, kRegion).code(),
            absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(GetCudaBackendCounters(**capped).registered_bytes, 0);
}

// Registered hidden states and output under registered_direct_min_bytes, in eager batches that
// copy kernels move: the kernels read and write them through the device's mapping (what a shard's
// merged batches and pooled TCP and ForwardRaw buffers are). Each Run bit-equal to the same batch
// from ordinary memory (and that within 1e-2 of the CPU reference) and counted as mapped; a
// tensor at an address that is not 16-byte aligned, and every tensor with registered_kernel_copies
// off, stays staged and equally correct.
TEST(CudaBackendVersionsTest, SmallRegisteredTensorsMoveByCopyKernels) {
  const std::unique_ptr<OwnedLayer> layer = Layer(321);
  constexpr size_t kRegion = size_t{4} << 20;
  void* raw = nullptr;
  ASSERT_EQ(posix_memalign(&raw, 4096, kRegion), 0);
  std::unique_ptr<void, decltype(&std::free)> region(raw, &std::free);
  auto* base = static_cast<uint8_t*>(raw);
  const int64_t kOut = int64_t{1} << 20;
  for (const bool kernel_copies : {true, false}) {
    CudaBackendOptions options;
    options.registered_kernel_copies = kernel_copies;
    absl::StatusOr<std::unique_ptr<ExpertBackend>> made = MakeCudaExpertBackend(options);
    if (!made.ok()) GTEST_SKIP() << made.status();
    ExpertBackend& b = **made;
    ASSERT_TRUE(b.PrepareLayer(0, layer->layer).ok());
    ASSERT_TRUE(b.RegisterHostMemory(base, kRegion).ok());
    cpu::RandomRequestSpec spec;
    spec.tokens = 40;  // [40, 256]: 40 KB F32, 20 KB BF16; eager (over graph_max_tokens)
    spec.top_k = 4;
    spec.seed = kernel_copies ? 100 : 200;
    for (const auto& [dtype_in, dtype_out] :
         {std::pair{DType::kF32, DType::kF32}, std::pair{DType::kBF16, DType::kBF16},
          std::pair{DType::kBF16, DType::kF32}}) {
      spec.in_dtype = dtype_in;
      spec.out_dtype = dtype_out;
      // (hidden offset, output offset) in the region; -1: the request's own memory.
      for (const auto& [in_at, out_at] :
           {std::pair<int64_t, int64_t>{0, kOut}, {16, -1}, {-1, kOut + 48}, {8, kOut + 8}}) {
        ++spec.seed;
        const bool aligned_in = in_at >= 0 && in_at % 16 == 0;
        const bool aligned_out = out_at >= 0 && out_at % 16 == 0;
        EXPECT_EQ(RunPlacedAgainstPlain(b, *layer, spec, base, in_at, out_at).mapped,
                  kernel_copies && (aligned_in || aligned_out))
            << "in_at " << in_at << " out_at " << out_at << " kernel copies " << kernel_copies;
      }
    }
    b.UnregisterHostMemory(base);
  }
}

// RunParts (a shard's merged batch as its requests' own rows): parts in registered memory are
// gathered and scattered by copy kernels, bit-equal to Run on the concatenated batch and counted
// as parts runs; a part outside registered memory, a misaligned one and a graphed batch size are
// refused as UNIMPLEMENTED with their outputs untouched (the caller merges); parts whose rows do
// not add up are INVALID_ARGUMENT.
TEST(CudaBackendVersionsTest, RunPartsGathersAndScattersRegisteredRows) {
  const std::unique_ptr<OwnedLayer> layer = Layer(555);
  absl::StatusOr<std::unique_ptr<ExpertBackend>> made = MakeCudaExpertBackend({});
  if (!made.ok()) GTEST_SKIP() << made.status();
  ExpertBackend& b = **made;
  ASSERT_TRUE(b.PrepareLayer(0, layer->layer).ok());
  constexpr size_t kRegion = size_t{4} << 20;
  void* raw = nullptr;
  ASSERT_EQ(posix_memalign(&raw, 4096, kRegion), 0);
  std::unique_ptr<void, decltype(&std::free)> region(raw, &std::free);
  auto* base = static_cast<uint8_t*>(raw);
  ASSERT_TRUE(b.RegisterHostMemory(base, kRegion).ok());
  const int64_t h = layer->layer.hidden;
  // Splits `whole`'s hidden rows into parts of `rows` at region offsets (in, out) 64 KB apart,
  // runs RunParts, and returns its status; `got` receives the output rows in order.
  const auto run_parts = [&](OwnedRequest& whole, const std::vector<int64_t>& rows,
                             size_t in_shift, std::vector<uint8_t>* got) {
    ExpertsRequest r = whole.Request();
    const size_t in_row = static_cast<size_t>(h) * DTypeSize(r.hidden_states.dtype);
    const size_t out_row = static_cast<size_t>(h) * DTypeSize(r.out.dtype);
    std::vector<TensorView> in_parts, out_parts;
    int64_t row = 0;
    for (size_t p = 0; p < rows.size(); ++p) {
      uint8_t* in_at = base + (p * 2) * 65536 + in_shift;
      uint8_t* out_at = base + (p * 2 + 1) * 65536;
      std::memcpy(in_at, static_cast<const uint8_t*>(r.hidden_states.data) + row * in_row,
                  rows[p] * in_row);
      std::memset(out_at, 0xFF, rows[p] * out_row);  // NaN
      in_parts.push_back(TensorView{r.hidden_states.dtype, {rows[p], h}, in_at});
      out_parts.push_back(TensorView{r.out.dtype, {rows[p], h}, out_at});
      row += rows[p];
    }
    r.hidden_states.data = in_parts[0].data;
    r.out.data = out_parts[0].data;
    const absl::Status s = b.RunParts(0, layer->layer, r, in_parts, out_parts);
    got->clear();
    for (size_t p = 0; p < rows.size(); ++p) {
      const auto* at = static_cast<const uint8_t*>(out_parts[p].data);
      got->insert(got->end(), at, at + rows[p] * out_row);
    }
    return s;
  };
  cpu::RandomRequestSpec spec;
  spec.top_k = 4;
  for (const auto& [dtype_in, dtype_out] :
       {std::pair{DType::kF32, DType::kF32}, std::pair{DType::kBF16, DType::kBF16}}) {
    spec.in_dtype = dtype_in;
    spec.out_dtype = dtype_out;
    for (const std::vector<int64_t>& rows :
         {std::vector<int64_t>{7, 21, 12}, std::vector<int64_t>{16, 16, 16, 16, 16, 16, 16, 16},
          std::vector<int64_t>{1, 1, 30}}) {
      int64_t tokens = 0;
      for (int64_t n : rows) tokens += n;
      spec.tokens = tokens;
      ++spec.seed;
      OwnedRequest whole = RunPlain(b, *layer, spec);
      std::vector<uint8_t> got;
      const int64_t parts_before = GetCudaBackendCounters(b).parts_runs;
      const absl::Status s = run_parts(whole, rows, 0, &got);
      ASSERT_TRUE(s.ok()) << s;
      EXPECT_EQ(GetCudaBackendCounters(b).parts_runs, parts_before + 1);
      ASSERT_EQ(got.size(), static_cast<size_t>(whole.Request().out.NumBytes()));
      EXPECT_EQ(std::memcmp(got.data(), whole.Request().out.data, got.size()), 0)
          << rows.size() << " parts";
      // A misaligned part: refused, nothing written.
      EXPECT_TRUE(absl::IsUnimplemented(run_parts(whole, rows, 8, &got)));
      EXPECT_TRUE(std::all_of(got.begin(), got.end(), [](uint8_t v) { return v == 0xFF; }));
    }
  }
  spec.in_dtype = DType::kF32;
  spec.out_dtype = DType::kF32;
  // A graphed size (4 tokens: the pinned buffer's graph): refused.
  spec.tokens = 4;
  ++spec.seed;
  OwnedRequest small = MakeRandomRequest(layer->layer, spec);
  std::vector<uint8_t> got;
  EXPECT_TRUE(absl::IsUnimplemented(run_parts(small, {2, 2}, 0, &got)));
  // A part outside registered memory: refused.
  spec.tokens = 20;
  ++spec.seed;
  OwnedRequest whole = MakeRandomRequest(layer->layer, spec);
  ExpertsRequest r = whole.Request();
  std::vector<float> own_in(static_cast<size_t>(10 * h)), own_out(static_cast<size_t>(10 * h));
  const std::vector<TensorView> outside_in = {
      TensorView{DType::kF32, {10, h}, own_in.data()},
      TensorView{DType::kF32, {10, h}, base}};
  const std::vector<TensorView> outside_out = {
      TensorView{DType::kF32, {10, h}, own_out.data()},
      TensorView{DType::kF32, {10, h}, base + 65536}};
  EXPECT_TRUE(absl::IsUnimplemented(b.RunParts(0, layer->layer, r, outside_in, outside_out)));
  // Rows that do not add up to the batch's.
  const std::vector<TensorView> short_in = {TensorView{DType::kF32, {10, h}, base}};
  const std::vector<TensorView> short_out = {TensorView{DType::kF32, {10, h}, base + 65536}};
  EXPECT_EQ(b.RunParts(0, layer->layer, r, short_in, short_out).code(),
            absl::StatusCode::kInvalidArgument);
  b.UnregisterHostMemory(base);
}

// Hidden states and output in device memory (what a shard passes for a same-host frontend's
// ForwardCuda): read and written in place by the kernels at 256-byte aligned addresses, moved by
// device copies at others; eager, captured and replayed; each form bit-equal to the same batch
// from host memory (and that within 1e-2 of the CPU reference); one device tensor with the other
// on the host works too.
TEST(CudaBackendVersionsTest, DeviceTensorsStayOnTheDevice) {
  const std::unique_ptr<OwnedLayer> layer = Layer(131);
  absl::StatusOr<std::unique_ptr<ExpertBackend>> made = MakeCudaExpertBackend({});
  if (!made.ok()) GTEST_SKIP() << made.status();
  ExpertBackend& b = **made;
  ASSERT_EQ(b.DeviceForTensors(), 0);
  ASSERT_TRUE(b.PrepareLayer(0, layer->layer).ok());
  constexpr size_t kBytes = size_t{4} << 20;
  void* d_in = cuda::DeviceAlloc(kBytes);
  void* d_out = cuda::DeviceAlloc(kBytes);
  ASSERT_NE(d_in, nullptr);
  ASSERT_NE(d_out, nullptr);
  const std::vector<uint8_t> poison(kBytes, 0xFF);
  int device_runs = 0, in_place_runs = 0;
  for (const int64_t tokens : {1, 2, 2, 2, 40, 300}) {  // 2 x 3: eager, captured, replayed
    // Offset 0: in place; 64: copied.
    const struct {
      bool hidden_dev, out_dev;
      size_t offset;
    } cases[] = {{true, true, 0}, {true, false, 0}, {false, true, 0},
                 {true, true, 64}, {true, false, 64}, {false, true, 64}};
    for (const auto& [hidden_dev, out_dev, offset] : cases) {
      cpu::RandomRequestSpec spec;
      spec.tokens = tokens;
      spec.top_k = 4;
      spec.in_dtype = tokens % 2 == 0 ? DType::kBF16 : DType::kF32;
      spec.out_dtype = tokens == 40 ? DType::kF32 : DType::kBF16;
      spec.seed = 700 + static_cast<uint64_t>(tokens) + (hidden_dev ? 10 : 0) + (out_dev ? 20 : 0);
      OwnedRequest host = MakeRandomRequest(layer->layer, spec);
      OwnedRequest want = host;
      OwnedRequest placed = host;
      host.Poison();
      want.Poison();
      placed.Poison();
      ASSERT_TRUE(b.Run(0, layer->layer, host.Request()).ok());
      ASSERT_TRUE(RunExpertsReference(layer->layer, want.Request()).ok());
      EXPECT_LE(RelErr(host, want, tokens * layer->layer.hidden), 1e-2);
      ExpertsRequest r = placed.Request();
      const size_t in_bytes = static_cast<size_t>(r.hidden_states.NumBytes());
      const size_t out_bytes = static_cast<size_t>(r.out.NumBytes());
      if (hidden_dev) {
        void* at = static_cast<uint8_t*>(d_in) + offset;
        ASSERT_TRUE(cuda::CopyAnyBytes(at, r.hidden_states.data, in_bytes));
        r.hidden_states.data = at;
        r.hidden_on_device = true;
      }
      if (out_dev) {
        void* at = static_cast<uint8_t*>(d_out) + offset;
        ASSERT_TRUE(cuda::CopyAnyBytes(at, poison.data(), out_bytes));
        r.out.data = at;
        r.out_on_device = true;
      }
      const absl::Status s = b.Run(0, layer->layer, r);
      ASSERT_TRUE(s.ok()) << s;
      ++device_runs;
      in_place_runs += offset == 0 ? 1 : 0;
      std::vector<uint8_t> got(out_bytes);
      ASSERT_TRUE(cuda::CopyAnyBytes(got.data(), r.out.data, out_bytes));
      EXPECT_EQ(std::memcmp(got.data(), host.Request().out.data, out_bytes), 0)
          << "T=" << tokens << " hidden on device " << hidden_dev << " output on device "
          << out_dev << " offset " << offset;
    }
  }
  const CudaBackendCounters n = GetCudaBackendCounters(b);
  EXPECT_EQ(n.device_tensor_runs, device_runs);
  EXPECT_EQ(n.in_place_runs, in_place_runs);
  EXPECT_GE(n.graph_replays, 1);
  cuda::DeviceFree(d_in);
  cuda::DeviceFree(d_out);
}

// Graphed small batches move their pinned buffer by copy kernels inside the graph; the output
// either written by the expert kernels straight into the mapped pinned buffer (the default) or
// moved there by a copy kernel after them. Both match the reference over eager, captured and
// replayed Runs with new inputs each time.
TEST(CudaBackendVersionsTest, GraphedCopyKernelsWithAndWithoutDirectOutput) {
  const std::unique_ptr<OwnedLayer> layer = Layer(99);
  for (const bool direct : {true, false}) {
    CudaBackendOptions options;
    options.pinned_direct_output = direct;
    absl::StatusOr<std::unique_ptr<ExpertBackend>> made = MakeCudaExpertBackend(options);
    if (!made.ok()) GTEST_SKIP() << made.status();
    ExpertBackend& b = **made;
    ASSERT_TRUE(b.PrepareLayer(0, layer->layer).ok());
    int runs = 0;
    for (int64_t tokens : {1, 3}) {
      for (int run = 0; run < 4; ++run) {
        cpu::RandomRequestSpec spec;
        spec.tokens = tokens;
        spec.top_k = 4;
        spec.seed = 500 + 10 * tokens + run;
        absl::Status s;
        EXPECT_LE(RunAndCompare(b, 0, *layer, spec, &s), 1e-2)
            << "direct " << direct << " T=" << tokens << " run " << run;
        ASSERT_TRUE(s.ok()) << s;
        ++runs;
      }
    }
    const CudaBackendCounters n = GetCudaBackendCounters(b);
    EXPECT_EQ(n.kernel_copy_runs, runs) << "direct " << direct;
    EXPECT_GE(n.graph_replays, 1) << "direct " << direct;
  }
}

// More shapes in use than the cache keeps (kMaxCudaGraphs): the first kMaxCudaGraphs repeated
// shapes are captured once and replayed from then on; the others run eagerly (refused, not
// captured over a graph in use), so no pass recaptures anything. The first pass grows the arena
// and scratch at every token count (dropping the graphs each time), which must not make the
// shapes count as unseen again. Every Run stays correct.
TEST(CudaBackendVersionsTest, GraphCacheKeepsItsWorkingSet) {
  const std::unique_ptr<OwnedLayer> layer = Layer(111);
  CudaBackendOptions options;
  constexpr int kShapes = kMaxCudaGraphs + 6;
  options.graph_max_tokens = kShapes;
  absl::StatusOr<std::unique_ptr<ExpertBackend>> made = MakeCudaExpertBackend(options);
  if (!made.ok()) GTEST_SKIP() << made.status();
  ExpertBackend& b = **made;
  ASSERT_TRUE(b.PrepareLayer(0, layer->layer).ok());
  for (int pass = 0; pass < 3; ++pass) {
    for (int64_t tokens = 1; tokens <= kShapes; ++tokens) {
      cpu::RandomRequestSpec spec;
      spec.tokens = tokens;
      spec.top_k = 2;
      spec.seed = 9000 + tokens;  // the same routing every pass: one shape per token count
      absl::Status s;
      const double err = RunAndCompare(b, 0, *layer, spec, &s);
      ASSERT_TRUE(s.ok()) << s;
      EXPECT_LE(err, 1e-2) << "pass " << pass << " T=" << tokens;
    }
    const CudaBackendCounters n = GetCudaBackendCounters(b);
    std::printf("after pass %d: captures %lld, replays %lld, refusals %lld, eager %lld, "
                "invalidations %lld\n",
                pass, static_cast<long long>(n.graph_captures),
                static_cast<long long>(n.graph_replays), static_cast<long long>(n.graph_refusals),
                static_cast<long long>(n.eager_runs), static_cast<long long>(n.graph_invalidations));
  }
  const CudaBackendCounters n = GetCudaBackendCounters(b);
  std::printf("graph cache: captures %lld, replays %lld, refusals %lld, eager %lld\n",
              static_cast<long long>(n.graph_captures), static_cast<long long>(n.graph_replays),
              static_cast<long long>(n.graph_refusals), static_cast<long long>(n.eager_runs));
  EXPECT_EQ(n.graph_captures, kMaxCudaGraphs);
  EXPECT_EQ(n.graph_replays, kMaxCudaGraphs);           // pass 2
  EXPECT_EQ(n.graph_refusals, 2 * (kShapes - kMaxCudaGraphs));  // passes 1 and 2
  EXPECT_EQ(n.eager_runs, kShapes + 2 * (kShapes - kMaxCudaGraphs));
}

// A failed capture costs the graph, not the batch: it runs eagerly, and so does its shape later.
TEST(CudaBackendVersionsTest, FailedCaptureRunsEagerly) {
  CudaBackendOptions options;
  options.test_fail_graph_capture = true;
  absl::StatusOr<std::unique_ptr<ExpertBackend>> made = MakeCudaExpertBackend(options);
  if (!made.ok()) GTEST_SKIP() << made.status();
  ExpertBackend& b = **made;
  const std::unique_ptr<OwnedLayer> layer = Layer(99);
  ASSERT_TRUE(b.PrepareLayer(0, layer->layer).ok());
  for (uint64_t seed : {1, 1, 2, 3}) {  // one shape: first sight, failed capture, then eager
    cpu::RandomRequestSpec spec;
    spec.tokens = 1;
    spec.top_k = 4;
    spec.not_local = 0.0;
    spec.seed = seed;
    absl::Status s;
    EXPECT_LE(RunAndCompare(b, 0, *layer, spec, &s), 1e-2) << "seed " << seed;
    ASSERT_TRUE(s.ok()) << s;
  }
  const CudaBackendCounters n = GetCudaBackendCounters(b);
  EXPECT_EQ(n.capture_failures, 1);
  EXPECT_EQ(n.graph_captures, 0);
  EXPECT_EQ(n.graph_replays, 0);
  EXPECT_EQ(n.eager_runs, 4);
}

// Two backends (two streams) run the fused layer kernel at the same time on one GPU. Each of
// its grids needs all of its CTAs resident at once (one per SM): two grids that each held part
// of the GPU would wait for each other forever, which cooperative launch rules out.
TEST(CudaBackendVersionsTest, TwoBackendsRunFusedLayersAtOnce) {
  const std::unique_ptr<OwnedLayer> layer = Layer(66);
  std::vector<std::unique_ptr<ExpertBackend>> backends;
  for (int i = 0; i < 2; ++i) {
    CudaBackendOptions options;
    options.fused_layer = 1;
    options.graph_max_tokens = 0;  // every Run launches its kernels
    absl::StatusOr<std::unique_ptr<ExpertBackend>> made = MakeCudaExpertBackend(options);
    if (!made.ok()) GTEST_SKIP() << made.status();
    ASSERT_TRUE((*made)->PrepareLayer(0, layer->layer).ok());
    backends.push_back(*std::move(made));
  }
  constexpr int kRuns = 200;
  std::vector<double> worst(2, 0.0);
  std::vector<absl::Status> errors(2);
  std::vector<std::thread> threads;
  for (int i = 0; i < 2; ++i) {
    threads.emplace_back([&, i] {
      for (int run = 0; run < kRuns; ++run) {
        cpu::RandomRequestSpec spec;
        spec.tokens = 1;
        spec.top_k = 4;
        spec.not_local = 0.0;
        spec.seed = 1000 * i + run;
        absl::Status s;
        const double rel = RunAndCompare(*backends[i], 0, *layer, spec, &s);
        if (!s.ok()) {
          errors[i] = s;
          return;
        }
        worst[i] = std::max(worst[i], rel);
      }
    });
  }
  for (std::thread& t : threads) t.join();
  for (int i = 0; i < 2; ++i) {
    EXPECT_TRUE(errors[i].ok()) << errors[i];
    EXPECT_LE(worst[i], 1e-2) << "backend " << i;
    EXPECT_EQ(GetCudaBackendCounters(*backends[i]).fused_layer_launches, kRuns);
  }
}

// Runs from several threads on one backend's lanes (concurrent_runs 3) give bitwise the outputs
// of the same batches run one at a time on a one-lane backend: graphed shapes (captured on one
// lane while others launch eagerly), eager and pinned ones, several copy paths, F32 and BF16; and
// the lanes did overlap (overlapped_runs).
TEST(CudaBackendVersionsTest, ConcurrentRunsMatchSerialRuns) {
  const std::unique_ptr<OwnedLayer> layer = Layer(88);
  std::unique_ptr<ExpertBackend> serial, lanes;
  for (int runs : {1, 3}) {
    CudaBackendOptions options;
    options.concurrent_runs = runs;
    options.poison_scratch = true;
    absl::StatusOr<std::unique_ptr<ExpertBackend>> made = MakeCudaExpertBackend(options);
    if (!made.ok()) GTEST_SKIP() << made.status();
    ASSERT_EQ((*made)->MaxConcurrentRuns(), runs);
    ASSERT_TRUE((*made)->PrepareLayer(0, layer->layer).ok());
    (runs == 1 ? serial : lanes) = *std::move(made);
  }
  // Batch shapes: graphed (1-8 tokens), grouped eager ones, the tiled and wgmma kernels (64),
  // a batch past the copy kernels' limit (3000 tokens x 256 x 4 bytes x 2 > 4 MB).
  std::vector<cpu::RandomRequestSpec> specs;
  uint64_t seed = 500;
  for (int64_t tokens : {1, 2, 7, 8, 19, 64, 333, 3000}) {
    for (DType dtype : {DType::kF32, DType::kBF16}) {
      cpu::RandomRequestSpec spec;
      spec.tokens = tokens;
      spec.top_k = 4;
      spec.in_dtype = spec.out_dtype = dtype;
      spec.seed = seed++;
      specs.push_back(spec);
    }
  }
  std::vector<OwnedRequest> want;
  for (const cpu::RandomRequestSpec& spec : specs) want.push_back(RunPlain(*serial, *layer, spec));
  constexpr int kThreads = 4, kRounds = 6;
  std::vector<std::string> mismatches(kThreads);
  std::vector<std::thread> threads;
  for (int i = 0; i < kThreads; ++i) {
    threads.emplace_back([&, i] {
      for (int round = 0; round < kRounds; ++round) {
        for (size_t k = 0; k < specs.size(); ++k) {
          // Each thread in its own order, so that different shapes overlap.
          const size_t j = (k * (2 * i + 1) + static_cast<size_t>(round + i)) % specs.size();
          OwnedRequest got = want[j];  // the same inputs
          got.Poison();
          const absl::Status st = lanes->Run(0, layer->layer, got.Request());
          const ExpertsRequest r = got.Request();
          if (!st.ok() ||
              std::memcmp(r.out.data, want[j].Request().out.data,
                          static_cast<size_t>(r.out.NumBytes())) != 0) {
            mismatches[i] = absl::StrCat("T=", specs[j].tokens, " ",
                                         specs[j].in_dtype == DType::kBF16 ? "BF16" : "F32",
                                         " round ", round, ": ", st.ToString());
            return;
          }
        }
      }
    });
  }
  for (std::thread& t : threads) t.join();
  for (int i = 0; i < kThreads; ++i) EXPECT_EQ(mismatches[i], "") << "thread " << i;
  const CudaBackendCounters c = GetCudaBackendCounters(*lanes);
  EXPECT_GT(c.overlapped_runs, 0);
  EXPECT_GT(c.graph_replays, 0);
  EXPECT_EQ(c.capture_failures, 0);
  std::printf("concurrent runs: %lld of %d overlapped another, %lld graph captures, %lld replays\n",
              static_cast<long long>(c.overlapped_runs), kThreads * kRounds *
              static_cast<int>(specs.size()), static_cast<long long>(c.graph_captures),
              static_cast<long long>(c.graph_replays));
}

// Lanes warming up together: while one lane captures a graph, others grow their scratch, arena
// and pinned buffer (device and pinned allocation, zeroing) and a thread pins and unpins host
// memory. Before CudaExpertBackend::capture_mu_ this crashed the process (SIGSEGV in
// cuCtxSynchronize, from the scratch zeroing's device-wide synchronization) or failed Runs
// ("operation not permitted when stream is capturing"): about one rpc_bench run in five at 16
// clients on the H200. Uploads of another layer (PrepareLayer) go on at the same time. A fresh
// backend per round, so every round starts cold; the outputs are bitwise those of a one-lane
// backend.
TEST(CudaBackendVersionsTest, LanesWarmingUpTogether) {
  const std::unique_ptr<OwnedLayer> layer = Layer(89);
  const auto make = [&](int runs) -> std::unique_ptr<ExpertBackend> {
    CudaBackendOptions options;
    options.concurrent_runs = runs;
    options.graph_max_tokens = 256;
    absl::StatusOr<std::unique_ptr<ExpertBackend>> made = MakeCudaExpertBackend(options);
    if (!made.ok() || !(*made)->PrepareLayer(0, layer->layer).ok()) return nullptr;
    return *std::move(made);
  };
  const std::unique_ptr<ExpertBackend> serial = make(1);
  if (serial == nullptr) GTEST_SKIP() << "no CUDA device";
  std::vector<cpu::RandomRequestSpec> specs;
  for (int64_t tokens : {1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256}) {
    cpu::RandomRequestSpec spec;
    spec.tokens = tokens;
    spec.top_k = 4;
    spec.in_dtype = spec.out_dtype = DType::kBF16;
    spec.seed = 900 + static_cast<uint64_t>(tokens);
    specs.push_back(spec);
  }
  std::vector<OwnedRequest> want;
  for (const cpu::RandomRequestSpec& spec : specs) want.push_back(RunPlain(*serial, *layer, spec));
  constexpr int kRounds = 6, kThreads = 4;
  int64_t captures = 0, overlapped = 0;
  for (int round = 0; round < kRounds; ++round) {
    const std::unique_ptr<ExpertBackend> lanes = make(kThreads);
    ASSERT_NE(lanes, nullptr);
    std::vector<std::string> mismatches(kThreads);
    std::atomic<bool> done{false};
    std::vector<std::thread> threads;
    for (int i = 0; i < kThreads; ++i) {
      threads.emplace_back([&, i] {
        // Growing shapes, each twice in a row (a lane captures a shape on its second batch),
        // every thread from its own starting point.
        for (size_t k = 0; k < 2 * specs.size(); ++k) {
          const size_t j = (k / 2 + static_cast<size_t>(i) * 3) % specs.size();
          OwnedRequest got = want[j];
          got.Poison();
          const absl::Status st = lanes->Run(0, layer->layer, got.Request());
          const ExpertsRequest r = got.Request();
          if (!st.ok() || std::memcmp(r.out.data, want[j].Request().out.data,
                                      static_cast<size_t>(r.out.NumBytes())) != 0) {
            mismatches[i] = absl::StrCat("T=", specs[j].tokens, ": ", st.ToString());
            return;
          }
        }
      });
    }
    // Meanwhile: host memory pinned and unpinned, and another layer index uploaded again and
    // again (each upload replaces and frees the previous copy, and drops every lane's graphs).
    int64_t uploads = 0;
    std::thread pinner([&] {
      std::vector<char> host(size_t{1} << 20);
      while (!done.load()) {
        if (lanes->RegisterHostMemory(host.data(), host.size()).ok()) {
          lanes->UnregisterHostMemory(host.data());
        }
        if (uploads < 8) {
          EXPECT_TRUE(lanes->PrepareLayer(1, layer->layer).ok());
          ++uploads;
        }
      }
    });
    for (std::thread& t : threads) t.join();
    done = true;
    pinner.join();
    for (int i = 0; i < kThreads; ++i) {
      EXPECT_EQ(mismatches[i], "") << "round " << round << " thread " << i;
    }
    const CudaBackendCounters c = GetCudaBackendCounters(*lanes);
    EXPECT_EQ(c.capture_failures, 0) << "round " << round;
    captures += c.graph_captures;
    overlapped += c.overlapped_runs;
  }
  EXPECT_GT(captures, 0);
  EXPECT_GT(overlapped, 0);
  std::printf("lanes warming up: %lld captures, %lld overlapped runs in %d rounds\n",
              static_cast<long long>(captures), static_cast<long long>(overlapped), kRounds);
}

// GEMM2 waiting per item (ExpertGemmParams::item_ready, forced on) gives the same bits as GEMM2
// waiting for the whole GEMM1 grid, batch after batch: the words GEMM2 sets back to zero must be
// zero for the next batch's GEMM1, whatever its shape (direct and grouped routes, items of one
// to four token groups), so a stale count would let GEMM2 read act rows before they exist
// (poisoned scratch: NaN).
TEST(CudaBackendVersionsTest, PerItemWaitMatchesGridWait) {
  const std::unique_ptr<OwnedLayer> layer = Layer(77);
  std::unique_ptr<ExpertBackend> backends[2];
  for (int i = 0; i < 2; ++i) {
    CudaBackendOptions options;
    options.item_ready = i == 0 ? 1 : 0;
    options.poison_scratch = true;
    options.graph_max_tokens = i == 0 ? 4 : 0;  // captures and replays on the per-item side
    absl::StatusOr<std::unique_ptr<ExpertBackend>> made = MakeCudaExpertBackend(options);
    if (!made.ok()) GTEST_SKIP() << made.status();
    ASSERT_TRUE((*made)->PrepareLayer(0, layer->layer).ok());
    backends[i] = *std::move(made);
  }
  int runs = 0;
  for (int round = 0; round < 3; ++round) {
    for (const int64_t tokens : {1, 2, 7, 19, 40, 3, 1, 30}) {
      cpu::RandomRequestSpec spec;
      spec.tokens = tokens;
      spec.top_k = 4;
      spec.seed = 100 * round + static_cast<uint64_t>(tokens);
      OwnedRequest got[2] = {MakeRandomRequest(layer->layer, spec),
                             MakeRandomRequest(layer->layer, spec)};
      for (int i = 0; i < 2; ++i) {
        got[i].Poison();
        ASSERT_TRUE(backends[i]->Run(0, layer->layer, got[i].Request()).ok());
      }
      ++runs;
      ASSERT_EQ(got[0].out_f32.size(), got[1].out_f32.size());
      EXPECT_EQ(std::memcmp(got[0].out_f32.data(), got[1].out_f32.data(),
                            got[0].out_f32.size() * sizeof(float)),
                0)
          << "round " << round << ", T=" << tokens;
      OwnedRequest want = MakeRandomRequest(layer->layer, spec);
      want.Poison();
      ASSERT_TRUE(RunExpertsReference(layer->layer, want.Request()).ok());
      EXPECT_LE(RelErr(got[0], want, tokens * layer->layer.hidden), 1e-2) << "T=" << tokens;
    }
  }
  // Batches on the mma.sync kernels (up to 32 routes per expert; more take the wgmma kernel,
  // which has no per-item wait) launch one per-item GEMM2 on the forced side; replays launch
  // what their capture launched.
  const CudaBackendCounters on = GetCudaBackendCounters(*backends[0]);
  EXPECT_LE(on.item_ready_launches, on.eager_runs + on.graph_captures);
  EXPECT_GE(on.item_ready_launches, 9);  // T = 7, 19 and 30 at least, every round
  EXPECT_EQ(GetCudaBackendCounters(*backends[1]).item_ready_launches, 0);
  EXPECT_EQ(runs, 24);
}

// (pinned staging, poisoned scratch, F32 in and out instead of BF16, programmatic launch, the
// fused layer kernel).
INSTANTIATE_TEST_SUITE_P(Forms, GraphReplayTest,
                         ::testing::Combine(::testing::Bool(), ::testing::Bool(),
                                            ::testing::Bool(), ::testing::Bool(),
                                            ::testing::Bool()));

}  // namespace
}  // namespace moe
