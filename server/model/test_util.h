// Helpers for this package's tests: fresh temporary directories, raw file writing, and decoders of
// the element formats written independently from shared/spec/numerics.md (they do not call
// kernels/formats.h), so loader output can be checked against an independent reading of the
// checkpoint bytes.
//
// Callers: *_test.cc in server/model. Thread-safety: not needed (single-threaded tests).
#ifndef MOE_SERVER_MODEL_TEST_UTIL_H_
#define MOE_SERVER_MODEL_TEST_UTIL_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/strings/string_view.h"

namespace moe::model::testing {

// A new, empty directory under TEST_TMPDIR whose name starts with `name`.
std::string FreshDir(absl::string_view name);

// Writes `bytes` to `path`, replacing it; fails the test on error.
void WriteFile(const std::string& path, absl::string_view bytes);
std::string ReadFile(const std::string& path);

// Element decoders from the spec's tables.
float RefE2m1(uint8_t nibble);  // low nibble: sign bit 3, magnitude 0, .5, 1, 1.5, 2, 3, 4, 6
float RefUe8m0(uint8_t bits);   // 2^(bits - 127)
float RefE4m3(uint8_t bits);    // e4m3fn: bias 7, subnormals, 0x7F/0xFF NaN
float RefBf16(uint16_t bits);   // upper half of an fp32

// Dequantizes a packed [rows, cols] FP4 matrix (even element in the low nibble).
// MXFP4: scales UE8M0 [rows, cols/32]. NVFP4: scales E4M3 [rows, cols/16], times `global`.
std::vector<float> RefDequantMxfp4(const uint8_t* values, const uint8_t* scales, int64_t rows,
                                   int64_t cols);
std::vector<float> RefDequantNvfp4(const uint8_t* values, const uint8_t* scales, int64_t rows,
                                   int64_t cols, float global);

}  // namespace moe::model::testing

#endif  // MOE_SERVER_MODEL_TEST_UTIL_H_
