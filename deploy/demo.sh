#!/usr/bin/env bash
# The moe-serve demo: a local cluster (coordinator + CPU shards) on a generated model, a verified
# client workload, the load table, then a clean shutdown. Run through `./moe demo`, which builds
# the binaries first, or as bin/moe-demo of an extracted runtime bundle (`./moe bundle`), which
# runs the bundle's launchers.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [[ -x "$ROOT/bin/moe-shard" ]]; then  # an extracted bundle: this script is bin/moe-demo
  COORDINATOR_BIN="$ROOT/bin/moe-coordinator"
  SHARD_BIN="$ROOT/bin/moe-shard"
  MOECTL_BIN="$ROOT/bin/moectl"
  MODEL_CACHE=""  # the bundle may be read-only: the model goes to the run's temporary directory
  BUILD_HINT="the bundle is incomplete; extract it again"
else
  COORDINATOR_BIN="$ROOT/bazel-bin/server/coordinator/moe_coordinator"
  SHARD_BIN="$ROOT/bazel-bin/server/shard/moe_shard"
  MOECTL_BIN="$ROOT/bazel-bin/client/moectl/moectl"
  MODEL_CACHE="$ROOT/.cache"
  BUILD_HINT="run ./moe demo (it builds first)"
fi

FORMAT=mxfp4
SHARDS=2
REDUNDANT=2
STEPS=240
TOKENS=16
CLIENTS=2
SKEW=1.2
BACKEND=cpu
MODEL=""

usage() {
  cat <<'USAGE'
usage: ./moe demo [--format mxfp4|nvfp4] [--shards N] [--redundant R] [--steps N]
                  [--tokens T] [--clients C] [--skew Z] [--backend cpu|cuda|auto] [--model DIR]

Starts moe_coordinator and N moe_shard processes on free loopback ports, generates a small model
(unless --model names one), runs `moectl workload`: STEPS routed forwards of T tokens over every
MoE layer from C concurrent client threads, with Zipf-like routing skew Z and ~5% padding tokens.
Every output is checked against the in-process CPU reference (the worst relative error is printed);
then throughput, latency percentiles and the coordinator's per-layer load table, whose counts must
equal the client's own exactly. Everything is shut down at the end; the exit code is 0 only if
every check passed.

  --format     mxfp4 (gpt-oss layout, SWIGLUOAI, biases, interleaved gate/up; default) or
               nvfp4 (ModelOpt layout, SILU, concatenated gate/up, shared expert)
  --shards     shard processes (default 2)
  --redundant  redundant EPLB slots, so some experts have two replicas (default 2)
  --steps      forwards in total (default 240)
  --tokens     tokens per forward (default 16)
  --clients    concurrent client threads (default 2)
  --skew       routing skew exponent (default 1.2; 0 = the router's own choice)
  --backend    shard backend (default cpu)
  --model      serve this checkpoint instead of the generated one
USAGE
}

while (($#)); do
  case "$1" in
    -h|--help) usage; exit 0 ;;
    --format) FORMAT="$2"; shift 2 ;;
    --shards) SHARDS="$2"; shift 2 ;;
    --redundant) REDUNDANT="$2"; shift 2 ;;
    --steps) STEPS="$2"; shift 2 ;;
    --tokens) TOKENS="$2"; shift 2 ;;
    --clients) CLIENTS="$2"; shift 2 ;;
    --skew) SKEW="$2"; shift 2 ;;
    --backend) BACKEND="$2"; shift 2 ;;
    --model) MODEL="$2"; shift 2 ;;
    *) echo "demo: unknown argument '$1'" >&2; usage >&2; exit 2 ;;
  esac
done

for b in "$COORDINATOR_BIN" "$SHARD_BIN" "$MOECTL_BIN"; do
  [[ -x "$b" ]] || { echo "demo: $b missing; $BUILD_HINT" >&2; exit 1; }
done

WORK="$(mktemp -d)"
PIDS=()
cleanup() {
  for pid in "${PIDS[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
  for pid in "${PIDS[@]}"; do wait "$pid" 2>/dev/null || true; done
  rm -rf "$WORK"
}
trap cleanup EXIT

if [[ -z "$MODEL" ]]; then
  MODEL="${MODEL_CACHE:-$WORK}/demo-model-$FORMAT"
  if [[ ! -f "$MODEL/config.json" ]]; then
    extra=()
    [[ "$FORMAT" == nvfp4 ]] && extra=(--shared_experts=1)
    "$MOECTL_BIN" gen-model --out "$MODEL" --format "$FORMAT" --layers 4 \
      --experts 16 --top_k 4 --hidden 512 --intermediate 256 --files 2 "${extra[@]}"
  fi
fi

# Waits (bounded) until a process has written its port file.
wait_port() {
  local file="$1" pid="$2"
  for _ in $(seq 1 600); do
    [[ -s "$file" ]] && { cat "$file"; return 0; }
    kill -0 "$pid" 2>/dev/null || { echo "demo: process $pid exited early" >&2; return 1; }
    sleep 0.05
  done
  echo "demo: timed out waiting for $file" >&2
  return 1
}

echo "== starting coordinator and $SHARDS shards (model $MODEL, backend $BACKEND)"
"$COORDINATOR_BIN" --port 0 --port_file "$WORK/coord.port" \
  --num_shards "$SHARDS" --redundant_slots "$REDUNDANT" 2>"$WORK/coordinator.log" &
PIDS+=($!)
COORD="127.0.0.1:$(wait_port "$WORK/coord.port" "${PIDS[0]}")"
for i in $(seq 0 $((SHARDS - 1))); do
  "$SHARD_BIN" --model "$MODEL" --coordinator "$COORD" --port 0 \
    --port_file "$WORK/shard$i.port" --rank "$i" --backend "$BACKEND" 2>"$WORK/shard$i.log" &
  PIDS+=($!)
done
for i in $(seq 0 $((SHARDS - 1))); do
  wait_port "$WORK/shard$i.port" "${PIDS[$((i + 1))]}" >/dev/null
done
"$MOECTL_BIN" map --coordinator "$COORD" | head -n $((SHARDS + 1))

echo "== workload: $STEPS forwards x $TOKENS tokens, $CLIENTS clients, skew $SKEW"
status=0
"$MOECTL_BIN" workload --coordinator "$COORD" --model "$MODEL" --steps "$STEPS" \
  --tokens "$TOKENS" --clients "$CLIENTS" --skew "$SKEW" || status=$?
if ((status != 0)); then
  echo "== demo FAILED; last log lines:" >&2
  tail -n 5 "$WORK"/*.log >&2
  exit "$status"
fi
echo "== shutting down"
exit 0
