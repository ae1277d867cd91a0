#include "server/common/tls.h"

#include <fstream>
#include <sstream>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "grpcpp/create_channel.h"
#include "server/common/auth.h"

namespace moe {
namespace {

absl::Mutex g_default_mu;
ChannelSecurity* g_default ABSL_GUARDED_BY(g_default_mu) = nullptr;

}  // namespace

bool ServerTlsEnabled(const TlsOptions& options) { return !options.cert_file.empty(); }

bool ClientTlsEnabled(const TlsOptions& options) {
  return !options.ca_file.empty() || !options.cert_file.empty();
}

absl::StatusOr<std::string> ReadSecretFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot open ", path));
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> MakeServerCredentials(
    const TlsOptions& options, std::shared_ptr<grpc::AuthMetadataProcessor> processor) {
  std::shared_ptr<grpc::ServerCredentials> credentials;
  if (ServerTlsEnabled(options)) {
    if (options.key_file.empty()) {
      return absl::InvalidArgumentError("a TLS certificate needs its key file (--tls_key)");
    }
    if (options.require_client_cert && options.ca_file.empty()) {
      return absl::InvalidArgumentError(
          "verifying client certificates (mTLS) needs a CA file (--tls_ca)");
    }
    grpc::SslServerCredentialsOptions ssl(
        options.require_client_cert ? GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY
                                    : GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE);
    grpc::SslServerCredentialsOptions::PemKeyCertPair pair;
    absl::StatusOr<std::string> cert = ReadSecretFile(options.cert_file);
    if (!cert.ok()) return cert.status();
    absl::StatusOr<std::string> key = ReadSecretFile(options.key_file);
    if (!key.ok()) return key.status();
    pair.cert_chain = *std::move(cert);
    pair.private_key = *std::move(key);
    ssl.pem_key_cert_pairs.push_back(std::move(pair));
    if (!options.ca_file.empty()) {
      absl::StatusOr<std::string> ca = ReadSecretFile(options.ca_file);
      if (!ca.ok()) return ca.status();
      ssl.pem_root_certs = *std::move(ca);
    }
    credentials = grpc::SslServerCredentials(ssl);
  } else if (options.require_client_cert) {
    return absl::InvalidArgumentError("mTLS (--tls_require_client_cert) needs --tls_cert");
  } else if (processor != nullptr) {
    credentials = grpc::experimental::LocalServerCredentials(LOCAL_TCP);
  } else {
    return grpc::InsecureServerCredentials();
  }
  if (processor != nullptr) credentials->SetAuthMetadataProcessor(std::move(processor));
  return credentials;
}

absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> MakeChannelCredentials(
    const TlsOptions& options) {
  if (!ClientTlsEnabled(options)) return grpc::InsecureChannelCredentials();
  grpc::SslCredentialsOptions ssl;
  if (!options.ca_file.empty()) {
    absl::StatusOr<std::string> ca = ReadSecretFile(options.ca_file);
    if (!ca.ok()) return ca.status();
    ssl.pem_root_certs = *std::move(ca);
  }
  if (!options.cert_file.empty()) {
    if (options.key_file.empty()) {
      return absl::InvalidArgumentError("a client certificate needs its key file (--tls_key)");
    }
    absl::StatusOr<std::string> cert = ReadSecretFile(options.cert_file);
    if (!cert.ok()) return cert.status();
    absl::StatusOr<std::string> key = ReadSecretFile(options.key_file);
    if (!key.ok()) return key.status();
    ssl.pem_cert_chain = *std::move(cert);
    ssl.pem_private_key = *std::move(key);
  }
  return grpc::SslCredentials(ssl);
}

absl::StatusOr<ChannelSecurity> MakeChannelSecurity(const TlsOptions& options,
                                                    const std::string& token_file) {
  ChannelSecurity security;
  absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> credentials =
      MakeChannelCredentials(options);
  if (!credentials.ok()) return credentials.status();
  if (ClientTlsEnabled(options)) {
    security.credentials = *std::move(credentials);
    if (!options.ca_file.empty()) {
      absl::StatusOr<std::shared_ptr<const TlsContext>> tcp = TcpTlsClientFromFile(options.ca_file);
      if (!tcp.ok()) return tcp.status();
      security.tcp_tls = *std::move(tcp);
    }
  }
  if (!token_file.empty()) {
    absl::StatusOr<std::string> token = ReadSecretFile(token_file);
    if (!token.ok()) return token.status();
    security.bearer_token = std::string(absl::StripAsciiWhitespace(*token));
    if (security.bearer_token.empty()) {
      return absl::InvalidArgumentError(absl::StrCat("token file ", token_file, " is empty"));
    }
  }
  return security;
}

absl::StatusOr<std::shared_ptr<const TlsContext>> TcpTlsServerFromFiles(
    const std::string& cert_file, const std::string& key_file) {
  absl::StatusOr<std::string> cert = ReadSecretFile(cert_file);
  if (!cert.ok()) return cert.status();
  absl::StatusOr<std::string> key = ReadSecretFile(key_file);
  if (!key.ok()) return key.status();
  return TlsContext::ForServer(*cert, *key);
}

absl::StatusOr<std::shared_ptr<const TlsContext>> TcpTlsClientFromFile(const std::string& ca_file) {
  absl::StatusOr<std::string> ca = ReadSecretFile(ca_file);
  if (!ca.ok()) return ca.status();
  return TlsContext::ForClient(*ca);
}

std::shared_ptr<grpc::Channel> CreateSecureChannel(const std::string& address,
                                                   const ChannelSecurity& security,
                                                   grpc::ChannelArguments args) {
  std::shared_ptr<grpc::ChannelCredentials> credentials =
      security.credentials != nullptr ? security.credentials : grpc::InsecureChannelCredentials();
  if (security.bearer_token.empty()) {
    return grpc::CreateCustomChannel(address, credentials, args);
  }
  std::vector<std::unique_ptr<grpc::experimental::ClientInterceptorFactoryInterface>> interceptors;
  interceptors.push_back(MakeBearerTokenInterceptorFactory(security.bearer_token));
  return grpc::experimental::CreateCustomChannelWithInterceptors(address, credentials, args,
                                                                 std::move(interceptors));
}

void SetDefaultChannelSecurity(ChannelSecurity security) {
  absl::MutexLock lock(&g_default_mu);
  delete g_default;
  g_default = new ChannelSecurity(std::move(security));
}

ChannelSecurity DefaultChannelSecurity() {
  absl::MutexLock lock(&g_default_mu);
  return g_default != nullptr ? *g_default : ChannelSecurity{};
}

}  // namespace moe
