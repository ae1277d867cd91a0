#!/usr/bin/env bash
# The runtime bundle on a machine without the build's libraries: extracts //deploy:bundle into an
# empty directory and
#  1. checks its layout, and that with only its lib/ (and lib/openssl/) on the search path every
#     library of every ELF file resolves into them except the base set a plain Ubuntu 24.04 has
#     (glibc, libstdc++, libgcc_s), that the glibc / libstdc++ symbol versions it needs exist on
#     Ubuntu 24.04, and that a launcher adds lib/openssl/ only where the system has no OpenSSL 3
#     (or MOE_BUNDLED_OPENSSL=1);
#  2. runs the bundle's demo (coordinator + 2 shards + the verified `moectl workload`, fewer steps)
#     with the build's libraries hidden: in a private mount namespace (unshare -m) /usr/include,
#     /usr/local/cuda and every system copy of a bundled library (runtime files, -dev symlinks and
#     static archives) are covered, so a library missing from the bundle fails to load. Where
#     mount namespaces are not allowed it says so and runs with a clean environment instead
#     (both with MOE_BUNDLED_OPENSSL=1: the hidden system stands for one without OpenSSL);
#  3. traces the dynamic loader (LD_DEBUG=libs) in every moe-serve process of the demo and checks
#     that each library it initialised came from the bundle's lib/ or the base set.
set -euo pipefail

TARBALL="${TEST_SRCDIR:?run under bazel test}/moe_serve/deploy/moe-serve-bundle.tar.gz"
WORK="$(mktemp -d "${TEST_TMPDIR:?}/bundle.XXXXXX")"
# Sonames of the base system (glibc, libstdc++, libgcc_s), written out here independently of
# deploy/bundle.sh.
BASE=(linux-vdso.so.1 ld-linux-x86-64.so.2 libc.so.6 libm.so.6 libmvec.so.1 libpthread.so.0
  libdl.so.2 librt.so.1 libresolv.so.2 libutil.so.1 libstdc++.so.6 libgcc_s.so.1)
# Ubuntu 24.04: glibc 2.39, GCC 14's libstdc++ (GLIBCXX_3.4.33, CXXABI_1.3.15).
TARGET_GLIBC=2.39 TARGET_GLIBCXX=3.4.33 TARGET_CXXABI=1.3.15

fail() { echo "FAIL: $*" >&2; exit 1; }
is_base() { local b; for b in "${BASE[@]}"; do [[ "$1" == "$b" ]] && return 0; done; return 1; }

mkdir "$WORK/x"
tar -xzf "$TARBALL" -C "$WORK/x"
mapfile -t tops < <(ls "$WORK/x")
[[ ${#tops[@]} == 1 && "${tops[0]}" == moe-serve-* ]] || fail "tarball top level: ${tops[*]}"
ROOT="$WORK/x/${tops[0]}"
echo "bundle $(basename "$ROOT"): $(grep -E '^(cuda|requires):' "$ROOT/BUILD_INFO" | tr '\n' ' ')"

# --- 1. layout and static resolution ---------------------------------------------------------
for f in bin/moe-coordinator bin/moe-shard bin/moectl bin/moe-demo libexec/moe_coordinator \
  libexec/moe_shard libexec/moectl README.md BUILD_INFO; do
  [[ -f "$ROOT/$f" ]] || fail "missing $f"
done
for lib in libgrpc++.so.1.51 libgrpc.so.29 libprotobuf.so.32 libglog.so.1 libgflags.so.2.2 \
  libcares.so.2 libre2.so.9 openssl/libssl.so.3 openssl/libcrypto.so.3 libz.so.1 libupb.so.29 \
  libaddress_sorting.so.29 libabsl_strings.so.20220623; do
  [[ -f "$ROOT/lib/$lib" ]] || fail "lib/$lib missing"
done
elfs=("$ROOT"/libexec/* "$ROOT"/lib/*.so* "$ROOT"/lib/openssl/*)
for lib in "$ROOT"/lib/*.so* "$ROOT"/lib/openssl/*; do
  is_base "$(basename "$lib")" && fail "bundle carries base library $(basename "$lib")"
done
checked=0
for elf in "${elfs[@]}"; do
  while read -r soname arrow path _; do
    [[ "$arrow" == "=>" ]] || continue
    [[ "$path" != not ]] || fail "$(basename "$elf"): $soname not found"
    if is_base "$soname"; then
      [[ "$path" != "$ROOT"/* ]] || fail "$soname taken from the bundle"
    else
      [[ "$path" == "$ROOT/lib/$soname" || "$path" == "$ROOT/lib/openssl/$soname" ]] ||
        fail "$(basename "$elf"): $soname -> $path"
    fi
    checked=$((checked + 1))
  done < <(env -i LD_LIBRARY_PATH="$ROOT/lib:$ROOT/lib/openssl" ldd "$elf")
done
echo "ldd: $checked library references of ${#elfs[@]} ELF files resolve into the bundle or the" \
  "base set"
readelf -d "$ROOT"/libexec/* | grep -qE 'R(UN)?PATH' && fail "a binary has an RPATH/RUNPATH"

# The launcher's OpenSSL choice, against a stand-in ldconfig on PATH: its library path ends
# with lib/openssl only where the system lists no libssl.so.3 / libcrypto.so.3.
mkdir "$WORK/fakebin_none" "$WORK/fakebin_both"
printf '#!/bin/sh\necho "1 libs found in cache"\n' >"$WORK/fakebin_none/ldconfig"
printf '#!/bin/sh\nprintf "\\tlibssl.so.3 (libc6,x86-64) => /x/libssl.so.3\\n\\tlibcrypto.so.3 (libc6,x86-64) => /x/libcrypto.so.3\\n"\n' \
  >"$WORK/fakebin_both/ldconfig"
chmod +x "$WORK"/fakebin_*/ldconfig
sed 's|^exec .*|echo "$LD_LIBRARY_PATH"|' "$ROOT/bin/moectl" >"$ROOT/bin/print-libs"
chmod +x "$ROOT/bin/print-libs"
with_none="$(env -i PATH="$WORK/fakebin_none:/usr/bin:/bin" "$ROOT/bin/print-libs")"
with_both="$(env -i PATH="$WORK/fakebin_both:/usr/bin:/bin" "$ROOT/bin/print-libs")"
forced="$(env -i PATH="$WORK/fakebin_both:/usr/bin:/bin" MOE_BUNDLED_OPENSSL=1 \
  "$ROOT/bin/print-libs")"
rm "$ROOT/bin/print-libs"
[[ "$with_none" == "$ROOT/lib:$ROOT/lib/openssl" ]] || fail "no system OpenSSL: $with_none"
[[ "$with_both" == "$ROOT/lib" ]] || fail "system OpenSSL: $with_both"
[[ "$forced" == "$ROOT/lib:$ROOT/lib/openssl" ]] || fail "MOE_BUNDLED_OPENSSL=1: $forced"
echo "launcher: the bundled OpenSSL only without a system one or when asked"

newest() {
  objdump -T "${elfs[@]}" | grep -o "\b$1_[0-9][0-9.]*" | sed "s/^$1_//" |
    sort -uV | tail -n 1
}
for pair in "GLIBC $TARGET_GLIBC" "GLIBCXX $TARGET_GLIBCXX" "CXXABI $TARGET_CXXABI"; do
  read -r name target <<<"$pair"
  need="$(newest "$name")"
  [[ "$(printf '%s\n%s\n' "$need" "$target" | sort -V | tail -n 1)" == "$target" ]] ||
    fail "needs ${name}_$need, newer than Ubuntu 24.04's ${name}_$target"
  echo "needs ${name}_$need <= ${name}_$target (Ubuntu 24.04)"
done

# --- 2. the demo with the build's libraries hidden --------------------------------------------
# What the binaries load from this machine when run without the bundle (the system's resolution,
# independent of what the bundle carries): everything outside the base set gets hidden.
for elf in "$ROOT"/libexec/*; do
  env -i ldd "$elf" | while read -r soname arrow path _; do
    if [[ "$arrow" == "=>" && -e "$path" ]] && ! is_base "$soname"; then echo "$soname"; fi
  done
done | sort -u >"$WORK/system_libs"
echo "the binaries use $(wc -l <"$WORK/system_libs") non-base libraries of this machine"

# Runs inside the private mount namespace: covers what a target machine would not have (headers,
# the CUDA toolkit, each library above with its -dev symlink and static archive), then runs the
# demo with a minimal environment. Arguments: bundle root, list of sonames, trace directory.
cat >"$WORK/hidden_run.sh" <<'EOF'
set -euo pipefail
root="$1" sonames="$2" trace="$3"
mount -t tmpfs -o ro,size=1m none /usr/include
[[ -d /usr/local/cuda ]] && mount -t tmpfs -o ro,size=1m none "$(readlink -f /usr/local/cuda)"
declare -A hidden=()
while read -r soname; do
  stem="${soname%%.so*}"
  for f in /usr/lib/x86_64-linux-gnu/"$stem".so* /usr/lib/x86_64-linux-gnu/"$stem".a; do
    [[ -e "$f" ]] || continue
    real="$(readlink -f "$f")"
    [[ -z "${hidden[$real]:-}" ]] || continue
    mount --bind /dev/null "$real"
    hidden[$real]=1
  done
done <"$sonames"
echo "hidden: /usr/include, /usr/local/cuda and ${#hidden[@]} system files of those libraries"
[[ ! -s /usr/lib/x86_64-linux-gnu/libgrpc.so.29 ]] || { echo "libgrpc still visible"; exit 1; }
cd /
exec env -i PATH=/usr/bin:/bin HOME=/nonexistent TMPDIR="$TMPDIR" LD_DEBUG=libs \
  LD_DEBUG_OUTPUT="$trace/ld" MOE_BUNDLED_OPENSSL=1 "$root/bin/moe-demo" --steps 24 --tokens 8
EOF
mkdir "$WORK/trace"
if unshare -m true 2>/dev/null; then
  TMPDIR="$WORK" unshare -m --propagation private bash "$WORK/hidden_run.sh" "$ROOT" \
    "$WORK/system_libs" "$WORK/trace" | tee "$WORK/demo.out"
else
  echo "NOTE: mount namespaces are not allowed here (unshare -m failed): the build's libraries" \
    "stay visible; the demo runs with a clean environment and the loader trace below proves" \
    "where each library came from"
  env -i PATH=/usr/bin:/bin HOME=/nonexistent TMPDIR="$WORK" LD_DEBUG=libs \
    LD_DEBUG_OUTPUT="$WORK/trace/ld" MOE_BUNDLED_OPENSSL=1 "$ROOT/bin/moe-demo" --steps 24 \
    --tokens 8 |
    tee "$WORK/demo.out"
fi
grep -q "coordinator load counts match the client's routed counts exactly" "$WORK/demo.out" ||
  fail "the demo workload did not verify"
grep -q "verified 24 forwards" "$WORK/demo.out" || fail "the demo did not run 24 forwards"

# --- 3. where every moe-serve process loaded its libraries from -------------------------------
declare -A seen_binaries=()
processes=0
for t in "$WORK"/trace/ld.*; do
  # A launcher's trace holds /bin/sh's start, then the binary's after the exec.
  program="$(sed -n 's/.*initialize program: //p' "$t" | tail -n 1)"
  [[ "$program" == "$ROOT"/libexec/* ]] || continue  # the demo script's own tools
  binary="$(basename "$program")"
  seen_binaries[$binary]=1
  processes=$((processes + 1))
  while read -r path; do
    soname="$(basename "$path")"
    if is_base "$soname"; then continue; fi
    [[ "$path" == "$ROOT/lib/$soname" || "$path" == "$ROOT/lib/openssl/$soname" ]] ||
      fail "$binary (trace $(basename "$t")) loaded $path"
  done < <(sed -n 's/.*calling init: //p' "$t")
done
for b in moe_coordinator moe_shard moectl; do
  [[ -n "${seen_binaries[$b]:-}" ]] || fail "no loader trace of $b"
done
((processes >= 5)) || fail "only $processes moe-serve processes traced"
echo "LD_DEBUG: $processes moe-serve processes initialised every non-base library from $ROOT/lib"
echo "PASS"
