#include "tests/security_fixtures.h"

#include <cstdlib>
#include <fstream>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace moe::testing {
namespace {

absl::Status Shell(const std::string& command) {
  const int rc = std::system(command.c_str());
  if (rc != 0) return absl::InternalError(absl::StrCat("`", command, "` exited with ", rc));
  return absl::OkStatus();
}

absl::Status WriteText(const std::string& path, const std::string& text) {
  std::ofstream out(path);
  out << text;
  out.close();
  if (!out) return absl::InternalError(absl::StrCat("cannot write ", path));
  return absl::OkStatus();
}

// A self-signed CA `name`.pem / `name`.key (P-256 keys: quick to generate).
absl::Status MakeCa(const std::string& dir, const std::string& name) {
  return Shell(absl::StrCat("cd ", dir,
                            " && openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1"
                            " -nodes -keyout ",
                            name, ".key -out ", name, ".pem -days 2 -subj /CN=", name,
                            " 2>>openssl.log"));
}

// `name`.pem / `name`.key signed by CA `ca` with the extensions in `name`.ext.
absl::Status MakeLeaf(const std::string& dir, const std::string& ca, const std::string& name,
                      const std::string& extensions) {
  if (absl::Status s = WriteText(absl::StrCat(dir, "/", name, ".ext"), extensions); !s.ok()) {
    return s;
  }
  return Shell(absl::StrCat(
      "cd ", dir,
      " && openssl req -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -keyout ", name,
      ".key -out ", name, ".csr -subj /CN=", name, " 2>>openssl.log && openssl x509 -req -in ",
      name, ".csr -CA ", ca, ".pem -CAkey ", ca, ".key -CAcreateserial -out ", name,
      ".pem -days 2 -extfile ", name, ".ext 2>>openssl.log"));
}

}  // namespace

absl::StatusOr<TestPki> GenerateTestPki(const std::string& dir) {
  if (absl::Status s = MakeCa(dir, "ca"); !s.ok()) return s;
  if (absl::Status s = MakeLeaf(dir, "ca", "node",
                                "subjectAltName=IP:127.0.0.1,DNS:localhost\n"
                                "extendedKeyUsage=serverAuth,clientAuth\n");
      !s.ok()) {
    return s;
  }
  if (absl::Status s = MakeCa(dir, "rogue_ca"); !s.ok()) return s;
  if (absl::Status s = MakeLeaf(dir, "rogue_ca", "rogue",
                                "subjectAltName=IP:127.0.0.1,DNS:localhost\n"
                                "extendedKeyUsage=clientAuth\n");
      !s.ok()) {
    return s;
  }
  return TestPki{dir + "/ca.pem", dir + "/node.pem", dir + "/node.key", dir + "/rogue.pem",
                 dir + "/rogue.key"};
}

absl::StatusOr<TokenFiles> WriteTokenFiles(const std::string& dir) {
  TokenFiles files{dir + "/tokens.txt", dir + "/internal_token.txt"};
  if (absl::Status s =
          WriteText(files.tokens, absl::StrCat("# role token name\n", "frontend ", kFrontendToken,
                                               " web\n", "internal ", kInternalToken, " nodes\n",
                                               "admin ", kAdminToken, " ops\n"));
      !s.ok()) {
    return s;
  }
  if (absl::Status s = WriteText(files.internal, absl::StrCat(kInternalToken, "\n")); !s.ok()) {
    return s;
  }
  return files;
}

}  // namespace moe::testing
