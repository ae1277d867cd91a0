// Host launcher of the staging kernels (staging_runner.h).
#include "kernels/cuda/staging_runner.h"

#include <vector>

#include "absl/strings/str_cat.h"

namespace moe::cuda {
namespace {

absl::Status CheckQuantization(const StagingParams& p) {
  if (p.x == nullptr) return absl::OkStatus();
  const int multiple = p.format == StagingFormat::kMxfp8 ? 128 : 64;
  if (p.hidden_size <= 0 || p.hidden_size % multiple != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("staging: hidden size ", p.hidden_size, " is not a positive multiple of ",
                     multiple));
  }
  if (p.q == nullptr || p.scales == nullptr ||
      (p.format == StagingFormat::kNvfp4 && p.token_scale == nullptr)) {
    return absl::InvalidArgumentError("staging: quantization outputs missing");
  }
  return absl::OkStatus();
}

absl::Status CheckRemap(const StagingParams& p) {
  if (p.topk_ids == nullptr) {
    if (p.load != nullptr) {
      return absl::InvalidArgumentError("staging: load recording needs topk_ids");
    }
    return absl::OkStatus();
  }
  if (p.top_k <= 0 || p.num_logical <= 0 || p.max_replicas <= 0 ||
      p.logical_to_physical == nullptr || p.replica_count == nullptr ||
      p.physical_ids == nullptr) {
    return absl::InvalidArgumentError("staging: remap needs top_k, a placement and physical_ids");
  }
  if (p.load != nullptr && (p.load_size < 0 || p.num_unpadded < 0 || p.num_unpadded > p.tokens)) {
    return absl::InvalidArgumentError(absl::StrCat("staging: num_unpadded ", p.num_unpadded,
                                                   " outside [0, ", p.tokens,
                                                   "] or negative load size"));
  }
  return absl::OkStatus();
}

}  // namespace

void DevicePlacement::Fill(StagingParams& p) const {
  p.logical_to_physical = logical_to_physical.as<const int32_t>();
  p.replica_count = replica_count.as<const int32_t>();
  p.num_logical = num_logical;
  p.max_replicas = max_replicas;
}

absl::StatusOr<std::unique_ptr<DevicePlacement>> UploadPlacement(const LayerPlacement& placement) {
  auto d = std::make_unique<DevicePlacement>();
  d->num_logical = placement.num_logical();
  d->max_replicas = placement.max_replicas();
  d->num_physical = placement.num_physical();
  const std::vector<int32_t>& table = placement.logical_to_physical();
  const std::vector<int32_t>& counts = placement.replica_count();
  if (absl::Status s = d->logical_to_physical.Reserve(table.size() * sizeof(int32_t)); !s.ok()) {
    return s;
  }
  if (absl::Status s = d->replica_count.Reserve(counts.size() * sizeof(int32_t)); !s.ok()) return s;
  if (absl::Status s = CudaStatus(cudaMemcpy(d->logical_to_physical.get(), table.data(),
                                             table.size() * sizeof(int32_t), cudaMemcpyHostToDevice),
                                  "placement upload");
      !s.ok()) {
    return s;
  }
  if (absl::Status s = CudaStatus(cudaMemcpy(d->replica_count.get(), counts.data(),
                                             counts.size() * sizeof(int32_t), cudaMemcpyHostToDevice),
                                  "placement upload");
      !s.ok()) {
    return s;
  }
  return d;
}

absl::Status EnqueueStaging(const StagingParams& p, cudaStream_t stream) {
  if (p.tokens < 0) return absl::InvalidArgumentError("staging: negative token count");
  if (p.mxfp8_block_threads != 0 && p.mxfp8_block_threads != 256 &&
      p.mxfp8_block_threads != 512 && p.mxfp8_block_threads != 1024) {
    return absl::InvalidArgumentError(absl::StrCat("staging: mxfp8_block_threads ",
                                                   p.mxfp8_block_threads,
                                                   " is not 0, 256, 512 or 1024"));
  }
  if (p.nvfp4_one_tile_registers != 0 && p.nvfp4_one_tile_registers != 56 &&
      p.nvfp4_one_tile_registers != 64 && p.nvfp4_one_tile_registers != 72) {
    return absl::InvalidArgumentError(absl::StrCat("staging: nvfp4_one_tile_registers ",
                                                   p.nvfp4_one_tile_registers,
                                                   " is not 0, 56, 64 or 72"));
  }
  if (p.nvfp4_shared_lane_chunks != 0 && p.nvfp4_shared_lane_chunks != 4 &&
      p.nvfp4_shared_lane_chunks != 7 && p.nvfp4_shared_lane_chunks != 14) {
    return absl::InvalidArgumentError(absl::StrCat(
        "staging: nvfp4_shared_lane_chunks ", p.nvfp4_shared_lane_chunks, " is not 0, 4, 7 or 14"));
  }
  if (absl::Status s = CheckQuantization(p); !s.ok()) return s;
  if (absl::Status s = CheckRemap(p); !s.ok()) return s;
  return CudaStatus(LaunchStaging(p, stream), "staging kernel launch");
}

}  // namespace moe::cuda
