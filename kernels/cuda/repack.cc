// Repacking into the fragment layout (see repack.h). The value words are built from source bytes
// (two consecutive K elements of one row, the even one in the low nibble) through four 256-entry
// tables, one per fragment register, so a word costs four loads and four lookups.
#include "kernels/cuda/repack.h"

#include <algorithm>
#include <array>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "kernels/cuda/fp4_fragment.h"

namespace moe::cuda {
namespace {

constexpr int kNvScaleShift = 8;

using ByteTables = std::array<std::array<uint32_t, 256>, 4>;

// tables[j][b]: the word bits of register j when its (even, odd) K pair is the byte b.
const ByteTables& RegisterTables() {
  static const ByteTables tables = [] {
    ByteTables t{};
    for (int j = 0; j < 4; ++j) {
      for (int b = 0; b < 256; ++b) {
        uint8_t codes[8] = {};
        codes[2 * j] = static_cast<uint8_t>(b & 15);
        codes[2 * j + 1] = static_cast<uint8_t>(b >> 4);
        t[j][b] = PackFragmentWord(codes);
      }
    }
    return t;
  }();
  return tables;
}

// Source row of tile row r (0..15) of a tile, or -1 for an all-zero row.
struct RowMap {
  bool gate_up_pairs = false;
  GateUpLayout layout = GateUpLayout::kInterleaved;
  int64_t rows = 0;   // source rows
  int64_t inter = 0;  // I (gate/up pairs only)

  int64_t operator()(int64_t tile, int r) const {
    if (gate_up_pairs) {
      const int64_t j = 8 * tile + (r & 7);
      return r < 8 ? GateRow(layout, j, inter) : UpRow(layout, j, inter);
    }
    const int64_t row = kTileRows * tile + r;
    return row < rows ? row : -1;
  }
};

void PackValues(const WeightMatrix& w, const PackedShape& shape, const RowMap& map,
                uint32_t* values) {
  const ByteTables& tables = RegisterTables();
  const uint8_t* codes = w.values.As<const uint8_t>();
  const int64_t row_bytes = w.cols / 2;
  for (int64_t tile = 0; tile < shape.tiles; ++tile) {
    int64_t src[kTileRows];
    for (int r = 0; r < kTileRows; ++r) src[r] = map(tile, r);
    for (int64_t chunk = 0; chunk < shape.chunks; ++chunk) {
      uint32_t* out = values + (tile * shape.chunks + chunk) * kWarpLanes * kStepsPerChunk;
      for (int lane = 0; lane < kWarpLanes; ++lane) {
        const int g = lane >> 2, t = lane & 3;
        for (int step = 0; step < kStepsPerChunk; ++step) {
          uint32_t word = 0;
          for (int j = 0; j < 4; ++j) {
            const int64_t row = src[FragmentRow(j, g)];
            const int64_t k = chunk * kChunkK + step * 16 + FragmentK(j, 0, t);
            if (row >= 0 && k < w.cols) word |= tables[j][codes[row * row_bytes + k / 2]];
          }
          out[lane * kStepsPerChunk + step] = word;
        }
      }
    }
  }
}

int MxExponentShift(const WeightMatrix& w) {
  const uint8_t* scales = w.scales.As<const uint8_t>();
  const int64_t n = w.rows * (w.cols / kMxfp4Block);
  int max_b = 0;
  for (int64_t i = 0; i < n; ++i) max_b = std::max<int>(max_b, scales[i]);
  return std::max(0, max_b - 128);
}

void PackMxScales(const WeightMatrix& w, const PackedShape& shape, const RowMap& map, int shift,
                  uint32_t* out) {
  const uint8_t* scales = w.scales.As<const uint8_t>();
  const int64_t blocks = w.cols / kMxfp4Block;
  for (int64_t tile = 0; tile < shape.tiles; ++tile) {
    for (int64_t chunk = 0; chunk < shape.chunks; ++chunk) {
      for (int g = 0; g < 8; ++g) {
        uint32_t word = 0;
        for (int row8 = 0; row8 < 2; ++row8) {
          const int64_t row = map(tile, g + 8 * row8);
          for (int blk = 0; blk < 2; ++blk) {
            const int64_t kb = 2 * chunk + blk;
            if (row < 0 || kb >= blocks) continue;
            const int biased = scales[row * blocks + kb] + 126 - shift;
            if (biased >= 1) word |= static_cast<uint32_t>(biased) << (8 * (2 * row8 + blk));
          }
        }
        out[(tile * shape.chunks + chunk) * 8 + g] = word;
      }
    }
  }
}

void PackNvScales(const WeightMatrix& w, const PackedShape& shape, const RowMap& map,
                  uint32_t* out) {
  const uint8_t* scales = w.scales.As<const uint8_t>();
  const int64_t blocks = w.cols / kNvfp4Block;
  const float factor = std::ldexp(1.f, 126 - kNvScaleShift);
  for (int64_t tile = 0; tile < shape.tiles; ++tile) {
    for (int64_t chunk = 0; chunk < shape.chunks; ++chunk) {
      for (int g = 0; g < 8; ++g) {
        for (int step = 0; step < kStepsPerChunk; ++step) {
          uint32_t word = 0;
          const int64_t kb = kStepsPerChunk * chunk + step;
          for (int row8 = 0; row8 < 2; ++row8) {
            const int64_t row = map(tile, g + 8 * row8);
            if (row < 0 || kb >= blocks) continue;
            // Exact: an e4m3 value has 4 significant bits and lands far inside bf16's range.
            const float scale = E4m3ToFloat(scales[row * blocks + kb]) * factor;
            word |= static_cast<uint32_t>(FloatToBf16(scale)) << (16 * row8);
          }
          out[((tile * shape.chunks + chunk) * 8 + g) * kStepsPerChunk + step] = word;
        }
      }
    }
  }
}

absl::Status PackMatrix(const WeightMatrix& w, const PackedShape& shape, const RowMap& map,
                        absl::Span<uint32_t> values, absl::Span<uint32_t> scales,
                        PackedScaleInfo* info) {
  if (w.format != WeightFormat::kMxfp4 && w.format != WeightFormat::kNvfp4) {
    return absl::InvalidArgumentError(
        absl::StrCat("repack: ", WeightFormatName(w.format), " is not an FP4 format"));
  }
  if (static_cast<int64_t>(values.size()) != shape.value_words() ||
      static_cast<int64_t>(scales.size()) != shape.scale_words(w.format)) {
    return absl::InvalidArgumentError(
        absl::StrCat("repack: buffers of ", values.size(), " and ", scales.size(),
                     " words; the packed matrix needs ", shape.value_words(), " and ",
                     shape.scale_words(w.format)));
  }
  PackValues(w, shape, map, values.data());
  if (w.format == WeightFormat::kMxfp4) {
    info->exponent_shift = MxExponentShift(w);
    PackMxScales(w, shape, map, info->exponent_shift, scales.data());
  } else {
    info->exponent_shift = kNvScaleShift;
    PackNvScales(w, shape, map, scales.data());
  }
  info->epilogue_factor = std::ldexp(1.f, info->exponent_shift);
  return absl::OkStatus();
}

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

}  // namespace

PackedShape W13PackedShape(int64_t hidden, int64_t inter) {
  return PackedShape{inter / 8, CeilDiv(hidden, kChunkK)};
}

PackedShape W2PackedShape(int64_t hidden, int64_t inter) {
  return PackedShape{CeilDiv(hidden, kTileRows), CeilDiv(inter, kChunkK)};
}

absl::Status PackW13(const WeightMatrix& w13, GateUpLayout layout, absl::Span<uint32_t> values,
                     absl::Span<uint32_t> scales, PackedScaleInfo* info) {
  const int64_t inter = w13.rows / 2;
  if (inter % 8 != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("repack: intermediate size ", inter, " is not a multiple of 8"));
  }
  const RowMap map{true, layout, w13.rows, inter};
  return PackMatrix(w13, W13PackedShape(w13.cols, inter), map, values, scales, info);
}

absl::Status PackW2(const WeightMatrix& w2, absl::Span<uint32_t> values,
                    absl::Span<uint32_t> scales, PackedScaleInfo* info) {
  const RowMap map{false, GateUpLayout::kInterleaved, w2.rows, 0};
  return PackMatrix(w2, W2PackedShape(w2.rows, w2.cols), map, values, scales, info);
}

}  // namespace moe::cuda
