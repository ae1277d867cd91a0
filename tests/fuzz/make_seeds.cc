// Writes the seed corpus of every fuzz target into <dir>/<target>/: valid inputs that start the
// fuzzers deep inside the code under test. Forward requests are checked to stage before they are
// written, so a seed that stops being valid (a format change) fails here rather than silently
// weakening the fuzzer. Deterministic: the committed tests/fuzz/corpus is its output.
//
// usage: make_seeds <dir>   (bench/fuzz/build.sh builds it into .cache/fuzz/bin)
#include <stdlib.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "kernels/formats.h"
#include "kernels/staging.h"
#include "server/common/tcp_channel_frame.h"
#include "server/common/wire.h"
#include "server/model/generator.h"
#include "server/model/safetensors.h"
#include "tests/fuzz/fuzz_fixture.h"

namespace moe::fuzz {
namespace {

[[noreturn]] void Die(const std::string& what) {
  std::fprintf(stderr, "make_seeds: %s\n", what.c_str());
  std::exit(1);
}

void Check(const absl::Status& s, const std::string& what) {
  if (!s.ok()) Die(what + ": " + std::string(s.message()));
}

std::string ReadAll(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) Die("cannot read " + path);
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

void Save(const std::string& dir, const std::string& target, const std::string& name,
          const std::string& bytes) {
  const std::string path = dir + "/" + target + "/" + name;
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  if (!out) Die("cannot write " + path);
}

// Deterministic values in [-2, 2).
HostTensor Floats(Shape shape, uint32_t seed) {
  HostTensor t(DType::kF32, std::move(shape));
  std::mt19937 rng(seed);
  for (int64_t i = 0; i < t.NumElements(); ++i) {
    t.data<float>()[i] = static_cast<float>(rng() % 4096) / 1024.f - 2.f;
  }
  return t;
}

HostTensor Ints(DType dtype, Shape shape, std::vector<int64_t> values) {
  HostTensor t(dtype, std::move(shape));
  for (size_t i = 0; i < values.size(); ++i) {
    if (dtype == DType::kI64) {
      t.data<int64_t>()[i] = values[i];
    } else if (dtype == DType::kI32) {
      t.data<int32_t>()[i] = static_cast<int32_t>(values[i]);
    } else {
      t.data<uint8_t>()[i] = static_cast<uint8_t>(values[i]);
    }
  }
  return t;
}

void Wire(const HostTensor& t, v1::Tensor* out) { ToWire(t.view(), out); }

// Modular routing for 3 tokens: ids [3, 2] with a no-route slot, weights in F32.
void ModularRoutes(v1::ForwardRequest& req) {
  Wire(Ints(DType::kI32, {3, kTopK}, {0, 5, 1, -1, 7, 2}), req.mutable_topk_ids());
  Wire(Floats({3, kTopK}, 11), req.mutable_topk_weights());
}

std::vector<std::pair<std::string, v1::ForwardRequest>> Requests() {
  std::vector<std::pair<std::string, v1::ForwardRequest>> out;
  const HostTensor x = Floats({3, kHidden}, 7);
  {
    v1::ForwardRequest req;
    req.mutable_hidden_states()->set_format(v1::ACTIVATION_F32);
    Wire(x, req.mutable_hidden_states()->mutable_data());
    ModularRoutes(req);
    out.emplace_back("f32_modular", req);
  }
  {
    v1::ForwardRequest req;
    req.set_layer(1);
    req.set_output_dtype(v1::F32);
    HostTensor bf16(DType::kBF16, {3, kHidden});
    Check(StageBf16(x.view(), bf16.view()), "StageBf16");
    req.mutable_hidden_states()->set_format(v1::ACTIVATION_BF16);
    Wire(bf16, req.mutable_hidden_states()->mutable_data());
    Wire(Ints(DType::kI64, {3, kTopK}, {3, 6, 1, 5, 2, 2}), req.mutable_topk_ids());
    HostTensor w(DType::kBF16, {3, kTopK});
    for (int i = 0; i < 6; ++i) w.data<uint16_t>()[i] = FloatToBf16(0.25f * i);
    Wire(w, req.mutable_topk_weights());
    Wire(Ints(DType::kI64, {3}, {40, 41, 97}), req.mutable_token_indices());
    Wire(Ints(DType::kBool, {3}, {0, 1, 0}), req.mutable_is_padding());
    Wire(Ints(DType::kBool, {3}, {1, 0, 1}), req.mutable_shared_mask());
    out.emplace_back("bf16_padding_indices_shared", req);
  }
  for (bool packed : {true, false}) {
    v1::ForwardRequest req;
    HostTensor q(DType::kE4M3, {3, kHidden});
    HostTensor scales = packed ? HostTensor(DType::kI32, {3, kHidden / 128})
                               : HostTensor(DType::kF32, {3, kHidden / 32});
    Check(packed ? QuantizeMxfp8(x.view(), q.view(), scales.view())
                 : QuantizeMxfp8Fp32Scale(x.view(), q.view(), scales.view()),
          "QuantizeMxfp8");
    req.mutable_hidden_states()->set_format(v1::ACTIVATION_MXFP8);
    Wire(q, req.mutable_hidden_states()->mutable_data());
    Wire(scales, req.mutable_hidden_states()->mutable_scales());
    ModularRoutes(req);
    out.emplace_back(packed ? "mxfp8_packed_scales" : "mxfp8_fp32_scales", req);
  }
  {
    v1::ForwardRequest req;
    HostTensor q(DType::kU8, {3, kHidden / 2});
    HostTensor sf(DType::kI32, {3, kHidden / 64});
    HostTensor ts(DType::kF32, {3});
    Check(QuantizeNvfp4PerToken(x.view(), q.view(), sf.view(), ts.view()), "QuantizeNvfp4");
    v1::HiddenStates* hs = req.mutable_hidden_states();
    hs->set_format(v1::ACTIVATION_NVFP4);
    Wire(q, hs->mutable_data());
    Wire(sf, hs->mutable_scales());
    Wire(ts, hs->mutable_token_scale());
    ModularRoutes(req);
    out.emplace_back("nvfp4", req);
  }
  for (const char* method : {"renormalize", "deepseek_v3"}) {
    v1::ForwardRequest req;
    req.set_return_routing(true);
    req.mutable_hidden_states()->set_format(v1::ACTIVATION_F32);
    Wire(x, req.mutable_hidden_states()->mutable_data());
    Wire(Floats({3, kExperts}, 13), req.mutable_router_logits());
    req.mutable_routing()->set_method(method);
    if (std::string(method) == "deepseek_v3") {
      req.mutable_routing()->set_n_group(4);
      req.mutable_routing()->set_topk_group(2);
      req.mutable_routing()->set_routed_scaling_factor(2.5f);
    }
    out.emplace_back(std::string("monolithic_") + method, req);
  }
  {
    v1::ForwardRequest req;  // no tokens at all
    req.mutable_hidden_states()->set_format(v1::ACTIVATION_F32);
    Wire(HostTensor(DType::kF32, {0, kHidden}), req.mutable_hidden_states()->mutable_data());
    Wire(HostTensor(DType::kI32, {0, kTopK}), req.mutable_topk_ids());
    Wire(HostTensor(DType::kF32, {0, kTopK}), req.mutable_topk_weights());
    out.emplace_back("empty", req);
  }
  return out;
}

void ForwardSeeds(const std::string& dir) {
  const ServedModel model = FuzzModel();
  for (const auto& [name, req] : Requests()) {
    for (const ShardPlacement* placement : Placements().all()) {
      absl::StatusOr<StagedRequest> staged = StageForwardRequest(req, model, *placement);
      Check(staged.status(), "seed " + name + " does not stage");
    }
    Save(dir, "forward_request", name, req.SerializeAsString());
  }
}

// transport_frames: each forward seed as a ForwardRaw frame (cut into three slices), as a
// stream of two TCP channel request frames, and a TCP response stream (an answer, then an
// error frame). Their first byte picks the framing (transport_frames_fuzzer.cc).
std::string TcpPrefix(uint32_t word, uint32_t header_len, uint64_t payload_len) {
  uint8_t raw[kTcpPrefixBytes];
  EncodeTcpPrefix({word, header_len, payload_len}, raw);
  return std::string(reinterpret_cast<const char*>(raw), sizeof(raw));
}

void TransportSeeds(const std::string& dir) {
  const ServedModel model = FuzzModel();
  for (const auto& [name, full] : Requests()) {
    v1::ForwardRequest header = full;
    const std::string payload = header.hidden_states().data().data();
    header.mutable_hidden_states()->mutable_data()->clear_data();
    for (const ShardPlacement* placement : Placements().all()) {
      Check(StageForwardRequest(header, model, *placement, payload).status(),
            "seed " + name + " does not stage with its payload apart");
    }
    const std::string head = header.SerializeAsString();
    std::string len(4, '\0');
    for (int i = 0; i < 4; ++i) len[i] = static_cast<char>(head.size() >> (8 * i));
    const std::string raw = len + head + payload;
    Save(dir, "transport_frames", "raw_" + name,
         std::string(1, '\0') + static_cast<char>(3) + static_cast<char>(raw.size() / 2) + raw);
    const std::string frame = TcpPrefix(kTcpRequestMagic, static_cast<uint32_t>(head.size()),
                                        payload.size()) + head + payload;
    Save(dir, "transport_frames", "tcp_request_" + name, std::string(1, '\1') + frame + frame);
  }
  v1::ForwardResponse answer;
  auto* out = answer.mutable_output();
  out->set_dtype(v1::F32);
  out->add_shape(2);
  out->add_shape(kHidden);
  const std::string head = answer.SerializeAsString();
  const std::string message = "layer 7 outside [0, 2)";
  Save(dir, "transport_frames", "tcp_response",
       std::string(1, '\2') + TcpPrefix(0, static_cast<uint32_t>(head.size()), 2 * kHidden * 4) +
           head + std::string(2 * kHidden * 4, '\x3f') +
           TcpPrefix(static_cast<uint32_t>(absl::StatusCode::kInvalidArgument),
                     static_cast<uint32_t>(message.size()), 0) +
           message);
}

// Provider-driven targets: a few byte patterns; the fuzzers' own mutations do the rest.
void ByteSeeds(const std::string& dir, const std::string& target) {
  Save(dir, target, "zeros", std::string(256, '\0'));
  Save(dir, target, "ones", std::string(256, '\xff'));
  std::mt19937 rng(5);
  for (int n = 0; n < 4; ++n) {
    std::string bytes(512, '\0');
    for (char& c : bytes) c = static_cast<char>(rng());
    Save(dir, target, "random" + std::to_string(n), bytes);
  }
}

void SafetensorsSeeds(const std::string& dir, const std::string& tmp) {
  model::SafetensorsWriter writer;
  const model::SafetensorsDType dtypes[] = {
      model::SafetensorsDType::kU8,   model::SafetensorsDType::kI8,
      model::SafetensorsDType::kBF16, model::SafetensorsDType::kF16,
      model::SafetensorsDType::kF32,  model::SafetensorsDType::kF8E4M3,
      model::SafetensorsDType::kI32,  model::SafetensorsDType::kI64,
      model::SafetensorsDType::kBool};
  for (model::SafetensorsDType d : dtypes) {
    const int64_t size = model::SafetensorsDTypeSize(d);
    std::vector<uint8_t> bytes(static_cast<size_t>(2 * 3 * size));
    for (size_t i = 0; i < bytes.size(); ++i) bytes[i] = static_cast<uint8_t>(i * 7 + 1);
    Check(writer.Add(std::string(model::SafetensorsDTypeName(d)), d, {2, 3}, bytes), "Add");
  }
  Check(writer.Add("empty", model::SafetensorsDType::kF32, {0, 4}, {}), "Add empty");
  Check(writer.Add("scalar", model::SafetensorsDType::kI64, {}, std::vector<uint8_t>(8, 3)),
        "Add scalar");
  Check(writer.Write(tmp + "/every_dtype.safetensors"), "Write");
  Save(dir, "safetensors", "every_dtype", ReadAll(tmp + "/every_dtype.safetensors"));
}

// Tiny generated checkpoints: their config texts seed model_config, their weights safetensors.
void ModelSeeds(const std::string& dir, const std::string& tmp) {
  struct Variant {
    const char* name;
    model::GenerateOptions options;
  };
  std::vector<Variant> variants(3);
  variants[0] = {"gpt_oss_mxfp4", {}};
  variants[1] = {"modelopt_nvfp4", {}};
  variants[1].options.format = WeightFormat::kNvfp4;
  variants[2] = {"deepseek_nvfp4_shared", variants[1].options};
  variants[2].options.n_shared_experts = 1;
  variants[2].options.n_group = 2;
  variants[2].options.topk_group = 1;
  for (Variant& v : variants) {
    v.options.layers = 1;
    v.options.experts = 2;
    v.options.top_k = 1;
    v.options.hidden = 64;
    v.options.intermediate = 32;
    const std::string model_dir = tmp + "/" + v.name;
    Check(model::GenerateModel(v.options, model_dir), std::string("GenerateModel ") + v.name);
    std::string config = ReadAll(model_dir + "/config.json");
    if (v.options.format == WeightFormat::kNvfp4) {
      config += "\n#hf_quant_config.json\n" + ReadAll(model_dir + "/hf_quant_config.json");
    }
    Save(dir, "model_config", v.name, config);
    Save(dir, "safetensors", v.name, ReadAll(model_dir + "/model.safetensors"));
  }
}

}  // namespace
}  // namespace moe::fuzz

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s <corpus dir>\n", argv[0]);
    return 2;
  }
  const std::string dir = argv[1];
  char tmp_template[] = "/tmp/make_seeds.XXXXXX";
  const char* tmp = mkdtemp(tmp_template);
  if (tmp == nullptr) moe::fuzz::Die("mkdtemp failed");
  for (const char* target :
       {"forward_request", "forward_structured", "safetensors", "model_config", "wire_staging",
        "transport_frames"}) {
    std::error_code error;
    std::filesystem::create_directories(dir + "/" + target, error);
    if (error) moe::fuzz::Die("cannot create " + dir + ": " + error.message());
  }
  moe::fuzz::ForwardSeeds(dir);
  moe::fuzz::TransportSeeds(dir);
  moe::fuzz::ByteSeeds(dir, "forward_structured");
  moe::fuzz::ByteSeeds(dir, "wire_staging");
  moe::fuzz::SafetensorsSeeds(dir, tmp);
  moe::fuzz::ModelSeeds(dir, tmp);
  std::filesystem::remove_all(tmp);
  return 0;
}
