// Conversions between moe.v1.Tensor (the wire form) and kernels' TensorView / HostTensor.
//
// Decoding is the validation edge for tensor payloads: dtype known, shape non-negative with every
// dimension and the element count bounded, and a byte length that matches exactly; anything else is
// INVALID_ARGUMENT naming the field. Views returned by ViewOf point into the message, which must
// outlive them. Stateless: thread-safe.
#ifndef MOE_SERVER_COMMON_WIRE_H_
#define MOE_SERVER_COMMON_WIRE_H_

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "kernels/tensor.h"
#include "moe/v1/tensor.pb.h"

namespace moe {

// Upper bound on elements of any one tensor on the wire, and on each of its dimensions (guards
// shape products and allocations).
inline constexpr int64_t kMaxWireElements = int64_t{1} << 34;

absl::StatusOr<DType> FromWireDType(v1::DType dtype, absl::string_view field);
v1::DType ToWireDType(DType dtype);

// A view over `t.data()` (read-only use intended). An unset tensor (no dtype, no shape, no data)
// yields a view with data == nullptr and rank 0 so callers can treat it as absent.
absl::StatusOr<TensorView> ViewOf(const v1::Tensor& t, absl::string_view field);
// The same with the bytes taken from `data` instead of t.data() (which is ignored): the payload of
// a raw frame or a shared-memory range, described by the message's dtype and shape.
absl::StatusOr<TensorView> ViewOf(const v1::Tensor& t, absl::string_view field,
                                  absl::string_view data);

// True when the client left the tensor unset.
inline bool IsUnset(const v1::Tensor& t) {
  return t.dtype() == v1::DTYPE_UNSPECIFIED && t.shape_size() == 0 && t.data().empty();
}

// Copies a view into a wire tensor.
void ToWire(const TensorView& view, v1::Tensor* out);

}  // namespace moe

#endif  // MOE_SERVER_COMMON_WIRE_H_
