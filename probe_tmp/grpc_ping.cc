#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>
#include <future>
#include "grpcpp/grpcpp.h"
#include "moe/v1/shard.grpc.pb.h"

using namespace moe;
class SyncSvc final : public v1::ExpertShard::Service {
  grpc::Status GetInfo(grpc::ServerContext*, const v1::GetInfoRequest*, v1::ShardInfo* i) override {
    i->set_num_layers(1); return grpc::Status::OK; }
};
class CbSvc final : public v1::ExpertShard::CallbackService {
  grpc::ServerUnaryReactor* GetInfo(grpc::CallbackServerContext* ctx, const v1::GetInfoRequest*, v1::ShardInfo* i) override {
    i->set_num_layers(1); auto* r = ctx->DefaultReactor(); r->Finish(grpc::Status::OK); return r; }
};
double Run(const std::string& addr, bool cb_client, double secs) {
  grpc::ChannelArguments args;
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  auto ch = grpc::CreateCustomChannel(addr, grpc::InsecureChannelCredentials(), args);
  auto stub = v1::ExpertShard::NewStub(ch);
  std::vector<double> us;
  auto stop = std::chrono::steady_clock::now() + std::chrono::duration<double>(secs);
  for (int i = 0; std::chrono::steady_clock::now() < stop || i < 100; ++i) {
    auto t0 = std::chrono::steady_clock::now();
    grpc::ClientContext ctx; v1::ShardInfo info;
    if (cb_client) {
      std::promise<grpc::Status> p;
      stub->async()->GetInfo(&ctx, new v1::GetInfoRequest(), &info, [&](grpc::Status s) { p.set_value(s); });
      p.get_future().get();
    } else {
      grpc::Status s = stub->GetInfo(&ctx, v1::GetInfoRequest(), &info);
      if (!s.ok()) { std::fprintf(stderr, "err %s\n", s.error_message().c_str()); exit(1); }
    }
    if (i >= 100) us.push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count());
  }
  std::nth_element(us.begin(), us.begin() + us.size() / 2, us.end());
  return us[us.size() / 2];
}
int main(int argc, char** argv) {
  double secs = argc > 1 ? atof(argv[1]) : 1;
  for (int mode = 0; mode < 4; ++mode) {
    SyncSvc sync; CbSvc cb;
    grpc::ServerBuilder b; int port = 0;
    b.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    if (mode == 2) { b.SetSyncServerOption(grpc::ServerBuilder::SyncServerOption::NUM_CQS, 1);
                     b.SetSyncServerOption(grpc::ServerBuilder::SyncServerOption::MIN_POLLERS, 1);
                     b.SetSyncServerOption(grpc::ServerBuilder::SyncServerOption::MAX_POLLERS, 2); }
    if (mode == 1 || mode == 3) b.RegisterService(&cb); else b.RegisterService(&sync);
    auto server = b.BuildAndStart();
    std::string addr = "127.0.0.1:" + std::to_string(port);
    double p50 = Run(addr, mode == 3, secs);
    const char* names[] = {"sync server, sync client", "callback server, sync client", "sync server 1 cq 1-2 pollers, sync client", "callback server, callback client"};
    std::printf("%-45s p50 %.1f us\n", names[mode], p50);
    server->Shutdown();
  }
}
