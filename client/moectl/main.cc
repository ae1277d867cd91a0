// moectl: the operator's and developer's command line for moe-serve.
#include <fstream>
#include <iostream>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "client/client.h"
#include "client/moectl/admin.h"
#include "client/moectl/heatmap.h"
#include "client/moectl/tables.h"
#include "client/moectl/workload.h"
#include "grpcpp/grpcpp.h"
#include "kernels/activation.h"
#include "server/common/security_flags.h"
#include "server/common/status.h"
#include "server/model/generator.h"

ABSL_FLAG(std::string, coordinator, "127.0.0.1:50051", "coordinator host:port");
ABSL_FLAG(std::string, shard, "", "shard host:port (info)");
ABSL_FLAG(std::string, model, "", "checkpoint directory (workload, forward --verify)");
ABSL_FLAG(std::string, out, "", "gen-model: output directory");
ABSL_FLAG(std::string, format, "mxfp4", "gen-model: mxfp4 (gpt-oss layout) | nvfp4 (ModelOpt)");
ABSL_FLAG(int64_t, layers, 4, "gen-model: MoE layers");
ABSL_FLAG(int64_t, experts, 16, "gen-model: routed experts per layer");
ABSL_FLAG(int64_t, top_k, 4, "gen-model: experts per token");
ABSL_FLAG(int64_t, hidden, 512, "gen-model: hidden size H");
ABSL_FLAG(int64_t, intermediate, 256, "gen-model: expert intermediate size I");
ABSL_FLAG(int64_t, files, 2, "gen-model: safetensors files (more than 1 writes an index)");
ABSL_FLAG(std::string, activation, "", "gen-model: activation override (silu, swigluoai, ...)");
ABSL_FLAG(int64_t, shared_experts, 0, "gen-model: shared experts (nvfp4 only)");
ABSL_FLAG(uint64_t, seed, 1, "random seed (gen-model, forward, workload)");
ABSL_FLAG(int, steps, 200, "workload: forwards in total");
ABSL_FLAG(int, tokens, 16, "workload/forward: tokens per forward");
ABSL_FLAG(int, clients, 2, "workload: concurrent client threads");
ABSL_FLAG(double, skew, 1.2, "workload: Zipf-like routing skew (0 = the router's own)");
ABSL_FLAG(int, layer, 0, "forward: layer");
ABSL_FLAG(bool, watch_map, true,
          "workload: keep the cluster map current with a WatchClusterMap stream (false: refresh "
          "it only when a shard answers that the map is stale)");
ABSL_FLAG(bool, verify, true,
          "workload: check every output against the CPU reference (false: for timing, calls "
          "back to back; load counts are still compared)");
ABSL_FLAG(std::string, transport, "auto",
          "workload/forward: auto (direct TCP channels where the shards serve them and the calls "
          "are not TLS-encrypted anyway, ForwardRaw elsewhere) | raw (ForwardRaw frames) | proto "
          "(protobuf Forward) | tcp (TCP channels wherever the shards serve them: moe_shard "
          "--tcp_channel; raw elsewhere)");
ABSL_FLAG(bool, refresh, true, "load: collect the shards' pending load first");
ABSL_FLAG(bool, dry_run, false, "rebalance: plan and report only");
ABSL_FLAG(double, min_gain, 0.0,
          "rebalance: re-place a layer only when its predicted balancedness gains this much");
ABSL_FLAG(double, window_seconds, 0, "rebalance: load window to plan with (0: the coordinator's)");
ABSL_FLAG(bool, wait, true, "rebalance/drain: wait until the new map version is committed");
ABSL_FLAG(int, timeout_seconds, 120, "rebalance/drain: how long to wait for the coordinator");
ABSL_FLAG(std::string, shard_id, "", "drain: the shard to drain (see `moectl map`)");
ABSL_FLAG(bool, heatmap, false, "load: print a layers x experts heatmap instead of the table");
ABSL_FLAG(int, heatmap_width, 0,
          "load --heatmap: fold experts so a row fits this many characters (0: one per expert)");
ABSL_FLAG(std::string, heatmap_svg, "", "load: also write the heatmap as an SVG file here");

namespace moe {
namespace {

constexpr char kUsage[] =
    "moectl COMMAND [--flags]\n\n"
    "Commands:\n"
    "  gen-model --out DIR [--format mxfp4|nvfp4 --layers --experts --top_k --hidden\n"
    "            --intermediate --files --activation --shared_experts --seed]\n"
    "                      write a synthetic checkpoint (gpt-oss MXFP4 or ModelOpt NVFP4 layout)\n"
    "  map       [--coordinator]            show the cluster map\n"
    "  load      [--coordinator --heatmap --heatmap_width N --heatmap_svg FILE]\n"
    "                      per-layer expert-load table, or a layers x experts heatmap\n"
    "  info      --shard HOST:PORT          describe one shard\n"
    "  rebalance [--coordinator --dry_run --min_gain --window_seconds --wait]\n"
    "                      EPLB plan from the load window: report it, or switch to it live\n"
    "  drain     --shard_id ID [--coordinator --wait]\n"
    "                      move a shard's slots to the others (two-phase), then stop it\n"
    "  forward   [--coordinator --layer --tokens --seed --transport auto|raw|proto|tcp]\n"
    "                      send one random routed batch through the cluster, print a summary\n"
    "  workload  --model DIR [--coordinator --steps --tokens --clients --skew --seed\n"
    "            --transport auto|raw|proto|tcp --verify --watch_map]\n"
    "                      routed forwards over all layers, verified against the CPU reference\n";

// --transport into the ForwardOptions fields it sets.
absl::Status ParseTransport(bool* raw, TcpChannelUse* tcp) {
  const std::string t = absl::GetFlag(FLAGS_transport);
  if (t != "auto" && t != "raw" && t != "proto" && t != "tcp") {
    return absl::InvalidArgumentError(
        absl::StrCat("--transport: '", t, "' is not auto, raw, proto or tcp"));
  }
  *raw = t != "proto";
  *tcp = t == "tcp"    ? TcpChannelUse::kAlways
         : t == "auto" ? TcpChannelUse::kAuto
                       : TcpChannelUse::kNever;
  return absl::OkStatus();
}

int Fail(const absl::Status& s) {
  std::cerr << "moectl: " << s << "\n";
  return 1;
}

int GenModel() {
  model::GenerateOptions g;
  const std::string format = absl::GetFlag(FLAGS_format);
  if (format != "mxfp4" && format != "nvfp4") {
    return Fail(absl::InvalidArgumentError("--format must be mxfp4 or nvfp4"));
  }
  g.format = format == "mxfp4" ? WeightFormat::kMxfp4 : WeightFormat::kNvfp4;
  g.layers = absl::GetFlag(FLAGS_layers);
  g.experts = absl::GetFlag(FLAGS_experts);
  g.top_k = absl::GetFlag(FLAGS_top_k);
  g.hidden = absl::GetFlag(FLAGS_hidden);
  g.intermediate = absl::GetFlag(FLAGS_intermediate);
  g.files = absl::GetFlag(FLAGS_files);
  g.seed = absl::GetFlag(FLAGS_seed);
  g.activation = absl::GetFlag(FLAGS_activation);
  g.n_shared_experts = absl::GetFlag(FLAGS_shared_experts);
  const std::string dir = absl::GetFlag(FLAGS_out);
  if (dir.empty()) return Fail(absl::InvalidArgumentError("gen-model needs --out DIR"));
  if (absl::Status s = model::GenerateModel(g, dir); !s.ok()) return Fail(s);
  std::cout << "wrote " << format << " model to " << dir << ": " << g.layers << " layers, "
            << g.experts << " experts, top-" << g.top_k << ", H=" << g.hidden
            << ", I=" << g.intermediate << "\n";
  return 0;
}

absl::StatusOr<std::unique_ptr<MoeClient>> Connect() {
  ClientOptions o;
  o.coordinator = absl::GetFlag(FLAGS_coordinator);
  o.watch_map = false;
  return MoeClient::Connect(o, absl::Seconds(10));
}

int Map() {
  absl::StatusOr<std::unique_ptr<MoeClient>> c = Connect();
  if (!c.ok()) return Fail(c.status());
  std::cout << FormatClusterMap((*c)->cluster_map());
  return 0;
}

int Load() {
  absl::StatusOr<std::unique_ptr<MoeClient>> c = Connect();
  if (!c.ok()) return Fail(c.status());
  absl::StatusOr<v1::LoadStats> stats = (*c)->GetLoadStats(absl::GetFlag(FLAGS_refresh));
  if (!stats.ok()) return Fail(stats.status());
  const HeatmapGrid grid = GridFromLoadStats(*stats);
  if (absl::GetFlag(FLAGS_heatmap)) {
    std::cout << RenderTerminalHeatmap(grid, {.max_width = absl::GetFlag(FLAGS_heatmap_width)});
  } else {
    std::cout << FormatLoadTable(*stats);
  }
  const std::string svg_path = absl::GetFlag(FLAGS_heatmap_svg);
  if (!svg_path.empty()) {
    const std::string title = absl::StrCat("expert load, map version ", stats->map_version(), ", ",
                                           stats->total_routes(), " routes");
    std::ofstream out(svg_path, std::ios::binary | std::ios::trunc);
    out << RenderSvgHeatmap(grid, {.title = title});
    out.close();
    if (!out) return Fail(absl::UnavailableError(absl::StrCat("cannot write ", svg_path)));
    std::cerr << "wrote " << svg_path << "\n";
  }
  return 0;
}

int Info() {
  const std::string addr = absl::GetFlag(FLAGS_shard);
  if (addr.empty()) return Fail(absl::InvalidArgumentError("info needs --shard HOST:PORT"));
  auto stub = v1::ExpertShard::NewStub(MakeChannel(addr));
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(5)));
  v1::ShardInfo info;
  grpc::Status s = stub->GetInfo(&ctx, v1::GetInfoRequest(), &info);
  if (!s.ok()) return Fail(FromGrpcStatus(s));
  std::cout << FormatShardInfo(info);
  return 0;
}

int Forward() {
  ForwardOptions fo;
  if (absl::Status s = ParseTransport(&fo.raw_transport, &fo.tcp_channel); !s.ok()) return Fail(s);
  absl::StatusOr<std::unique_ptr<MoeClient>> c = Connect();
  if (!c.ok()) return Fail(c.status());
  const v1::ClusterMap map = (*c)->cluster_map();
  const int64_t t_count = absl::GetFlag(FLAGS_tokens), h = map.model().hidden_size();
  const int64_t e = map.model().num_experts(), k = map.model().top_k();
  std::mt19937_64 rng(absl::GetFlag(FLAGS_seed));
  std::normal_distribution<float> normal;
  HostTensor x(DType::kF32, {t_count, h}), logits(DType::kF32, {t_count, e}), ids, weights;
  for (int64_t i = 0; i < x.NumElements(); ++i) x.data<float>()[i] = normal(rng);
  for (int64_t i = 0; i < logits.NumElements(); ++i) logits.data<float>()[i] = normal(rng);
  RoutingParams rp;
  rp.method = RoutingMethod::kRenormalize;
  rp.top_k = static_cast<int32_t>(k);
  if (absl::Status s = MoeClient::RouteLogits(rp, logits.view(), ids, weights); !s.ok()) {
    return Fail(s);
  }
  const absl::Time start = absl::Now();
  absl::StatusOr<ForwardResult> r =
      (*c)->Forward(absl::GetFlag(FLAGS_layer), x.view(), ids.view(), weights.view(), fo);
  if (!r.ok()) return Fail(r.status());
  double norm = 0;
  for (int64_t i = 0; i < r->output.NumElements(); ++i) {
    norm += static_cast<double>(r->output.data<float>()[i]) * r->output.data<float>()[i];
  }
  std::cout << "forward layer " << absl::GetFlag(FLAGS_layer) << ": " << t_count << " tokens, "
            << r->shards_called << " shards, map version " << r->map_version << ", "
            << absl::ToDoubleMicroseconds(absl::Now() - start) << " us, output L2 norm "
            << std::sqrt(norm) << "\n";
  return 0;
}

int Workload() {
  WorkloadOptions o;
  o.coordinator = absl::GetFlag(FLAGS_coordinator);
  o.model_dir = absl::GetFlag(FLAGS_model);
  o.steps = absl::GetFlag(FLAGS_steps);
  o.tokens = absl::GetFlag(FLAGS_tokens);
  o.clients = absl::GetFlag(FLAGS_clients);
  o.skew = absl::GetFlag(FLAGS_skew);
  o.seed = absl::GetFlag(FLAGS_seed);
  o.verify = absl::GetFlag(FLAGS_verify);
  o.watch_map = absl::GetFlag(FLAGS_watch_map);
  if (o.model_dir.empty()) return Fail(absl::InvalidArgumentError("workload needs --model DIR"));
  if (absl::Status s = ParseTransport(&o.raw_transport, &o.tcp_channel); !s.ok()) return Fail(s);
  absl::StatusOr<WorkloadReport> r = RunWorkload(o, std::cout);
  if (!r.ok()) return Fail(r.status());
  return 0;
}

int Rebalance() {
  v1::RebalanceRequest request;
  request.set_dry_run(absl::GetFlag(FLAGS_dry_run));
  request.set_min_gain(absl::GetFlag(FLAGS_min_gain));
  request.set_window_seconds(absl::GetFlag(FLAGS_window_seconds));
  request.set_wait(absl::GetFlag(FLAGS_wait));
  absl::Status s = RunRebalance(absl::GetFlag(FLAGS_coordinator), request,
                                absl::Seconds(absl::GetFlag(FLAGS_timeout_seconds)), std::cout);
  return s.ok() ? 0 : Fail(s);
}

int Drain() {
  v1::DrainRequest request;
  request.set_shard_id(absl::GetFlag(FLAGS_shard_id));
  if (request.shard_id().empty()) {
    return Fail(absl::InvalidArgumentError("drain needs --shard_id (see `moectl map`)"));
  }
  request.set_wait(absl::GetFlag(FLAGS_wait));
  absl::Status s = RunDrain(absl::GetFlag(FLAGS_coordinator), request,
                            absl::Seconds(absl::GetFlag(FLAGS_timeout_seconds)), std::cout);
  return s.ok() ? 0 : Fail(s);
}

}  // namespace
}  // namespace moe

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(moe::kUsage);
  std::vector<char*> args = absl::ParseCommandLine(argc, argv);
  if (args.size() != 2) {
    std::cerr << moe::kUsage;
    return 2;
  }
  const std::string cmd = args[1];
  // --tls_ca/--tls_cert/--tls_key and --auth_token_file apply to every call moectl makes.
  if (absl::Status s = moe::InstallClientSecurityFromFlags(); !s.ok()) {
    std::cerr << "moectl: " << s << "\n";
    return 2;
  }
  if (cmd == "gen-model") return moe::GenModel();
  if (cmd == "map") return moe::Map();
  if (cmd == "load") return moe::Load();
  if (cmd == "info") return moe::Info();
  if (cmd == "forward") return moe::Forward();
  if (cmd == "workload") return moe::Workload();
  if (cmd == "rebalance") return moe::Rebalance();
  if (cmd == "drain") return moe::Drain();
  std::cerr << "moectl: unknown command '" << cmd << "'\n\n" << moe::kUsage;
  return 2;
}
