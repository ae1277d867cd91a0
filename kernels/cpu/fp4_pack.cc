// Scalar repacking (once per layer load): each source nibble is moved to the byte and nibble the
// layout in fp4_pack.h gives it.
#include "kernels/cpu/fp4_pack.h"

#include <array>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace moe::cpu {
namespace {

constexpr int kHalfRows = kGroupRows / 2;
// 0.5 undoes the doubled E2M1 codes, 2^-8 the code's place in the high byte of an int16.
constexpr float kCodeUnit = 1.f / 512.f;

struct NibblePlace {
  int64_t byte;  // offset inside the 64-byte chunk
  bool high;
};

// Where row r (0..15) of a group and column kc (0..7) of a chunk live inside the chunk.
NibblePlace PlaceOf(int r, int kc) {
  const int h = r / kHalfRows, j = r % kHalfRows;
  const int u = kc / 2, kk = kc % 2;
  return {32 * h + 16 * (j / 4) + 8 * (u % 2) + 2 * (j % 4) + kk, u >= 2};
}

// Chunk byte b takes its low nibble from (row, column) and its high nibble from (row, column + 4)
// of the chunk (PlaceOf puts k-pairs u and u + 2 of one row in one byte); with the chunk's source
// bytes gathered row by row (4 per row), both nibbles come from gathered bytes lo and hi, at the
// same shift.
struct ChunkByteSource {
  uint8_t lo;
  uint8_t hi;
  uint8_t shift;
};
using ChunkSources = std::array<ChunkByteSource, kChunkBytes>;

ChunkSources MakeChunkSources() {
  ChunkSources s{};
  for (int r = 0; r < kGroupRows; ++r) {
    for (int col = 0; col < kChunkCols / 2; ++col) {
      s[PlaceOf(r, col).byte] = {static_cast<uint8_t>(4 * r + col / 2),
                                 static_cast<uint8_t>(4 * r + (col + 4) / 2),
                                 static_cast<uint8_t>(4 * (col % 2))};
    }
  }
  return s;
}

// Packs chunk c of a group whose row r starts at rows[r] in the source.
void PackChunk(const ChunkSources& sources, const uint8_t* const* rows, int64_t c, uint8_t* out) {
  uint8_t gathered[kChunkBytes];
  for (int r = 0; r < kGroupRows; ++r) std::memcpy(&gathered[4 * r], rows[r] + 4 * c, 4);
  for (int b = 0; b < kChunkBytes; ++b) {
    const ChunkByteSource& s = sources[b];
    out[b] = static_cast<uint8_t>((gathered[s.lo] >> s.shift & 0x0F) |
                                  (gathered[s.hi] >> s.shift & 0x0F) << 4);
  }
}

}  // namespace

Fp4MatrixRef PackedFp4Matrix::ref() const {
  Fp4MatrixRef r;
  r.codes = codes.data();
  r.scales = scales.data();
  r.row_scale = row_scale.data();
  r.bias = bias.empty() ? nullptr : bias.data();
  r.groups = rows / kGroupRows;
  r.cols = cols;
  r.block = static_cast<int32_t>(format == WeightFormat::kMxfp4 ? kMxfp4Block : kNvfp4Block);
  r.nvfp4 = format == WeightFormat::kNvfp4;
  return r;
}

int64_t SourceRow(RowPairing pairing, GateUpLayout layout, int64_t rows, int64_t p) {
  if (pairing == RowPairing::kPlain) return p;
  const int64_t inter = rows / 2;
  const int64_t g = p / kGroupRows, i = p % kGroupRows;
  const int64_t j = g * kHalfRows + i % kHalfRows;
  return i < kHalfRows ? GateRow(layout, j, inter) : UpRow(layout, j, inter);
}

absl::StatusOr<PackedFp4Matrix> PackFp4Matrix(const WeightMatrix& w, RowPairing pairing,
                                              GateUpLayout layout, float first_scale,
                                              float second_scale, const float* bias) {
  if (w.format == WeightFormat::kBf16) {
    return absl::InvalidArgumentError("PackFp4Matrix: BF16 matrices are not packed");
  }
  const int64_t block = w.format == WeightFormat::kMxfp4 ? kMxfp4Block : kNvfp4Block;
  if (w.rows % kGroupRows != 0 || w.cols % block != 0) {
    return absl::InvalidArgumentError(absl::StrCat("PackFp4Matrix: [", w.rows, ", ", w.cols,
                                                   "] needs rows % 16 == 0 and cols % ", block,
                                                   " == 0"));
  }
  PackedFp4Matrix m;
  m.format = w.format;
  m.rows = w.rows;
  m.cols = w.cols;
  const int64_t chunks = w.cols / kChunkCols, blocks = w.cols / block;
  m.codes.resize(static_cast<size_t>(w.rows / kGroupRows * chunks * kChunkBytes));
  m.scales.resize(static_cast<size_t>(w.rows * blocks));
  m.row_scale.resize(static_cast<size_t>(w.rows));
  if (bias != nullptr) m.bias.resize(static_cast<size_t>(w.rows));
  const uint8_t* values = w.values.As<const uint8_t>();
  const uint8_t* scales = w.scales.As<const uint8_t>();
  static const ChunkSources sources = MakeChunkSources();
  for (int64_t g = 0; g < w.rows / kGroupRows; ++g) {
    const uint8_t* rows[kGroupRows];
    for (int r = 0; r < kGroupRows; ++r) {
      const int64_t p = g * kGroupRows + r;
      const int64_t src = SourceRow(pairing, layout, w.rows, p);
      const bool first = pairing == RowPairing::kPlain || r < kHalfRows;
      m.row_scale[p] = kCodeUnit * (first ? first_scale : second_scale);
      if (bias != nullptr) m.bias[p] = bias[src];
      for (int64_t b = 0; b < blocks; ++b) {
        m.scales[(g * blocks + b) * kGroupRows + r] = scales[src * blocks + b];
      }
      rows[r] = values + src * (w.cols / 2);
    }
    for (int64_t c = 0; c < chunks; ++c) {
      PackChunk(sources, rows, c, &m.codes[(g * chunks + c) * kChunkBytes]);
    }
  }
  return m;
}

uint8_t PackedCode(const PackedFp4Matrix& m, int64_t p, int64_t k) {
  const int64_t chunks = m.cols / kChunkCols;
  const NibblePlace place = PlaceOf(static_cast<int>(p % kGroupRows), static_cast<int>(k % 8));
  const uint8_t byte =
      m.codes[(p / kGroupRows * chunks + k / kChunkCols) * kChunkBytes + place.byte];
  return place.high ? byte >> 4 : byte & 0x0F;
}

}  // namespace moe::cpu
