"""moe-serve client: route router logits, dispatch routed tokens to the expert shards with the
cluster's EPLB map, and combine their outputs, with numpy arrays in and out.

    client = moe_serve_client.connect("coordinator:50051")
    ids, weights = moe_serve_client.route(logits, "renormalize", top_k=4)
    out = client.forward(layer, hidden, ids, weights).output

The protocol messages and stubs are in moe_serve_client.pb.
"""

from moe_serve_client.client import ForwardResult
from moe_serve_client.client import LoadStats
from moe_serve_client.client import MoeClient
from moe_serve_client.client import MoeServeError
from moe_serve_client.client import connect
from moe_serve_client.dispatch import DispatchPlan
from moe_serve_client.dispatch import LayerPlacement
from moe_serve_client.dispatch import plan_dispatch
from moe_serve_client.dispatch import replica_hash
from moe_serve_client.routing import ROUTING_METHODS
from moe_serve_client.routing import route

__version__ = "0.1.0"
__all__ = ["ForwardResult", "LoadStats", "MoeClient", "MoeServeError", "connect", "DispatchPlan",
           "LayerPlacement", "plan_dispatch", "replica_hash", "ROUTING_METHODS", "route"]
