#include "server/shard/transport_test_util.h"

#include <cstdlib>
#include <filesystem>
#include <vector>

#include "absl/strings/str_cat.h"
#include "server/model/generator.h"

namespace moe {
namespace {

void SetRoutes(v1::Tensor* t, v1::DType dtype, int64_t tokens, const void* data, size_t bytes) {
  t->set_dtype(dtype);
  t->add_shape(tokens);
  t->add_shape(2);
  t->set_data(std::string(static_cast<const char*>(data), bytes));
}

}  // namespace

absl::StatusOr<std::string> TestModelDir(const std::string& name, int64_t hidden) {
  const char* tmp = std::getenv("TEST_TMPDIR");
  const std::string dir = absl::StrCat(tmp != nullptr ? tmp : "/tmp", "/", name);
  if (std::filesystem::exists(std::filesystem::path(dir) / "config.json")) return dir;
  model::GenerateOptions gen;
  gen.hidden = hidden;
  if (absl::Status s = model::GenerateModel(gen, dir); !s.ok()) return s;
  return dir;
}

absl::StatusOr<std::unique_ptr<InProcessShard>> StartTestShard(const std::string& name,
                                                               int64_t hidden,
                                                               InProcessShardOptions options) {
  absl::StatusOr<std::string> dir = TestModelDir(name, hidden);
  if (!dir.ok()) return dir.status();
  options.model_dir = *dir;
  return InProcessShard::Start(options);
}

v1::ForwardRequest RoutedBf16Header(int64_t tokens, int64_t hidden, std::string* payload) {
  v1::ForwardRequest req;
  req.set_layer(1);
  req.set_request_id(42);
  req.set_output_dtype(v1::F32);
  v1::HiddenStates* hs = req.mutable_hidden_states();
  hs->set_format(v1::ACTIVATION_BF16);
  hs->mutable_data()->set_dtype(v1::BF16);
  hs->mutable_data()->add_shape(tokens);
  hs->mutable_data()->add_shape(hidden);
  std::vector<uint16_t> x(static_cast<size_t>(tokens * hidden));
  // BF16 sign/exponent 0x3c.. or 0xbc.. (magnitudes ~0.008-0.016), mantissa from the index.
  for (size_t i = 0; i < x.size(); ++i) {
    x[i] = static_cast<uint16_t>((i % 3 == 0 ? 0xbc00 : 0x3c00) | (i * 37 % 256));
  }
  payload->assign(reinterpret_cast<const char*>(x.data()), x.size() * 2);
  std::vector<int32_t> ids;
  std::vector<float> w;
  for (int64_t t = 0; t < tokens; ++t) {
    ids.insert(ids.end(), {static_cast<int32_t>(t % 8), static_cast<int32_t>((t + 3) % 8)});
    w.insert(w.end(), {0.75f, 0.25f});
  }
  SetRoutes(req.mutable_topk_ids(), v1::I32, tokens, ids.data(), ids.size() * 4);
  SetRoutes(req.mutable_topk_weights(), v1::F32, tokens, w.data(), w.size() * 4);
  return req;
}

}  // namespace moe
