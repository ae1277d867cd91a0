// Safetensors files: a strict, read-only, memory-mapped reader and a small writer.
//
// Format: an 8-byte little-endian header length n, n bytes of JSON
// ({name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}), then the data
// section; offsets are relative to the start of the data section. The reader validates every
// header field against the file before handing out a pointer, so a hostile or truncated file is an
// error (naming the file and tensor), never a crash or an out-of-bounds read.
//
// Callers: the checkpoint (checkpoint.h) and through it the model loader; the writer serves the
// synthetic-model generator and tests. Thread-safety: an open SafetensorsFile is immutable, so
// concurrent reads are safe; a writer is not thread-safe. Ownership: SafetensorsFile owns its
// mapping; every SafetensorsTensor and TensorView it hands out points into that mapping and is
// valid only while the file object lives. The mapping is read-only: writing through a view faults.
#ifndef MOE_SERVER_MODEL_SAFETENSORS_H_
#define MOE_SERVER_MODEL_SAFETENSORS_H_

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "kernels/tensor.h"

namespace moe::model {

// The safetensors dtypes this project reads and writes.
enum class SafetensorsDType : uint8_t { kU8, kI8, kBF16, kF16, kF32, kF8E4M3, kI32, kI64, kBool };

absl::string_view SafetensorsDTypeName(SafetensorsDType dtype);  // "U8", "F8_E4M3", ...
// INVALID_ARGUMENT for a name outside the list above.
absl::StatusOr<SafetensorsDType> ParseSafetensorsDType(absl::string_view name);
int64_t SafetensorsDTypeSize(SafetensorsDType dtype);
// The kernels' dtype for a safetensors dtype; INVALID_ARGUMENT for I8 and F16, which no kernel
// reads.
absl::StatusOr<DType> ToDType(SafetensorsDType dtype);
// Every kernels dtype has a safetensors equivalent (kE4M3 -> F8_E4M3, kBool -> BOOL, ...).
SafetensorsDType FromDType(DType dtype);

// Upper bounds that keep a hostile header from exhausting memory.
inline constexpr int64_t kMaxSafetensorsHeaderBytes = int64_t{100} << 20;
inline constexpr int kMaxSafetensorsRank = 16;

// One tensor of an open file: a non-owning handle into the file's mapping.
struct SafetensorsTensor {
  std::string name;
  SafetensorsDType dtype = SafetensorsDType::kU8;
  Shape shape;
  const uint8_t* data = nullptr;  // not necessarily aligned; null when num_bytes == 0
  int64_t num_bytes = 0;

  int64_t NumElements() const;
  absl::Span<const uint8_t> bytes() const {
    return absl::MakeConstSpan(data, static_cast<size_t>(num_bytes));
  }
  // A view over the mapped bytes; INVALID_ARGUMENT when the dtype has no kernels equivalent.
  absl::StatusOr<TensorView> View() const;
};

class SafetensorsFile {
 public:
  // Maps `path` and validates its header. NOT_FOUND when the file does not exist, DATA_LOSS when
  // it is truncated or an offset points outside it, INVALID_ARGUMENT for a malformed header.
  [[nodiscard]] static absl::StatusOr<std::unique_ptr<SafetensorsFile>> Open(
      const std::string& path);
  // Validates an in-memory image exactly as Open validates a file (same checks and codes);
  // `name` stands in for the path in messages. REQUIRES: `bytes` stays alive and unchanged while
  // the returned file, or any tensor or view it hands out, is in use (nothing is copied).
  [[nodiscard]] static absl::StatusOr<std::unique_ptr<SafetensorsFile>> FromBuffer(
      std::string name, absl::Span<const uint8_t> bytes);

  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;
  ~SafetensorsFile();

  const std::string& path() const { return path_; }
  int64_t file_size() const { return file_size_; }
  bool Contains(absl::string_view name) const { return tensors_.find(name) != tensors_.end(); }
  // NOT_FOUND naming the file when there is no such tensor.
  absl::StatusOr<SafetensorsTensor> Get(absl::string_view name) const;
  std::vector<std::string> TensorNames() const;  // sorted

 private:
  SafetensorsFile(std::string path, const uint8_t* base, int64_t size, bool mapped)
      : path_(std::move(path)), base_(base), file_size_(size), mapped_(mapped) {}
  absl::Status ParseHeader();

  std::string path_;
  const uint8_t* base_ = nullptr;  // start of the mapping (null for an empty mapping)
  int64_t file_size_ = 0;
  bool mapped_ = false;  // base_ is our mmap (Open), not a caller's buffer (FromBuffer)
  std::map<std::string, SafetensorsTensor, std::less<>> tensors_;
};

// Collects named tensors and writes them as one safetensors file. Tensors are laid out by
// descending element size, then by name, right after a header padded to 8 bytes, so every
// tensor of a written file is aligned to its element size.
class SafetensorsWriter {
 public:
  // INVALID_ARGUMENT for an empty or duplicate name, the reserved "__metadata__", a negative
  // dimension or a byte count that does not match the shape.
  [[nodiscard]] absl::Status Add(std::string name, SafetensorsDType dtype, Shape shape,
                                 std::vector<uint8_t> bytes);
  // Copies a view's bytes (the dtype maps through FromDType).
  [[nodiscard]] absl::Status Add(std::string name, const TensorView& view);

  // Writes the file (through a temporary file renamed into place).
  [[nodiscard]] absl::Status Write(const std::string& path) const;

  int64_t data_bytes() const { return data_bytes_; }
  size_t size() const { return tensors_.size(); }

 private:
  struct Entry {
    SafetensorsDType dtype;
    Shape shape;
    std::vector<uint8_t> bytes;
  };
  std::map<std::string, Entry> tensors_;
  int64_t data_bytes_ = 0;
};

}  // namespace moe::model

#endif  // MOE_SERVER_MODEL_SAFETENSORS_H_
