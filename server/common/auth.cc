#include "server/common/auth.h"

#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/synchronization/mutex.h"
#include "server/common/tls.h"

namespace moe {
namespace {

struct MethodRule {
  const char* method;
  MethodRequirement requirement;
};

// Methods below admin. Everything else (Rebalance, Drain, reflection, new methods) needs admin.
constexpr MethodRule kRules[] = {
    {"/grpc.health.v1.Health/Check", {true, Role::kFrontend}},
    {"/grpc.health.v1.Health/Watch", {true, Role::kFrontend}},
    {"/moe.v1.ExpertShard/Forward", {false, Role::kFrontend}},
    {"/moe.v1.ExpertShard/ForwardStream", {false, Role::kFrontend}},
    {"/moe.v1.ExpertShard/ForwardRaw", {false, Role::kFrontend}},
    {"/moe.v1.ExpertShard/GetInfo", {false, Role::kFrontend}},
    {"/moe.v1.ExpertShard/GetStats", {false, Role::kFrontend}},
    {"/moe.v1.ExpertShard/CollectLoad", {false, Role::kInternal}},
    // The shared-memory data plane (shm.proto): a frontend registers its own segments.
    {"/moe.v1.SharedMemoryShard/RegisterSharedMemory", {false, Role::kFrontend}},
    {"/moe.v1.SharedMemoryShard/UnregisterSharedMemory", {false, Role::kFrontend}},
    {"/moe.v1.SharedMemoryShard/Forward", {false, Role::kFrontend}},
    {"/moe.v1.SharedMemoryShard/OpenChannel", {false, Role::kFrontend}},
    {"/moe.v1.SharedMemoryShard/CloseChannel", {false, Role::kFrontend}},
    {"/moe.v1.SharedMemoryShard/ForwardCuda", {false, Role::kFrontend}},
    // The direct TCP channel (tcp.proto): its ticket carries this call's authorization.
    {"/moe.v1.TcpChannelShard/OpenTcpChannel", {false, Role::kFrontend}},
    {"/moe.v1.Coordinator/GetClusterMap", {false, Role::kFrontend}},
    {"/moe.v1.Coordinator/WatchClusterMap", {false, Role::kFrontend}},
    {"/moe.v1.Coordinator/GetLoadStats", {false, Role::kFrontend}},
    {"/moe.v1.Coordinator/RegisterShard", {false, Role::kInternal}},
    {"/moe.v1.Coordinator/Heartbeat", {false, Role::kInternal}},
};

// The table of the newest TokenAuthProcessor, for CallerIdentity (one server table per process).
absl::Mutex g_identity_mu;
std::shared_ptr<const TokenTable>* const g_identity_tokens ABSL_PT_GUARDED_BY(g_identity_mu) =
    new std::shared_ptr<const TokenTable>();

std::string RefToString(grpc::string_ref ref) { return std::string(ref.data(), ref.size()); }

class BearerTokenInterceptor : public grpc::experimental::Interceptor {
 public:
  explicit BearerTokenInterceptor(const std::string* header) : header_(header) {}
  void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override {
    if (methods->QueryInterceptionHookPoint(
            grpc::experimental::InterceptionHookPoints::PRE_SEND_INITIAL_METADATA)) {
      methods->GetSendInitialMetadata()->insert({"authorization", *header_});
    }
    methods->Proceed();
  }

 private:
  const std::string* header_;  // owned by the factory, which the channel keeps
};

class BearerTokenInterceptorFactory : public grpc::experimental::ClientInterceptorFactoryInterface {
 public:
  explicit BearerTokenInterceptorFactory(std::string token)
      : header_(absl::StrCat("Bearer ", token)) {}
  grpc::experimental::Interceptor* CreateClientInterceptor(
      grpc::experimental::ClientRpcInfo*) override {
    return new BearerTokenInterceptor(&header_);
  }

 private:
  const std::string header_;
};

}  // namespace

absl::StatusOr<Role> ParseRole(absl::string_view name) {
  if (name == "frontend") return Role::kFrontend;
  if (name == "internal") return Role::kInternal;
  if (name == "admin") return Role::kAdmin;
  return absl::InvalidArgumentError(
      absl::StrCat("unknown role '", name, "' (frontend, internal or admin)"));
}

const char* RoleName(Role role) {
  switch (role) {
    case Role::kFrontend:
      return "frontend";
    case Role::kInternal:
      return "internal";
    case Role::kAdmin:
      return "admin";
  }
  return "unknown";
}

MethodRequirement RequirementOf(absl::string_view full_method) {
  for (const MethodRule& rule : kRules) {
    if (full_method == rule.method) return rule.requirement;
  }
  return MethodRequirement{false, Role::kAdmin};
}

absl::StatusOr<TokenTable> TokenTable::Load(const std::string& path) {
  absl::StatusOr<std::string> text = ReadSecretFile(path);
  if (!text.ok()) return text.status();
  absl::StatusOr<TokenTable> table = Parse(*text);
  if (!table.ok()) {
    return absl::Status(table.status().code(), absl::StrCat(path, ": ", table.status().message()));
  }
  return table;
}

absl::StatusOr<TokenTable> TokenTable::Parse(absl::string_view text) {
  TokenTable table;
  int line_number = 0;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    ++line_number;
    line = line.substr(0, line.find('#'));
    std::vector<absl::string_view> fields =
        absl::StrSplit(line, absl::ByAnyChar(" \t\r"), absl::SkipEmpty());
    if (fields.empty()) continue;
    if (fields.size() < 2 || fields.size() > 3) {
      return absl::InvalidArgumentError(
          absl::StrCat("line ", line_number, ": expected 'role token [name]'"));
    }
    absl::StatusOr<Role> role = ParseRole(fields[0]);
    if (!role.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("line ", line_number, ": ", role.status().message()));
    }
    std::string client =
        fields.size() == 3 ? std::string(fields[2]) : absl::StrCat(fields[0], "-line", line_number);
    if (!table.entries_.emplace(std::string(fields[1]), Entry{*role, std::move(client)}).second) {
      return absl::InvalidArgumentError(absl::StrCat("line ", line_number, ": duplicate token"));
    }
  }
  if (table.entries_.empty()) return absl::InvalidArgumentError("no tokens");
  return table;
}

const TokenTable::Entry* TokenTable::Find(absl::string_view token) const {
  auto it = entries_.find(token);
  return it == entries_.end() ? nullptr : &it->second;
}

TokenAuthProcessor::TokenAuthProcessor(TokenTable tokens)
    : tokens_(std::make_shared<const TokenTable>(std::move(tokens))) {
  absl::MutexLock lock(&g_identity_mu);
  *g_identity_tokens = tokens_;
}

grpc::Status TokenAuthProcessor::Process(const InputMetadata& auth_metadata, grpc::AuthContext*,
                                         OutputMetadata*, OutputMetadata*) {
  std::string method;
  if (auto it = auth_metadata.find(":path"); it != auth_metadata.end()) {
    method = RefToString(it->second);
  }
  const MethodRequirement requirement = RequirementOf(method);
  auto header = auth_metadata.find("authorization");
  if (header == auth_metadata.end()) {
    if (requirement.public_method) return grpc::Status::OK;
    return grpc::Status(grpc::StatusCode::UNAUTHENTICATED, "missing bearer token");
  }
  absl::string_view value(header->second.data(), header->second.size());
  if (!absl::ConsumePrefix(&value, "Bearer ")) {
    return grpc::Status(grpc::StatusCode::UNAUTHENTICATED, "authorization is not a bearer token");
  }
  const TokenTable::Entry* entry = tokens_->Find(value);
  if (entry == nullptr) {
    return grpc::Status(grpc::StatusCode::UNAUTHENTICATED, "unknown bearer token");
  }
  if (!requirement.public_method && entry->role < requirement.role) {
    return grpc::Status(grpc::StatusCode::PERMISSION_DENIED,
                        absl::StrCat(method, " needs role ", RoleName(requirement.role)));
  }
  // Nothing is added to `context`: gRPC 1.51 passes the connection's AuthContext here, shared by
  // every call on the connection (and clients share connections between channels), so a
  // property would describe some earlier call. CallerIdentity reads the call's own header.
  return grpc::Status::OK;
}

std::string CallerIdentity(const grpc::ServerContext& context) {
  std::shared_ptr<const TokenTable> tokens;
  {
    absl::MutexLock lock(&g_identity_mu);
    tokens = *g_identity_tokens;
  }
  auto header = context.client_metadata().find("authorization");
  if (tokens != nullptr && header != context.client_metadata().end()) {
    absl::string_view value(header->second.data(), header->second.size());
    if (absl::ConsumePrefix(&value, "Bearer ")) {
      if (const TokenTable::Entry* entry = tokens->Find(value); entry != nullptr) {
        return entry->client;
      }
    }
  }
  return context.peer();
}

std::unique_ptr<grpc::experimental::ClientInterceptorFactoryInterface>
MakeBearerTokenInterceptorFactory(std::string token) {
  return std::make_unique<BearerTokenInterceptorFactory>(std::move(token));
}

}  // namespace moe
