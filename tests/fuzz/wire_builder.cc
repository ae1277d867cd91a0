#include "tests/fuzz/wire_builder.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <string>

#include "tests/fuzz/fuzz_fixture.h"

namespace moe::fuzz {

int64_t WireDTypeSize(v1::DType dtype) {
  switch (dtype) {
    case v1::F32:
    case v1::I32:
      return 4;
    case v1::BF16:
      return 2;
    case v1::I64:
      return 8;
    default:
      return 1;
  }
}

int64_t WireBuilder::BadDim(int64_t d) {
  static const int64_t kBad[] = {0,
                                 1,
                                 -1,
                                 int64_t{1} << 31,
                                 int64_t{1} << 34,
                                 (int64_t{1} << 34) + 1,
                                 int64_t{1} << 40,
                                 std::numeric_limits<int64_t>::max(),
                                 std::numeric_limits<int64_t>::min()};
  int64_t off;  // d may already be perturbed to an extreme: wrap rather than overflow
  switch (in_.ConsumeIntegralInRange<int>(0, 2)) {
    case 0:
      return __builtin_add_overflow(d, 1, &off) ? 0 : off;
    case 1:
      return __builtin_sub_overflow(d, 1, &off) ? 0 : off;
    default:
      return in_.PickValueInArray(kBad);
  }
}

void WireBuilder::Tensor(v1::Tensor* t, v1::DType dtype, std::vector<int64_t> shape, Fill fill) {
  int64_t length_delta = 0;
  switch (in_.ConsumeIntegralInRange<int>(0, 15)) {
    case 0:
      dtype = static_cast<v1::DType>(in_.ConsumeIntegralInRange<int>(0, 9));
      break;
    case 1:  // one or more dimensions: [huge, 0] needs two
      for (bool more = !shape.empty(); more; more = in_.ConsumeBool()) {
        int64_t& d = shape[in_.ConsumeIntegralInRange<size_t>(0, shape.size() - 1)];
        d = BadDim(d);
      }
      break;
    case 2:
      length_delta = in_.ConsumeBool() ? 1 : -1;
      break;
    case 3:
      shape.push_back(in_.ConsumeIntegralInRange<int64_t>(0, 2));
      break;
    default:
      break;
  }
  t->set_dtype(dtype);
  for (int64_t d : shape) t->add_shape(d);
  int64_t bytes = WireDTypeSize(dtype);
  for (int64_t d : shape) {
    if (d < 0 || __builtin_mul_overflow(bytes, d, &bytes) || bytes > kMaxPayloadBytes) return;
  }
  bytes = std::max<int64_t>(0, bytes + length_delta);
  std::string* out = t->mutable_data();
  out->resize(static_cast<size_t>(bytes));
  const int64_t element = WireDTypeSize(dtype);
  for (int64_t i = 0; i < bytes; i += element) {
    Element(fill, dtype, out->data() + i, std::min(element, bytes - i));
  }
}

void WireBuilder::Element(Fill fill, v1::DType dtype, char* out, int64_t n) {
  uint8_t raw[8] = {};
  switch (fill) {
    case Fill::kRaw: {
      const std::vector<uint8_t> bytes = in_.ConsumeBytes<uint8_t>(static_cast<size_t>(n));
      std::copy(bytes.begin(), bytes.end(), raw);
      break;
    }
    case Fill::kId: {
      const int64_t id = in_.ConsumeIntegralInRange<int64_t>(-2, kExperts);
      std::memcpy(raw, &id, sizeof(id));  // little-endian: the low four bytes are the I32 id
      break;
    }
    case Fill::kWeight: {
      const float w = static_cast<float>(in_.ConsumeIntegral<int8_t>()) / 16.f;
      uint32_t bits;
      std::memcpy(&bits, &w, sizeof(bits));
      if (dtype == v1::BF16) bits >>= 16;  // exact: w has at most 8 significant bits
      std::memcpy(raw, &bits, sizeof(bits));
      break;
    }
    case Fill::kBool:
      raw[0] = in_.ConsumeIntegralInRange<uint8_t>(0, 15) == 0 ? 2 : in_.ConsumeBool();
      break;
    case Fill::kZero:
      break;
  }
  std::memcpy(out, raw, static_cast<size_t>(n));
}

}  // namespace moe::fuzz
