#!/usr/bin/env bash
# Builds the libFuzzer targets of tests/fuzz/ outside Bazel (Bazel's toolchain is gcc, libFuzzer
# needs clang): clang++-14 with AddressSanitizer, UndefinedBehaviorSanitizer and libFuzzer
# coverage, compiling the project sources the targets exercise plus protoc-generated message code,
# linked against Debian's shared Abseil / protobuf / glog (gcc-built, but ABI compatible: clang uses
# the same libstdc++). Incremental: an object is rebuilt when its source or any header it includes
# (clang -MMD) is newer, or the flags changed.
#
# usage: bench/fuzz/build.sh [--out DIR] [--jobs N]
#   --out DIR   build directory (default .cache/fuzz); binaries land in DIR/bin/<target>_fuzzer
#   --jobs N    parallel compiles (default: nproc)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
OUT="$ROOT/.cache/fuzz"
JOBS="$(nproc)"
while (($#)); do
  case "$1" in
    --out) OUT="$2"; shift 2 ;;
    --jobs) JOBS="$2"; shift 2 ;;
    -h|--help) sed -n '2,11p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "build.sh: unknown argument '$1'" >&2; exit 2 ;;
  esac
done
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"

say() { printf '[fuzz-build] %s\n' "$*" >&2; }
die() { printf '[fuzz-build] error: %s\n' "$*" >&2; exit 1; }

CXX=clang++-14
command -v "$CXX" >/dev/null || die "$CXX not found: run ./moe deps (Debian clang-14)"
"$CXX" -print-file-name=libclang_rt.fuzzer-x86_64.a | grep -q / ||
  die "libFuzzer runtime missing: run ./moe deps (Debian libclang-rt-14-dev)"
command -v protoc >/dev/null || die "protoc not found: run ./moe deps"

# One builder at a time per output directory (the sh_test and ./moe fuzz may overlap).
exec 9>"$OUT/.lock"
flock 9

TARGETS=(forward_request forward_structured safetensors model_config wire_staging transport_frames)
# Project sources under test, and the fixture code the targets share.
LIB_SRCS=(
  kernels/tensor.cc kernels/formats.cc kernels/activation.cc kernels/routing.cc kernels/eplb.cc
  kernels/staging.cc server/common/wire.cc server/shard/placement.cc server/shard/request.cc
  server/model/safetensors.cc server/model/checkpoint.cc server/model/model_config.cc
  server/model/generator.cc server/common/raw_frame.cc server/common/tcp_channel_frame.cc
  tests/fuzz/fuzz_fixture.cc tests/fuzz/wire_builder.cc
)
PROTOS=(tensor shard coordinator)
LIBS=(
  -lgrpc++ -lgrpc -lgpr -lprotobuf -lglog -lgflags
  -labsl_statusor -labsl_status -labsl_cord -labsl_cordz_info -labsl_cord_internal
  -labsl_cordz_functions -labsl_exponential_biased -labsl_cordz_handle -labsl_bad_optional_access
  -labsl_strerror -labsl_bad_variant_access -labsl_str_format_internal -labsl_synchronization
  -labsl_graphcycles_internal -labsl_stacktrace -labsl_symbolize -labsl_debugging_internal
  -labsl_demangle_internal -labsl_malloc_internal -labsl_time -labsl_civil_time -labsl_time_zone
  -labsl_strings -labsl_strings_internal -labsl_base -labsl_spinlock_wait -labsl_int128
  -labsl_throw_delegate -labsl_raw_logging_internal -labsl_log_severity -lpthread
)
SANITIZE=(-fsanitize=address,undefined -fno-sanitize-recover=all)
CXXFLAGS=(-std=c++20 -O1 -g -fno-omit-frame-pointer "${SANITIZE[@]}" -fsanitize=fuzzer-no-link
  -I"$ROOT" -I"$OUT/gen" -Wall -Wno-unused-parameter)

# Generated message code (no gRPC stubs: the targets only parse and build messages). protoc
# rewrites files in a scratch directory; only changed ones replace the old, keeping mtimes stable.
mkdir -p "$OUT/gen" "$OUT/obj" "$OUT/bin"
scratch="$(mktemp -d)"
trap 'rm -rf "$scratch"' EXIT
proto_files=()
for p in "${PROTOS[@]}"; do proto_files+=("$ROOT/proto/moe/v1/$p.proto"); done
protoc -I"$ROOT/proto" --cpp_out="$scratch" "${proto_files[@]}"
(cd "$scratch" && find . -type f) | while read -r f; do
  mkdir -p "$OUT/gen/$(dirname "$f")"
  cmp -s "$scratch/$f" "$OUT/gen/$f" || cp "$scratch/$f" "$OUT/gen/$f"
done

# A change of compiler flags invalidates every object.
flags_now="$("$CXX" --version | head -1) ${CXXFLAGS[*]}"
if [[ ! -f "$OUT/flags" || "$(cat "$OUT/flags")" != "$flags_now" ]]; then
  rm -rf "$OUT/obj" && mkdir -p "$OUT/obj"
  printf '%s' "$flags_now" >"$OUT/flags"
fi

# source path (absolute) -> object path
obj_of() {
  local rel="${1#"$ROOT"/}"
  rel="${rel#"$OUT"/}"
  echo "$OUT/obj/${rel%.cc}.o"
}

# True when the object is missing or older than its source or anything its depfile lists.
stale() {
  local src="$1" obj; obj="$(obj_of "$src")"
  [[ -f "$obj" && -f "${obj%.o}.d" ]] || return 0
  local dep
  for dep in $(sed -e 's/\\$//' -e 's/^[^:]*://' "${obj%.o}.d"); do
    [[ -e "$dep" && ! "$dep" -nt "$obj" ]] || return 0
  done
  return 1
}

SRCS=()
for s in "${LIB_SRCS[@]}"; do SRCS+=("$ROOT/$s"); done
for t in "${TARGETS[@]}"; do SRCS+=("$ROOT/tests/fuzz/${t}_fuzzer.cc"); done
SRCS+=("$ROOT/tests/fuzz/make_seeds.cc")
for p in "${PROTOS[@]}"; do SRCS+=("$OUT/gen/moe/v1/$p.pb.cc"); done

todo=()
for s in "${SRCS[@]}"; do
  [[ -f "$s" ]] || die "missing source $s"
  if stale "$s"; then todo+=("$s"); fi
done
if ((${#todo[@]})); then
  say "compiling ${#todo[@]} of ${#SRCS[@]} sources with $CXX (${JOBS} jobs)"
  export CXX OUT ROOT
  export CXXFLAGS_STR="${CXXFLAGS[*]}"
  compile_one() {
    local src="$1" rel="${1#"$ROOT"/}"
    rel="${rel#"$OUT"/}"
    local obj="$OUT/obj/${rel%.cc}.o"
    mkdir -p "$(dirname "$obj")"
    # shellcheck disable=SC2086
    $CXX $CXXFLAGS_STR -MMD -MF "${obj%.o}.d" -c "$src" -o "$obj.tmp" && mv "$obj.tmp" "$obj"
  }
  export -f compile_one
  printf '%s\0' "${todo[@]}" | xargs -0 -P "$JOBS" -n 1 bash -c 'compile_one "$1"' _ ||
    die "compilation failed"
fi

LIB_OBJS=()
for s in "${LIB_SRCS[@]}"; do LIB_OBJS+=("$(obj_of "$ROOT/$s")"); done
for p in "${PROTOS[@]}"; do LIB_OBJS+=("$(obj_of "$OUT/gen/moe/v1/$p.pb.cc")"); done

# Links `bin` from `objs` when any of them is newer; `mode` is the link-time sanitizer list.
link() {
  local bin="$1" mode="$2"; shift 2
  local newest=0 o
  if [[ -f "$bin" ]]; then
    for o in "$@"; do [[ "$o" -nt "$bin" ]] && newest=1; done
    ((newest)) || return 0
  fi
  "$CXX" "$mode" "$@" "${LIBS[@]}" -o "$bin.tmp" && mv "$bin.tmp" "$bin"
  say "linked ${bin#"$OUT"/}"
}
for t in "${TARGETS[@]}"; do
  link "$OUT/bin/${t}_fuzzer" -fsanitize=fuzzer,address,undefined \
    "$(obj_of "$ROOT/tests/fuzz/${t}_fuzzer.cc")" "${LIB_OBJS[@]}"
done
# The seed generator has its own main: coverage hooks without the libFuzzer driver.
link "$OUT/bin/make_seeds" -fsanitize=fuzzer-no-link,address,undefined \
  "$(obj_of "$ROOT/tests/fuzz/make_seeds.cc")" "${LIB_OBJS[@]}"
say "targets in ${OUT}/bin: ${TARGETS[*]/%/_fuzzer}"
