// The screenshot reader on a hand-built 2 x 4 PNG whose rows use the Sub, Paeth, Average and Up
// filters (filtered bytes worked out by hand from the PNG specification).
#include "tests/png_pixels.h"

#include <zlib.h>

#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace moe::testing {
namespace {

std::string BigEndian(uint32_t v) {
  return {static_cast<char>(v >> 24), static_cast<char>(v >> 16), static_cast<char>(v >> 8),
          static_cast<char>(v)};
}

std::string Chunk(const std::string& type, const std::string& data) {
  const std::string body = type + data;
  const uint32_t crc =
      crc32(0, reinterpret_cast<const Bytef*>(body.data()), static_cast<uInt>(body.size()));
  return BigEndian(data.size()) + body + BigEndian(crc);
}

std::string Png(uint32_t width, uint32_t height, uint8_t color, const std::vector<uint8_t>& raw) {
  std::vector<uint8_t> packed(compressBound(raw.size()));
  uLongf size = packed.size();
  EXPECT_EQ(compress(packed.data(), &size, raw.data(), raw.size()), Z_OK);
  std::string ihdr = BigEndian(width) + BigEndian(height);
  ihdr += std::string{8, static_cast<char>(color), 0, 0, 0};
  return std::string("\x89PNG\r\n\x1a\n", 8) + Chunk("IHDR", ihdr) +
         Chunk("IDAT", std::string(packed.begin(), packed.begin() + size)) + Chunk("IEND", "");
}

TEST(PngPixelsTest, UndoesEveryFilter) {
  // Wanted pixels, row by row: (10,20,30) (15,25,35) | (12,22,32) (20,30,40) |
  // (14,24,34) (30,30,30) | (1,2,3) (4,5,6).
  const std::vector<uint8_t> raw = {
      1, 10,  20,  30,  5,   5,   5,    // Sub: second pixel minus the first
      4, 2,   2,   2,   5,   5,   5,    // Paeth: predictor picks "above" for both pixels
      3, 8,   13,  18,  13,  3,   249,  // Average of left and above, floored
      2, 243, 234, 225, 230, 231, 232,  // Up: minus the row above, mod 256
  };
  absl::StatusOr<PngImage> image = DecodePng(Png(2, 4, 2, raw));
  ASSERT_TRUE(image.ok()) << image.status();
  EXPECT_EQ(image->width, 2);
  EXPECT_EQ(image->height, 4);
  EXPECT_EQ(image->rgb, (std::vector<uint8_t>{10, 20, 30, 15, 25, 35, 12, 22, 32, 20, 30, 40,
                                              14, 24, 34, 30, 30, 30, 1,  2,  3,  4,  5,  6}));
  EXPECT_EQ(image->CountPixels(30, 30, 30), 1);
  EXPECT_EQ(image->CountPixels(0, 0, 0), 0);
}

TEST(PngPixelsTest, RgbaDropsAlphaAndBadInputIsRejected) {
  const std::vector<uint8_t> raw = {0, 1, 2, 3, 255, 9, 9, 9, 128};
  absl::StatusOr<PngImage> image = DecodePng(Png(2, 1, 6, raw));
  ASSERT_TRUE(image.ok()) << image.status();
  EXPECT_EQ(image->rgb, (std::vector<uint8_t>{1, 2, 3, 9, 9, 9}));
  EXPECT_FALSE(DecodePng("GIF89a").ok());
  EXPECT_FALSE(DecodePng(Png(2, 1, 3, {0, 1, 2})).ok());              // palette
  EXPECT_FALSE(DecodePng(Png(2, 1, 2, {7, 1, 2, 3, 4, 5, 6})).ok());  // filter 7
  EXPECT_FALSE(DecodePng(Png(3, 1, 2, {0, 1, 2, 3, 4, 5, 6})).ok());  // too little data
}

}  // namespace
}  // namespace moe::testing
