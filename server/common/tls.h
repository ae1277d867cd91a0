// TLS and mutual TLS for every moe-serve server and client: certificate, key and CA files turned
// into gRPC server and channel credentials, plus the process-wide channel security that
// MakeChannel (client/client.h) and the servers' own outgoing calls use.
//
// Server side: with a certificate the server speaks TLS (and with require_client_cert, verifies a
// client certificate against the CA: mTLS, refused at the handshake). Without one it is
// plaintext; when bearer tokens are also configured (auth.h) it uses gRPC's local TCP
// credentials instead, because gRPC runs an AuthMetadataProcessor only on "secure" server
// credentials: local credentials are plaintext on the wire but accept loopback peers only, so
// tokens are never sent in clear text across a network.
//
// Callers: moe_shard, moe_coordinator, moectl (through security_flags.h) and tests.
// Thread-safety: the functions are thread-safe; the process default is guarded by a mutex.
#ifndef MOE_SERVER_COMMON_TLS_H_
#define MOE_SERVER_COMMON_TLS_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "grpcpp/channel.h"
#include "grpcpp/security/auth_metadata_processor.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/support/channel_arguments.h"
#include "server/common/tcp_stream.h"

namespace moe {

struct TlsOptions {
  std::string cert_file;  // PEM certificate chain (server: required for TLS; client: for mTLS)
  std::string key_file;   // PEM private key of cert_file
  std::string ca_file;    // PEM roots: a server verifies client certs with it, a client the server
  // Server only: refuse clients without a certificate signed by ca_file (mutual TLS).
  bool require_client_cert = false;
};

// Whether `options` asks for TLS at all (a client needs only a CA; a server needs a cert).
bool ServerTlsEnabled(const TlsOptions& options);
bool ClientTlsEnabled(const TlsOptions& options);

// Reads a whole file (certificates, keys, tokens). NOT_FOUND when it cannot be opened.
absl::StatusOr<std::string> ReadSecretFile(const std::string& path);

// Server credentials for `options`; `processor` (may be null) authenticates every call. See the
// header comment for the plaintext + processor case. INVALID_ARGUMENT on incomplete options.
absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> MakeServerCredentials(
    const TlsOptions& options, std::shared_ptr<grpc::AuthMetadataProcessor> processor);

// Channel credentials: TLS when ClientTlsEnabled (with a client certificate when cert_file is
// set), else insecure.
absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> MakeChannelCredentials(
    const TlsOptions& options);

// How a client reaches a moe-serve server: transport credentials and an optional bearer token
// sent as "authorization: Bearer <token>" on every call (auth.h).
struct ChannelSecurity {
  std::shared_ptr<grpc::ChannelCredentials> credentials;  // null: insecure
  std::string bearer_token;                               // empty: none
  // The roots that verify a shard's TLS TCP channels (client/tcp_channel.h), from the same CA
  // file as `credentials` (MakeChannelSecurity sets it with TLS); null: none.
  std::shared_ptr<const TlsContext> tcp_tls;
  // Whether calls are taken to be TLS-encrypted: any credentials count (MakeChannelSecurity
  // leaves them null without TLS), so a plaintext extra such as the client's TCP channels
  // (TcpChannelUse::kAuto) is never chosen for a link that might be encrypted.
  bool encrypted() const { return credentials != nullptr; }
};

// Builds ChannelSecurity from TLS options and a token file (empty path: no token).
absl::StatusOr<ChannelSecurity> MakeChannelSecurity(const TlsOptions& options,
                                                    const std::string& token_file);

// TLS contexts of the TCP request channels (tcp_stream.h) from PEM files: a server's from its
// certificate chain and key, a client's from its CA. NOT_FOUND for a missing file,
// INVALID_ARGUMENT for PEM that OpenSSL refuses.
absl::StatusOr<std::shared_ptr<const TlsContext>> TcpTlsServerFromFiles(
    const std::string& cert_file, const std::string& key_file);
absl::StatusOr<std::shared_ptr<const TlsContext>> TcpTlsClientFromFile(const std::string& ca_file);

// A channel to `address` with `security` and `args`.
std::shared_ptr<grpc::Channel> CreateSecureChannel(const std::string& address,
                                                   const ChannelSecurity& security,
                                                   grpc::ChannelArguments args);

// The process-wide security of outgoing channels (the shard's link to the coordinator, the
// coordinator's calls to shards, moectl). Set once at start-up, before any channel is made.
void SetDefaultChannelSecurity(ChannelSecurity security);
ChannelSecurity DefaultChannelSecurity();

}  // namespace moe

#endif  // MOE_SERVER_COMMON_TLS_H_
