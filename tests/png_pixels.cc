#include "tests/png_pixels.h"

#include <zlib.h>

#include <cstdlib>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace moe::testing {
namespace {

uint32_t BigEndian32(const std::string& s, size_t at) {
  return (static_cast<uint32_t>(static_cast<uint8_t>(s[at])) << 24) |
         (static_cast<uint32_t>(static_cast<uint8_t>(s[at + 1])) << 16) |
         (static_cast<uint32_t>(static_cast<uint8_t>(s[at + 2])) << 8) |
         static_cast<uint32_t>(static_cast<uint8_t>(s[at + 3]));
}

uint8_t Paeth(int a, int b, int c) {
  const int p = a + b - c, pa = std::abs(p - a), pb = std::abs(p - b), pc = std::abs(p - c);
  if (pa <= pb && pa <= pc) return static_cast<uint8_t>(a);
  return static_cast<uint8_t>(pb <= pc ? b : c);
}

// Undoes the filter of one scanline in place; `prev` is the previous unfiltered line (zeros for
// the first). PNG specification, section 9.
bool Unfilter(uint8_t type, uint8_t* line, const uint8_t* prev, size_t n, size_t bpp) {
  for (size_t i = 0; i < n; ++i) {
    const int a = i >= bpp ? line[i - bpp] : 0, b = prev[i], c = i >= bpp ? prev[i - bpp] : 0;
    switch (type) {
      case 0:
        break;
      case 1:
        line[i] = static_cast<uint8_t>(line[i] + a);
        break;
      case 2:
        line[i] = static_cast<uint8_t>(line[i] + b);
        break;
      case 3:
        line[i] = static_cast<uint8_t>(line[i] + (a + b) / 2);
        break;
      case 4:
        line[i] = static_cast<uint8_t>(line[i] + Paeth(a, b, c));
        break;
      default:
        return false;
    }
  }
  return true;
}

}  // namespace

int64_t PngImage::CountPixels(uint8_t r, uint8_t g, uint8_t b) const {
  int64_t n = 0;
  for (size_t i = 0; i + 2 < rgb.size(); i += 3) {
    n += rgb[i] == r && rgb[i + 1] == g && rgb[i + 2] == b ? 1 : 0;
  }
  return n;
}

absl::StatusOr<PngImage> DecodePng(const std::string& bytes) {
  static const char kSignature[] = "\x89PNG\r\n\x1a\n";
  if (bytes.size() < 8 || std::memcmp(bytes.data(), kSignature, 8) != 0) {
    return absl::InvalidArgumentError("not a PNG file");
  }
  PngImage image;
  size_t channels = 0;
  std::string compressed;
  for (size_t at = 8; at + 12 <= bytes.size();) {
    const uint32_t length = BigEndian32(bytes, at);
    if (at + 12 + length > bytes.size()) return absl::InvalidArgumentError("truncated chunk");
    const std::string type = bytes.substr(at + 4, 4);
    const size_t data = at + 8;
    if (type == "IHDR") {
      image.width = static_cast<int>(BigEndian32(bytes, data));
      image.height = static_cast<int>(BigEndian32(bytes, data + 4));
      const uint8_t depth = bytes[data + 8], color = bytes[data + 9], interlace = bytes[data + 12];
      if (depth != 8 || (color != 2 && color != 6) || interlace != 0) {
        return absl::InvalidArgumentError(absl::StrCat("unsupported PNG: depth ", int{depth},
                                                       " color type ", int{color}, " interlace ",
                                                       int{interlace}));
      }
      channels = color == 2 ? 3 : 4;
    } else if (type == "IDAT") {
      compressed.append(bytes, data, length);
    }
    at += 12 + length;
  }
  if (channels == 0 || image.width <= 0 || image.height <= 0) {
    return absl::InvalidArgumentError("PNG without a usable IHDR");
  }
  const size_t stride = static_cast<size_t>(image.width) * channels;
  std::vector<uint8_t> raw((stride + 1) * image.height);
  uLongf raw_size = raw.size();
  if (uncompress(raw.data(), &raw_size, reinterpret_cast<const Bytef*>(compressed.data()),
                 compressed.size()) != Z_OK ||
      raw_size != raw.size()) {
    return absl::InvalidArgumentError("PNG image data does not inflate to the expected size");
  }
  std::vector<uint8_t> zeros(stride, 0);
  image.rgb.resize(static_cast<size_t>(image.width) * image.height * 3);
  for (int y = 0; y < image.height; ++y) {
    uint8_t* line = raw.data() + y * (stride + 1) + 1;
    const uint8_t* prev = y == 0 ? zeros.data() : line - (stride + 1);
    if (!Unfilter(line[-1], line, prev, stride, channels)) {
      return absl::InvalidArgumentError(absl::StrCat("bad filter type on row ", y));
    }
    for (int x = 0; x < image.width; ++x) {
      std::memcpy(&image.rgb[(static_cast<size_t>(y) * image.width + x) * 3], line + x * channels,
                  3);
    }
  }
  return image;
}

}  // namespace moe::testing
