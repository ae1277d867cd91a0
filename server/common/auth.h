// Bearer-token authentication and per-method roles for every moe-serve server.
//
// Roles, from least to most privileged:
//   frontend  Forward, ForwardStream, ForwardRaw, GetInfo, GetStats and the SharedMemoryShard
//             data plane (shard); GetClusterMap, WatchClusterMap, GetLoadStats (coordinator).
//   internal  what frontend may, plus the shard<->coordinator control calls: RegisterShard and
//             Heartbeat (shard -> coordinator), CollectLoad (coordinator -> shard). Shards and the
//             coordinator use an internal token for each other, so a leaked shard token cannot
//             Rebalance or Drain the cluster.
//   admin     every method (Rebalance, Drain, reflection, ...).
// The standard health service is public (Kubernetes probes carry no token). A method missing
// from the table needs admin (fail closed).
//
// Design: one grpc::AuthMetadataProcessor does both checks before any handler runs, reading the
// "authorization: Bearer <token>" header and the ":path" pseudo-header, so a refused call never
// reaches service code and changes nothing. (gRPC 1.51 server interceptors cannot fail a call
// before its handler runs, and an AuthMetadataProcessor needs secure server credentials: tls.h
// uses TLS, or local-TCP credentials when tokens are used without TLS.) No or unknown token:
// UNAUTHENTICATED; a role below the method's: PERMISSION_DENIED. The processor adds no AuthContext
// properties (in gRPC 1.51 it is handed the connection's context, shared by every call on it);
// CallerIdentity maps the call's own token to its name instead.
//
// Tokens file: one "role token [name]" per line; '#' starts a comment. The name (default
// "<role>-line<N>") identifies the client for quotas (admission.h) and logs; tokens are never
// logged. Clients send their token through MakeBearerTokenInterceptorFactory (tls.h
// CreateSecureChannel does this).
//
// Thread-safety: TokenTable is immutable after Load; the processor is thread-safe.
#ifndef MOE_SERVER_COMMON_AUTH_H_
#define MOE_SERVER_COMMON_AUTH_H_

#include <map>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "grpcpp/security/auth_metadata_processor.h"
#include "grpcpp/server_context.h"
#include "grpcpp/support/client_interceptor.h"

namespace moe {

enum class Role { kFrontend = 1, kInternal = 2, kAdmin = 3 };

absl::StatusOr<Role> ParseRole(absl::string_view name);
const char* RoleName(Role role);

// The role a full method name ("/moe.v1.Coordinator/Drain") needs; nullopt-like: `public_method`
// is set for methods anyone may call.
struct MethodRequirement {
  bool public_method = false;
  Role role = Role::kAdmin;
};
MethodRequirement RequirementOf(absl::string_view full_method);

class TokenTable {
 public:
  struct Entry {
    Role role;
    std::string client;
  };
  // INVALID_ARGUMENT (with the line number, never the token) on a malformed line, an unknown
  // role or a duplicate token; NOT_FOUND when the file cannot be read.
  static absl::StatusOr<TokenTable> Load(const std::string& path);
  static absl::StatusOr<TokenTable> Parse(absl::string_view text);

  const Entry* Find(absl::string_view token) const;
  size_t size() const { return entries_.size(); }

 private:
  std::map<std::string, Entry, std::less<>> entries_;
};

// Authenticates and authorizes every call (see the header comment).
class TokenAuthProcessor : public grpc::AuthMetadataProcessor {
 public:
  // Also makes `tokens` the table CallerIdentity resolves names with (the newest one wins).
  explicit TokenAuthProcessor(TokenTable tokens);
  bool IsBlocking() const override { return false; }
  grpc::Status Process(const InputMetadata& auth_metadata, grpc::AuthContext* context,
                       OutputMetadata* consumed_auth_metadata,
                       OutputMetadata* response_metadata) override;

 private:
  const std::shared_ptr<const TokenTable> tokens_;
};

// The identity admission quotas use: the name of the call's bearer token in the table of the
// newest TokenAuthProcessor, else the peer address (connections may be shared by channels, so
// without tokens two clients of one process are one identity).
std::string CallerIdentity(const grpc::ServerContext& context);

// Adds "authorization: Bearer <token>" to every call of a channel.
std::unique_ptr<grpc::experimental::ClientInterceptorFactoryInterface>
MakeBearerTokenInterceptorFactory(std::string token);

}  // namespace moe

#endif  // MOE_SERVER_COMMON_AUTH_H_
