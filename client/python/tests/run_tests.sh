#!/usr/bin/env bash
# The Python package as a user gets it: copies client/python and proto/ out of the runfiles,
# creates a fresh venv over Debian's python3-grpcio / python3-numpy / python3-protobuf
# (/usr/bin/python3 -m venv --system-site-packages), pip-installs the package offline (its build
# generates the gRPC stubs), then, from outside the source tree:
#   - the unit tests (tests/test_dispatch.py);
#   - test_cluster.py against moe_coordinator + 2 moe_shard processes (8 experts in 24 slots: three
#     replicas each, so the replica hash decides the shard) and a standalone moe_shard hosting
#     every expert (the reference);
#   - test_secure.py against a secured coordinator + shard (a throw-away PKI made with the
#     openssl command-line tool: TLS, client certificates required, bearer tokens);
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

# --- a secured cluster: TLS, client certificates required, bearer tokens ----------------------
PKI="$WORK/pki"
mkdir -p "$PKI"
(
  cd "$PKI"
  for ca in ca rogue_ca; do
    openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -keyout "$ca.key" \
      -out "$ca.pem" -days 2 -subj "/CN=$ca" 2>>openssl.log
  done
  for leaf in node:ca rogue:rogue_ca; do
    name=${leaf%%:*} ca=${leaf##*:}
    printf 'subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth,clientAuth\n' \
      >"$name.ext"
    openssl req -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -keyout "$name.key" \
      -out "$name.csr" -subj "/CN=$name" 2>>openssl.log
    openssl x509 -req -in "$name.csr" -CA "$ca.pem" -CAkey "$ca.key" -CAcreateserial \
      -out "$name.pem" -days 2 -extfile "$name.ext" 2>>openssl.log
  done
  printf 'frontend py-frontend-5d1e web\ninternal py-internal-0b7c nodes\n' >tokens.txt
  echo py-internal-0b7c >internal_token.txt
)
SECURE=(--tls_cert "$PKI/node.pem" --tls_key "$PKI/node.key" --tls_ca "$PKI/ca.pem"
  --tls_require_client_cert --auth_tokens_file "$PKI/tokens.txt"
  --auth_token_file "$PKI/internal_token.txt")
"$RUNFILES/server/coordinator/moe_coordinator" --port 0 --port_file "$WORK/secure_coordinator.port" \
  --num_shards 1 "${SECURE[@]}" 2>"$WORK/secure_coordinator.log" &
PIDS+=($!)
SECURE_COORDINATOR="127.0.0.1:$(wait_port "$WORK/secure_coordinator.port" "${PIDS[-1]}")"
"$RUNFILES/server/shard/moe_shard" --model "$WORK/model" --coordinator "$SECURE_COORDINATOR" \
  --port 0 --port_file "$WORK/secure_shard.port" --backend cpu --tcp_channel "${SECURE[@]}" \
  2>"$WORK/secure_shard.log" &
PIDS+=($!)
wait_port "$WORK/secure_shard.port" "${PIDS[-1]}" >/dev/null
MOE_TEST_SECURE_COORDINATOR="$SECURE_COORDINATOR" MOE_TEST_REFERENCE="$REFERENCE" \
  MOE_TEST_PKI="$PKI" MOE_TEST_FRONTEND_TOKEN=py-frontend-5d1e \
  "$PY" -m unittest discover -s "$WORK/src/client/python/tests" -p test_secure.py -v 2>&1 |
  tee "$WORK/secure_tests.out"
grep -qE "^Ran [0-9]+ tests" "$WORK/secure_tests.out"
! grep -q "skipped" "$WORK/secure_tests.out" || { echo "secure cluster tests were skipped"; exit 1; }
grep -q "tcp channel: connection opened" "$WORK/secure_shard.log" ||
  { echo "the secured shard opened no TCP channel"; exit 1; }

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
