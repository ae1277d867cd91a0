#include "server/common/security_flags.h"

#include <string>
#include <utility>

#include "absl/flags/flag.h"
#include "absl/flags/usage_config.h"
#include "absl/strings/match.h"
#include "absl/strings/string_view.h"
#include "server/common/auth.h"
#include "server/common/tls.h"

ABSL_FLAG(std::string, tls_cert, "", "PEM certificate chain of this process (enables TLS)");
ABSL_FLAG(std::string, tls_key, "", "PEM private key of --tls_cert");
ABSL_FLAG(std::string, tls_ca, "",
          "PEM CA certificates: verifies servers (clients) and client certificates (servers)");
ABSL_FLAG(bool, tls_require_client_cert, false,
          "servers: refuse clients without a certificate signed by --tls_ca (mutual TLS)");
ABSL_FLAG(std::string, auth_tokens_file, "",
          "servers: file of 'role token [name]' lines (roles frontend, internal, admin); every "
          "call then needs 'authorization: Bearer <token>'");
ABSL_FLAG(std::string, auth_token_file, "", "clients: file holding the bearer token to send");

namespace moe {

void ListServerFlagsInHelp() {
  absl::FlagsUsageConfig config;
  config.contains_help_flags = [](absl::string_view path) {
    return absl::StrContains(path, "server/");
  };
  absl::SetFlagsUsageConfig(config);
}

namespace {

TlsOptions TlsFromFlags() {
  TlsOptions o;
  o.cert_file = absl::GetFlag(FLAGS_tls_cert);
  o.key_file = absl::GetFlag(FLAGS_tls_key);
  o.ca_file = absl::GetFlag(FLAGS_tls_ca);
  o.require_client_cert = absl::GetFlag(FLAGS_tls_require_client_cert);
  return o;
}

}  // namespace

absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> ServerCredentialsFromFlags() {
  std::shared_ptr<grpc::AuthMetadataProcessor> processor;
  if (const std::string path = absl::GetFlag(FLAGS_auth_tokens_file); !path.empty()) {
    absl::StatusOr<TokenTable> tokens = TokenTable::Load(path);
    if (!tokens.ok()) return tokens.status();
    processor = std::make_shared<TokenAuthProcessor>(*std::move(tokens));
  }
  return MakeServerCredentials(TlsFromFlags(), std::move(processor));
}

absl::StatusOr<std::shared_ptr<const TlsContext>> TcpChannelTlsFromFlags() {
  const TlsOptions tls = TlsFromFlags();
  if (!ServerTlsEnabled(tls)) return std::shared_ptr<const TlsContext>();
  return TcpTlsServerFromFiles(tls.cert_file, tls.key_file);
}

absl::Status InstallClientSecurityFromFlags() {
  absl::StatusOr<ChannelSecurity> security =
      MakeChannelSecurity(TlsFromFlags(), absl::GetFlag(FLAGS_auth_token_file));
  if (!security.ok()) return security.status();
  SetDefaultChannelSecurity(*std::move(security));
  return absl::OkStatus();
}

}  // namespace moe
