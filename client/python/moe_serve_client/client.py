"""MoeClient: the Python side of moe-serve, mirroring the C++ MoeClient (client/client.h).

It keeps the cluster map (fetched from the coordinator, kept current by a WatchClusterMap thread),
plans which shard gets which tokens with the shards' own EPLB replica choice (dispatch.py), calls
the shards in parallel, and sums their partial outputs per token. Answers that say the map is
stale (FAILED_PRECONDITION "stale map version") or that a shard is unavailable are retried on a
refreshed map until the call's deadline.

Thread-safety: forward() may be called from several threads at once. Ownership: the client owns
its channels and watch thread; close() (or a `with` block) releases them.
"""

import collections
import dataclasses
import ssl
import threading
import time

import grpc
import numpy as np

from moe_serve_client import dispatch
from moe_serve_client import pb
from moe_serve_client import tcp_channel
from moe_serve_client import wire

MAX_MESSAGE_BYTES = 256 << 20  # the servers' limit too
# transport="auto": seconds before a shard whose TCP channel did not open is tried again.
_TCP_RETRY_AFTER = 30.0
# transport="auto" under TLS: the largest request (hidden-state bytes) sent over a TLS TCP
# channel; larger ones take the gRPC call (the C++ client's kTlsChannelMaxAutoPayload: a TLS
# channel costs ~4-8 us per 16 KB record and direction, NOTES-cuda.md).
_TLS_CHANNEL_MAX_AUTO_PAYLOAD = 64 << 10

_CHANNEL_OPTIONS = [("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)]
_WIRE_DTYPES = {"f32": (pb.tensor_pb2.F32, pb.shard_pb2.ACTIVATION_F32),
                "bf16": (pb.tensor_pb2.BF16, pb.shard_pb2.ACTIVATION_BF16)}


class MoeServeError(Exception):
    """A call the cluster refused or that ran out of time; `code` is the grpc.StatusCode."""

    def __init__(self, code, message):
        super().__init__("%s: %s" % (code.name, message))
        self.code = code
        self.message = message


@dataclasses.dataclass
class ForwardResult:
    output: np.ndarray  # float32 [T, H]: per token, the sum over every shard's routes
    map_version: int  # the map version the answer was computed under
    shards_called: int
    attempts: int


@dataclasses.dataclass
class LoadStats:
    """The coordinator's expert-load aggregation, as numpy arrays."""
    map_version: int
    expert_load: np.ndarray  # int64 [L, E], summed over replicas
    slot_load: np.ndarray  # int64 [L, P]
    shard_load: np.ndarray  # int64 [L, shards]
    balancedness: np.ndarray  # float64 [L]: mean / max shard load
    total_routes: int
    proto: object  # the moe.v1.LoadStats message (per-shard request counts...)


@dataclasses.dataclass
class _MapState:
    map: object  # moe.v1.ClusterMap
    layers: list  # dispatch.LayerPlacement per layer


class _CallDetails(collections.namedtuple(
        "_CallDetails", ("method", "timeout", "metadata", "credentials", "wait_for_ready",
                         "compression")), grpc.ClientCallDetails):
    pass


class _BearerToken(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
    """Adds "authorization: Bearer <token>" to every call (the servers' --auth_tokens_file)."""

    def __init__(self, token):
        self._header = ("authorization", "Bearer " + token)

    def _details(self, d):
        return _CallDetails(d.method, d.timeout, list(d.metadata or []) + [self._header],
                            d.credentials, getattr(d, "wait_for_ready", None),
                            getattr(d, "compression", None))

    def intercept_unary_unary(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)

    def intercept_unary_stream(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)


def _read(path):
    with open(path, "rb") as f:
        return f.read()


class _Security:
    """How the client reaches the servers: plaintext or TLS (verified with the CA in `tls_ca`,
    with a client certificate for mutual TLS), and an optional bearer token on every call."""

    def __init__(self, tls_ca=None, tls_cert=None, tls_key=None, auth_token=None):
        if (tls_cert is None) != (tls_key is None):
            raise ValueError("tls_cert and tls_key come together")
        if tls_cert is not None and tls_ca is None:
            raise ValueError("a client certificate (tls_cert) needs tls_ca")
        if auth_token is not None and not auth_token:
            raise ValueError("auth_token is empty")
        self.tls = tls_ca is not None
        self._credentials = None
        self.ssl_context = None  # verifies the shards' TLS TCP channels
        if self.tls:
            self._credentials = grpc.ssl_channel_credentials(
                root_certificates=_read(tls_ca),
                private_key=_read(tls_key) if tls_key else None,
                certificate_chain=_read(tls_cert) if tls_cert else None)
            self.ssl_context = ssl.create_default_context(cafile=tls_ca)
            if tls_cert:
                self.ssl_context.load_cert_chain(tls_cert, tls_key)
        self._token = _BearerToken(auth_token) if auth_token else None

    def channel(self, address):
        """(the channel to close, the channel to call through)."""
        if self._credentials is not None:
            raw = grpc.secure_channel(address, self._credentials, options=_CHANNEL_OPTIONS)
        else:
            raw = grpc.insecure_channel(address, options=_CHANNEL_OPTIONS)
        return raw, grpc.intercept_channel(raw, self._token) if self._token else raw


def _retryable(error):
    return error.code() == grpc.StatusCode.UNAVAILABLE or (
        error.code() == grpc.StatusCode.FAILED_PRECONDITION and
        "stale map version" in (error.details() or ""))


def _all_ready(cluster_map):
    return cluster_map.version > 0 and len(cluster_map.shards) > 0 and all(
        s.ready for s in cluster_map.shards)


def connect(coordinator, wait=60.0, watch_map=True, default_deadline=30.0, *, tls_ca=None,
            tls_cert=None, tls_key=None, auth_token=None):
    """A client of the cluster whose coordinator listens at `coordinator` ("host:port"), once the
    coordinator has published a map whose shards are all ready (polling for up to `wait` seconds;
    MoeServeError UNAVAILABLE after that, naming the last answer, e.g. UNAUTHENTICATED).

    Secured clusters (the servers' --tls_cert / --tls_ca / --auth_tokens_file): `tls_ca`, the
    path of the PEM CA certificate that verifies the servers, turns on TLS for every call and
    for the shards' TCP channels; `tls_cert` and `tls_key` (PEM paths) add a client certificate
    (--tls_require_client_cert); `auth_token` is sent as "authorization: Bearer <token>" on
    every call (a frontend token)."""
    client = MoeClient(coordinator, watch_map=watch_map, default_deadline=default_deadline,
                       tls_ca=tls_ca, tls_cert=tls_cert, tls_key=tls_key, auth_token=auth_token)
    try:
        client._wait_until_ready(wait)
    except BaseException:
        client.close()
        raise
    return client


class MoeClient:
    """Use connect(); see the module docstring."""

    def __init__(self, coordinator, watch_map=True, default_deadline=30.0, tls_ca=None,
                 tls_cert=None, tls_key=None, auth_token=None):
        self.coordinator = coordinator
        self.default_deadline = default_deadline
        self._watch = watch_map
        self._security = _Security(tls_ca, tls_cert, tls_key, auth_token)
        self._channel, calls = self._security.channel(coordinator)
        self._coordinator = pb.coordinator_pb2_grpc.CoordinatorStub(calls)
        self._lock = threading.Lock()
        self._state = None
        self._shards = {}  # address -> (channel, channel to call through, stub)
        self._idle_tcp = {}  # address -> open TcpChannels not in use (transport="tcp")
        self._no_tcp = set()  # addresses of shards that do not serve TCP channels
        # transport="auto": address -> time.monotonic() before which no channel is tried again
        self._tcp_retry_after = {}
        self._closed = threading.Event()
        self._watch_call = None
        self._watcher = None

    # --- map ------------------------------------------------------------------------------

    def _wait_until_ready(self, wait):
        give_up = time.monotonic() + wait
        backoff, last = 0.02, "no answer"
        while True:
            try:
                self.refresh_map()
                if _all_ready(self.cluster_map()):
                    break
                last = "shards are not all ready yet"
            except grpc.RpcError as e:
                last = "%s: %s" % (e.code().name, e.details())
            if time.monotonic() >= give_up:
                raise MoeServeError(grpc.StatusCode.UNAVAILABLE, "connecting to coordinator %s: %s"
                                    % (self.coordinator, last))
            time.sleep(backoff)  # polling the coordinator at start-up
            backoff = min(backoff * 2, 0.5)
        if self._watch:
            self._watcher = threading.Thread(target=self._watch_loop, daemon=True,
                                             name="moe-map-watch")
            self._watcher.start()

    def _install(self, cluster_map):
        num_experts = cluster_map.model.num_experts
        layers = [dispatch.LayerPlacement(list(l.physical_to_logical), num_experts)
                  for l in cluster_map.layers]
        with self._lock:
            if self._state is None or self._state.map.version <= cluster_map.version:
                self._state = _MapState(cluster_map, layers)

    def refresh_map(self):
        """Fetches the map now (the watch normally keeps it current)."""
        self._install(self._coordinator.GetClusterMap(pb.coordinator_pb2.GetClusterMapRequest(),
                                                      timeout=5.0))

    def cluster_map(self):
        """The moe.v1.ClusterMap the client plans with (None before the first fetch)."""
        with self._lock:
            return self._state.map if self._state else None

    def watch_map(self, known_version=0, timeout=None):
        """Yields each moe.v1.ClusterMap the coordinator publishes, starting with the current one
        when it is newer than `known_version`. Ends when the stream ends or after `timeout`
        seconds; closing the generator cancels the stream."""
        stream = self._coordinator.WatchClusterMap(
            pb.coordinator_pb2.WatchClusterMapRequest(known_version=known_version),
            timeout=timeout)
        try:
            for cluster_map in stream:
                yield cluster_map
        except grpc.RpcError as e:
            if e.code() not in (grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED):
                raise
        finally:
            stream.cancel()

    def _watch_loop(self):
        while not self._closed.is_set():
            state = self._current()
            call = self._coordinator.WatchClusterMap(
                pb.coordinator_pb2.WatchClusterMapRequest(known_version=state.map.version))
            with self._lock:
                self._watch_call = call
            if self._closed.is_set():
                call.cancel()
            try:
                for cluster_map in call:
                    self._install(cluster_map)
            except grpc.RpcError:
                pass  # cancelled by close(), or the coordinator went away: reconnect below
            self._closed.wait(0.2)  # reconnect backoff

    def _current(self):
        with self._lock:
            if self._state is None:
                raise MoeServeError(grpc.StatusCode.FAILED_PRECONDITION, "client has no map")
            return self._state

    def _shard_stub(self, address):
        with self._lock:
            if address not in self._shards:
                channel, calls = self._security.channel(address)
                self._shards[address] = (channel, calls, pb.shard_pb2_grpc.ExpertShardStub(calls))
            return self._shards[address][2]

    def _take_tcp(self, address, timeout, fall_back):
        """An idle TCP channel to the shard at `address`, or a new one; None when the shard does
        not serve them. When one cannot be opened: with `fall_back` (transport "auto") None, and
        no new try for _TCP_RETRY_AFTER seconds; otherwise TcpChannelError."""
        self._shard_stub(address)
        with self._lock:
            if address in self._no_tcp:
                return None
            if fall_back and time.monotonic() < self._tcp_retry_after.get(address, 0):
                return None
            idle = self._idle_tcp.get(address)
            if idle:
                return idle.pop()
            grpc_channel = self._shards[address][1]
        host = address[1:address.index("]")] if address.startswith("[") else \
            address.rsplit(":", 1)[0] if address.count(":") == 1 else address
        try:
            return tcp_channel.open_channel(grpc_channel, host, timeout,
                                            ssl_context=self._security.ssl_context)
        except tcp_channel.TcpChannelError as e:
            if e.code() == grpc.StatusCode.UNIMPLEMENTED:
                with self._lock:
                    self._no_tcp.add(address)
                return None
            if not fall_back:
                raise
            with self._lock:
                self._tcp_retry_after[address] = time.monotonic() + _TCP_RETRY_AFTER
            return None

    def _return_tcp(self, address, channel):
        with self._lock:
            idle = self._idle_tcp.setdefault(address, [])
            if channel.broken or self._closed.is_set() or len(idle) >= 16:
                channel.close()
            else:
                idle.append(channel)

    # --- forward --------------------------------------------------------------------------

    def forward(self, layer, hidden, topk_ids, topk_weights, is_padding=None, *,
                shared_experts=False, wire_hidden_dtype="bf16", wire_output_dtype="f32",
                deadline=None, transport="auto"):
        """Runs MoE layer `layer` for a batch and returns a ForwardResult.

        hidden float32 [T, H]; topk_ids int [T, K] logical expert ids (-1 = no route);
        topk_weights float32 [T, K]; is_padding optional bool [T] (padded tokens are neither
        computed nor counted as load; their output rows are 0). shared_experts marks each token
        for exactly one shard to add the shared-expert output (models that have one). Hidden
        states travel as BF16 (default) or F32, outputs as F32 (default) or BF16. `deadline`:
        seconds for the whole call, retries included (default: the client's default_deadline).
        transport "tcp" sends each shard's request over a direct TCP channel (kept open from call
        to call; shards started with --tcp_channel) instead of a gRPC call: a decode step then
        costs about a TCP round trip of transport; shards without them get the gRPC call. "auto"
        (the default) does the same, but a shard whose channel cannot be opened gets gRPC calls
        for a while instead of an error, and with TLS (connect's tls_ca) only requests of up to
        64 KB of hidden states take a channel (TLS ones, verified with the same CA); "grpc" never
        opens channels.
        ValueError for malformed arguments; MoeServeError when the cluster refuses the call or
        the deadline passes."""
        hidden, ids, weights, padding = self._check(layer, hidden, topk_ids, topk_weights,
                                                    is_padding)
        if wire_hidden_dtype not in _WIRE_DTYPES or wire_output_dtype not in _WIRE_DTYPES:
            raise ValueError("wire dtypes are 'f32' or 'bf16'")
        if transport not in ("auto", "grpc", "tcp"):
            raise ValueError("transport is 'auto', 'grpc' or 'tcp'")
        give_up = time.monotonic() + (deadline or self.default_deadline)
        attempt = 0
        while True:
            attempt += 1
            state = self._current()
            try:
                output, shards = self._forward_once(state, layer, hidden, ids, weights, padding,
                                                    shared_experts, wire_hidden_dtype,
                                                    wire_output_dtype, give_up, transport)
                return ForwardResult(output, state.map.version, shards, attempt)
            except grpc.RpcError as e:
                if not _retryable(e) or time.monotonic() >= give_up:
                    raise MoeServeError(e.code(), e.details() or "") from None
            time.sleep(min(0.005 * attempt, max(give_up - time.monotonic(), 0)))
            try:
                self.refresh_map()
            except grpc.RpcError:
                pass  # the next attempt reports the cluster's state

    def _check(self, layer, hidden, topk_ids, topk_weights, is_padding):
        model = self._current().map.model
        if not 0 <= layer < model.num_layers:
            raise ValueError("layer %d outside [0, %d)" % (layer, model.num_layers))
        hidden = np.asarray(hidden, dtype=np.float32)
        ids = np.asarray(topk_ids)
        weights = np.asarray(topk_weights, dtype=np.float32)
        if hidden.ndim != 2 or hidden.shape[1] != model.hidden_size:
            raise ValueError("hidden must be [T, %d], got %s" % (model.hidden_size, hidden.shape))
        t_count = hidden.shape[0]
        if ids.ndim != 2 or ids.shape[0] != t_count or ids.shape[1] < 1 or \
                not np.issubdtype(ids.dtype, np.integer):
            raise ValueError("topk_ids must be integer [%d, K >= 1], got %s %s"
                             % (t_count, ids.dtype, ids.shape))
        if weights.shape != ids.shape:
            raise ValueError("topk_weights must be %s, got %s" % (ids.shape, weights.shape))
        if np.any((ids < -1) | (ids >= model.num_experts)):
            raise ValueError("topk_ids must be in [-1, %d)" % model.num_experts)
        padding = None
        if is_padding is not None:
            padding = np.asarray(is_padding, dtype=bool)
            if padding.shape != (t_count,):
                raise ValueError("is_padding must be [%d], got %s" % (t_count, padding.shape))
        return hidden, ids.astype(np.int32), weights, padding

    def _forward_once(self, state, layer, hidden, ids, weights, padding, shared_experts,
                      hidden_dtype, output_dtype, give_up, transport):
        cluster_map = state.map
        plan = dispatch.plan_dispatch(state.layers[layer], list(cluster_map.slot_to_rank),
                                      len(cluster_map.shards), ids, padding, shared_experts)
        tensor_dtype, activation_format = _WIRE_DTYPES[hidden_dtype]
        hidden_wire = wire.float_to_bf16_bits(hidden) if hidden_dtype == "bf16" else hidden
        calls = []  # (rank, rows, gRPC future or None, TcpChannel or None, request, payload)
        try:
            for rank, rows in enumerate(plan.tokens_by_rank):
                if len(rows) == 0:
                    continue
                address = cluster_map.shards[rank].address
                timeout = max(give_up - time.monotonic(), 0.001)
                rows_wire = np.ascontiguousarray(hidden_wire[rows])
                # Under TLS, "auto" keeps large requests on gRPC (_TLS_CHANNEL_MAX_AUTO_PAYLOAD).
                use_tcp = transport == "tcp" or (transport == "auto" and (
                    not self._security.tls or rows_wire.nbytes <= _TLS_CHANNEL_MAX_AUTO_PAYLOAD))
                channel = self._take_tcp(address, timeout, fall_back=transport == "auto") \
                    if use_tcp else None
                data = wire.to_tensor(rows_wire, tensor_dtype)
                if channel is not None:
                    data.data = b""  # the bytes travel beside the header
                request = pb.shard_pb2.ForwardRequest(
                    model_fingerprint=cluster_map.model.fingerprint, layer=layer,
                    map_version=cluster_map.version,
                    hidden_states=pb.shard_pb2.HiddenStates(format=activation_format, data=data),
                    topk_ids=wire.to_tensor(ids[rows], pb.tensor_pb2.I32),
                    topk_weights=wire.to_tensor(weights[rows], pb.tensor_pb2.F32),
                    token_indices=wire.to_tensor(rows, pb.tensor_pb2.I64),
                    output_dtype=_WIRE_DTYPES[output_dtype][0])
                if padding is not None:
                    request.is_padding.CopyFrom(wire.to_tensor(padding[rows], pb.tensor_pb2.BOOL))
                if shared_experts:
                    request.shared_mask.CopyFrom(
                        wire.to_tensor(plan.shared_rank[rows] == rank, pb.tensor_pb2.BOOL))
                future = None
                if channel is None:
                    future = self._shard_stub(address).Forward.future(request, timeout=timeout)
                calls.append([rank, rows, future, channel, request, rows_wire])
            # Every TCP request goes out before the first answer is read: the shards work at once.
            for call in calls:
                if call[3] is not None:
                    call[3].send(call[4], call[5], max(give_up - time.monotonic(), 0.001))
            output = np.zeros(hidden.shape, dtype=np.float32)
            for call in calls:
                rank, rows, future, channel = call[:4]
                if channel is None:
                    wire_output = future.result().output
                else:
                    call[3] = None
                    try:
                        response, data = channel.receive(max(give_up - time.monotonic(), 0.001))
                    finally:  # a refusal leaves the channel in step; a broken one is closed
                        self._return_tcp(cluster_map.shards[rank].address, channel)
                    wire_output = response.output
                    wire_output.data = data
                partial = wire.from_tensor(wire_output)
                if partial.shape != (len(rows), hidden.shape[1]):
                    raise MoeServeError(grpc.StatusCode.INTERNAL, "shard %d answered shape %s for "
                                        "%d tokens" % (rank, partial.shape, len(rows)))
                output[rows] += partial
            return output, len(calls)
        finally:
            for call in calls:  # channels whose answer was not read are out of step
                if call[3] is not None:
                    call[3].close()

    # --- load -----------------------------------------------------------------------------

    def load_stats(self, refresh=True):
        """The coordinator's load aggregation (refresh: collect the shards' pending counts
        first)."""
        stats = self._coordinator.GetLoadStats(
            pb.coordinator_pb2.GetLoadStatsRequest(refresh=refresh), timeout=10.0)

        def stack(field):
            return np.array([list(getattr(l, field)) for l in stats.layers], dtype=np.int64)
        return LoadStats(map_version=stats.map_version, expert_load=stack("expert_load"),
                         slot_load=stack("slot_load"), shard_load=stack("shard_load"),
                         balancedness=np.array([l.balancedness for l in stats.layers]),
                         total_routes=stats.total_routes, proto=stats)

    # --- lifetime -------------------------------------------------------------------------

    def close(self):
        """Stops the map watch and closes every channel. Idempotent."""
        self._closed.set()
        with self._lock:
            call = self._watch_call
        if call is not None:
            call.cancel()
        if self._watcher is not None and self._watcher is not threading.current_thread():
            self._watcher.join(timeout=5.0)
        with self._lock:
            shards, self._shards = self._shards, {}
            idle, self._idle_tcp = self._idle_tcp, {}
        for channel, _, _ in shards.values():
            channel.close()
        for channels in idle.values():
            for channel in channels:
                channel.close()
        self._channel.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
