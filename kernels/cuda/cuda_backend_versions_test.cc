// CudaExpertBackend keeps device weights per (layer index, host weights): two versions of one
// layer prepared one after the other (what a shard does during a two-phase placement switch) both
// stay runnable, each against its own CPU reference; re-preparing the same weights replaces their
// copy; weights never prepared are refused; requests from several threads while a new version is
// uploaded all match. Needs a GPU (tag "gpu"): skipped without one.
#include <cmath>
#include <memory>
#include <string>
#include <thread>
#include <vector>

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

// Runs `layer` on the backend and on the reference with the same random request.
double RunAndCompare(ExpertBackend& backend, int layer_index, const OwnedLayer& layer,
                     uint64_t seed, absl::Status* status) {
  cpu::RandomRequestSpec spec;
  spec.tokens = 19;
  spec.top_k = 4;
  spec.seed = seed;
  OwnedRequest got = MakeRandomRequest(layer.layer, spec);
  OwnedRequest want = MakeRandomRequest(layer.layer, spec);
  got.Poison();
  want.Poison();
  *status = backend.Run(layer_index, layer.layer, got.Request());
  if (!status->ok()) return INFINITY;
  EXPECT_TRUE(RunExpertsReference(layer.layer, want.Request()).ok());
  return RelErr(got, want, spec.tokens * layer.layer.hidden);
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

}  // namespace
}  // namespace moe
