#!/usr/bin/env bash
# Builds the CUDA test and benchmark binaries here and runs them on the GPU machine.
#
#   bench/gpu_bundle.sh make        # here: bazel build (CUDA on), copy binaries and the shared
#                                   # libraries they need into .bundle/ (one xz archive)
#   bench/gpu_bundle.sh run [args]  # there (from the repo root, OUT set): device probe, the GPU
#                                   # tests and benchmarks present in the bundle (kernel_bench
#                                   # gets the args); SANITIZE=<gtest filter> adds a
#                                   # compute-sanitizer memcheck; NCU="64 4096" profiles the first
#                                   # two GEMMs at those sizes; POWER="A:512:6000" runs points
#                                   # sustained with power and clock sampling; RPC="<args>"
#                                   # runs rpc_bench (when bundled) with those arguments;
#                                   # STAGING="<args>" passes arguments to staging_bench
#
# .bundle/ (or $BUNDLE_DIR, so several bundles can sit side by side) is git-ignored; hand it to
# the device tool as a carried path. BUNDLE_TARGETS picks the binaries (default: all of
# device_test backend_test experts_cuda_test staging_cuda_test device_copy_cuda_test
# cuda_backend_versions_test cuda_ipc_test kernel_bench staging_bench; rpc_bench on request).
# Each but device_test holds the same ~17 MB kernel
# fatbin (the seven targets before backend_test stripped were ~127 MB); xz with a dictionary
# larger than the archive stores the repeated fatbin once (~16 MB, against ~60 MB with xz's
# default 8 MiB dictionary; unpacking needs ~200 MB of memory). `make` refuses an archive over
# the tool's 64 MiB transfer limit (name fewer targets).
# Each step of `run` is bounded by `timeout` so one hang cannot eat the whole call. PACK=1 packs
# $OUT into one out.tgz at the end (set it on the device tool: it returns at most 8 files).
set -uo pipefail
cd "$(dirname "$0")/.."
B="${BUNDLE_DIR:-.bundle}"
mode="${1:-}"
shift || true

ALL_TARGETS=(device_test backend_test experts_cuda_test staging_cuda_test device_copy_cuda_test
  cuda_backend_versions_test cuda_ipc_test kernel_bench staging_bench)

label_of() {
  case "$1" in
    cuda_ipc_test) echo //server/shard:cuda_ipc_test ;;
    backend_test) echo //kernels:backend_test ;;
    kernel_bench | staging_bench | rpc_bench) echo "//bench:$1" ;;
    *) echo "//kernels/cuda:$1" ;;
  esac
}

make_bundle() {
  set -e
  local targets labels=() name
  read -r -a targets <<< "${BUNDLE_TARGETS:-${ALL_TARGETS[*]}}"
  for name in "${targets[@]}"; do labels+=("$(label_of "$name")"); done
  bazel build "${labels[@]}"
  rm -rf "$B" && mkdir -p "$B"/lib
  for name in "${targets[@]}"; do
    cp "bazel-bin/$(label_of "$name" | sed -E 's|^//||; s|:|/|')" "$B"/
  done
  # Shared libraries outside glibc/libstdc++ (the GPU machine has newer ones of those).
  for name in "${targets[@]}"; do ldd "$B/$name"; done | awk '/=>/ {print $3}' | sort -u |
    grep -Ev '/(libc|libm|libpthread|libdl|librt|libstdc\+\+|libgcc_s)\.so' |
    xargs -r cp -L -t "$B"/lib/
  # OpenSSL apart: run uses the GPU machine's own where it has one (faster there, as the release
  # bundle's launchers do).
  mkdir -p "$B"/lib/openssl
  for f in "$B"/lib/libssl.so.3 "$B"/lib/libcrypto.so.3; do [[ -f "$f" ]] && mv "$f" "$B"/lib/openssl/; done
  git rev-parse --short HEAD > "$B"/commit
  if ! git diff --quiet HEAD -- kernels bench third_party; then echo "+uncommitted" >> "$B"/commit; fi
  chmod u+w "$B"/*
  # NOSTRIP="rpc_bench ..." keeps those symbol tables (a crash's stack then names functions).
  for name in "${targets[@]}"; do [[ " ${NOSTRIP:-} " == *" $name "* ]] || strip "$B/$name"; done
  tar cf - -C "$B" . | xz -T0 --lzma2=preset=6,dict=192MiB > /tmp/moe_gpu_bundle.txz
  rm -rf "$B" && mkdir "$B" && mv /tmp/moe_gpu_bundle.txz "$B"/b.txz
  du -sh "$B"
  if (($(stat -c %s "$B"/b.txz) > 64 * 1024 * 1024)); then
    echo "$B/b.txz is over the device tool's 64 MiB transfer limit: set BUNDLE_TARGETS to fewer" \
      "of: ${ALL_TARGETS[*]}" >&2
    return 1
  fi
}

run_bundle() {
  local out="${OUT:-/tmp/out}"
  mkdir -p "$out"
  # Always unpack: binaries left from an earlier call may still sit beside a newer archive.
  if [[ -f "$B"/b.txz ]]; then tar xJf "$B"/b.txz -C "$B"; fi
  has() { [[ -x "$B/$1" ]]; }
  export LD_LIBRARY_PATH="$PWD/$B/lib:${LD_LIBRARY_PATH:-}"
  if ! { ldconfig -p || /sbin/ldconfig -p; } 2>/dev/null | grep -q 'libcrypto\.so\.3 '; then
    LD_LIBRARY_PATH="$PWD/$B/lib/openssl:$LD_LIBRARY_PATH"
  fi
  local commit
  commit="$(tr '\n' ' ' < "$B"/commit)"
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu \
    --format=csv | tee "$out/gpu.txt"
  has device_test && timeout 60 "$B"/device_test 2>&1 | tail -3
  # A GPU test, when in the bundle: its log into $OUT, the lines matching the pattern shown.
  run_logged() {
    local name="$1" limit="$2" pattern="$3"
    has "$name" || return 0
    timeout "$limit" "$B/$name" > "$out/$name.log" 2>&1
    grep -E "$pattern" "$out/$name.log"
  }
  run_logged backend_test 60 "FAILED|PASSED|Failure"
  run_logged staging_cuda_test 180 "FAILED|PASSED|Failure"
  run_logged device_copy_cuda_test 60 "FAILED|PASSED|Failure"
  run_logged cuda_backend_versions_test 150 "FAILED|PASSED|Failure|during upload"
  run_logged cuda_ipc_test 120 "FAILED|PASSED|Failure|client:"
  run_logged experts_cuda_test 240 "FAILED|PASSED|Failure|error"
  if has experts_cuda_test; then
    awk '/cuda-vs-ref/ {n++; split($5, a, "="); if (a[2] + 0 > m) m = a[2] + 0}
         END {print n " comparisons, max rel_err " m}' "$out/experts_cuda_test.log"
  fi
  if has kernel_bench; then
    timeout 240 "$B"/kernel_bench --commit="$commit" --out_json="$out/kernel_bench.json" "$@" \
      2>&1 | tee "$out/kernel_bench.log"
  fi
  # RPC="--routes=uniform --backend=cuda ..." : the served latency of a generated layer through
  # an in-process shard (bench/rpc_bench.cc); several runs separated by ';'.
  if [[ -n "${RPC:-}" ]] && has rpc_bench; then
    local i=0 args
    IFS=';' read -r -a rpc_runs <<< "$RPC"
    for args in "${rpc_runs[@]}"; do
      i=$((i + 1))
      # shellcheck disable=SC2086  # the arguments are words on purpose
      timeout 400 "$B"/rpc_bench $args --out_json="$out/rpc_bench_$i.json" 2>&1 |
        tee "$out/rpc_bench_$i.log"
    done
  fi
  # STAGING="--nvfp4_variants=default,registers --small=false": staging_bench's arguments.
  if has staging_bench; then
    # shellcheck disable=SC2086  # the arguments are words on purpose
    timeout 120 "$B"/staging_bench --commit="$commit" --out_json="$out/staging_bench.json" \
      ${STAGING:-} 2>&1 | tee "$out/staging_bench.log"
  fi
  if [[ -n "${SANITIZE:-}" ]] && has experts_cuda_test && command -v compute-sanitizer > /dev/null; then
    timeout 100 compute-sanitizer --tool memcheck "$B"/experts_cuda_test \
      --gtest_filter="$SANITIZE" > "$out/memcheck.log" 2>&1
    tail -4 "$out/memcheck.log"
  fi
  # POWER="A:512:6000 A:1:100000 ..." (problem:tokens:replays): each point run long enough to
  # reach the steady state a serving GPU lives in, with nvidia-smi sampling power, SM clock and
  # the throttle reasons every 100 ms beside it (its power reading is a ~1 s average). Every
  # point but A 1 runs at the 700 W cap once warm (NOTES-cuda.md, tenth session), where time
  # follows energy per pass rather than instruction count.
  if [[ -n "${POWER:-}" ]] && has kernel_bench && command -v nvidia-smi > /dev/null; then
    for spec in ${POWER}; do
      IFS=: read -r prob toks reps <<< "$spec"
      local csv="$out/power_${prob}_${toks}.csv"
      nvidia-smi --format=csv,noheader -lms 100 \
        --query-gpu=timestamp,power.draw,clocks.sm,temperature.gpu,clocks_throttle_reasons.active \
        > "$csv" &
      local sampler=$!
      timeout 200 "$B"/kernel_bench --commit="$commit" --problem="$prob" --tokens="$toks" \
        --reps="$reps" --check_tokens=0 --extras=none \
        --out_json="$out/kernel_bench_power_${prob}_${toks}.json" 2>&1 | grep -E "^T="
      kill "$sampler" 2> /dev/null
      wait "$sampler" 2> /dev/null
      # 0x4 in the throttle reasons: the software power cap.
      awk -F', ' -v s="$spec" '
        $2 + 0 > 350 {
          n++; w += $2; c += $3
          if (min == 0 || $3 + 0 < min) min = $3 + 0
          if ($5 ~ /4$/) cap++
        }
        END {
          if (!n) { print s ": no sample over 350 W"; exit }
          printf "%s: %d samples over 350 W, mean %.0f W, SM clock mean %.0f min %d MHz, " \
                 "power cap in %d\n", s, n, w / n, c / n, min, cap
        }' "$csv"
    done
  fi
  if [[ -n "${NCU:-}" ]] && has kernel_bench && command -v ncu > /dev/null; then
    for t in ${NCU}; do
      timeout 150 ncu --clock-control none --kernel-name regex:GemmKernel --launch-count 2 \
        --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy \
        --section WarpStateStats --section SchedulerStats --section LaunchStats \
        "$B"/kernel_bench --tokens="$t" --reps=2 --check_tokens=0 --extras_max_tokens=0 \
        > "$out/ncu_T$t.txt" 2>&1
      grep -E "GemmKernel|DRAM Throughput|Memory Throughput|Achieved Occupancy|Issue Slots|Stall|Registers|Duration" \
        "$out/ncu_T$t.txt" | head -40
    done
  fi
  pack_out "$out"
}

# PACK=1: everything written under the output folder goes into one archive there, out.tgz, and
# the loose files are removed (the device tool brings back at most 8 files per call, and drops the
# rest without telling which it would have kept).
pack_out() {
  local out="$1" archive
  [[ "${PACK:-0}" == 1 ]] || return 0
  archive=$(mktemp --suffix=.tgz) && tar czf "$archive" -C "$out" . && rm -rf "${out:?}"/* &&
    mv "$archive" "$out"/out.tgz
  echo "packed into $out/out.tgz"
}

case "$mode" in
  make) make_bundle ;;
  run) run_bundle "$@" ;;
  *)
    echo "usage: $0 make | run [kernel_bench flags]" >&2
    exit 2
    ;;
esac
