// GPU staging (staging_runner.h) against the CPU functions QuantizeMxfp8, QuantizeNvfp4PerToken,
// MapLogicalToPhysical and RecordLoad: every output byte and every load count must be equal, on
// fresh random data each run (seeded from the clock, printed) with zero rows, huge and tiny
// values, infinities and NaNs, replicated and vacant slots, out-of-range ids, padding and a
// partial hosted mask, and NVFP4 rows longer than one block tile. Outputs are poisoned before the
// launch. Needs a GPU (tagged "gpu").
#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cuda/staging_runner.h"
#include "kernels/eplb.h"
#include "kernels/formats.h"
#include "kernels/staging.h"
#include "kernels/tensor.h"

namespace moe::cuda {
namespace {

constexpr int kExperts = 64;
constexpr int kTopK = 6;
constexpr int kSlots = 80;  // 64 experts, 15 extra replicas, 1 vacant slot

// Rows of N(0, 1) times 2^u (u uniform in [-30, 30]); row kinds by t % 7: 1 all zero, 2 with
// huge values (BF16 max) mixed in, 3 tiny (subnormal BF16) values, 4 an infinity and a NaN, 5 a
// scale 2^u with u in [-86, -70] (NVFP4 token scales on both sides of 2^-91, where the kernel's
// threshold table switches from fp32 FMAs to double products), 6 alternately a row amax just
// below or at 2^121 (where the NVFP4 encode stops comparing BF16 patterns as FP16) and magnitudes
// 2^-135..2^-100 (thresholds and elements that read as FP16 subnormals on the fast path).
std::vector<uint16_t> RandomHidden(int64_t tokens, int64_t hidden, std::mt19937_64& rng) {
  std::vector<uint16_t> x(tokens * hidden);
  std::normal_distribution<float> normal(0.f, 1.f);
  std::uniform_int_distribution<int> exponent(-30, 30);
  for (int64_t t = 0; t < tokens; ++t) {
    const float scale = std::ldexp(1.f, exponent(rng));
    uint16_t* row = &x[t * hidden];
    for (int64_t h = 0; h < hidden; ++h) row[h] = FloatToBf16(normal(rng) * scale);
    switch (t % 7) {
      case 1:
        std::fill(row, row + hidden, 0);
        break;
      case 2:
        for (int64_t h = 0; h < hidden; h += 37) row[h] = (rng() & 1) ? 0x7F7F : 0xFF7F;
        break;
      case 3:
        for (int64_t h = 0; h < hidden; ++h) row[h] = static_cast<uint16_t>(rng() % 0x80);
        break;
      case 4:
        row[rng() % hidden] = 0x7F80;  // +inf
        row[rng() % hidden] = 0x7FC1;  // NaN
        break;
      case 5: {
        const float tiny = std::ldexp(1.f, -86 + static_cast<int>(rng() % 17));
        for (int64_t h = 0; h < hidden; ++h) row[h] = FloatToBf16(normal(rng) * tiny);
        break;
      }
      case 6:
        if ((t / 7) % 2 == 0) {
          const float big = std::ldexp(1.f, 114 + static_cast<int>(rng() % 6));
          for (int64_t h = 0; h < hidden; ++h) row[h] = FloatToBf16(normal(rng) * big);
          row[rng() % hidden] = (rng() & 1) ? 0x7BFF : 0xFC00;  // below 2^121, or -2^121
        } else {
          std::uniform_int_distribution<int> low(-135, -100);
          for (int64_t h = 0; h < hidden; ++h) {
            row[h] = FloatToBf16(std::ldexp(normal(rng), low(rng)));
          }
        }
        break;
      default:
        break;
    }
  }
  return x;
}

LayerPlacement RandomPlacement(std::mt19937_64& rng) {
  std::vector<int32_t> p2l(kSlots);
  for (int s = 0; s < kSlots; ++s) p2l[s] = s < kExperts ? s : static_cast<int32_t>(rng() % 8);
  p2l[kSlots - 1] = -1;
  std::shuffle(p2l.begin(), p2l.end(), rng);
  absl::StatusOr<LayerPlacement> placement = LayerPlacement::Create(p2l, kExperts);
  EXPECT_TRUE(placement.ok()) << placement.status();
  return *std::move(placement);
}

template <typename T>
T* DeviceCopy(const std::vector<T>& host, DeviceBuffer& buf) {
  EXPECT_TRUE(buf.Reserve(host.size() * sizeof(T)).ok());
  EXPECT_EQ(cudaMemcpy(buf.get(), host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice),
            cudaSuccess);
  return buf.as<T>();
}

template <typename T>
std::vector<T> HostCopy(const DeviceBuffer& buf, size_t n) {
  std::vector<T> host(n);
  EXPECT_EQ(cudaMemcpy(host.data(), buf.get(), n * sizeof(T), cudaMemcpyDeviceToHost), cudaSuccess);
  return host;
}

template <typename T>
size_t Mismatches(const std::vector<T>& got, const std::vector<T>& want) {
  size_t n = 0;
  for (size_t i = 0; i < want.size(); ++i) n += std::memcmp(&got[i], &want[i], sizeof(T)) != 0;
  return n;
}

// mx_threads: StagingParams::mxfp8_block_threads; programmatic: StagingParams::programmatic;
// remap_only: no quantization input (x null, hidden_size 0): remap and load only, the
// quantization outputs stay as poisoned; shared_lane_chunks: -1 the register kernels
// (nvfp4_shared_rows off), else nvfp4_shared_rows (the default) with this
// nvfp4_shared_lane_chunks; one_tile_registers: StagingParams::nvfp4_one_tile_registers;
// pipeline: StagingParams::nvfp4_shared_pipeline.
void CheckCase(StagingFormat format, int64_t tokens, int64_t hidden, uint64_t seed,
               int mx_threads = 0, bool programmatic = true, bool remap_only = false,
               int shared_lane_chunks = 0, int one_tile_registers = 0, bool pipeline = false) {
  SCOPED_TRACE(testing::Message() << (format == StagingFormat::kMxfp8 ? "MXFP8" : "NVFP4")
                                  << " T=" << tokens << " H=" << hidden << " seed=" << seed
                                  << " one_tile_registers=" << one_tile_registers
                                  << " shared_lane_chunks=" << shared_lane_chunks
                                  << " pipeline=" << pipeline);
  std::mt19937_64 rng(seed);
  const bool mx = format == StagingFormat::kMxfp8;
  const int64_t q_bytes = mx ? tokens * hidden : tokens * hidden / 2;
  const int64_t words = tokens * hidden / (mx ? 128 : 64);
  const std::vector<uint16_t> x = RandomHidden(tokens, hidden, rng);
  std::vector<int32_t> ids(tokens * kTopK);
  for (int32_t& id : ids) {
    const int r = static_cast<int>(rng() % 100);
    id = r < 5 ? -1 : (r < 7 ? kExperts + r : static_cast<int32_t>(rng() % kExperts));
  }
  std::vector<int64_t> token_indices(tokens);
  for (int64_t& i : token_indices) i = static_cast<int64_t>(rng() % (int64_t{1} << 40));
  std::vector<uint8_t> hosted(kSlots);
  std::unique_ptr<bool[]> hosted_bool(new bool[kSlots]);
  std::vector<int64_t> load(kSlots);
  for (int s = 0; s < kSlots; ++s) {
    hosted[s] = rng() % 4 != 0;
    hosted_bool[s] = hosted[s] != 0;
    load[s] = static_cast<int64_t>(rng() % 1000);
  }
  const int64_t num_unpadded = tokens - tokens / 3;
  const LayerPlacement placement = RandomPlacement(rng);

  // CPU reference.
  std::vector<uint8_t> q_ref(q_bytes);
  std::vector<int32_t> scales_ref(words), phys_ref(tokens * kTopK);
  std::vector<float> token_scale_ref(tokens);
  const TensorView xv = MakeView(DType::kBF16, {tokens, hidden}, x.data());
  if (mx) {
    ASSERT_TRUE(QuantizeMxfp8(xv, MakeView(DType::kE4M3, {tokens, hidden}, q_ref.data()),
                              MakeView(DType::kI32, {tokens, hidden / 128}, scales_ref.data()))
                    .ok());
  } else {
    ASSERT_TRUE(
        QuantizeNvfp4PerToken(xv, MakeView(DType::kU8, {tokens, hidden / 2}, q_ref.data()),
                              MakeView(DType::kI32, {tokens, hidden / 64}, scales_ref.data()),
                              MakeView(DType::kF32, {tokens}, token_scale_ref.data()))
            .ok());
  }
  const TensorView phys_view = MakeView(DType::kI32, {tokens, kTopK}, phys_ref.data());
  ASSERT_TRUE(MapLogicalToPhysical(placement, MakeView(DType::kI32, {tokens, kTopK}, ids.data()),
                                   MakeView(DType::kI64, {tokens}, token_indices.data()), phys_view)
                  .ok());
  std::vector<int64_t> load_ref = load;
  ASSERT_TRUE(RecordLoad(phys_view, num_unpadded, absl::Span<const bool>(hosted_bool.get(), kSlots),
                         absl::Span<int64_t>(load_ref))
                  .ok());

  // GPU, outputs poisoned.
  absl::StatusOr<std::unique_ptr<DevicePlacement>> dp = UploadPlacement(placement);
  ASSERT_TRUE(dp.ok()) << dp.status();
  DeviceBuffer dx, dq, ds, dts, dids, didx, dphys, dhosted, dload;
  StagingParams p;
  p.format = format;
  p.x = DeviceCopy(x, dx);
  p.tokens = static_cast<int32_t>(tokens);
  p.hidden_size = static_cast<int32_t>(hidden);
  p.q = DeviceCopy(std::vector<uint8_t>(q_bytes, 0xA5), dq);
  p.scales = DeviceCopy(std::vector<int32_t>(words, 0x5A5A5A5A), ds);
  p.token_scale = DeviceCopy(std::vector<float>(tokens, NAN), dts);
  p.topk_ids = DeviceCopy(ids, dids);
  p.token_indices = DeviceCopy(token_indices, didx);
  p.top_k = kTopK;
  (*dp)->Fill(p);
  p.physical_ids = DeviceCopy(std::vector<int32_t>(tokens * kTopK, 0x7777), dphys);
  p.load = reinterpret_cast<unsigned long long*>(DeviceCopy(load, dload));
  p.hosted = DeviceCopy(hosted, dhosted);
  p.load_size = kSlots;
  p.num_unpadded = static_cast<int32_t>(num_unpadded);
  p.mxfp8_block_threads = mx_threads;
  p.programmatic = programmatic;
  p.nvfp4_one_tile_registers = one_tile_registers;
  p.nvfp4_shared_rows = shared_lane_chunks >= 0;
  p.nvfp4_shared_lane_chunks = std::max(shared_lane_chunks, 0);
  p.nvfp4_shared_pipeline = pipeline;
  if (remap_only) {
    p.x = nullptr;
    p.hidden_size = 0;
  }
  ASSERT_TRUE(EnqueueStaging(p, nullptr).ok());
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);

  if (remap_only) {
    EXPECT_EQ(HostCopy<uint8_t>(dq, q_bytes), std::vector<uint8_t>(q_bytes, 0xA5));
  } else {
    EXPECT_EQ(Mismatches(HostCopy<uint8_t>(dq, q_bytes), q_ref), 0u);
    EXPECT_EQ(Mismatches(HostCopy<int32_t>(ds, words), scales_ref), 0u);
    if (!mx) {
      EXPECT_EQ(Mismatches(HostCopy<float>(dts, tokens), token_scale_ref), 0u);
    }
  }
  EXPECT_EQ(Mismatches(HostCopy<int32_t>(dphys, tokens * kTopK), phys_ref), 0u);
  EXPECT_EQ(HostCopy<int64_t>(dload, kSlots), load_ref);
}

uint64_t FreshSeed() {
  const uint64_t seed =
      static_cast<uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count());
  std::printf("staging_cuda_test seed %llu\n", static_cast<unsigned long long>(seed));
  return seed;
}

TEST(StagingCudaTest, Mxfp8MatchesCpuBitForBit) {
  const uint64_t seed = FreshSeed();
  for (int64_t tokens : {1, 2, 7, 64, 333, 4096}) {
    for (int64_t hidden : {128, 2944, 7168}) {
      CheckCase(StagingFormat::kMxfp8, tokens, hidden, seed + tokens * 31 + hidden);
    }
  }
  // The other block sizes, and a plain launch.
  for (int threads : {512, 1024}) {
    for (int64_t tokens : {1, 7, 333}) {
      CheckCase(StagingFormat::kMxfp8, tokens, 2944, seed + tokens * 7 + threads, threads);
    }
  }
  CheckCase(StagingFormat::kMxfp8, 64, 7168, seed + 5, 0, false);
}

TEST(StagingCudaTest, Nvfp4MatchesCpuBitForBit) {
  const uint64_t seed = FreshSeed();
  // The launcher picks 7 chunks of 8 elements per lane for H = 7168 and 4 for the others; at
  // H = 576 and 2880 a block's last warp has a partial tile; at 2048, 4096 (4 lane chunks) and
  // 7168 (7) a row is exactly one tile, which the launcher stages through shared memory
  // (StageNvfp4SharedKernel).
  for (int64_t tokens : {1, 2, 7, 64, 333, 4096}) {
    for (int64_t hidden : {128, 576, 2048, 2880, 4096, 7168}) {
      CheckCase(StagingFormat::kNvfp4, tokens, hidden, seed + tokens * 17 + hidden);
    }
  }
  // Rows longer than one block tile are read twice, tile by tile: 4 lane chunks (H = 61440, tiles
  // of 32768 elements) and 7 (H = 100352, tiles of 50176).
  for (int64_t hidden : {61440, 100352}) {
    for (int64_t tokens : {1, 7}) {
      CheckCase(StagingFormat::kNvfp4, tokens, hidden, seed + tokens * 17 + hidden);
    }
  }
  // The register kernels for one-tile rows (nvfp4_shared_rows off): 4 lane chunks (2048, 4096)
  // at their cap, and every cap of the 7-lane-chunk kernel (H = 1792 has one warp per row, 3584
  // two, 7168 four; 56 registers carry an 8-byte spill).
  for (int64_t hidden : {2048, 4096}) {
    for (int64_t tokens : {1, 333, 4096}) {
      CheckCase(StagingFormat::kNvfp4, tokens, hidden, seed + tokens * 11 + hidden, 0, true, false,
                -1);
    }
  }
  for (int registers : {56, 64, 72}) {
    for (int64_t hidden : {1792, 3584, 7168}) {
      for (int64_t tokens : {1, 333, 4096}) {
        CheckCase(StagingFormat::kNvfp4, tokens, hidden,
                  seed + tokens * 13 + hidden + registers * 101, 0, true, false, -1, registers);
      }
    }
  }
  // Rows staged through shared memory (the default): one-tile rows of 7 lane chunks (1792, 3584)
  // and of 4 (20480: 20 warps, the largest row it takes), beside the loop above's sizes.
  for (int64_t hidden : {1792, 3584, 20480}) {
    for (int64_t tokens : {1, 333, 4096}) {
      if (hidden > 8192 && tokens > 333) continue;
      CheckCase(StagingFormat::kNvfp4, tokens, hidden, seed + tokens * 19 + hidden * 3);
    }
  }
  // Forced lane chunks: 14 (H = 3584: one warp, 7168: two), 4 (7168: seven warps), 7 (7168), and
  // counts that do not tile the row, which fall back (14 at 2048 and 4096, 7 at 4096).
  const struct {
    int lane_chunks;
    int64_t hidden;
  } forced[] = {{14, 3584}, {14, 7168}, {4, 7168}, {7, 7168}, {14, 2048}, {14, 4096}, {7, 4096}};
  for (const auto& f : forced) {
    for (int64_t tokens : {1, 333, 4096}) {
      CheckCase(StagingFormat::kNvfp4, tokens, f.hidden,
                seed + tokens * 23 + f.hidden * 5 + f.lane_chunks, 0, true, false, f.lane_chunks);
    }
  }
}

// The looping two-buffer kernel (nvfp4_shared_pipeline): one-tile rows of 4 lane chunks (2048,
// 4096) and 7 (1792, 3584, 7168), forced 4 at 7168; forced 14 (not a pipeline instance) and
// 20480 (two rows over the kernel's limit) fall back to the single-row kernel. 1 and 333 tokens
// leave blocks without a second row; 4096 and 9000 make every block loop, the last ones unevenly. A
// remap-only launch beside it.
TEST(StagingCudaTest, Nvfp4SharedPipelineMatchesCpuBitForBit) {
  const uint64_t seed = FreshSeed();
  for (int64_t hidden : {1792, 2048, 3584, 4096, 7168, 20480}) {
    for (int64_t tokens : {1, 333, 4096}) {
      if (hidden > 8192 && tokens > 333) continue;
      CheckCase(StagingFormat::kNvfp4, tokens, hidden, seed + tokens * 29 + hidden * 7, 0, true,
                false, 0, 0, true);
    }
  }
  CheckCase(StagingFormat::kNvfp4, 9000, 7168, seed + 3, 0, true, false, 0, 0, true);
  for (int lane_chunks : {4, 14}) {
    CheckCase(StagingFormat::kNvfp4, 4096, 7168, seed + lane_chunks, 0, true, false, lane_chunks, 0,
              true);
  }
  CheckCase(StagingFormat::kNvfp4, 333, 7168, seed + 9, 0, false, false, 0, 0, true);
  CheckCase(StagingFormat::kNvfp4, 333, 128, seed + 11, 0, true, true, 0, 0, true);
}

TEST(StagingCudaTest, RemapOnlyAndRejectsBadHidden) {
  // Remap and load recording without a quantization input, hidden_size 0 (the NVFP4 launcher
  // sizes its blocks from it).
  const uint64_t seed = FreshSeed();
  for (StagingFormat format : {StagingFormat::kMxfp8, StagingFormat::kNvfp4}) {
    for (int64_t tokens : {1, 333}) CheckCase(format, tokens, 128, seed + tokens, 0, true, true);
  }
  StagingParams p;
  p.format = StagingFormat::kMxfp8;
  uint16_t dummy = 0;
  p.x = &dummy;
  p.tokens = 1;
  p.hidden_size = 2880;  // not a multiple of 128
  EXPECT_EQ(EnqueueStaging(p, nullptr).code(), absl::StatusCode::kInvalidArgument);
  p.hidden_size = 128;  // outputs missing
  EXPECT_EQ(EnqueueStaging(p, nullptr).code(), absl::StatusCode::kInvalidArgument);
  p.mxfp8_block_threads = 384;  // not a supported block size
  EXPECT_EQ(EnqueueStaging(p, nullptr).code(), absl::StatusCode::kInvalidArgument);
  p.mxfp8_block_threads = 0;
  p.nvfp4_one_tile_registers = 48;  // not an instantiated cap (checked before the outputs)
  const absl::Status bad_cap = EnqueueStaging(p, nullptr);
  EXPECT_EQ(bad_cap.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad_cap.message().find("nvfp4_one_tile_registers 48"), absl::string_view::npos)
      << bad_cap;
  p.nvfp4_one_tile_registers = 0;
  p.nvfp4_shared_lane_chunks = 8;  // not a shared-row kernel instance
  const absl::Status bad_chunks = EnqueueStaging(p, nullptr);
  EXPECT_EQ(bad_chunks.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad_chunks.message().find("nvfp4_shared_lane_chunks 8"), absl::string_view::npos)
      << bad_chunks;
}

}  // namespace
}  // namespace moe::cuda
