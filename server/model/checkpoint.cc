// Checkpoint directory: index parsing and lazy file mapping.
#include "server/model/checkpoint.h"

#include <sys/stat.h>

#include <cerrno>
#include <cstdio>

#include "absl/strings/str_cat.h"
#include "nlohmann/json.hpp"

namespace moe::model {
namespace {

using Json = nlohmann::json;

// Index files of very large models are a few MiB; anything far beyond is not an index.
constexpr int64_t kMaxIndexBytes = int64_t{256} << 20;

// A weight_map value must name a file inside the checkpoint directory.
bool IsPlainFileName(const std::string& name) {
  return !name.empty() && name != "." && name != ".." && name.find('/') == std::string::npos &&
         name.find('\0') == std::string::npos;
}

}  // namespace

bool RegularFileExists(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode);
}

absl::StatusOr<std::string> ReadSmallFile(const std::string& path, int64_t max_bytes) {
  std::FILE* f = std::fopen(path.c_str(), "rb");
  if (f == nullptr) return absl::ErrnoToStatus(errno, absl::StrCat("cannot open ", path));
  std::string text;
  char buffer[1 << 16];
  size_t n;
  while ((n = std::fread(buffer, 1, sizeof(buffer), f)) > 0) {
    if (static_cast<int64_t>(text.size() + n) > max_bytes) {
      std::fclose(f);
      return absl::InvalidArgumentError(
          absl::StrCat(path, ": larger than the limit of ", max_bytes, " bytes"));
    }
    text.append(buffer, n);
  }
  const bool failed = std::ferror(f) != 0;
  std::fclose(f);
  if (failed) return absl::DataLossError(absl::StrCat(path, ": read error"));
  return text;
}

absl::StatusOr<std::shared_ptr<Checkpoint>> Checkpoint::Open(const std::string& dir) {
  std::shared_ptr<Checkpoint> checkpoint(new Checkpoint(dir));
  const std::string index_path = absl::StrCat(dir, "/", kIndexFileName);
  const std::string single_path = absl::StrCat(dir, "/", kSingleFileName);
  if (RegularFileExists(index_path)) {
    if (absl::Status s = checkpoint->ReadIndex(index_path); !s.ok()) return s;
    absl::MutexLock lock(&checkpoint->mu_);
    checkpoint->opened_.resize(checkpoint->files_.size());
    return checkpoint;
  }
  if (!RegularFileExists(single_path)) {
    return absl::NotFoundError(
        absl::StrCat(dir, ": neither ", kIndexFileName, " nor ", kSingleFileName, " found"));
  }
  absl::StatusOr<std::unique_ptr<SafetensorsFile>> file = SafetensorsFile::Open(single_path);
  if (!file.ok()) return file.status();
  checkpoint->files_.push_back(kSingleFileName);
  for (std::string& name : (*file)->TensorNames()) checkpoint->weight_map_.emplace(name, 0);
  absl::MutexLock lock(&checkpoint->mu_);
  checkpoint->opened_.push_back(*std::move(file));
  return checkpoint;
}

absl::Status Checkpoint::ReadIndex(const std::string& index_path) {
  absl::StatusOr<std::string> text = ReadSmallFile(index_path, kMaxIndexBytes);
  if (!text.ok()) return text.status();
  const Json index = Json::parse(*text, nullptr, /*allow_exceptions=*/false);
  if (index.is_discarded() || !index.is_object()) {
    return absl::InvalidArgumentError(absl::StrCat(index_path, ": not a JSON object"));
  }
  auto map_it = index.find("weight_map");
  if (map_it == index.end() || !map_it->is_object()) {
    return absl::InvalidArgumentError(absl::StrCat(index_path, ": no \"weight_map\" object"));
  }
  std::map<std::string, int> file_index;
  for (const auto& [name, file] : map_it->items()) {
    if (!file.is_string() || !IsPlainFileName(file.get_ref<const std::string&>())) {
      return absl::InvalidArgumentError(
          absl::StrCat(index_path, ": weight_map[\"", name, "\"] is not a file name in ", dir_));
    }
    const std::string& file_name = file.get_ref<const std::string&>();
    auto [it, inserted] = file_index.emplace(file_name, static_cast<int>(files_.size()));
    if (inserted) files_.push_back(file_name);
    weight_map_.emplace(name, it->second);
  }
  return absl::OkStatus();
}

std::vector<std::string> Checkpoint::TensorNames() const {
  std::vector<std::string> names;
  names.reserve(weight_map_.size());
  for (const auto& [name, file] : weight_map_) names.push_back(name);
  return names;
}

absl::StatusOr<const SafetensorsFile*> Checkpoint::File(int index) const {
  absl::MutexLock lock(&mu_);
  if (opened_[index] == nullptr) {
    // A failure is not cached: the next Get retries (the file may be mid-copy).
    absl::StatusOr<std::unique_ptr<SafetensorsFile>> file =
        SafetensorsFile::Open(absl::StrCat(dir_, "/", files_[index]));
    if (!file.ok()) return file.status();
    opened_[index] = *std::move(file);
  }
  return opened_[index].get();
}

absl::StatusOr<SafetensorsTensor> Checkpoint::Get(absl::string_view name) const {
  auto it = weight_map_.find(name);
  if (it == weight_map_.end()) {
    return absl::NotFoundError(absl::StrCat(dir_, ": no tensor '", name, "' in the checkpoint"));
  }
  absl::StatusOr<const SafetensorsFile*> file = File(it->second);
  if (!file.ok()) return file.status();
  absl::StatusOr<SafetensorsTensor> tensor = (*file)->Get(name);
  if (!tensor.ok()) {
    return absl::NotFoundError(absl::StrCat(tensor.status().message(), " (the index of ", dir_,
                                            " places it in that file)"));
  }
  return tensor;
}

}  // namespace moe::model
