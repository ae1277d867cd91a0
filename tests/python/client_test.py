"""A Python client of moe-serve, written only from the protos: it reads the cluster map, sends
routed tensors to each expert shard, and checks the coordinator's load accounting against counts
it derives itself from the ids it sent (numerics.md section 4: replica = h mod replicas over the
expert's slots in ascending order, h = token_index * 2654435769 mod 2^32).

Run by run_client_test.sh, which starts the cluster and generates the stubs:
  client_test.py --coordinator HOST:PORT [unittest flags]
"""

import argparse
import sys
import time
import unittest

import grpc
import numpy as np

from moe.v1 import coordinator_pb2
from moe.v1 import coordinator_pb2_grpc
from moe.v1 import shard_pb2
from moe.v1 import shard_pb2_grpc
from moe.v1 import tensor_pb2

DEADLINE_S = 30.0
COORDINATOR = None  # set from the command line

# numpy dtype of each wire dtype.
NP_DTYPE = {
    tensor_pb2.F32: np.float32,
    tensor_pb2.I32: np.int32,
    tensor_pb2.I64: np.int64,
    tensor_pb2.BOOL: np.uint8,
}


def to_wire(array, dtype):
    """A moe.v1.Tensor holding `array` as little-endian bytes of `dtype`."""
    array = np.ascontiguousarray(array, dtype=np.dtype(NP_DTYPE[dtype]).newbyteorder("<"))
    return tensor_pb2.Tensor(dtype=dtype, shape=list(array.shape), data=array.tobytes())


def from_wire(tensor):
    array = np.frombuffer(tensor.data, dtype=np.dtype(NP_DTYPE[tensor.dtype]).newbyteorder("<"))
    return array.reshape(tuple(tensor.shape))


def replica_slot(physical_to_logical, logical, token_index):
    """The physical slot a route of `logical` from token `token_index` hits."""
    slots = sorted(p for p, e in enumerate(physical_to_logical) if e == logical)
    h = (token_index * 2654435769) % (1 << 32)
    return slots[h % len(slots)]


class ClientTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.channel = grpc.insecure_channel(COORDINATOR)
        cls.coordinator = coordinator_pb2_grpc.CoordinatorStub(cls.channel)
        cls.map = cls.wait_for_ready_map()
        cls.shards = [shard_pb2_grpc.ExpertShardStub(grpc.insecure_channel(s.address))
                      for s in cls.map.shards]
        shape = cls.map.model
        cls.E, cls.H, cls.L = shape.num_experts, shape.hidden_size, shape.num_layers
        # Every batch this test sends goes to every shard. Per logical expert the coordinator
        # must then count each route once (the shards hosting its replicas split it): plain
        # counts of the ids sent. Per slot, the replica rule decides.
        cls.sent_expert_load = np.zeros((cls.L, cls.E), dtype=np.int64)
        cls.sent_slot_load = np.zeros((cls.L, cls.map.num_physical), dtype=np.int64)

    @classmethod
    def wait_for_ready_map(cls):
        """Bounded polling of GetClusterMap until a map is published and every shard is ready."""
        give_up = time.monotonic() + 60.0
        last = None
        while time.monotonic() < give_up:
            try:
                m = cls.coordinator.GetClusterMap(coordinator_pb2.GetClusterMapRequest(),
                                                  timeout=2.0)
                if m.version > 0 and m.shards and all(s.ready for s in m.shards):
                    return m
                last = "map version %d, ready %s" % (m.version, [s.ready for s in m.shards])
            except grpc.RpcError as e:
                last = "%s: %s" % (e.code(), e.details())
            time.sleep(0.05)
        raise AssertionError("cluster never became ready: %s" % last)

    @classmethod
    def tearDownClass(cls):
        cls.channel.close()

    def make_batch(self, seed, tokens=6, k=2):
        """Hidden F32 [T, H]; ids I32 [T, K] with token 3 unrouted; weights F32 [T, K]."""
        rng = np.random.default_rng(seed)
        hidden = rng.standard_normal((tokens, self.H)).astype(np.float32)
        ids = np.stack([rng.choice(self.E, size=k, replace=False) for _ in range(tokens)])
        ids = ids.astype(np.int32)
        ids[3, :] = -1
        weights = rng.uniform(0.1, 1.0, size=(tokens, k)).astype(np.float32)
        return hidden, ids, weights

    def request(self, layer, hidden, ids, weights, output_dtype=tensor_pb2.F32,
                token_indices=None):
        req = shard_pb2.ForwardRequest(
            model_fingerprint=self.map.model.fingerprint,
            layer=layer,
            map_version=self.map.version,
            hidden_states=shard_pb2.HiddenStates(format=shard_pb2.ACTIVATION_F32,
                                                 data=to_wire(hidden, tensor_pb2.F32)),
            topk_ids=to_wire(ids, tensor_pb2.I32),
            topk_weights=to_wire(weights, tensor_pb2.F32),
            output_dtype=output_dtype,
            request_id=7)
        if token_indices is not None:
            req.token_indices.CopyFrom(to_wire(token_indices, tensor_pb2.I64))
        return req

    def forward_everywhere(self, layer, request, ids, token_indices=None):
        """Sends `request` to every shard; returns their responses by rank."""
        if token_indices is None:  # absent on the wire: the row is the token index
            token_indices = range(len(ids))
        responses = [stub.Forward(request, timeout=DEADLINE_S) for stub in self.shards]
        type(self).sent_expert_load[layer] += np.bincount(ids[ids >= 0], minlength=self.E)
        p2l = list(self.map.layers[layer].physical_to_logical)
        for t, row in zip(token_indices, ids):
            for e in row[row >= 0]:
                type(self).sent_slot_load[layer, replica_slot(p2l, int(e), int(t))] += 1
        return responses

    def hosted_route(self, rank, layer, ids):
        """[T] bool: whether each token has a route on a slot of shard `rank`."""
        p2l = list(self.map.layers[layer].physical_to_logical)
        return np.array([any(e >= 0 and self.map.slot_to_rank[replica_slot(p2l, int(e), t)] == rank
                             for e in row) for t, row in enumerate(ids)])

    def test_forward_on_each_shard(self):
        layer = 1
        hidden, ids, weights = self.make_batch(seed=3)
        req = self.request(layer, hidden, ids, weights)
        firsts = self.forward_everywhere(layer, req, ids)
        seconds = self.forward_everywhere(layer, req, ids)
        for rank, (first, second) in enumerate(zip(firsts, seconds)):
            with self.subTest(rank=rank):
                self.assertEqual(first.request_id, 7)
                self.assertEqual(first.map_version, self.map.version)
                self.assertEqual(first.output.dtype, tensor_pb2.F32)
                self.assertEqual(list(first.output.shape), [6, self.H])
                self.assertEqual(first.output.data, second.output.data, "not deterministic")
                out = from_wire(first.output)
                self.assertTrue(np.all(np.isfinite(out)))
                np.testing.assert_array_equal(out[3], np.zeros(self.H, np.float32))
                # A row is zero exactly when none of the token's routes is hosted on this shard.
                routed_here = self.hosted_route(rank, layer, ids)
                self.assertTrue(routed_here.any(), "the batch should reach every shard")
                for t in range(6):
                    self.assertEqual(bool(np.any(out[t] != 0)), bool(routed_here[t]),
                                     "token %d" % t)

    def test_bf16_output_matches_f32(self):
        layer = 0
        hidden, ids, weights = self.make_batch(seed=4)
        f32 = self.forward_everywhere(layer, self.request(layer, hidden, ids, weights), ids)
        bf16 = self.forward_everywhere(
            layer, self.request(layer, hidden, ids, weights, tensor_pb2.BF16), ids)
        for rank in range(len(self.shards)):
            self.assertEqual(bf16[rank].output.dtype, tensor_pb2.BF16)
            self.assertEqual(list(bf16[rank].output.shape), [6, self.H])
            bits = np.frombuffer(bf16[rank].output.data, dtype="<u2").astype(np.uint32) << 16
            widened = bits.view(np.float32).reshape(6, self.H)
            # BF16 keeps 8 significant bits: relative rounding error at most 2^-8.
            np.testing.assert_allclose(widened, from_wire(f32[rank].output), rtol=2.0 ** -8,
                                       atol=0)

    def test_load_stats_equal_counts_of_sent_ids(self):
        layer = 0
        hidden, ids, weights = self.make_batch(seed=5)
        indices = np.array([1000003, 17, 2, 5000000011, 40, 7], dtype=np.int64)
        self.forward_everywhere(
            layer, self.request(layer, hidden, ids, weights, token_indices=indices), ids, indices)
        stats = self.coordinator.GetLoadStats(coordinator_pb2.GetLoadStatsRequest(refresh=True),
                                              timeout=DEADLINE_S)
        self.assertEqual(stats.map_version, self.map.version)
        self.assertEqual(len(stats.layers), self.L)
        for l in range(self.L):
            got = stats.layers[l]
            self.assertEqual(list(got.expert_load), self.sent_expert_load[l].tolist(),
                             "layer %d experts" % l)
            self.assertEqual(list(got.slot_load), self.sent_slot_load[l].tolist(),
                             "layer %d slots" % l)
            shard_load = [sum(int(self.sent_slot_load[l, p]) for p, r in
                              enumerate(self.map.slot_to_rank) if r == rank)
                          for rank in range(len(self.shards))]
            self.assertEqual(list(got.shard_load), shard_load, "layer %d shards" % l)
        self.assertEqual(stats.total_routes, int(self.sent_expert_load.sum()))


def main():
    global COORDINATOR
    parser = argparse.ArgumentParser()
    parser.add_argument("--coordinator", required=True)
    args, rest = parser.parse_known_args()
    COORDINATOR = args.coordinator
    unittest.main(argv=[sys.argv[0]] + rest)


if __name__ == "__main__":
    main()
