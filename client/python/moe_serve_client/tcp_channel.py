"""Direct TCP request channel to one shard (proto/moe/v1/tcp.proto; frames as in
server/common/tcp_channel_frame.h): a one-use ticket from OpenTcpChannel over gRPC, then a socket
of the client's own carrying each request as [u32 magic][u32 header_len][u64 payload_len], the
ForwardRequest header and the hidden-state bytes, and each answer as [i32 status][u32 len][u64
payload_len], the ForwardResponse header (or the error message) and the output bytes. No gRPC call
per request. Shards serve it with `moe_shard --tcp_channel`; the data connection is TLS when the
shard's gRPC port is (open_channel's ssl_context), plaintext otherwise.

Thread-safety: one request in flight per channel (send(), then receive()); use one channel per
thread. A transfer error breaks the channel (`broken`); open a new one.
"""

import socket
import struct

import grpc

from moe_serve_client import pb

_MAGIC = b"MOETCP01"
_TICKET_BYTES = 32
_REQUEST_MAGIC = 0x514F454D
_PREFIX = struct.Struct("<IIQ")  # request: magic, header_len, payload_len
_ANSWER = struct.Struct("<iIQ")  # answer: status code, header_len, payload_len
_MAX_HEADER = 16 << 20
_STATUS_BY_CODE = {c.value[0]: c for c in grpc.StatusCode}


class TcpChannelError(grpc.RpcError):
    """A shard's refusal or a transfer failure, shaped like grpc.RpcError (code(), details()) so
    that callers handle both transports alike."""

    def __init__(self, code, details):
        super().__init__("%s: %s" % (code.name, details))
        self._code = code
        self._details = details

    def code(self):
        return self._code

    def details(self):
        return self._details


def open_channel(grpc_channel, host, timeout=10.0, ssl_context=None):
    """A TcpChannel to the shard reachable at `grpc_channel`, whose channel port is on `host`.
    A shard whose gRPC port has TLS serves its channels in TLS too: they need `ssl_context` (an
    ssl.SSLContext that verifies the shard's certificate for `host`), else FAILED_PRECONDITION.
    Raises TcpChannelError: UNIMPLEMENTED when the shard does not serve TCP channels, UNAVAILABLE
    when it cannot be reached or its certificate does not verify, the shard's refusal
    otherwise."""
    stub = pb.tcp_pb2_grpc.TcpChannelShardStub(grpc_channel)
    try:
        opened = stub.OpenTcpChannel(pb.tcp_pb2.OpenTcpChannelRequest(), timeout=timeout)
    except grpc.RpcError as e:
        raise TcpChannelError(e.code(), e.details() or "") from None
    if len(opened.ticket) != _TICKET_BYTES or not 0 < opened.port < 65536:
        raise TcpChannelError(grpc.StatusCode.INTERNAL, "malformed OpenTcpChannel answer")
    if opened.tls and ssl_context is None:
        raise TcpChannelError(grpc.StatusCode.FAILED_PRECONDITION,
                              "tcp channel: the shard's channels speak TLS and no ssl_context "
                              "was given")
    try:
        sock = socket.create_connection((host, opened.port), timeout=timeout)
        if opened.tls:
            sock = ssl_context.wrap_socket(sock, server_hostname=host)
    except OSError as e:  # ssl.SSLError is an OSError
        raise TcpChannelError(grpc.StatusCode.UNAVAILABLE, "tcp channel: cannot connect to "
                              "%s:%d: %s" % (host, opened.port, e)) from None
    channel = TcpChannel(sock)
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        channel._io(lambda: sock.sendall(_MAGIC + opened.ticket), timeout)
        code, header, payload_len = channel._read_answer(timeout)
        if code != 0:
            raise TcpChannelError(_status(code), header.decode("utf-8", "replace"))
        if header or payload_len:
            raise TcpChannelError(grpc.StatusCode.INTERNAL, "malformed hello answer")
    except BaseException:
        channel.close()
        raise
    return channel


def _status(code):
    return _STATUS_BY_CODE.get(code, grpc.StatusCode.UNKNOWN)


class TcpChannel:
    """Use open_channel(); see the module docstring."""

    def __init__(self, sock):
        self._sock = sock
        self.broken = False
        self._awaiting = False

    def close(self):
        self._sock.close()

    def send(self, request, payload, timeout):
        """Sends `request` (a ForwardRequest whose hidden_states.data has dtype and shape but no
        data) and `payload` (those bytes: bytes or a buffer)."""
        if self.broken:
            raise TcpChannelError(grpc.StatusCode.UNAVAILABLE, "tcp channel is broken")
        if self._awaiting:
            raise TcpChannelError(grpc.StatusCode.FAILED_PRECONDITION,
                                  "tcp channel: the previous answer was not received")
        header = request.SerializeToString()
        if len(header) > _MAX_HEADER:
            raise ValueError("request header of %d bytes exceeds %d" % (len(header), _MAX_HEADER))
        payload = memoryview(payload).cast("B")
        prefix = _PREFIX.pack(_REQUEST_MAGIC, len(header), payload.nbytes)
        self._io(lambda: self._send(prefix + header, payload), timeout)
        self._awaiting = True

    def receive(self, timeout):
        """The answer to the request sent last: (ForwardResponse, output bytes). Raises
        TcpChannelError with the shard's status when it refused the request."""
        if self.broken or not self._awaiting:
            raise TcpChannelError(grpc.StatusCode.FAILED_PRECONDITION,
                                  "tcp channel: nothing to receive")
        self._awaiting = False
        code, header, payload_len = self._read_answer(timeout)
        if code != 0:
            raise TcpChannelError(_status(code), header.decode("utf-8", "replace"))
        response = pb.shard_pb2.ForwardResponse()
        try:
            response.ParseFromString(header)
        except Exception:  # a protobuf DecodeError: the stream cannot be trusted any more
            self.broken = True
            raise TcpChannelError(grpc.StatusCode.INTERNAL,
                                  "tcp channel: response header does not parse") from None
        return response, self._io(lambda: self._recv_exactly(payload_len), timeout)

    # --- socket I/O -----------------------------------------------------------------------

    def _send(self, head, payload):
        # One segment for small requests (a decode step); large payloads go without a copy.
        if payload.nbytes <= 1 << 16:
            self._sock.sendall(head + payload.tobytes())
        else:
            self._sock.sendall(head)
            self._sock.sendall(payload)

    def _io(self, fn, timeout):
        self._sock.settimeout(timeout)
        try:
            return fn()
        except (OSError, EOFError) as e:
            self.broken = True
            code = grpc.StatusCode.DEADLINE_EXCEEDED if isinstance(e, socket.timeout) else \
                grpc.StatusCode.UNAVAILABLE
            raise TcpChannelError(code, "tcp channel: %s" % (e or "connection closed")) from None

    def _read_answer(self, timeout):
        code, header_len, payload_len = _ANSWER.unpack(
            self._io(lambda: self._recv_exactly(_ANSWER.size), timeout))
        if header_len > _MAX_HEADER or (code != 0 and payload_len != 0):
            self.broken = True
            raise TcpChannelError(grpc.StatusCode.INTERNAL, "tcp channel: malformed answer")
        return code, self._io(lambda: self._recv_exactly(header_len), timeout), payload_len

    def _recv_exactly(self, n):
        buf = bytearray(n)
        view = memoryview(buf)
        got = 0
        while got < n:
            k = self._sock.recv_into(view[got:], n - got)
            if k == 0:
                raise EOFError("connection closed by the shard")
            got += k
        return bytes(buf)
