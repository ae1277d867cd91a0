// Test fixtures for TLS and token tests: a throw-away PKI made with the openssl command-line tool
// (a CA; a node certificate for 127.0.0.1/localhost that servers and their clients both use; a
// second, untrusted CA with a client certificate of its own) and a tokens file with one token
// per role.
//
// Callers: tests/security_test.cc, tests/admission_test.cc. Thread-safety: call from the test
// body. Ownership: files live in the directory given (under $TEST_TMPDIR).
#ifndef MOE_TESTS_SECURITY_FIXTURES_H_
#define MOE_TESTS_SECURITY_FIXTURES_H_

#include <string>

#include "absl/status/statusor.h"

namespace moe::testing {

struct TestPki {
  std::string ca;         // trusted CA certificate
  std::string node_cert;  // signed by `ca`; SAN IP:127.0.0.1, DNS:localhost; server+client auth
  std::string node_key;
  std::string rogue_cert;  // client certificate signed by an untrusted CA
  std::string rogue_key;
};

// Generates the PKI into `dir` (openssl must be on PATH).
absl::StatusOr<TestPki> GenerateTestPki(const std::string& dir);

// Fixed tokens, one per role, and the names the tokens file gives them.
inline constexpr char kFrontendToken[] = "frontend-3f9a1c";
inline constexpr char kInternalToken[] = "internal-77b2e0";
inline constexpr char kAdminToken[] = "admin-c41d8e";

struct TokenFiles {
  std::string tokens;    // server side: "role token name" lines for the three tokens
  std::string internal;  // client side: the internal token alone (shards, coordinator)
};
absl::StatusOr<TokenFiles> WriteTokenFiles(const std::string& dir);

}  // namespace moe::testing

#endif  // MOE_TESTS_SECURITY_FIXTURES_H_
