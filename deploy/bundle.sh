#!/usr/bin/env bash
# Assembles the relocatable moe-serve runtime bundle: the release binaries, every shared library
# they load that a base Ubuntu/Debian system does not have, a launcher per binary, the demo and a
# README, packed as moe-serve-VERSION/ in a reproducible .tar.gz.
#
# Run by the //deploy:bundle genrule:
#   bundle.sh --out FILE.tar.gz --version V --cuda yes|no --readme FILE --demo FILE \
#             --binary NAME=PATH [--binary NAME=PATH ...]
# NAME is the launcher's name (bin/NAME); the ELF file keeps its own name under libexec/.
# `./moe bundle` builds that genrule, then copies the tarball under its versioned name:
#   bundle.sh --install TARBALL DIR      -> DIR/moe-serve-VERSION.tar.gz
#
# Libraries are found with ldd (the dynamic loader's own resolution, so transitive dependencies are
# included). The base set that stays on the target is glibc (libc, libm, libpthread, libdl, librt,
# libresolv, libutil, libmvec, the loader), libstdc++ and libgcc_s; the NVIDIA driver's libraries
# (libcuda, libnvidia-*) must come from the target's driver and are never bundled. The bundle is
# checked before packing: with only its own lib/ on the search path every library resolves.
set -euo pipefail

# Sonames that the target system provides: glibc, libstdc++, libgcc_s.
BASE_LIBS=(linux-vdso.so.1 ld-linux-x86-64.so.2 libc.so.6 libm.so.6 libmvec.so.1 libpthread.so.0
  libdl.so.2 librt.so.1 libresolv.so.2 libutil.so.1 libstdc++.so.6 libgcc_s.so.1)
# The GPU driver's libraries come from the target's driver.
DRIVER_LIB_RE='^(libcuda\.so.*|libnvidia-.*)$'
# OpenSSL 3 goes to lib/openssl/, which the launcher puts on the search path only when the target
# lacks libssl.so.3 / libcrypto.so.3 (or MOE_BUNDLED_OPENSSL=1): the target's own build is tuned
# for its CPU (on the H200 host Ubuntu's libcrypto ran AES-128-GCM at 14.5 GB/s, the bundled
# Debian one at 4.8), and OpenSSL keeps its ABI across 3.x.
OPENSSL_LIB_RE='^(libssl|libcrypto)\.so\.3$'
# Also searched: the CUDA toolkit's libraries, for a shard that links one of them dynamically
# (NCCL, cuBLAS; the CUDA runtime itself is linked statically).
SEARCH_DIRS=(/usr/local/cuda/lib64)

die() { echo "bundle.sh: $*" >&2; exit 1; }
# Whether a soname stays on the target (base system or driver).
from_target() {
  local b
  for b in "${BASE_LIBS[@]}"; do [[ "$1" == "$b" ]] && return 0; done
  [[ "$1" =~ $DRIVER_LIB_RE ]]
}

# Copies a built tarball to DIR/<its top directory>.tar.gz and prints what it holds.
install_bundle() {
  local tarball="$1" dir="$2" top
  top="$(tar -tzf "$tarball" | sed -n 1p)"
  top="${top%%/*}"
  [[ "$top" == moe-serve-* ]] || die "$tarball is not a moe-serve bundle"
  mkdir -p "$dir"
  install -m 0644 "$tarball" "$dir/$top.tar.gz"
  tar -xzOf "$tarball" "$top/BUILD_INFO" | grep -vE '^(name|libraries):'
  echo "bundle: $dir/$top.tar.gz ($(du -h "$dir/$top.tar.gz" | cut -f1))"
}
if [[ "${1:-}" == --install ]]; then
  (($# == 3)) || die "usage: bundle.sh --install TARBALL DIR"
  install_bundle "$2" "$3"
  exit 0
fi

OUT="" VERSION="" CUDA="" README="" DEMO=""
BINARIES=()
while (($#)); do
  case "$1" in
    --out) OUT="$2"; shift 2 ;;
    --version) VERSION="$2"; shift 2 ;;
    --cuda) CUDA="$2"; shift 2 ;;
    --readme) README="$2"; shift 2 ;;
    --demo) DEMO="$2"; shift 2 ;;
    --binary) BINARIES+=("$2"); shift 2 ;;
    *) die "unknown argument '$1'" ;;
  esac
done
[[ -n "$OUT" && -n "$VERSION" && -n "$README" && -n "$DEMO" && ${#BINARIES[@]} -gt 0 ]] ||
  die "usage: bundle.sh --out F --version V --cuda yes|no --readme F --demo F --binary NAME=PATH..."
[[ "$CUDA" == yes || "$CUDA" == no ]] || die "--cuda must be yes or no"

STAGE="$(mktemp -d)"
trap 'rm -rf "$STAGE"' EXIT
NAME="moe-serve-$VERSION"
ROOT="$STAGE/$NAME"
mkdir -p "$ROOT/bin" "$ROOT/lib" "$ROOT/libexec"

# Prints "SONAME PATH" for every library `elf` loads (PATH is "not-found" when unresolved).
needed_libs() {
  LD_LIBRARY_PATH="${2:-}" ldd "$1" | awk '
    $2 == "=>" && $3 == "not" { print $1, "not-found"; next }
    $2 == "=>" { print $1, $3; next }
    $1 ~ /^\// { n = split($1, p, "/"); print p[n], $1 }'
}

# Copies the libraries of one ELF file into lib/ (dereferenced, named by soname).
bundle_libs_of() {
  local elf="$1" soname path
  while read -r soname path; do
    from_target "$soname" && continue
    [[ "$path" != not-found ]] || die "$elf needs $soname, which is not installed"
    local dest="$ROOT/lib/$soname"
    [[ "$soname" =~ $OPENSSL_LIB_RE ]] && dest="$ROOT/lib/openssl/$soname"
    [[ -e "$dest" ]] || install -m 0644 -D "$path" "$dest"
  done < <(needed_libs "$elf" "$(IFS=:; echo "${SEARCH_DIRS[*]}")")
}

write_launcher() {
  local launcher="$1" elf_name="$2"
  cat >"$ROOT/bin/$launcher" <<EOF
#!/bin/sh
# moe-serve launcher: runs libexec/$elf_name with this bundle's lib/ first on the library search
# path, wherever the bundle was extracted (symlinks to this script are followed). The bundled
# OpenSSL (lib/openssl/) only where the system has none (or MOE_BUNDLED_OPENSSL=1).
self=\$(readlink -f -- "\$0")
root=\$(dirname -- "\$(dirname -- "\$self")")
libs="\$root/lib"
if [ -d "\$root/lib/openssl" ]; then
  system_libs=\$({ ldconfig -p || /sbin/ldconfig -p; } 2>/dev/null)
  case "\${MOE_BUNDLED_OPENSSL:-0}:\$system_libs" in
    1:*) libs="\$libs:\$root/lib/openssl" ;;
    *"libssl.so.3 "*"libcrypto.so.3 "* | *"libcrypto.so.3 "*"libssl.so.3 "*) ;;
    *) libs="\$libs:\$root/lib/openssl" ;;
  esac
fi
LD_LIBRARY_PATH="\$libs\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}"
export LD_LIBRARY_PATH
exec "\$root/libexec/$elf_name" "\$@"
EOF
  chmod 0755 "$ROOT/bin/$launcher"
}

for spec in "${BINARIES[@]}"; do
  launcher="${spec%%=*}" path="${spec#*=}"
  [[ -x "$path" ]] || die "binary $path missing"
  elf_name="$(basename "$path")"
  install -m 0755 "$path" "$ROOT/libexec/$elf_name"
  bundle_libs_of "$ROOT/libexec/$elf_name"
  write_launcher "$launcher" "$elf_name"
done
install -m 0755 "$DEMO" "$ROOT/bin/moe-demo"
install -m 0644 "$README" "$ROOT/README.md"

# Every library must now resolve from lib/ and lib/openssl/ alone (plus the base set).
for elf in "$ROOT"/libexec/* "$ROOT"/lib/*.so* "$ROOT"/lib/openssl/*; do
  [[ -f "$elf" ]] || continue
  while read -r soname path; do
    from_target "$soname" && continue
    [[ "$path" == "$ROOT/lib/$soname" || "$path" == "$ROOT/lib/openssl/$soname" ]] ||
      die "$(basename "$elf"): $soname resolves to $path"
  done < <(needed_libs "$elf" "$ROOT/lib:$ROOT/lib/openssl")
done

# The newest symbol versions the bundle needs from the target's base libraries.
newest_version() {
  objdump -T "$ROOT"/libexec/* "$ROOT"/lib/*.so* "$ROOT"/lib/openssl/* 2>/dev/null | grep -o "\b$1_[0-9][0-9.]*" |
    sort -uV | tail -n 1
}
{
  echo "name: moe-serve"
  echo "version: $VERSION"
  echo "cuda: $CUDA"
  echo "requires: $(newest_version GLIBC) $(newest_version GLIBCXX) $(newest_version CXXABI)"
  echo "binaries: $(cd "$ROOT/libexec" && echo *)"
  echo "libraries: $(cd "$ROOT/lib" && echo *.so* openssl/*)"
} >"$ROOT/BUILD_INFO"

# Reproducible archive: sorted names, fixed owner and time, no gzip timestamp.
tar --sort=name --owner=0 --group=0 --numeric-owner --mtime=@0 -C "$STAGE" -cf - "$NAME" |
  gzip -n -6 >"$OUT"
