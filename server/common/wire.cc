#include "server/common/wire.h"

#include <cstring>
#include <string>

#include "absl/strings/str_cat.h"

namespace moe {

absl::StatusOr<DType> FromWireDType(v1::DType dtype, absl::string_view field) {
  switch (dtype) {
    case v1::F32:
      return DType::kF32;
    case v1::BF16:
      return DType::kBF16;
    case v1::U8:
      return DType::kU8;
    case v1::I32:
      return DType::kI32;
    case v1::I64:
      return DType::kI64;
    case v1::E4M3:
      return DType::kE4M3;
    case v1::BOOL:
      return DType::kBool;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat(field, ": unknown or unspecified dtype ", static_cast<int>(dtype)));
  }
}

v1::DType ToWireDType(DType dtype) {
  switch (dtype) {
    case DType::kF32:
      return v1::F32;
    case DType::kBF16:
      return v1::BF16;
    case DType::kU8:
      return v1::U8;
    case DType::kI32:
      return v1::I32;
    case DType::kI64:
      return v1::I64;
    case DType::kE4M3:
      return v1::E4M3;
    case DType::kBool:
      return v1::BOOL;
  }
  return v1::DTYPE_UNSPECIFIED;
}

absl::StatusOr<TensorView> ViewOf(const v1::Tensor& t, absl::string_view field) {
  return ViewOf(t, field, absl::string_view(t.data()));
}

absl::StatusOr<TensorView> ViewOf(const v1::Tensor& t, absl::string_view field,
                                  absl::string_view data) {
  if (t.dtype() == v1::DTYPE_UNSPECIFIED && t.shape_size() == 0 && data.empty()) {
    return TensorView{DType::kF32, {}, nullptr};
  }
  absl::StatusOr<DType> dtype = FromWireDType(t.dtype(), field);
  if (!dtype.ok()) return dtype.status();
  TensorView view{*dtype, {}, nullptr};
  int64_t elements = 1;
  for (int64_t d : t.shape()) {
    if (d < 0) {
      return absl::InvalidArgumentError(absl::StrCat(field, ": negative dimension ", d));
    }
    // Each dimension is bounded on its own as well: after a zero dimension the product bounds
    // nothing, and callers scale dimensions (NVFP4's two values per byte, [T, H] outputs).
    if (d > kMaxWireElements || (d != 0 && elements > kMaxWireElements / d)) {
      return absl::InvalidArgumentError(absl::StrCat(field, ": shape too large"));
    }
    elements *= d;
    view.shape.push_back(d);
  }
  const int64_t expected = elements * static_cast<int64_t>(DTypeSize(*dtype));
  if (static_cast<int64_t>(data.size()) != expected) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": ", data.size(), " bytes of data for ", DTypeName(*dtype),
                     ShapeString(view.shape), ", expected ", expected));
  }
  view.data = const_cast<char*>(data.data());
  return view;
}

void ToWire(const TensorView& view, v1::Tensor* out) {
  out->set_dtype(ToWireDType(view.dtype));
  out->clear_shape();
  for (int64_t d : view.shape) out->add_shape(d);
  out->set_data(static_cast<const char*>(view.data), view.NumBytes());
}

}  // namespace moe
