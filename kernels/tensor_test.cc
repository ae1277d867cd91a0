#include "kernels/tensor.h"

#include <cstdint>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace moe {
namespace {

TEST(DTypeTest, SizesAndNames) {
  struct Case {
    DType dtype;
    size_t size;
    absl::string_view name;
  };
  const Case cases[] = {
      {DType::kF32, 4, "F32"},   {DType::kBF16, 2, "BF16"}, {DType::kU8, 1, "U8"},
      {DType::kI32, 4, "I32"},   {DType::kI64, 8, "I64"},   {DType::kE4M3, 1, "E4M3"},
      {DType::kBool, 1, "BOOL"},
  };
  for (const Case& c : cases) {
    EXPECT_EQ(DTypeSize(c.dtype), c.size) << c.name;
    EXPECT_EQ(DTypeName(c.dtype), c.name);
  }
}

TEST(ShapeStringTest, Formats) {
  EXPECT_EQ(ShapeString({}), "[]");
  EXPECT_EQ(ShapeString({7}), "[7]");
  EXPECT_EQ(ShapeString({2, 3, 0}), "[2, 3, 0]");
}

TEST(TensorViewTest, NumElementsAndBytes) {
  TensorView scalar{DType::kF32, {}, nullptr};
  EXPECT_EQ(scalar.NumElements(), 1);
  TensorView t{DType::kBF16, {2, 3, 4}, nullptr};
  EXPECT_EQ(t.rank(), 3);
  EXPECT_EQ(t.dim(1), 3);
  EXPECT_EQ(t.NumElements(), 24);
  EXPECT_EQ(t.NumBytes(), 48);
  EXPECT_FALSE(t.present());
  TensorView empty{DType::kI64, {5, 0}, nullptr};
  EXPECT_EQ(empty.NumElements(), 0);
  EXPECT_EQ(empty.NumBytes(), 0);
}

TEST(TensorViewTest, MakeViewKeepsPointer) {
  const std::vector<int32_t> v = {1, 2, 3, 4, 5, 6};
  TensorView t = MakeView(DType::kI32, {2, 3}, v.data());
  EXPECT_EQ(t.As<const int32_t>(), v.data());
  EXPECT_EQ(t.As<int32_t>()[5], 6);
  EXPECT_TRUE(t.present());
}

TEST(HostTensorTest, ZeroInitializedAndSized) {
  HostTensor t(DType::kI64, {3, 5});
  EXPECT_EQ(t.dtype(), DType::kI64);
  EXPECT_EQ(t.shape(), Shape({3, 5}));
  EXPECT_EQ(t.NumElements(), 15);
  for (int i = 0; i < 15; ++i) EXPECT_EQ(t.data<int64_t>()[i], 0);
  t.data<int64_t>()[14] = -9;
  TensorView v = t.view();
  EXPECT_EQ(v.NumBytes(), 120);
  EXPECT_EQ(v.As<int64_t>()[14], -9);
  EXPECT_TRUE(v.present());
}

TEST(HostTensorTest, EmptyTensorHasNoElements) {
  HostTensor t(DType::kF32, {0, 64});
  EXPECT_EQ(t.NumElements(), 0);
  EXPECT_TRUE(CheckTensor(t.view(), "t", DType::kF32, {0, 64}).ok());
}

TEST(CheckTensorTest, AcceptsMatchingTensors) {
  float data[8] = {};
  EXPECT_TRUE(CheckTensor(MakeView(DType::kF32, {2, 4}, data), "x", DType::kF32, {2, 4}).ok());
  EXPECT_TRUE(
      CheckTensor(MakeView(DType::kF32, {2, 4}, data), "x", DType::kF32, {kAnyDim, 4}).ok());
  EXPECT_TRUE(
      CheckTensor(MakeView(DType::kF32, {2, 4}, data), "x", DType::kF32, {kAnyDim, kAnyDim}).ok());
  // A tensor with no elements may have null data.
  EXPECT_TRUE(
      CheckTensor(TensorView{DType::kI32, {0, 4}, nullptr}, "x", DType::kI32, {kAnyDim, 4}).ok());
  const TensorView scalar{DType::kF32, Shape(), data};
  EXPECT_TRUE(CheckTensor(scalar, "s", DType::kF32, {}).ok());
}

struct BadCase {
  std::string label;
  TensorView t;
  DType dtype;
  int64_t rows;  // expected shape [rows, cols]
  int64_t cols;
  std::string message;
};

absl::Status Check2d(const BadCase& c) {
  return CheckTensor(c.t, "hidden", c.dtype, {c.rows, c.cols});
}

TEST(CheckTensorTest, RejectsWithPreciseMessages) {
  float data[8] = {};
  const BadCase cases[] = {
      {"dtype", MakeView(DType::kBF16, {2, 4}, data), DType::kF32, 2, 4,
       "hidden: expected dtype F32, got BF16"},
      {"rank", MakeView(DType::kF32, {8}, data), DType::kF32, 2, kAnyDim,
       "hidden: rank 1, expected 2 (expected shape [2, *], got [8])"},
      {"dim0", MakeView(DType::kF32, {4, 2}, data), DType::kF32, 2, kAnyDim,
       "hidden: dimension 0 is 4, expected 2 (expected shape [2, *], got [4, 2])"},
      {"dim1", MakeView(DType::kF32, {2, 4}, data), DType::kF32, 2, 8,
       "hidden: dimension 1 is 4, expected 8 (expected shape [2, 8], got [2, 4])"},
      {"null", TensorView{DType::kF32, {2, 4}, nullptr}, DType::kF32, 2, 4,
       "hidden: data is null but shape [2, 4] has 8 elements"},
      {"negative", MakeView(DType::kF32, {0, -3}, data), DType::kF32, kAnyDim, kAnyDim,
       "hidden: negative dimension in shape [0, -3]"},
      {"overflow", MakeView(DType::kF32, {int64_t{1} << 31, int64_t{1} << 31}, data), DType::kF32,
       kAnyDim, kAnyDim, "hidden: shape [2147483648, 2147483648] has too many elements"},
  };
  for (const BadCase& c : cases) {
    absl::Status s = Check2d(c);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << c.label;
    EXPECT_EQ(s.message(), c.message) << c.label;
  }
}

TEST(CheckTensorOneOfTest, AcceptsAnyListedDtype) {
  uint16_t data[4] = {};
  EXPECT_TRUE(CheckTensorOneOf(MakeView(DType::kBF16, {1, 4}, data), "x",
                               {DType::kF32, DType::kBF16}, {1, 4})
                  .ok());
}

TEST(CheckTensorOneOfTest, RejectsOtherDtypeAndStillChecksShape) {
  int32_t data[4] = {};
  absl::Status s = CheckTensorOneOf(MakeView(DType::kI32, {1, 4}, data), "topk_weights",
                                    {DType::kF32, DType::kBF16}, {1, 4});
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message(), "topk_weights: expected dtype one of {F32, BF16}, got I32");

  s = CheckTensorOneOf(MakeView(DType::kI64, {1, 4}, data), "topk_ids", {DType::kI32, DType::kI64},
                       {1, 3});
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message(),
            "topk_ids: dimension 1 is 4, expected 3 (expected shape [1, 3], got [1, 4])");
}

}  // namespace
}  // namespace moe
