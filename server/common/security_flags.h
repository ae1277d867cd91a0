// The command-line flags of TLS, mTLS and bearer tokens shared by moe_shard, moe_coordinator and
// moectl, turned into server credentials (with the token processor) and the process-wide channel
// security (tls.h SetDefaultChannelSecurity).
//
//   --tls_cert/--tls_key   this process's certificate and key (servers: required for TLS;
//                          clients: sent for mTLS)
//   --tls_ca               CA that verifies the peer (servers: client certs; clients: servers)
//   --tls_require_client_cert  servers refuse clients without a valid certificate (mTLS)
//   --auth_tokens_file     servers: "role token [name]" lines; calls need a token (auth.h)
//   --auth_token_file      clients: the token this process sends (moectl: frontend or admin;
//                          shards/coordinator: an internal token for each other)
//
// Thread-safety: call once from main before serving.
#ifndef MOE_SERVER_COMMON_SECURITY_FLAGS_H_
#define MOE_SERVER_COMMON_SECURITY_FLAGS_H_

#include <memory>

#include "absl/status/statusor.h"
#include "grpcpp/security/server_credentials.h"
#include "server/common/tcp_stream.h"

namespace moe {

// Server credentials from the flags (insecure when none are set).
absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> ServerCredentialsFromFlags();

// Sets the process default channel security from the flags.
absl::Status InstallClientSecurityFromFlags();

// TLS for the TCP request channels of a server with a certificate (--tls_cert, --tls_key; the
// same one its gRPC port presents); null without one.
absl::StatusOr<std::shared_ptr<const TlsContext>> TcpChannelTlsFromFlags();

// Makes --help list the flags defined under server/ (the binary's own and these security flags).
// absl's default lists only flags from a file named after the program, which moe_shard's main.cc
// is not. Call before absl::ParseCommandLine.
void ListServerFlagsInHelp();

}  // namespace moe

#endif  // MOE_SERVER_COMMON_SECURITY_FLAGS_H_
