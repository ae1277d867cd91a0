#!/usr/bin/env bash
# The Python package as a user gets it: copies client/python and proto/ out of the runfiles,
# creates a fresh venv over Debian's python3-grpcio / python3-numpy / python3-protobuf
# (/usr/bin/python3 -m venv --system-site-packages), pip-installs the package offline (its build
# generates the gRPC stubs), then, from outside the source tree:
#   - the unit tests (tests/test_dispatch.py);
#   - test_cluster.py against moe_coordinator + 2 moe_shard processes (8 experts in 24 slots: three
#     replicas each, so the replica hash decides the shard) and a standalone moe_shard hosting
#     every expert (the reference);
#   - the README's Python example, extracted from README.md and run verbatim.
# Servers bind port 0 and are stopped on every exit.
set -euo pipefail

RUNFILES="${TEST_SRCDIR:?run under bazel test}/moe_serve"
WORK="$(mktemp -d "${TEST_TMPDIR:?}/pyclient.XXXXXX")"
PIDS=()

# shellcheck source=tests/lib/servers.sh
source "$RUNFILES/tests/lib/servers.sh"
trap stop_servers EXIT
trap 'exit 143' TERM INT

# --- install into a fresh venv ------------------------------------------------------------------
mkdir -p "$WORK/src/client"
cp -rL "$RUNFILES/client/python" "$WORK/src/client/python"
cp -rL "$RUNFILES/proto" "$WORK/src/proto"
chmod -R u+w "$WORK/src"
/usr/bin/python3 -m venv --system-site-packages --without-pip "$WORK/venv"
PY="$WORK/venv/bin/python"
"$PY" -m pip install --quiet --no-index --no-build-isolation --no-deps "$WORK/src/client/python"
"$PY" -m pip show --files moe-serve-client |
  grep -E "^(Name|Version|Location)|_generated/moe/v1/shard_pb2"

cd "$WORK"  # away from the sources: every import must come from the venv
"$PY" -m unittest discover -s "$WORK/src/client/python/tests" -p test_dispatch.py -v 2>&1

# --- the cluster and the reference ------------------------------------------------------------
"$RUNFILES/client/moectl/moectl" gen-model --out "$WORK/model" --format mxfp4 --layers 2 \
  --experts 8 --top_k 2 --hidden 128 --intermediate 64 --files 2 --seed 23 >/dev/null
"$RUNFILES/server/coordinator/moe_coordinator" --port 0 --port_file "$WORK/coordinator.port" \
  --num_shards 2 --redundant_slots 16 2>"$WORK/coordinator.log" &
PIDS+=($!)
COORDINATOR="127.0.0.1:$(wait_port "$WORK/coordinator.port" "${PIDS[0]}")"
# Rank 0 also serves direct TCP channels (transport="tcp"); rank 1 does not (the gRPC fallback).
for rank in 0 1; do
  tcp=()
  ((rank == 0)) && tcp=(--tcp_channel)
  "$RUNFILES/server/shard/moe_shard" --model "$WORK/model" --coordinator "$COORDINATOR" \
    --port 0 --port_file "$WORK/shard$rank.port" --rank "$rank" --backend cpu "${tcp[@]}" \
    2>"$WORK/shard$rank.log" &
  PIDS+=($!)
done
"$RUNFILES/server/shard/moe_shard" --model "$WORK/model" --port 0 \
  --port_file "$WORK/reference.port" --backend cpu 2>"$WORK/reference.log" &
PIDS+=($!)
for rank in 0 1; do wait_port "$WORK/shard$rank.port" "${PIDS[$((rank + 1))]}" >/dev/null; done
REFERENCE="127.0.0.1:$(wait_port "$WORK/reference.port" "${PIDS[3]}")"

MOE_TEST_COORDINATOR="$COORDINATOR" MOE_TEST_REFERENCE="$REFERENCE" \
  "$PY" -m unittest discover -s "$WORK/src/client/python/tests" -p test_cluster.py -v 2>&1 |
  tee "$WORK/cluster_tests.out"
grep -qE "^Ran [0-9]+ tests" "$WORK/cluster_tests.out"
! grep -q "skipped" "$WORK/cluster_tests.out" || { echo "cluster tests were skipped"; exit 1; }

# --- the README example, verbatim ---------------------------------------------------------------
"$PY" - "$WORK/src/client/python/README.md" >"$WORK/example.py" <<'EOF'
import re, sys
blocks = re.findall(r"^```python\n(.*?)^```$", open(sys.argv[1]).read(), re.S | re.M)
assert len(blocks) == 1, "README.md should have exactly one python block, has %d" % len(blocks)
sys.stdout.write(blocks[0])
EOF
echo "README example ($(grep -c . "$WORK/example.py") lines):"
MOE_COORDINATOR="$COORDINATOR" "$PY" "$WORK/example.py" | tee "$WORK/example.out"
grep -qE '^\(4, 128\) [0-9]+$' "$WORK/example.out"
echo "PASS"
