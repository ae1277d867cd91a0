// Tensor views, owning host tensors and the one validation routine every entry point calls.
#include "kernels/tensor.h"

#include <cstring>
#include <limits>

#include "absl/algorithm/container.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "glog/logging.h"

namespace moe {
namespace {

// Formats an expected shape, printing kAnyDim as "*".
std::string ExpectedShapeString(std::initializer_list<int64_t> shape) {
  std::string out = "[";
  const char* sep = "";
  for (int64_t d : shape) {
    absl::StrAppend(&out, sep, d == kAnyDim ? std::string("*") : absl::StrCat(d));
    sep = ", ";
  }
  return out + "]";
}

// OK when every dimension is non-negative and the byte count fits in int64, so that NumBytes()
// and the pointer arithmetic of callers cannot overflow on shapes that came over the network.
absl::Status CheckDimensions(const TensorView& t, absl::string_view name) {
  for (int64_t d : t.shape) {
    if (d < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(name, ": negative dimension in shape ", ShapeString(t.shape)));
    }
  }
  if (absl::c_linear_search(t.shape, 0)) return absl::OkStatus();
  const int64_t max_elements =
      std::numeric_limits<int64_t>::max() / static_cast<int64_t>(DTypeSize(t.dtype));
  int64_t elements = 1;
  for (int64_t d : t.shape) {
    if (elements > max_elements / d) {
      return absl::InvalidArgumentError(
          absl::StrCat(name, ": shape ", ShapeString(t.shape), " has too many elements"));
    }
    elements *= d;
  }
  return absl::OkStatus();
}

// Everything CheckTensor checks except the dtype.
absl::Status CheckShapeAndData(const TensorView& t, absl::string_view name,
                               std::initializer_list<int64_t> shape) {
  if (t.rank() != static_cast<int64_t>(shape.size())) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, ": rank ", t.rank(), ", expected ", shape.size(), " (expected shape ",
                     ExpectedShapeString(shape), ", got ", ShapeString(t.shape), ")"));
  }
  if (absl::Status s = CheckDimensions(t, name); !s.ok()) return s;
  int i = 0;
  for (int64_t want : shape) {
    if (want != kAnyDim && t.shape[i] != want) {
      return absl::InvalidArgumentError(absl::StrCat(
          name, ": dimension ", i, " is ", t.shape[i], ", expected ", want, " (expected shape ",
          ExpectedShapeString(shape), ", got ", ShapeString(t.shape), ")"));
    }
    ++i;
  }
  if (t.data == nullptr && t.NumElements() != 0) {
    return absl::InvalidArgumentError(absl::StrCat(name, ": data is null but shape ",
                                                   ShapeString(t.shape), " has ", t.NumElements(),
                                                   " elements"));
  }
  return absl::OkStatus();
}

}  // namespace

size_t DTypeSize(DType dtype) {
  switch (dtype) {
    case DType::kF32:
    case DType::kI32:
      return 4;
    case DType::kBF16:
      return 2;
    case DType::kI64:
      return 8;
    case DType::kU8:
    case DType::kE4M3:
    case DType::kBool:
      return 1;
  }
  LOG(FATAL) << "unknown DType " << static_cast<int>(dtype);
  __builtin_unreachable();  // LOG(FATAL) aborts; tells the compiler so.
}

absl::string_view DTypeName(DType dtype) {
  switch (dtype) {
    case DType::kF32:
      return "F32";
    case DType::kBF16:
      return "BF16";
    case DType::kU8:
      return "U8";
    case DType::kI32:
      return "I32";
    case DType::kI64:
      return "I64";
    case DType::kE4M3:
      return "E4M3";
    case DType::kBool:
      return "BOOL";
  }
  return "UNKNOWN";
}

std::string ShapeString(absl::Span<const int64_t> shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

int64_t TensorView::NumElements() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

namespace {

struct RecycledStorage {
  absl::Mutex mu;
  std::vector<std::vector<std::byte, internal::DefaultInitAllocator<std::byte>>> free
      ABSL_GUARDED_BY(mu);
  size_t bytes ABSL_GUARDED_BY(mu) = 0;
};

RecycledStorage& Recycled() {
  static auto* recycled = new RecycledStorage;
  return *recycled;
}

}  // namespace

HostTensor::Storage HostTensor::Allocate(size_t bytes) {
  Storage storage;
  if (bytes >= kRecycleMinBytes) {
    RecycledStorage& r = Recycled();
    absl::MutexLock lock(&r.mu);
    // The smallest cached buffer that fits, if it is not more than twice the size asked for.
    size_t best = r.free.size();
    for (size_t i = 0; i < r.free.size(); ++i) {
      const size_t cap = r.free[i].capacity();
      if (cap >= bytes && cap <= 2 * bytes &&
          (best == r.free.size() || cap < r.free[best].capacity())) {
        best = i;
      }
    }
    if (best < r.free.size()) {
      storage = std::move(r.free[best]);
      r.free.erase(r.free.begin() + static_cast<std::ptrdiff_t>(best));
      r.bytes -= storage.capacity();
    }
  }
  storage.resize(bytes);  // default-initializes: no pass over the bytes
  return storage;
}

void HostTensor::Recycle(Storage storage) {
  const size_t cap = storage.capacity();
  if (cap < kRecycleMinBytes) return;
  RecycledStorage& r = Recycled();
  absl::MutexLock lock(&r.mu);
  // Full: drop the oldest buffers first (they are the least likely to match again).
  while (!r.free.empty() &&
         (r.free.size() >= kRecycledBuffers || r.bytes + cap > kRecycledBytes)) {
    r.bytes -= r.free.front().capacity();
    r.free.erase(r.free.begin());
  }
  if (cap > kRecycledBytes) return;
  storage.clear();
  r.bytes += cap;
  r.free.push_back(std::move(storage));
}

HostTensor::HostTensor(DType dtype, Shape shape) : dtype_(dtype), shape_(std::move(shape)) {
  for (int64_t d : shape_) CHECK_GE(d, 0) << "HostTensor shape " << ShapeString(shape_);
  storage_ = Allocate(static_cast<size_t>(view().NumBytes()));
  if (!storage_.empty()) std::memset(storage_.data(), 0, storage_.size());
}

HostTensor HostTensor::Uninitialized(DType dtype, Shape shape) {
  HostTensor t;
  t.dtype_ = dtype;
  t.shape_ = std::move(shape);
  for (int64_t d : t.shape_) CHECK_GE(d, 0) << "HostTensor shape " << ShapeString(t.shape_);
  t.storage_ = Allocate(static_cast<size_t>(t.view().NumBytes()));
  return t;
}

HostTensor::~HostTensor() { Recycle(std::move(storage_)); }

HostTensor& HostTensor::operator=(HostTensor&& other) noexcept {
  if (this != &other) {
    Recycle(std::move(storage_));
    dtype_ = other.dtype_;
    shape_ = std::move(other.shape_);
    storage_ = std::move(other.storage_);
    other.storage_ = Storage();
  }
  return *this;
}

HostTensor::HostTensor(const HostTensor& other) : dtype_(other.dtype_), shape_(other.shape_) {
  storage_ = Allocate(other.storage_.size());
  if (!storage_.empty()) std::memcpy(storage_.data(), other.storage_.data(), storage_.size());
}

HostTensor& HostTensor::operator=(const HostTensor& other) {
  if (this != &other) *this = HostTensor(other);
  return *this;
}

absl::Status CheckTensor(const TensorView& t, absl::string_view name, DType dtype,
                         std::initializer_list<int64_t> shape) {
  if (t.dtype != dtype) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, ": expected dtype ", DTypeName(dtype), ", got ", DTypeName(t.dtype)));
  }
  return CheckShapeAndData(t, name, shape);
}

absl::Status CheckTensorOneOf(const TensorView& t, absl::string_view name,
                              std::initializer_list<DType> dtypes,
                              std::initializer_list<int64_t> shape) {
  for (DType d : dtypes) {
    if (t.dtype == d) return CheckShapeAndData(t, name, shape);
  }
  std::string names;
  for (DType d : dtypes) absl::StrAppend(&names, names.empty() ? "" : ", ", DTypeName(d));
  return absl::InvalidArgumentError(
      absl::StrCat(name, ": expected dtype one of {", names, "}, got ", DTypeName(t.dtype)));
}

}  // namespace moe
