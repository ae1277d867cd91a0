#!/usr/bin/env bash
# Starts a moe_coordinator and two moe_shard processes on port 0, serving a model written by
# `moectl gen-model` with 8 experts in 24 slots (every expert has three replicas, so the replica
# hash matters); generates Python stubs from proto/moe/v1 with protoc and grpc_python_plugin; runs
# client_test.py with Debian's /usr/bin/python3 (python3-grpcio, python3-numpy), not the pyenv
# python3 first on PATH. The exit code is the Python test's; the servers are stopped on every exit.
set -euo pipefail

RUNFILES="${TEST_SRCDIR:?run under bazel test}/moe_serve"
WORK="$(mktemp -d "${TEST_TMPDIR:?}/pyclient.XXXXXX")"
PIDS=()

# shellcheck source=tests/lib/servers.sh
source "$RUNFILES/tests/lib/servers.sh"
trap stop_servers EXIT
trap 'exit 143' TERM INT  # so that a killed test still stops its servers

"$RUNFILES/client/moectl/moectl" gen-model --out "$WORK/model" --format mxfp4 --layers 2 \
  --experts 8 --top_k 2 --hidden 128 --intermediate 64 --files 1 --seed 41 >/dev/null

mkdir -p "$WORK/gen"
/usr/bin/protoc --python_out="$WORK/gen" --grpc_out="$WORK/gen" \
  --plugin=protoc-gen-grpc=/usr/bin/grpc_python_plugin -I "$RUNFILES/proto" \
  "$RUNFILES"/proto/moe/v1/*.proto

"$RUNFILES/server/coordinator/moe_coordinator" --port 0 --port_file "$WORK/coordinator.port" \
  --num_shards 2 --redundant_slots 16 2>"$WORK/coordinator.log" &
PIDS+=($!)
COORDINATOR="127.0.0.1:$(wait_port "$WORK/coordinator.port" "${PIDS[0]}")"
for rank in 0 1; do
  "$RUNFILES/server/shard/moe_shard" --model "$WORK/model" --coordinator "$COORDINATOR" \
    --port 0 --port_file "$WORK/shard$rank.port" --rank "$rank" --backend cpu \
    2>"$WORK/shard$rank.log" &
  PIDS+=($!)
done
for rank in 0 1; do
  wait_port "$WORK/shard$rank.port" "${PIDS[$((rank + 1))]}" >/dev/null
done

PYTHONPATH="$WORK/gen" /usr/bin/python3 "$RUNFILES/tests/python/client_test.py" \
  --coordinator "$COORDINATOR" -v
