// Safetensors reader and writer. The reader trusts nothing in the file: every number in the
// header is range-checked before it becomes a pointer, and the JSON parser runs without
// exceptions (a malformed header comes back as a discarded value, not a throw).
#include "server/model/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <limits>
#include <optional>
#include <set>
#include <utility>

#include "absl/strings/str_cat.h"
#include "nlohmann/json.hpp"

namespace moe::model {
namespace {

using Json = nlohmann::json;

struct DTypeInfo {
  SafetensorsDType dtype;
  absl::string_view name;
  int64_t size;
};

constexpr DTypeInfo kDTypes[] = {
    {SafetensorsDType::kU8, "U8", 1},     {SafetensorsDType::kI8, "I8", 1},
    {SafetensorsDType::kBF16, "BF16", 2}, {SafetensorsDType::kF16, "F16", 2},
    {SafetensorsDType::kF32, "F32", 4},   {SafetensorsDType::kF8E4M3, "F8_E4M3", 1},
    {SafetensorsDType::kI32, "I32", 4},   {SafetensorsDType::kI64, "I64", 8},
    {SafetensorsDType::kBool, "BOOL", 1},
};

const DTypeInfo& Info(SafetensorsDType dtype) {
  for (const DTypeInfo& info : kDTypes) {
    if (info.dtype == dtype) return info;
  }
  return kDTypes[0];  // unreachable: the table covers the enum
}

// Element count of `shape` times `element_size`, or nullopt when it does not fit in int64.
std::optional<int64_t> CheckedByteCount(absl::Span<const int64_t> shape, int64_t element_size) {
  int64_t count = element_size;
  for (int64_t d : shape) {
    if (d < 0 || __builtin_mul_overflow(count, d, &count)) return std::nullopt;
  }
  return count;
}

// A JSON non-negative integer that fits in int64.
std::optional<int64_t> NonNegativeInt(const Json& v) {
  if (!v.is_number_unsigned()) return std::nullopt;
  const uint64_t u = v.get<uint64_t>();
  if (u > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) return std::nullopt;
  return static_cast<int64_t>(u);
}

// Shape from a header entry; the error text says which rule failed.
absl::StatusOr<Shape> ParseShape(const Json& v) {
  if (!v.is_array()) return absl::InvalidArgumentError("\"shape\" is not an array");
  if (v.size() > static_cast<size_t>(kMaxSafetensorsRank)) {
    return absl::InvalidArgumentError(
        absl::StrCat("rank ", v.size(), " exceeds the limit of ", kMaxSafetensorsRank));
  }
  Shape shape;
  for (const Json& d : v) {
    if (d.is_number_integer() && !d.is_number_unsigned()) {
      return absl::InvalidArgumentError(absl::StrCat("negative dimension ", d.dump()));
    }
    std::optional<int64_t> dim = NonNegativeInt(d);
    if (!dim) return absl::InvalidArgumentError(absl::StrCat("bad dimension ", d.dump()));
    shape.push_back(*dim);
  }
  return shape;
}

// Parses the header text, rejecting a tensor name that appears twice (the JSON library would
// silently keep the last one).
absl::StatusOr<Json> ParseHeaderJson(absl::string_view text) {
  std::set<std::string> seen;
  std::string duplicate;
  auto callback = [&](int depth, Json::parse_event_t event, Json& parsed) {
    if (depth == 1 && event == Json::parse_event_t::key && parsed.is_string()) {
      const std::string& key = parsed.get_ref<const std::string&>();
      if (!seen.insert(key).second && duplicate.empty()) duplicate = key;
    }
    return true;
  };
  Json header = Json::parse(text.begin(), text.end(), callback, /*allow_exceptions=*/false);
  if (header.is_discarded()) return absl::InvalidArgumentError("header is not valid JSON");
  if (!header.is_object()) return absl::InvalidArgumentError("header is not a JSON object");
  if (!duplicate.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("tensor '", duplicate, "' appears twice"));
  }
  return header;
}

// Validates one header entry against the data section of `data_size` bytes.
absl::StatusOr<SafetensorsTensor> ParseEntry(const std::string& name, const Json& entry,
                                             const uint8_t* data, int64_t data_size) {
  if (!entry.is_object()) return absl::InvalidArgumentError("entry is not an object");
  auto dtype_it = entry.find("dtype");
  auto shape_it = entry.find("shape");
  auto offsets_it = entry.find("data_offsets");
  if (dtype_it == entry.end() || shape_it == entry.end() || offsets_it == entry.end()) {
    return absl::InvalidArgumentError("entry needs \"dtype\", \"shape\" and \"data_offsets\"");
  }
  if (!dtype_it->is_string()) return absl::InvalidArgumentError("\"dtype\" is not a string");
  absl::StatusOr<SafetensorsDType> dtype =
      ParseSafetensorsDType(dtype_it->get_ref<const std::string&>());
  if (!dtype.ok()) return dtype.status();
  absl::StatusOr<Shape> shape = ParseShape(*shape_it);
  if (!shape.ok()) return shape.status();
  const Json& offsets = *offsets_it;
  std::optional<int64_t> begin, end;
  if (offsets.is_array() && offsets.size() == 2) {
    begin = NonNegativeInt(offsets[0]);
    end = NonNegativeInt(offsets[1]);
  }
  if (!begin || !end) {
    return absl::InvalidArgumentError("\"data_offsets\" is not two non-negative integers");
  }
  if (*begin > *end) {
    return absl::InvalidArgumentError(
        absl::StrCat("data_offsets [", *begin, ", ", *end, "] end before they begin"));
  }
  if (*end > data_size) {
    return absl::DataLossError(absl::StrCat("data_offsets [", *begin, ", ", *end,
                                            "] reach past the data section of ", data_size,
                                            " bytes (truncated file?)"));
  }
  std::optional<int64_t> expected = CheckedByteCount(*shape, SafetensorsDTypeSize(*dtype));
  if (!expected) {
    return absl::InvalidArgumentError(
        absl::StrCat("shape ", ShapeString(*shape), " has more bytes than fit in int64"));
  }
  if (*expected != *end - *begin) {
    return absl::InvalidArgumentError(
        absl::StrCat("shape ", ShapeString(*shape), " of ", SafetensorsDTypeName(*dtype), " needs ",
                     *expected, " bytes but data_offsets span ", *end - *begin));
  }
  SafetensorsTensor tensor;
  tensor.name = name;
  tensor.dtype = *dtype;
  tensor.shape = *std::move(shape);
  tensor.num_bytes = *end - *begin;
  tensor.data = tensor.num_bytes > 0 ? data + *begin : nullptr;
  return tensor;
}

absl::Status WriteAll(std::FILE* f, const void* data, size_t size) {
  if (size > 0 && std::fwrite(data, 1, size, f) != size) {
    return absl::ErrnoToStatus(errno, "write failed");
  }
  return absl::OkStatus();
}

}  // namespace

absl::string_view SafetensorsDTypeName(SafetensorsDType dtype) { return Info(dtype).name; }

int64_t SafetensorsDTypeSize(SafetensorsDType dtype) { return Info(dtype).size; }

absl::StatusOr<SafetensorsDType> ParseSafetensorsDType(absl::string_view name) {
  for (const DTypeInfo& info : kDTypes) {
    if (info.name == name) return info.dtype;
  }
  return absl::InvalidArgumentError(absl::StrCat("unsupported safetensors dtype '", name, "'"));
}

absl::StatusOr<DType> ToDType(SafetensorsDType dtype) {
  switch (dtype) {
    case SafetensorsDType::kU8:
      return DType::kU8;
    case SafetensorsDType::kBF16:
      return DType::kBF16;
    case SafetensorsDType::kF32:
      return DType::kF32;
    case SafetensorsDType::kF8E4M3:
      return DType::kE4M3;
    case SafetensorsDType::kI32:
      return DType::kI32;
    case SafetensorsDType::kI64:
      return DType::kI64;
    case SafetensorsDType::kBool:
      return DType::kBool;
    case SafetensorsDType::kI8:
    case SafetensorsDType::kF16:
      break;
  }
  return absl::InvalidArgumentError(absl::StrCat("safetensors dtype ", SafetensorsDTypeName(dtype),
                                                 " has no kernels equivalent"));
}

SafetensorsDType FromDType(DType dtype) {
  switch (dtype) {
    case DType::kF32:
      return SafetensorsDType::kF32;
    case DType::kBF16:
      return SafetensorsDType::kBF16;
    case DType::kU8:
      return SafetensorsDType::kU8;
    case DType::kI32:
      return SafetensorsDType::kI32;
    case DType::kI64:
      return SafetensorsDType::kI64;
    case DType::kE4M3:
      return SafetensorsDType::kF8E4M3;
    case DType::kBool:
      return SafetensorsDType::kBool;
  }
  return SafetensorsDType::kU8;  // unreachable: the switch covers the enum
}

int64_t SafetensorsTensor::NumElements() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;  // the reader checked that this cannot overflow
  return n;
}

absl::StatusOr<TensorView> SafetensorsTensor::View() const {
  absl::StatusOr<DType> dtype = ToDType(this->dtype);
  if (!dtype.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("tensor '", name, "': ", dtype.status().message()));
  }
  return TensorView{*dtype, shape, const_cast<uint8_t*>(data)};
}

absl::StatusOr<std::unique_ptr<SafetensorsFile>> SafetensorsFile::Open(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return absl::ErrnoToStatus(errno, absl::StrCat("cannot open ", path));
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    const int err = errno;
    ::close(fd);
    return absl::ErrnoToStatus(err, absl::StrCat("cannot stat ", path));
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    return absl::InvalidArgumentError(absl::StrCat(path, ": not a regular file"));
  }
  const int64_t size = st.st_size;
  // A file too short for the header length is left unmapped (mmap refuses an empty one) and
  // rejected by ParseHeader.
  void* base = nullptr;
  if (size >= 8) {
    base = ::mmap(nullptr, static_cast<size_t>(size), PROT_READ, MAP_SHARED, fd, 0);
  }
  const int mmap_errno = errno;
  ::close(fd);  // the mapping keeps the file alive
  if (base == MAP_FAILED) return absl::ErrnoToStatus(mmap_errno, absl::StrCat("cannot map ", path));
  std::unique_ptr<SafetensorsFile> file(
      new SafetensorsFile(path, static_cast<const uint8_t*>(base), size, /*mapped=*/true));
  if (absl::Status s = file->ParseHeader(); !s.ok()) return s;
  return file;
}

absl::StatusOr<std::unique_ptr<SafetensorsFile>> SafetensorsFile::FromBuffer(
    std::string name, absl::Span<const uint8_t> bytes) {
  std::unique_ptr<SafetensorsFile> file(new SafetensorsFile(
      std::move(name), bytes.data(), static_cast<int64_t>(bytes.size()), /*mapped=*/false));
  if (absl::Status s = file->ParseHeader(); !s.ok()) return s;
  return file;
}

SafetensorsFile::~SafetensorsFile() {
  if (mapped_ && base_ != nullptr) {
    ::munmap(const_cast<uint8_t*>(base_), static_cast<size_t>(file_size_));
  }
}

absl::Status SafetensorsFile::ParseHeader() {
  if (file_size_ < 8) {
    return absl::DataLossError(absl::StrCat(path_, ": file is ", file_size_,
                                            " bytes, shorter than the 8-byte header length"));
  }
  uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | base_[i];
  if (header_len > static_cast<uint64_t>(kMaxSafetensorsHeaderBytes)) {
    return absl::InvalidArgumentError(absl::StrCat(path_, ": header length ", header_len,
                                                   " exceeds the limit of ",
                                                   kMaxSafetensorsHeaderBytes, " bytes"));
  }
  if (static_cast<int64_t>(header_len) > file_size_ - 8) {
    return absl::DataLossError(absl::StrCat(path_, ": header length ", header_len,
                                            " is larger than the rest of the file (",
                                            file_size_ - 8, " bytes)"));
  }
  const absl::string_view text(reinterpret_cast<const char*>(base_ + 8), header_len);
  absl::StatusOr<Json> header = ParseHeaderJson(text);
  if (!header.ok())
    return absl::InvalidArgumentError(absl::StrCat(path_, ": ", header.status().message()));
  const uint8_t* data = base_ + 8 + header_len;
  const int64_t data_size = file_size_ - 8 - static_cast<int64_t>(header_len);
  for (const auto& [name, entry] : header->items()) {
    if (name == "__metadata__") continue;
    absl::StatusOr<SafetensorsTensor> tensor = ParseEntry(name, entry, data, data_size);
    if (!tensor.ok()) {
      return absl::Status(tensor.status().code(), absl::StrCat(path_, ": tensor '", name,
                                                               "': ", tensor.status().message()));
    }
    tensors_.emplace(name, *std::move(tensor));
  }
  return absl::OkStatus();
}

absl::StatusOr<SafetensorsTensor> SafetensorsFile::Get(absl::string_view name) const {
  auto it = tensors_.find(name);
  if (it == tensors_.end()) {
    return absl::NotFoundError(absl::StrCat(path_, ": no tensor '", name, "'"));
  }
  return it->second;
}

std::vector<std::string> SafetensorsFile::TensorNames() const {
  std::vector<std::string> names;
  names.reserve(tensors_.size());
  for (const auto& [name, tensor] : tensors_) names.push_back(name);
  return names;
}

absl::Status SafetensorsWriter::Add(std::string name, SafetensorsDType dtype, Shape shape,
                                    std::vector<uint8_t> bytes) {
  if (name.empty() || name == "__metadata__") {
    return absl::InvalidArgumentError(absl::StrCat("tensor name '", name, "' is reserved"));
  }
  // Printable ASCII keeps the JSON header free of escapes and encoding questions.
  for (char c : name) {
    if (c < 0x20 || c > 0x7e || c == '"' || c == '\\') {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor name '", name, "' has a character outside printable ASCII"));
    }
  }
  if (tensors_.count(name) > 0) {
    return absl::InvalidArgumentError(absl::StrCat("tensor '", name, "' added twice"));
  }
  if (shape.size() > static_cast<size_t>(kMaxSafetensorsRank)) {
    return absl::InvalidArgumentError(absl::StrCat("tensor '", name, "': rank too large"));
  }
  std::optional<int64_t> expected = CheckedByteCount(shape, SafetensorsDTypeSize(dtype));
  if (!expected || *expected != static_cast<int64_t>(bytes.size())) {
    return absl::InvalidArgumentError(absl::StrCat("tensor '", name, "': shape ",
                                                   ShapeString(shape), " does not match ",
                                                   bytes.size(), " bytes"));
  }
  data_bytes_ += *expected;
  tensors_.emplace(std::move(name), Entry{dtype, std::move(shape), std::move(bytes)});
  return absl::OkStatus();
}

absl::Status SafetensorsWriter::Add(std::string name, const TensorView& view) {
  std::optional<int64_t> bytes = CheckedByteCount(view.shape, DTypeSize(view.dtype));
  if (!bytes || (*bytes > 0 && view.data == nullptr)) {
    return absl::InvalidArgumentError(absl::StrCat("tensor '", name, "': bad view"));
  }
  const uint8_t* begin = static_cast<const uint8_t*>(view.data);
  return Add(std::move(name), FromDType(view.dtype), view.shape,
             std::vector<uint8_t>(begin, begin + *bytes));
}

absl::Status SafetensorsWriter::Write(const std::string& path) const {
  std::vector<const std::pair<const std::string, Entry>*> order;
  for (const auto& item : tensors_) order.push_back(&item);
  std::stable_sort(order.begin(), order.end(), [](const auto* a, const auto* b) {
    return SafetensorsDTypeSize(a->second.dtype) > SafetensorsDTypeSize(b->second.dtype);
  });
  Json header = Json::object();
  header["__metadata__"] = {{"format", "pt"}};
  int64_t offset = 0;
  for (const auto* item : order) {
    const Entry& entry = item->second;
    const int64_t size = static_cast<int64_t>(entry.bytes.size());
    header[item->first] = {{"dtype", std::string(SafetensorsDTypeName(entry.dtype))},
                           {"shape", std::vector<int64_t>(entry.shape.begin(), entry.shape.end())},
                           {"data_offsets", {offset, offset + size}}};
    offset += size;
  }
  std::string text = header.dump(-1, ' ', false, Json::error_handler_t::replace);
  text.append((8 - text.size() % 8) % 8, ' ');
  uint8_t length[8];
  for (int i = 0; i < 8; ++i) length[i] = static_cast<uint8_t>(uint64_t{text.size()} >> (8 * i));

  const std::string tmp = path + ".tmp";
  std::FILE* f = std::fopen(tmp.c_str(), "wb");
  if (f == nullptr) return absl::ErrnoToStatus(errno, absl::StrCat("cannot create ", tmp));
  absl::Status status = WriteAll(f, length, sizeof(length));
  if (status.ok()) status = WriteAll(f, text.data(), text.size());
  for (size_t i = 0; i < order.size() && status.ok(); ++i) {
    status = WriteAll(f, order[i]->second.bytes.data(), order[i]->second.bytes.size());
  }
  if (std::fclose(f) != 0 && status.ok()) status = absl::ErrnoToStatus(errno, "close failed");
  if (status.ok() && std::rename(tmp.c_str(), path.c_str()) != 0) {
    status = absl::ErrnoToStatus(errno, "rename failed");
  }
  if (!status.ok()) {
    std::remove(tmp.c_str());
    return absl::Status(status.code(), absl::StrCat(path, ": ", status.message()));
  }
  return absl::OkStatus();
}

}  // namespace moe::model
