#!/usr/bin/env bash
# Builds the CUDA test and benchmark binaries here and runs them on the GPU machine.
#
#   bench/gpu_bundle.sh make        # here: bazel build (CUDA on), copy binaries, the shared
#                                   # libraries they need and the kernel objects into .bundle/
#   bench/gpu_bundle.sh run [args]  # there (from the repo root, OUT set): device probe, GPU
#                                   # tests, kernel_bench (args passed on);
#                                   # SANITIZE=<gtest filter> adds a compute-sanitizer memcheck;
#                                   # NCU="64 4096" profiles the first two GEMMs at those sizes
#
# .bundle/ (or $BUNDLE_DIR, so several bundles can sit side by side) is git-ignored; hand it to
# the device tool as a carried path. The stripped binaries are ~127 MB (each holds the fatbin),
# over the tool's 64 MiB transfer limit, so `make` leaves them as one xz archive (.bundle/b.txz,
# ~60 MB) and `run` unpacks it. Each step is bounded by
# `timeout` so one hang cannot eat the whole call.
set -uo pipefail
cd "$(dirname "$0")/.."
B="${BUNDLE_DIR:-.bundle}"
mode="${1:-}"
shift || true

make_bundle() {
  set -e
  bazel build //kernels/cuda:device_test //kernels/cuda:experts_cuda_test \
    //kernels/cuda:staging_cuda_test //kernels/cuda:cuda_backend_versions_test \
    //server/shard:cuda_ipc_test //bench:kernel_bench //bench:staging_bench
  rm -rf "$B" && mkdir -p "$B"/lib
  cp bazel-bin/kernels/cuda/{device_test,experts_cuda_test,staging_cuda_test,cuda_backend_versions_test} "$B"/
  cp bazel-bin/server/shard/cuda_ipc_test "$B"/
  cp bazel-bin/bench/{kernel_bench,staging_bench} "$B"/
  # Shared libraries outside glibc/libstdc++ (the GPU machine has newer ones of those).
  ldd "$B"/{device_test,experts_cuda_test,staging_cuda_test,cuda_backend_versions_test,cuda_ipc_test,kernel_bench,staging_bench} | awk '/=>/ {print $3}' |
    sort -u | grep -Ev '/(libc|libm|libpthread|libdl|librt|libstdc\+\+|libgcc_s)\.so' |
    xargs -r cp -L -t "$B"/lib/
  git rev-parse --short HEAD > "$B"/commit
  if ! git diff --quiet HEAD -- kernels bench; then echo "+uncommitted" >> "$B"/commit; fi
  chmod u+w "$B"/*
  strip "$B"/{device_test,experts_cuda_test,staging_cuda_test,cuda_backend_versions_test,cuda_ipc_test,kernel_bench,staging_bench}
  # xz: the seven binaries each hold the ~17 MB fatbin; gzip left 71 MB (over the transfer limit).
  tar cf - -C "$B" . | xz -T0 -6 > /tmp/moe_gpu_bundle.txz
  rm -rf "$B" && mkdir "$B" && mv /tmp/moe_gpu_bundle.txz "$B"/b.txz
  du -sh "$B"
}

run_bundle() {
  local out="${OUT:-/tmp/out}"
  mkdir -p "$out"
  if [[ -f "$B"/b.txz && ! -x "$B"/kernel_bench ]]; then tar xJf "$B"/b.txz -C "$B"; fi
  export LD_LIBRARY_PATH="$PWD/$B/lib:${LD_LIBRARY_PATH:-}"
  local commit
  commit="$(tr '\n' ' ' < "$B"/commit)"
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu \
    --format=csv | tee "$out/gpu.txt"
  timeout 60 "$B"/device_test 2>&1 | tail -3
  timeout 60 "$B"/staging_cuda_test > "$out/staging_cuda_test.log" 2>&1
  grep -E "FAILED|PASSED|Failure" "$out/staging_cuda_test.log"
  timeout 60 "$B"/cuda_backend_versions_test > "$out/cuda_backend_versions_test.log" 2>&1
  grep -E "FAILED|PASSED|Failure|during upload" "$out/cuda_backend_versions_test.log"
  timeout 120 "$B"/cuda_ipc_test > "$out/cuda_ipc_test.log" 2>&1
  grep -E "FAILED|PASSED|Failure|client:" "$out/cuda_ipc_test.log"
  timeout 240 "$B"/experts_cuda_test > "$out/experts_cuda_test.log" 2>&1
  grep -E "FAILED|PASSED|Failure|error" "$out/experts_cuda_test.log"
  awk '/cuda-vs-ref/ {n++; split($5, a, "="); if (a[2] + 0 > m) m = a[2] + 0}
       END {print n " comparisons, max rel_err " m}' "$out/experts_cuda_test.log"
  timeout 240 "$B"/kernel_bench --commit="$commit" --out_json="$out/kernel_bench.json" "$@" \
    2>&1 | tee "$out/kernel_bench.log"
  timeout 60 "$B"/staging_bench --commit="$commit" --out_json="$out/staging_bench.json" \
    2>&1 | tee "$out/staging_bench.log"
  if [[ -n "${SANITIZE:-}" ]] && command -v compute-sanitizer > /dev/null; then
    timeout 100 compute-sanitizer --tool memcheck "$B"/experts_cuda_test \
      --gtest_filter="$SANITIZE" > "$out/memcheck.log" 2>&1
    tail -4 "$out/memcheck.log"
  fi
  if [[ -n "${NCU:-}" ]] && command -v ncu > /dev/null; then
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
}

case "$mode" in
  make) make_bundle ;;
  run) run_bundle "$@" ;;
  *)
    echo "usage: $0 make | run [kernel_bench flags]" >&2
    exit 2
    ;;
esac
