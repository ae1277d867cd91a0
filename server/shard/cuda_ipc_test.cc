// ForwardCuda across two processes on one GPU machine: this test starts an in-process shard (CPU
// backend: ForwardCuda staged through host memory; then CUDA backend: the hidden states and
// output stay on the GPU) and re-executes itself as a client process that puts BF16 hidden
// states in its own device memory, shares them and an output buffer through CUDA IPC handles,
// calls ForwardCuda, and compares the output (copied back from its device buffer) byte for byte
// with a protobuf Forward of the same request. The client also sends a handle of the wrong size, a garbage
// handle and ranges beyond its allocations (each INVALID_ARGUMENT), a wrong output length, and
// checks the shard still answers afterwards. Needs a GPU (tag "gpu"): skipped without one.
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include <cuda_runtime_api.h>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "kernels/cuda/cuda_backend.h"
#include "kernels/cuda/device.h"
#include "moe/v1/shard.grpc.pb.h"
#include "moe/v1/shm.grpc.pb.h"
#include "server/model/generator.h"
#include "server/shard/in_process_shard.h"

extern char** environ;

namespace moe {
namespace {

constexpr int64_t kHidden = 256;
constexpr int64_t kTokens = 7;

std::unique_ptr<grpc::ClientContext> Context() {
  auto ctx = std::make_unique<grpc::ClientContext>();
  ctx->set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(60)));
  return ctx;
}

// The request header (no hidden bytes) and the BF16 hidden-state bytes.
v1::ForwardRequest Header(std::string* payload) {
  v1::ForwardRequest req;
  req.set_layer(1);
  req.set_output_dtype(v1::BF16);
  v1::HiddenStates* hs = req.mutable_hidden_states();
  hs->set_format(v1::ACTIVATION_BF16);
  hs->mutable_data()->set_dtype(v1::BF16);
  hs->mutable_data()->add_shape(kTokens);
  hs->mutable_data()->add_shape(kHidden);
  payload->resize(kTokens * kHidden * 2);
  for (size_t i = 0; i < payload->size(); i += 2) {
    (*payload)[i] = static_cast<char>(i * 29);
    (*payload)[i + 1] = static_cast<char>(i % 10 == 0 ? 0xbe : 0x3e);
  }
  std::vector<int32_t> ids;
  std::vector<float> w;
  for (int t = 0; t < kTokens; ++t) {
    ids.insert(ids.end(), {t % 8, (t + 3) % 8});
    w.insert(w.end(), {0.6f, 0.4f});
  }
  req.mutable_topk_ids()->set_dtype(v1::I32);
  req.mutable_topk_weights()->set_dtype(v1::F32);
  for (v1::Tensor* t : {req.mutable_topk_ids(), req.mutable_topk_weights()}) {
    t->add_shape(kTokens);
    t->add_shape(2);
  }
  req.mutable_topk_ids()->set_data(ids.data(), ids.size() * 4);
  req.mutable_topk_weights()->set_data(w.data(), w.size() * 4);
  return req;
}

#define CLIENT_CHECK(cond, ...)                                        \
  do {                                                                 \
    if (!(cond)) {                                                     \
      std::fprintf(stderr, "client: %s: %s\n", #cond,                 \
                   absl::StrCat(__VA_ARGS__).c_str());                 \
      return 1;                                                        \
    }                                                                  \
  } while (0)

// The client process: returns its exit status.
int RunClient(const std::string& address) {
  auto channel = grpc::CreateChannel(address, grpc::InsecureChannelCredentials());
  auto stub = v1::ExpertShard::NewStub(channel);
  auto shm_stub = v1::SharedMemoryShard::NewStub(channel);
  std::string payload;
  const v1::ForwardRequest header = Header(&payload);
  v1::ForwardRequest full = header;
  full.mutable_hidden_states()->mutable_data()->set_data(payload);
  v1::ForwardResponse expected;
  grpc::Status g = stub->Forward(Context().get(), full, &expected);
  CLIENT_CHECK(g.ok(), g.error_message());
  const size_t out_bytes = expected.output().data().size();
  CLIENT_CHECK(out_bytes == kTokens * kHidden * 2, out_bytes);

  // Device buffers: hidden states at offset 256 of one allocation, output at 512 of another.
  char *d_in = nullptr, *d_out = nullptr;
  CLIENT_CHECK(cudaMalloc(reinterpret_cast<void**>(&d_in), 256 + payload.size()) == cudaSuccess, "cudaMalloc");
  CLIENT_CHECK(cudaMalloc(reinterpret_cast<void**>(&d_out), 512 + out_bytes) == cudaSuccess, "cudaMalloc");
  CLIENT_CHECK(cudaMemcpy(d_in + 256, payload.data(), payload.size(), cudaMemcpyHostToDevice) ==
                   cudaSuccess,
               "H2D");
  CLIENT_CHECK(cudaMemset(d_out, 0xFF, 512 + out_bytes) == cudaSuccess, "poison");
  // The frontend's writes must be complete before the shard (another context) reads or writes.
  CLIENT_CHECK(cudaDeviceSynchronize() == cudaSuccess, "sync");
  cudaIpcMemHandle_t h_in, h_out;
  CLIENT_CHECK(cudaIpcGetMemHandle(&h_in, d_in) == cudaSuccess, "handle");
  CLIENT_CHECK(cudaIpcGetMemHandle(&h_out, d_out) == cudaSuccess, "handle");
  v1::CudaForwardRequest req;
  *req.mutable_request() = header;
  req.mutable_hidden_states()->set_handle(&h_in, sizeof(h_in));
  req.mutable_hidden_states()->set_offset(256);
  req.mutable_hidden_states()->set_length(payload.size());
  req.mutable_output()->set_handle(&h_out, sizeof(h_out));
  req.mutable_output()->set_offset(512);
  req.mutable_output()->set_length(out_bytes);

  const auto call = [&](const v1::CudaForwardRequest& r) {
    v1::ForwardResponse resp;
    return shm_stub->ForwardCuda(Context().get(), r, &resp);
  };
  const auto check_output = [&]() -> int {
    std::string got(out_bytes, '\0');
    CLIENT_CHECK(cudaMemcpy(got.data(), d_out + 512, out_bytes, cudaMemcpyDeviceToHost) ==
                     cudaSuccess,
                 "D2H");
    CLIENT_CHECK(got == expected.output().data(), "ForwardCuda output differs from Forward");
    return 0;
  };
  for (int i = 0; i < 20; ++i) {
    g = call(req);
    CLIENT_CHECK(g.ok(), "call ", i, ": ", g.error_message());
    if (int rc = check_output(); rc != 0) return rc;
  }
  // Hidden states at an odd offset (BF16 read from there would be misaligned): served through
  // host memory, which realigns them; then the payload goes back to offset 256.
  {
    CLIENT_CHECK(cudaMemcpy(d_in + 1, payload.data(), payload.size(), cudaMemcpyHostToDevice) ==
                     cudaSuccess,
                 "H2D");
    CLIENT_CHECK(cudaDeviceSynchronize() == cudaSuccess, "sync");
    v1::CudaForwardRequest odd = req;
    odd.mutable_hidden_states()->set_offset(1);
    g = call(odd);
    CLIENT_CHECK(g.ok(), "odd offset: ", g.error_message());
    if (int rc = check_output(); rc != 0) return rc;
    CLIENT_CHECK(cudaMemcpy(d_in + 256, payload.data(), payload.size(), cudaMemcpyHostToDevice) ==
                     cudaSuccess,
                 "H2D");
    CLIENT_CHECK(cudaDeviceSynchronize() == cudaSuccess, "sync");
  }
  // Misuse, each followed by a good call.
  struct Bad {
    const char* what;
    v1::CudaForwardRequest req;
    grpc::StatusCode code;
    std::string message;
  };
  std::vector<Bad> bad;
  bad.push_back({"short handle", req, grpc::StatusCode::INVALID_ARGUMENT,
                 "hidden_states.handle: 10 bytes, a CUDA IPC handle has 64"});
  bad.back().req.mutable_hidden_states()->set_handle(std::string(10, 'x'));
  bad.push_back({"garbage handle", req, grpc::StatusCode::INVALID_ARGUMENT, ""});
  bad.back().req.mutable_output()->set_handle(std::string(64, '\x5a'));
  bad.push_back({"range past the allocation", req, grpc::StatusCode::INVALID_ARGUMENT,
                 absl::StrCat("hidden_states: offset 257 + length ", payload.size(),
                              " exceeds the shared allocation of ")});
  bad.back().req.mutable_hidden_states()->set_offset(257);
  bad.push_back({"wrapping range", req, grpc::StatusCode::INVALID_ARGUMENT,
                 absl::StrCat("output: offset ", ~uint64_t{0} - 7, " + length ", out_bytes,
                              " exceeds the shared allocation of ")});
  bad.back().req.mutable_output()->set_offset(~uint64_t{0} - 7);
  bad.push_back({"huge length", req, grpc::StatusCode::RESOURCE_EXHAUSTED,
                 "output: length 18446744073709551612 exceeds the 1073741824-byte limit"});
  bad.back().req.mutable_output()->set_offset(8);
  bad.back().req.mutable_output()->set_length(~uint64_t{0} - 3);
  bad.push_back({"output length", req, grpc::StatusCode::INVALID_ARGUMENT,
                 absl::StrCat("output: range of ", out_bytes - 2, " bytes, the output has ",
                              out_bytes)});
  bad.back().req.mutable_output()->set_length(out_bytes - 2);
  bad.push_back({"payload in the message", req, grpc::StatusCode::INVALID_ARGUMENT,
                 "request.hidden_states.data.data: must be empty"});
  bad.back().req.mutable_request()->mutable_hidden_states()->mutable_data()->set_data("ab");
  for (const Bad& b : bad) {
    g = call(b.req);
    CLIENT_CHECK(g.error_code() == b.code, b.what, ": got ", static_cast<int>(g.error_code()),
                 " ", g.error_message());
    CLIENT_CHECK(g.error_message().rfind(b.message, 0) == 0, b.what, ": message '",
                 g.error_message(), "'");
    std::fprintf(stderr, "client: %s -> %s\n", b.what, g.error_message().c_str());
    CLIENT_CHECK(cudaMemset(d_out, 0xFF, 512 + out_bytes) == cudaSuccess, "poison");
    CLIENT_CHECK(cudaDeviceSynchronize() == cudaSuccess, "sync");
    g = call(req);
    CLIENT_CHECK(g.ok(), "good call after ", b.what, ": ", g.error_message());
    if (int rc = check_output(); rc != 0) return rc;
  }
  cudaFree(d_in);
  cudaFree(d_out);
  std::fprintf(stderr,
               "client: 20 ForwardCuda calls and one at an odd offset equal Forward; %zu misuses "
               "refused\n",
               bad.size());
  return 0;
}

TEST(CudaIpcTest, SecondProcessForwardsDeviceTensors) {
  std::string why;
  if (cuda::DeviceCount(&why) == 0) GTEST_SKIP() << why;
  const std::string dir = absl::StrCat(std::getenv("TEST_TMPDIR") ? std::getenv("TEST_TMPDIR")
                                                                  : "/tmp",
                                       "/cuda_ipc_model_", getpid());
  model::GenerateOptions gen;
  gen.hidden = kHidden;
  ASSERT_TRUE(model::GenerateModel(gen, dir).ok());
  for (const char* backend : {"cpu", "cuda"}) {
    InProcessShardOptions options;
    options.model_dir = dir;
    options.backend = backend;
    absl::StatusOr<std::unique_ptr<InProcessShard>> shard = InProcessShard::Start(options);
    ASSERT_TRUE(shard.ok()) << shard.status();
    const std::string arg = absl::StrCat("--ipc_client=", (*shard)->address());
    char* argv[] = {const_cast<char*>("/proc/self/exe"), const_cast<char*>(arg.c_str()), nullptr};
    pid_t pid = 0;
    ASSERT_EQ(posix_spawn(&pid, "/proc/self/exe", nullptr, nullptr, argv, environ), 0);
    int status = 0;
    ASSERT_EQ(waitpid(pid, &status, 0), pid);
    ASSERT_TRUE(WIFEXITED(status));
    EXPECT_EQ(WEXITSTATUS(status), 0)
        << backend << " backend: the client process failed (its stderr says why)";
    // The CUDA backend ran every good ForwardCuda (20, and one after each of 7 misuses; not the
    // odd offset's, staged) on the client's device memory, in place (offsets 256 and 512 of
    // allocations on its device); the CPU backend has no such counters (all zero).
    const CudaBackendCounters n = GetCudaBackendCounters((*shard)->backend());
    const int64_t want = std::string(backend) == "cuda" ? 27 : 0;
    EXPECT_EQ(n.device_tensor_runs, want) << backend;
    EXPECT_EQ(n.in_place_runs, want) << backend;
    std::fprintf(stderr, "%s backend: %lld ForwardCuda runs on device tensors, %lld in place\n",
                 backend, static_cast<long long>(n.device_tensor_runs),
                 static_cast<long long>(n.in_place_runs));
  }
}

}  // namespace
}  // namespace moe

int main(int argc, char** argv) {
  if (argc == 2 && std::strncmp(argv[1], "--ipc_client=", 13) == 0) {
    return moe::RunClient(argv[1] + 13);
  }
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
