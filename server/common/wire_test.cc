// Wire tensors: exact byte-length validation, hostile shapes, dtype mapping, status mapping.
#include "server/common/wire.h"

#include <cstring>
#include <vector>

#include "gtest/gtest.h"
#include "server/common/status.h"

namespace moe {
namespace {

v1::Tensor Make(v1::DType dtype, std::vector<int64_t> shape, size_t bytes) {
  v1::Tensor t;
  t.set_dtype(dtype);
  for (int64_t d : shape) t.add_shape(d);
  t.set_data(std::string(bytes, '\x01'));
  return t;
}

TEST(WireTest, ValidTensorViewsTheMessageBytes) {
  v1::Tensor t = Make(v1::BF16, {3, 4}, 24);
  absl::StatusOr<TensorView> v = ViewOf(t, "x");
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ(v->dtype, DType::kBF16);
  EXPECT_EQ(v->NumElements(), 12);
  EXPECT_EQ(v->data, t.data().data());
}

TEST(WireTest, UnsetTensorIsAbsent) {
  absl::StatusOr<TensorView> v = ViewOf(v1::Tensor(), "x");
  ASSERT_TRUE(v.ok());
  EXPECT_FALSE(v->present());
}

struct BadCase {
  const char* what;
  v1::Tensor tensor;
};

TEST(WireTest, RejectsMalformedTensors) {
  const std::vector<BadCase> cases = {
      {"truncated", Make(v1::F32, {2, 2}, 15)},
      {"oversize", Make(v1::F32, {2, 2}, 17)},
      {"negative dim", Make(v1::U8, {-1, 4}, 0)},
      {"overflowing shape", Make(v1::U8, {int64_t{1} << 40, int64_t{1} << 40}, 0)},
      // Zero elements, but a dimension that overflows when a caller doubles it (found by fuzzing).
      {"huge dim beside a zero", Make(v1::U8, {0, INT64_MAX}, 0)},
      {"dim just over the bound beside a zero", Make(v1::U8, {(int64_t{1} << 34) + 1, 0}, 0)},
      {"unspecified dtype with data", Make(v1::DTYPE_UNSPECIFIED, {1}, 1)},
      {"unknown dtype", Make(static_cast<v1::DType>(99), {1}, 1)},
  };
  for (const BadCase& c : cases) {
    absl::StatusOr<TensorView> v = ViewOf(c.tensor, "field_x");
    ASSERT_FALSE(v.ok()) << c.what;
    EXPECT_EQ(v.status().code(), absl::StatusCode::kInvalidArgument) << c.what;
    EXPECT_NE(v.status().message().find("field_x"), absl::string_view::npos) << c.what;
  }
}

TEST(WireTest, RoundTripThroughToWire) {
  const float values[3] = {1.5f, -2.f, 0.25f};
  v1::Tensor t;
  ToWire(MakeView(DType::kF32, {3}, values), &t);
  absl::StatusOr<TensorView> v = ViewOf(t, "x");
  ASSERT_TRUE(v.ok());
  EXPECT_EQ(std::memcmp(v->data, values, sizeof(values)), 0);
  for (DType d : {DType::kF32, DType::kBF16, DType::kU8, DType::kI32, DType::kI64, DType::kE4M3,
                  DType::kBool}) {
    absl::StatusOr<DType> back = FromWireDType(ToWireDType(d), "x");
    ASSERT_TRUE(back.ok());
    EXPECT_EQ(*back, d);
  }
}

TEST(StatusTest, CodesAndMessagesSurviveBothDirections) {
  const absl::Status s = absl::FailedPreconditionError("stale map version 3");
  const grpc::Status g = ToGrpcStatus(s);
  EXPECT_EQ(g.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_EQ(g.error_message(), "stale map version 3");
  EXPECT_EQ(FromGrpcStatus(g), s);
  EXPECT_TRUE(ToGrpcStatus(absl::OkStatus()).ok());
}

}  // namespace
}  // namespace moe
