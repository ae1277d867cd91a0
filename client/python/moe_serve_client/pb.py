"""The moe.v1 protocol messages and gRPC stubs, generated from proto/moe/v1 when the package was
built (setup.py). Use them for calls the high-level client does not wrap:

    from moe_serve_client import pb
    stub = pb.shard_pb2_grpc.ExpertShardStub(channel)
    info = stub.GetInfo(pb.shard_pb2.GetInfoRequest(), timeout=5)
"""

from moe_serve_client._generated.moe.v1 import coordinator_pb2
from moe_serve_client._generated.moe.v1 import coordinator_pb2_grpc
from moe_serve_client._generated.moe.v1 import shard_pb2
from moe_serve_client._generated.moe.v1 import shard_pb2_grpc
from moe_serve_client._generated.moe.v1 import tcp_pb2
from moe_serve_client._generated.moe.v1 import tcp_pb2_grpc
from moe_serve_client._generated.moe.v1 import tensor_pb2

__all__ = ["coordinator_pb2", "coordinator_pb2_grpc", "shard_pb2", "shard_pb2_grpc", "tcp_pb2",
           "tcp_pb2_grpc", "tensor_pb2"]
