// Fuzz target wire_staging: wire tensors built from the input are decoded with ViewOf and handed
// to the kernels' staging entry points (RepackTopk, DequantizeMxfp8, DequantizeNvfp4PerToken,
// MapLogicalToPhysical), outputs included, so mismatched dtypes and shapes between arguments reach
// the kernels' own checks. Every decoded view is copied into an exactly-sized heap buffer first,
// so AddressSanitizer flags a kernel that reads or writes one byte outside any argument. Accepted
// calls are checked against independent decoders written here from numerics.md.
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <vector>

#include "fuzzer/FuzzedDataProvider.h"
#include "kernels/eplb.h"
#include "kernels/staging.h"
#include "server/common/wire.h"
#include "tests/fuzz/fuzz_fixture.h"
#include "tests/fuzz/wire_builder.h"

namespace moe::fuzz {
namespace {

// Kernel cost is linear in every dimension; the request edge bounds rows by the payload (H > 0),
// but a bare view may describe 2^34 empty rows. Such views are skipped rather than timed.
constexpr int64_t kMaxKernelDim = int64_t{1} << 16;

void Expect(bool ok, const char* what) {
  if (!ok) {
    std::fprintf(stderr, "fuzz invariant violated: %s\n", what);
    std::abort();
  }
}

// A decoded view whose bytes live in an allocation of exactly NumBytes().
class ExactCopy {
 public:
  explicit ExactCopy(const TensorView& v) : view_(v) {
    if (!v.present()) return;
    const size_t n = static_cast<size_t>(v.NumBytes());
    bytes_.reset(new uint8_t[n]);
    std::memcpy(bytes_.get(), v.data, n);
    view_.data = bytes_.get();
  }
  const TensorView& view() const { return view_; }
  template <typename T>
  T At(int64_t i) const {
    T x;
    std::memcpy(&x, bytes_.get() + i * sizeof(T), sizeof(T));
    return x;
  }

 private:
  TensorView view_;
  std::unique_ptr<uint8_t[]> bytes_;
};

// Independent element decoders (numerics.md section 1).
float RefE4m3(uint8_t b) {
  const int exp = (b >> 3) & 0xF, man = b & 7;
  const float sign = (b & 0x80) ? -1.f : 1.f;
  if (exp == 0xF && man == 7) return NAN;
  if (exp == 0) return sign * std::ldexp(man / 8.f, -6);
  return sign * std::ldexp(1.f + man / 8.f, exp - 7);
}
float RefUe8m0(uint8_t b) { return b == 0xFF ? NAN : std::ldexp(1.f, b - 127); }
float RefE2m1(uint8_t nibble) {
  static const float kMagnitude[8] = {0.f, .5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f};
  return (nibble & 8 ? -1.f : 1.f) * kMagnitude[nibble & 7];
}
uint8_t ByteOf(int32_t word, int64_t j) { return static_cast<uint8_t>(word >> (8 * j)); }

bool SameFloat(float a, float b) { return (std::isnan(a) && std::isnan(b)) || a == b; }

class Harness {
 public:
  explicit Harness(FuzzedDataProvider& in) : in_(in), wire_(in) {}

  void Run() {
    switch (in_.ConsumeIntegralInRange<int>(0, 4)) {
      case 0:
        return DecodeArbitrary();
      case 1:
        return Repack();
      case 2:
        return Mxfp8();
      case 3:
        return Nvfp4();
      default:
        return MapToPhysical();
    }
  }

 private:
  // Builds a wire tensor and decodes it; false (after checking the rejection) when ViewOf refuses
  // it or it is too large for a kernel call. Absent tensors decode to an absent view.
  bool Decode(v1::DType dtype, std::vector<int64_t> shape, Fill fill, bool optional = false) {
    v1::Tensor t;
    if (!optional || in_.ConsumeBool()) wire_.Tensor(&t, dtype, std::move(shape), fill);
    absl::StatusOr<TensorView> view = ViewOf(t, "fuzz");
    if (!view.ok()) {
      Expect(view.status().code() == absl::StatusCode::kInvalidArgument, "ViewOf: wrong code");
      return false;
    }
    for (int64_t d : view->shape) {
      if (d > kMaxKernelDim) return false;
    }
    views_.emplace_back(*view);
    return true;
  }
  const ExactCopy& arg(size_t i) const { return views_[i]; }

  // ViewOf alone on any dtype, rank, dimensions and length.
  void DecodeArbitrary() {
    v1::Tensor t;
    t.set_dtype(static_cast<v1::DType>(in_.ConsumeIntegralInRange<int>(-1, 9)));
    const int rank = in_.ConsumeIntegralInRange<int>(0, 5);
    for (int i = 0; i < rank; ++i) {
      t.add_shape(in_.ConsumeBool() ? in_.ConsumeIntegralInRange<int64_t>(0, 8)
                                    : in_.ConsumeIntegral<int64_t>());
    }
    t.set_data(in_.ConsumeRandomLengthString(256));
    absl::StatusOr<TensorView> view = ViewOf(t, "fuzz");
    if (!view.ok()) {
      Expect(view.status().code() == absl::StatusCode::kInvalidArgument, "ViewOf: wrong code");
      return;
    }
    if (IsUnset(t)) {
      Expect(!view->present() && view->rank() == 0, "unset tensor not absent");
      return;
    }
    Expect(ToWireDType(view->dtype) == t.dtype(), "ViewOf changed the dtype");
    Expect(view->rank() == t.shape_size(), "ViewOf changed the rank");
    for (int i = 0; i < t.shape_size(); ++i) Expect(view->dim(i) == t.shape(i), "dim changed");
    Expect(view->NumElements() <= kMaxWireElements, "element bound not enforced");
    Expect(view->NumBytes() == static_cast<int64_t>(t.data().size()), "byte count mismatch");
    Expect(view->data == t.data().data(), "view does not point into the message");
  }

  void Repack() {
    const int64_t t = in_.ConsumeIntegralInRange<int64_t>(0, 6);
    const int64_t k = in_.ConsumeIntegralInRange<int64_t>(0, 9);
    const int32_t num_experts = in_.ConsumeIntegralInRange<int32_t>(-1, kExperts + 1);
    if (!Decode(in_.ConsumeBool() ? v1::I64 : v1::I32, {t, k}, Fill::kId) ||
        !Decode(in_.ConsumeBool() ? v1::BF16 : v1::F32, {t, k}, Fill::kWeight) ||
        !Decode(v1::BOOL, {t}, Fill::kBool, /*optional=*/true) ||
        !Decode(v1::I32, {t, k}, Fill::kZero) || !Decode(v1::F32, {t, k}, Fill::kZero)) {
      return;
    }
    const absl::Status s = RepackTopk(arg(0).view(), arg(1).view(), arg(2).view(), num_experts,
                                      arg(3).view(), arg(4).view());
    if (!s.ok()) return ExpectRejected(s);
    const TensorView& ids = arg(0).view();
    for (int64_t row = 0; row < ids.dim(0); ++row) {
      const bool padded = arg(2).view().present() && arg(2).At<uint8_t>(row) != 0;
      for (int64_t i = row * ids.dim(1); i < (row + 1) * ids.dim(1); ++i) {
        const int64_t id = ids.dtype == DType::kI64 ? arg(0).At<int64_t>(i) : arg(0).At<int32_t>(i);
        const float w = arg(1).view().dtype == DType::kBF16 ? RefBf16(arg(1).At<uint16_t>(i))
                                                            : arg(1).At<float>(i);
        const int32_t out_id = arg(3).At<int32_t>(i);
        const float out_w = arg(4).At<float>(i);
        Expect(padded ? out_id == -1 : out_id == id, "repacked id differs");
        Expect(padded ? out_w == 0.f : (std::isfinite(w) && out_w == w), "repacked weight differs");
        Expect(out_id >= -1 && out_id < num_experts, "repacked id out of range");
      }
    }
  }

  static float RefBf16(uint16_t bits) {
    const uint32_t word = uint32_t{bits} << 16;
    float f;
    std::memcpy(&f, &word, sizeof(f));
    return f;
  }

  int64_t Hidden() {
    static const int64_t kSizes[] = {0, 32, 64, 96, 128, 256};
    return in_.ConsumeBool() ? in_.PickValueInArray(kSizes)
                             : in_.ConsumeIntegralInRange<int64_t>(0, 300);
  }

  void Mxfp8() {
    const int64_t t = in_.ConsumeIntegralInRange<int64_t>(0, 4);
    const int64_t h = Hidden();
    const bool packed = in_.ConsumeBool();
    if (!Decode(v1::E4M3, {t, h}, Fill::kRaw) ||
        !Decode(packed ? v1::I32 : v1::F32, {t, packed ? h / 128 : h / 32},
                packed ? Fill::kRaw : Fill::kWeight) ||
        !Decode(v1::F32, {t, h}, Fill::kZero)) {
      return;
    }
    const absl::Status s = DequantizeMxfp8(arg(0).view(), arg(1).view(), arg(2).view());
    if (!s.ok()) return ExpectRejected(s);
    const TensorView& q = arg(0).view();
    const bool words = arg(1).view().dtype == DType::kI32;
    for (int64_t row = 0; row < q.dim(0); ++row) {
      for (int64_t c = 0; c < q.dim(1); ++c) {
        const int64_t g = c / 32;
        const int64_t groups = q.dim(1) / 32;
        const float scale =
            words ? RefUe8m0(ByteOf(arg(1).At<int32_t>(row * (groups / 4) + g / 4), g % 4))
                  : arg(1).At<float>(row * groups + g);
        const float want = RefE4m3(arg(0).At<uint8_t>(row * q.dim(1) + c)) * scale;
        Expect(SameFloat(arg(2).At<float>(row * q.dim(1) + c), want), "MXFP8 value differs");
      }
    }
  }

  void Nvfp4() {
    const int64_t t = in_.ConsumeIntegralInRange<int64_t>(0, 4);
    const int64_t h = Hidden();
    if (!Decode(v1::U8, {t, h / 2}, Fill::kRaw) || !Decode(v1::I32, {t, h / 64}, Fill::kRaw) ||
        !Decode(v1::F32, {t}, Fill::kWeight) || !Decode(v1::F32, {t, h}, Fill::kZero)) {
      return;
    }
    const absl::Status s =
        DequantizeNvfp4PerToken(arg(0).view(), arg(1).view(), arg(2).view(), arg(3).view());
    if (!s.ok()) return ExpectRejected(s);
    const int64_t rows = arg(0).view().dim(0), width = 2 * arg(0).view().dim(1);
    for (int64_t row = 0; row < rows; ++row) {
      for (int64_t c = 0; c < width; ++c) {
        const int64_t g = c / 16;
        const uint8_t sf = ByteOf(arg(1).At<int32_t>(row * (width / 64) + g / 4), g % 4);
        const uint8_t pair = arg(0).At<uint8_t>(row * (width / 2) + c / 2);
        const float want =
            RefE2m1(c % 2 == 0 ? pair & 0xF : pair >> 4) * RefE4m3(sf) * arg(2).At<float>(row);
        Expect(SameFloat(arg(3).At<float>(row * width + c), want), "NVFP4 value differs");
      }
    }
  }

  void MapToPhysical() {
    const int64_t t = in_.ConsumeIntegralInRange<int64_t>(0, 6);
    const int64_t k = in_.ConsumeIntegralInRange<int64_t>(0, 9);
    const int32_t layer = in_.ConsumeIntegralInRange<int32_t>(0, kLayers - 1);
    const ShardPlacement& shard =
        in_.ConsumeBool() ? *Placements().rank0 : *Placements().standalone;
    const LayerPlacement& placement = shard.layer(layer);
    if (!Decode(in_.ConsumeBool() ? v1::I64 : v1::I32, {t, k}, Fill::kId) ||
        !Decode(v1::I64, {t}, Fill::kRaw, /*optional=*/true) ||
        !Decode(v1::I32, {t, k}, Fill::kZero)) {
      return;
    }
    const absl::Status s =
        MapLogicalToPhysical(placement, arg(0).view(), arg(1).view(), arg(2).view());
    if (!s.ok()) return ExpectRejected(s);
    const TensorView& ids = arg(0).view();
    for (int64_t i = 0; i < ids.NumElements(); ++i) {
      const int64_t id = ids.dtype == DType::kI64 ? arg(0).At<int64_t>(i) : arg(0).At<int32_t>(i);
      const int32_t p = arg(2).At<int32_t>(i);
      if (id < 0 || id >= placement.num_logical()) {
        Expect(p == -1, "an out-of-range id was mapped");
      } else {
        Expect(p >= 0 && p < placement.num_physical() && placement.physical_to_logical()[p] == id,
               "mapped to a slot of another expert");
      }
    }
  }

  static void ExpectRejected(const absl::Status& s) {
    Expect(s.code() == absl::StatusCode::kInvalidArgument && !s.message().empty(),
           "kernel rejection is not INVALID_ARGUMENT with a message");
  }

  FuzzedDataProvider& in_;
  WireBuilder wire_;
  std::vector<ExactCopy> views_;
};

}  // namespace
}  // namespace moe::fuzz

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  FuzzedDataProvider in(data, size);
  moe::fuzz::Harness(in).Run();
  return 0;
}
