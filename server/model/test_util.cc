// Test helpers; the decoders follow numerics.md section 1 literally, favouring clarity over speed.
#include "server/model/test_util.h"

#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <limits>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"

namespace moe::model::testing {

std::string FreshDir(absl::string_view name) {
  static std::atomic<int> counter{0};
  const char* root = std::getenv("TEST_TMPDIR");
  const std::string dir =
      absl::StrCat(root != nullptr ? root : "/tmp", "/", std::string(name), "_", counter++);
  std::error_code ec;
  std::filesystem::remove_all(dir, ec);
  std::filesystem::create_directories(dir, ec);
  EXPECT_FALSE(ec) << dir << ": " << ec.message();
  return dir;
}

void WriteFile(const std::string& path, absl::string_view bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  out.close();
  ASSERT_TRUE(out.good()) << "cannot write " << path;
}

std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  EXPECT_TRUE(in.good()) << "cannot read " << path;
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

float RefE2m1(uint8_t nibble) {
  static constexpr float kMagnitude[8] = {0.f, 0.5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f};
  const float m = kMagnitude[nibble & 7];
  return (nibble & 8) ? -m : m;
}

float RefUe8m0(uint8_t bits) {
  if (bits == 255) return std::numeric_limits<float>::quiet_NaN();
  return std::ldexp(1.f, static_cast<int>(bits) - 127);
}

float RefE4m3(uint8_t bits) {
  if ((bits & 0x7F) == 0x7F) return std::numeric_limits<float>::quiet_NaN();
  const int exponent = (bits >> 3) & 0xF;
  const int mantissa = bits & 7;
  const float magnitude = exponent == 0 ? std::ldexp(static_cast<float>(mantissa), -9)
                                        : std::ldexp(1.f + mantissa / 8.f, exponent - 7);
  return (bits & 0x80) ? -magnitude : magnitude;
}

float RefBf16(uint16_t bits) {
  const uint32_t wide = static_cast<uint32_t>(bits) << 16;
  float out;
  std::memcpy(&out, &wide, sizeof(out));
  return out;
}

namespace {

uint8_t Nibble(const uint8_t* values, int64_t cols, int64_t r, int64_t c) {
  const uint8_t byte = values[r * (cols / 2) + c / 2];
  return c % 2 == 0 ? byte & 0xF : byte >> 4;
}

}  // namespace

std::vector<float> RefDequantMxfp4(const uint8_t* values, const uint8_t* scales, int64_t rows,
                                   int64_t cols) {
  std::vector<float> out(rows * cols);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      out[r * cols + c] =
          RefE2m1(Nibble(values, cols, r, c)) * RefUe8m0(scales[r * (cols / 32) + c / 32]);
    }
  }
  return out;
}

std::vector<float> RefDequantNvfp4(const uint8_t* values, const uint8_t* scales, int64_t rows,
                                   int64_t cols, float global) {
  std::vector<float> out(rows * cols);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      out[r * cols + c] =
          RefE2m1(Nibble(values, cols, r, c)) * RefE4m3(scales[r * (cols / 16) + c / 16]) * global;
    }
  }
  return out;
}

}  // namespace moe::model::testing
