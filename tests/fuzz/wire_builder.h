// Builds moe.v1 wire tensors from fuzzer input: usually well-formed (the intended dtype and shape
// with exactly the right number of bytes, values drawn so they mostly pass value checks), and one
// time in four perturbed (unknown dtype, dimensions off by one, zero or enormous, a byte count off
// by one, an extra dimension), so that fuzzers get past the byte-count checks at once and still
// probe every rejection.
//
// Callers: the forward_structured and wire_staging fuzz targets. Thread-safety: a builder wraps
// one FuzzedDataProvider and is used by one thread. Ownership: the provider is borrowed.
#ifndef MOE_TESTS_FUZZ_WIRE_BUILDER_H_
#define MOE_TESTS_FUZZ_WIRE_BUILDER_H_

#include <cstdint>
#include <vector>

#include "fuzzer/FuzzedDataProvider.h"
#include "moe/v1/tensor.pb.h"

namespace moe::fuzz {

// How element values are drawn: raw input bytes, expert ids in [-2, kExperts], small finite
// weights (multiples of 1/16 in [-8, 8)), booleans that are 2 one time in sixteen, or zeros
// (outputs; consumes no input).
enum class Fill { kRaw, kId, kWeight, kBool, kZero };

// Payloads are never built beyond this; a shape asking for more gets no data (it must be
// rejected by its shape alone).
inline constexpr int64_t kMaxPayloadBytes = int64_t{64} << 10;

class WireBuilder {
 public:
  explicit WireBuilder(FuzzedDataProvider& in) : in_(in) {}

  // Fills `t` with `dtype` and `shape`, perturbed one time in four.
  void Tensor(v1::Tensor* t, v1::DType dtype, std::vector<int64_t> shape, Fill fill);

  FuzzedDataProvider& input() { return in_; }

 private:
  int64_t BadDim(int64_t d);
  void Element(Fill fill, v1::DType dtype, char* out, int64_t n);

  FuzzedDataProvider& in_;
};

// Bytes per element of a wire dtype (1 for unknown ones, which carry whatever bytes they get).
int64_t WireDTypeSize(v1::DType dtype);

}  // namespace moe::fuzz

#endif  // MOE_TESTS_FUZZ_WIRE_BUILDER_H_
