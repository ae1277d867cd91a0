// Host tensor views and their validation: the currency of every kernels/ entry point.
//
// A TensorView is a non-owning, dense, row-major view of host memory with a dtype and a shape;
// HostTensor owns such memory. Entry points take views and check them with CheckTensor once, at
// the edge, returning INVALID_ARGUMENT for a wrong dtype, rank, dimension or null data.
// Thread-safety: views are plain values; concurrent reads are safe, writes need outside locking.
// Ownership: a view never owns; the caller keeps the memory alive for the duration of the call.
#ifndef MOE_KERNELS_TENSOR_H_
#define MOE_KERNELS_TENSOR_H_

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/inlined_vector.h"
#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"

namespace moe {

enum class DType : uint8_t {
  kF32,
  kBF16,  // raw bits in uint16_t
  kU8,
  kI32,
  kI64,
  kE4M3,  // fp8 e4m3fn, raw bits in uint8_t
  kBool,  // one byte per element, 0 or 1
};

size_t DTypeSize(DType dtype);
absl::string_view DTypeName(DType dtype);

using Shape = absl::InlinedVector<int64_t, 4>;

std::string ShapeString(absl::Span<const int64_t> shape);

struct TensorView {
  DType dtype = DType::kF32;
  Shape shape;
  void* data = nullptr;

  int64_t rank() const { return static_cast<int64_t>(shape.size()); }
  int64_t dim(int i) const { return shape[i]; }
  int64_t NumElements() const;
  int64_t NumBytes() const { return NumElements() * static_cast<int64_t>(DTypeSize(dtype)); }
  bool present() const { return data != nullptr; }
  template <typename T>
  T* As() const {
    return static_cast<T*>(data);
  }
};

// Makes a view over memory the caller owns.
template <typename T>
TensorView MakeView(DType dtype, Shape shape, T* data) {
  return TensorView{dtype, std::move(shape), const_cast<void*>(static_cast<const void*>(data))};
}

// Owning, zero-initialized host tensor.
namespace internal {

// std::allocator value-initializes elements on resize; this one default-initializes them (leaves
// bytes as they are), for HostTensor::Uninitialized.
template <typename T>
struct DefaultInitAllocator : std::allocator<T> {
  using value_type = T;
  template <typename U>
  struct rebind {
    using other = DefaultInitAllocator<U>;
  };
  DefaultInitAllocator() = default;
  template <typename U>
  DefaultInitAllocator(const DefaultInitAllocator<U>&) noexcept {}
  template <typename U>
  void construct(U* p) noexcept {
    ::new (static_cast<void*>(p)) U;
  }
  template <typename U, typename... Args>
  void construct(U* p, Args&&... args) {
    ::new (static_cast<void*>(p)) U(std::forward<Args>(args)...);
  }
};

}  // namespace internal

// Owning host tensor. Storage of 1 MiB and more is recycled through a process-wide cache when a
// tensor is destroyed (at most kRecycledBuffers buffers, kRecycledBytes bytes): request staging and
// output buffers of the same sizes come back every call, and fresh multi-megabyte allocations are
// mmapped by malloc (always above 64 MiB on non-main arenas) and page-faulted again on each use.
class HostTensor {
 public:
  static constexpr size_t kRecycleMinBytes = size_t{1} << 20;
  static constexpr size_t kRecycledBuffers = 16;
  static constexpr size_t kRecycledBytes = size_t{1} << 30;

  HostTensor() = default;
  ~HostTensor();
  HostTensor(HostTensor&&) noexcept = default;
  HostTensor& operator=(HostTensor&& other) noexcept;
  HostTensor(const HostTensor& other);
  HostTensor& operator=(const HostTensor& other);
  // Zero-filled.
  HostTensor(DType dtype, Shape shape);
  // Contents left indeterminate: for buffers the caller overwrites entirely (staging and output
  // buffers of multi-megabyte requests, where zero-filling costs as much as the copy itself).
  static HostTensor Uninitialized(DType dtype, Shape shape);

  TensorView view() const {
    return TensorView{dtype_, shape_, const_cast<std::byte*>(storage_.data())};
  }
  DType dtype() const { return dtype_; }
  const Shape& shape() const { return shape_; }
  template <typename T>
  T* data() {
    return reinterpret_cast<T*>(storage_.data());
  }
  template <typename T>
  const T* data() const {
    return reinterpret_cast<const T*>(storage_.data());
  }
  int64_t NumElements() const { return view().NumElements(); }

 private:
  using Storage = std::vector<std::byte, internal::DefaultInitAllocator<std::byte>>;
  // Storage of `bytes` bytes, indeterminate contents (recycled when one fits).
  static Storage Allocate(size_t bytes);
  static void Recycle(Storage storage);

  DType dtype_ = DType::kF32;
  Shape shape_;
  Storage storage_;
};

// Wildcard dimension for CheckTensor.
inline constexpr int64_t kAnyDim = -1;

// OK when `t` has `dtype`, the rank of `shape`, every non-wildcard dimension equal, and non-null
// data (a tensor with zero elements may have null data). Otherwise INVALID_ARGUMENT naming `name`.
[[nodiscard]] absl::Status CheckTensor(const TensorView& t, absl::string_view name, DType dtype,
                                       std::initializer_list<int64_t> shape);
// Same, accepting any of `dtypes`.
[[nodiscard]] absl::Status CheckTensorOneOf(const TensorView& t, absl::string_view name,
                                            std::initializer_list<DType> dtypes,
                                            std::initializer_list<int64_t> shape);

}  // namespace moe

#endif  // MOE_KERNELS_TENSOR_H_
