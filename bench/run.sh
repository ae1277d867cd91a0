#!/usr/bin/env bash
# Runs one benchmark of bench/ (built with -c opt) and records its JSON in bench/results/.
# Called by `./moe bench NAME [ARGS...]`; without NAME it lists the benchmarks.
set -euo pipefail
cd "$(dirname "$0")/.."

usage() {
  cat <<'USAGE'
usage: ./moe bench NAME [ARGS...]

  cpu        bench/cpu_bench: optimized CPU backend vs the reference, problem D and gpt-oss shapes
  cpu-peer   bench/cpu_peer.py: problem D beside ggml's MUL_MAT_ID on this host, alternating
             rounds (--ggml_bin: a test-backend-ops built from a ggml checkout outside the repo)
  eplb       bench/eplb_bench: EPLB planner quality and planning time on the Zipf trace
  rpc        bench/rpc_bench: Forward transport (protobuf, raw buffers, shared memory)
  metrics    bench/metrics_bench: cost of the metrics hooks and scrapes
  kernel     bench/kernel_bench: CUDA expert path, problems A/B/C (needs a GPU; see
             bench/gpu_bundle.sh for running it on the GPU machine)
  staging    bench/staging_bench: CUDA staging kernels (needs a GPU)
  fuzz       bench/fuzz/run.sh: libFuzzer targets (same as ./moe fuzz)
  sass       bench/sass_budget.py: static SASS instruction budget of the CUDA GEMM main loops
             (no GPU needed: nvcc here, cuobjdump from its PyPI wheel)

ARGS go to the benchmark (each answers --help). Results land in bench/results/.
USAGE
}

name="${1:-}"
shift || true
case "$name" in
  cpu|eplb|rpc|metrics|kernel|staging) target="//bench:${name}_bench" ;;
  fuzz) exec bench/fuzz/run.sh "$@" ;;
  cpu-peer) exec python3 bench/cpu_peer.py "$@" ;;
  sass) exec python3 bench/sass_budget.py "$@" ;;
  ""|-h|--help) usage; exit 0 ;;
  *) usage >&2; echo "bench: unknown benchmark '$name'" >&2; exit 2 ;;
esac
config=()
if [[ "${MOE_NOCUDA:-0}" == 1 ]] || ! command -v /usr/local/cuda/bin/nvcc >/dev/null; then
  config=(--config=nocuda)
fi
bazel build -c opt "${config[@]}" "$target"
exec "bazel-bin/bench/${name}_bench" "$@"
