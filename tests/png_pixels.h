// A minimal PNG reader for screenshot checks in tests: 8-bit RGB or RGBA, non-interlaced (what
// headless Chromium writes), decoded to RGB pixels with the five scanline filters undone.
//
// Callers: tests/dashboard_test. Thread-safety: pure functions. Ownership: the image owns its
// pixels.
#ifndef MOE_TESTS_PNG_PIXELS_H_
#define MOE_TESTS_PNG_PIXELS_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace moe::testing {

struct PngImage {
  int width = 0;
  int height = 0;
  std::vector<uint8_t> rgb;  // [height * width * 3], row-major

  // Pixels whose color is exactly (r, g, b).
  int64_t CountPixels(uint8_t r, uint8_t g, uint8_t b) const;
};

// INVALID_ARGUMENT for anything that is not a well-formed 8-bit RGB/RGBA non-interlaced PNG.
absl::StatusOr<PngImage> DecodePng(const std::string& bytes);

}  // namespace moe::testing

#endif  // MOE_TESTS_PNG_PIXELS_H_
