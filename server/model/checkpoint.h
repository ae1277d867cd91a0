// A Hugging Face-style checkpoint directory: either one `model.safetensors`, or
// `model.safetensors.index.json` ({"weight_map": {tensor name: file name}}) naming several
// safetensors files, which are mapped lazily, on the first Get of one of their tensors.
//
// Callers: the model loader (model.h) and tests. Thread-safety: all methods are safe to call
// concurrently (the lazily opened files sit behind a mutex; an opened file never changes).
// Ownership: the checkpoint owns every mapping; tensors it returns point into them and stay valid
// as long as the checkpoint lives (hold the shared_ptr to keep it alive).
#ifndef MOE_SERVER_MODEL_CHECKPOINT_H_
#define MOE_SERVER_MODEL_CHECKPOINT_H_

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "server/model/safetensors.h"

namespace moe::model {

inline constexpr char kSingleFileName[] = "model.safetensors";
inline constexpr char kIndexFileName[] = "model.safetensors.index.json";

// Reads a small text file (config, index) whole. NOT_FOUND when it does not exist,
// INVALID_ARGUMENT when it is larger than `max_bytes`.
absl::StatusOr<std::string> ReadSmallFile(const std::string& path, int64_t max_bytes);

// True when `path` names an existing regular file.
bool RegularFileExists(const std::string& path);

class Checkpoint {
 public:
  // Prefers the index when both forms are present. NOT_FOUND when the directory holds neither;
  // INVALID_ARGUMENT for a malformed index (a weight_map value that is not a plain file name in
  // the directory, e.g. "../x"); a single file is opened and validated at once.
  [[nodiscard]] static absl::StatusOr<std::shared_ptr<Checkpoint>> Open(const std::string& dir);

  Checkpoint(const Checkpoint&) = delete;
  Checkpoint& operator=(const Checkpoint&) = delete;

  const std::string& dir() const { return dir_; }
  bool Contains(absl::string_view name) const { return weight_map_.count(name) > 0; }
  std::vector<std::string> TensorNames() const;  // sorted
  const std::vector<std::string>& file_names() const { return files_; }

  // The tensor's handle, mapping its file first when needed. NOT_FOUND naming the checkpoint when
  // no file holds the name, or naming the file when the index points at a file without it; the
  // file's own errors when it cannot be opened.
  absl::StatusOr<SafetensorsTensor> Get(absl::string_view name) const;

 private:
  explicit Checkpoint(std::string dir) : dir_(std::move(dir)) {}
  absl::Status ReadIndex(const std::string& index_path);
  absl::StatusOr<const SafetensorsFile*> File(int index) const;

  std::string dir_;
  std::vector<std::string> files_;                      // file names relative to dir_
  std::map<std::string, int, std::less<>> weight_map_;  // tensor name -> index into files_
  mutable absl::Mutex mu_;
  mutable std::vector<std::unique_ptr<SafetensorsFile>> opened_ ABSL_GUARDED_BY(mu_);
};

}  // namespace moe::model

#endif  // MOE_SERVER_MODEL_CHECKPOINT_H_
