// Fuzz target safetensors: arbitrary bytes -> SafetensorsFile::FromBuffer (the parser Open uses
// on a mapped file). A rejected image must be INVALID_ARGUMENT or DATA_LOSS; an accepted one must
// hand out only tensors whose bytes lie inside the image's data section and match their shape.
// libFuzzer's input buffer is exactly `size` bytes on the heap, so AddressSanitizer flags any read
// past the image, including the byte-sum over every tensor below.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>

#include "server/model/safetensors.h"

namespace {

void Expect(bool ok, const char* what) {
  if (!ok) {
    std::fprintf(stderr, "fuzz invariant violated: %s\n", what);
    std::abort();
  }
}

void CheckTensor(const moe::model::SafetensorsTensor& t, const uint8_t* image, size_t size) {
  const int64_t element = moe::model::SafetensorsDTypeSize(t.dtype);
  Expect(t.num_bytes == t.NumElements() * element, "byte count differs from shape * dtype size");
  Expect(static_cast<int64_t>(t.shape.size()) <= moe::model::kMaxSafetensorsRank, "rank too high");
  if (t.num_bytes == 0) return;
  Expect(t.data >= image + 8 && t.data + t.num_bytes <= image + size, "tensor outside the image");
  uint8_t sum = 0;
  for (uint8_t b : t.bytes()) sum = static_cast<uint8_t>(sum + b);
  volatile uint8_t sink = sum;
  (void)sink;
  absl::StatusOr<moe::TensorView> view = t.View();
  if (view.ok()) {
    Expect(view->NumBytes() == t.num_bytes, "view size differs from the tensor's");
    Expect(view->data == t.data, "view points elsewhere");
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  absl::StatusOr<std::unique_ptr<moe::model::SafetensorsFile>> file =
      moe::model::SafetensorsFile::FromBuffer("fuzz.safetensors", absl::MakeConstSpan(data, size));
  if (!file.ok()) {
    const absl::StatusCode code = file.status().code();
    Expect(code == absl::StatusCode::kInvalidArgument || code == absl::StatusCode::kDataLoss,
           "rejection with an unexpected status code");
    return 0;
  }
  for (const std::string& name : (*file)->TensorNames()) {
    Expect(name != "__metadata__", "__metadata__ listed as a tensor");
    absl::StatusOr<moe::model::SafetensorsTensor> t = (*file)->Get(name);
    Expect(t.ok() && t->name == name, "a listed tensor cannot be fetched");
    CheckTensor(*t, data, size);
  }
  Expect((*file)->Get("\x01 not a tensor").status().code() == absl::StatusCode::kNotFound,
         "a missing tensor is not NOT_FOUND");
  return 0;
}
