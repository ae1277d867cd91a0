"""The installed package against a live cluster (coordinator + 2 shards, every expert in three
slots) and a reference: one standalone shard of the same checkpoint that hosts every expert.

  MOE_TEST_COORDINATOR=HOST:PORT MOE_TEST_REFERENCE=HOST:PORT python -m unittest test_cluster

Forward outputs must equal, within 1e-5 relative, what the reference computes for the same tokens
in one request; the coordinator's load counts must equal counts derived here from the ids sent
(numerics.md section 4, computed with Python integers, not with the package); routing must pick
what the shard's own router picks (its routing replay).
"""

import os
import sys
import unittest

import grpc
import numpy as np

import moe_serve_client as moe
from moe_serve_client import pb
from moe_serve_client import tcp_channel
from moe_serve_client import wire

COORDINATOR = os.environ.get("MOE_TEST_COORDINATOR", "")
REFERENCE = os.environ.get("MOE_TEST_REFERENCE", "")
RTOL = 1e-5


def assert_close(test, got, want, what):
    """Every element within RTOL of the reference, relative to the reference's largest value (an
    element near zero cannot be held to a relative bound of its own)."""
    scale = float(np.abs(want).max())
    test.assertGreater(scale, 0.0, what)
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=RTOL * scale, err_msg=what)


def expected_slot(p2l, logical, token_index):
    """numerics.md section 4 in plain integers: the expert's slots ascending, replica h mod n."""
    slots = [p for p, e in enumerate(p2l) if e == logical]
    return slots[(token_index * 2654435769) % 2**32 % len(slots)]


@unittest.skipUnless(COORDINATOR and REFERENCE, "needs MOE_TEST_COORDINATOR and MOE_TEST_REFERENCE")
class ClusterTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.client = moe.connect(COORDINATOR, wait=60.0)
        cls.map = cls.client.cluster_map()
        cls.model = cls.map.model
        cls.reference_channel = grpc.insecure_channel(REFERENCE)
        cls.reference = pb.shard_pb2_grpc.ExpertShardStub(cls.reference_channel)

    @classmethod
    def tearDownClass(cls):
        cls.client.close()
        cls.reference_channel.close()

    def batch(self, seed, tokens=24):
        """hidden [T, H], routed ids/weights with two unrouted ids, padding on 3 tokens."""
        rng = np.random.default_rng(seed)
        hidden = rng.standard_normal((tokens, self.model.hidden_size), dtype=np.float32)
        logits = rng.standard_normal((tokens, self.model.num_experts), dtype=np.float32)
        ids, weights = moe.route(logits, "renormalize", top_k=self.model.top_k)
        ids[5, 0] = -1
        ids[9, :] = -1
        padding = np.zeros(tokens, dtype=bool)
        padding[[2, 11, 17]] = True
        return hidden, ids, weights, padding

    def reference_forward(self, layer, hidden, ids, weights, padding, hidden_format):
        """The whole batch in one request to the shard that hosts every expert."""
        if hidden_format == pb.shard_pb2.ACTIVATION_BF16:
            data = wire.to_tensor(wire.float_to_bf16_bits(hidden), pb.tensor_pb2.BF16)
        else:
            data = wire.to_tensor(hidden, pb.tensor_pb2.F32)
        request = pb.shard_pb2.ForwardRequest(
            layer=layer, hidden_states=pb.shard_pb2.HiddenStates(format=hidden_format, data=data),
            topk_ids=wire.to_tensor(ids, pb.tensor_pb2.I32),
            topk_weights=wire.to_tensor(weights, pb.tensor_pb2.F32),
            is_padding=wire.to_tensor(padding, pb.tensor_pb2.BOOL), output_dtype=pb.tensor_pb2.F32)
        return wire.from_tensor(self.reference.Forward(request, timeout=30).output)

    def test_installed_package_is_the_one_under_test(self):
        self.assertTrue(moe.__file__.startswith(sys.prefix), moe.__file__)
        self.assertNotEqual(sys.prefix, sys.base_prefix, "not running inside the venv")

    def test_cluster_spreads_replicas_over_both_shards(self):
        # Three replicas per expert (h mod 3 picks one: a wrong hash sends tokens to the wrong
        # shard, which drops them), and replicas of one expert on both shards.
        self.assertEqual(len(self.map.shards), 2)
        p2l = list(self.map.layers[0].physical_to_logical)
        for e in range(self.model.num_experts):
            self.assertEqual(p2l.count(e), 3, "expert %d" % e)
        ranks = [{self.map.slot_to_rank[p] for p, x in enumerate(p2l) if x == e}
                 for e in range(self.model.num_experts)]
        self.assertTrue(any(len(r) == 2 for r in ranks), ranks)

    def test_forward_matches_a_single_shard_hosting_every_expert(self):
        for layer in range(self.model.num_layers):
            for wire_dtype, fmt in (("f32", pb.shard_pb2.ACTIVATION_F32),
                                    ("bf16", pb.shard_pb2.ACTIVATION_BF16)):
                with self.subTest(layer=layer, wire=wire_dtype):
                    hidden, ids, weights, padding = self.batch(seed=10 * layer + len(wire_dtype))
                    result = self.client.forward(layer, hidden, ids, weights, padding,
                                                 wire_hidden_dtype=wire_dtype)
                    self.assertEqual(result.output.dtype, np.float32)
                    self.assertEqual(result.output.shape, hidden.shape)
                    self.assertEqual(result.shards_called, 2)
                    self.assertEqual(result.map_version, self.map.version)
                    want = self.reference_forward(layer, hidden, ids, weights, padding, fmt)
                    assert_close(self, result.output, want, "layer %d %s" % (layer, wire_dtype))
                    for t in (2, 9, 11, 17):  # padded or unrouted: exactly zero
                        self.assertFalse(result.output[t].any(), "token %d" % t)

    def test_bf16_output_on_the_wire(self):
        hidden, ids, weights, padding = self.batch(seed=77)
        f32 = self.client.forward(1, hidden, ids, weights, padding, wire_hidden_dtype="f32")
        bf16 = self.client.forward(1, hidden, ids, weights, padding, wire_hidden_dtype="f32",
                                   wire_output_dtype="bf16")
        # Each shard's partial sum is rounded to BF16 (relative error <= 2^-9 each) before the
        # client adds the two partials.
        np.testing.assert_allclose(bf16.output, f32.output, rtol=2.0**-7,
                                   atol=2.0**-8 * np.abs(f32.output).max())

    def test_load_counts_every_route_once_on_its_replica(self):
        layer = 1
        hidden, ids, weights, padding = self.batch(seed=5)
        before = self.client.load_stats()
        self.client.forward(layer, hidden, ids, weights, padding)
        after = self.client.load_stats()
        sent = [(t, int(e)) for t in range(len(ids)) if not padding[t] for e in ids[t] if e >= 0]
        expert_delta = np.zeros(self.model.num_experts, dtype=np.int64)
        slot_delta = np.zeros(self.map.num_physical, dtype=np.int64)
        p2l = list(self.map.layers[layer].physical_to_logical)
        for t, e in sent:
            expert_delta[e] += 1
            slot_delta[expected_slot(p2l, e, t)] += 1
        np.testing.assert_array_equal(after.expert_load[layer] - before.expert_load[layer],
                                      expert_delta)
        np.testing.assert_array_equal(after.slot_load[layer] - before.slot_load[layer], slot_delta)
        self.assertEqual(after.total_routes - before.total_routes, len(sent))
        self.assertTrue(np.all(after.expert_load[1 - layer] == before.expert_load[1 - layer]))
        self.assertEqual(after.shard_load.shape, (self.model.num_layers, 2))

    def test_route_matches_the_shards_router(self):
        rng = np.random.default_rng(8)
        logits = rng.standard_normal((16, self.model.num_experts), dtype=np.float32)
        hidden = rng.standard_normal((16, self.model.hidden_size), dtype=np.float32)
        cases = [("default", {}), ("renormalize", {}), ("renormalize_naive", {}), ("sigmoid", {}),
                 ("sigmoid_renorm", {}),
                 ("deepseek_v3", {"n_group": 4, "topk_group": 2, "routed_scaling_factor": 2.5,
                                  "renormalize": True})]
        for method, extra in cases:
            with self.subTest(method=method):
                k = 3
                ids, weights = moe.route(logits, method, top_k=k, **extra)
                spec = pb.shard_pb2.RoutingSpec(method=method, top_k=k, **extra)
                request = pb.shard_pb2.ForwardRequest(
                    layer=0, hidden_states=pb.shard_pb2.HiddenStates(
                        format=pb.shard_pb2.ACTIVATION_F32,
                        data=wire.to_tensor(hidden, pb.tensor_pb2.F32)),
                    router_logits=wire.to_tensor(logits, pb.tensor_pb2.F32), routing=spec,
                    return_routing=True, output_dtype=pb.tensor_pb2.F32)
                replay = self.reference.Forward(request, timeout=30)
                np.testing.assert_array_equal(ids, wire.from_tensor(replay.topk_ids))
                np.testing.assert_allclose(weights, wire.from_tensor(replay.topk_weights),
                                           rtol=1e-6)
                # The client's routed forward equals the shard's monolithic one.
                out = self.client.forward(0, hidden, ids, weights, wire_hidden_dtype="f32").output
                assert_close(self, out, wire.from_tensor(replay.output), method)

    def test_watch_map_starts_with_the_current_map(self):
        stream = self.client.watch_map(known_version=0, timeout=10)
        first = next(stream)
        stream.close()
        self.assertEqual(first.version, self.map.version)
        self.assertEqual([s.address for s in first.shards], [s.address for s in self.map.shards])
        self.assertEqual(list(first.slot_to_rank), list(self.map.slot_to_rank))

    def test_malformed_arguments_are_refused_before_sending(self):
        hidden, ids, weights, _ = self.batch(seed=3)
        bad = [((self.model.num_layers, hidden, ids, weights), "layer"),
               ((0, hidden[:, 1:], ids, weights), "hidden"),
               ((0, hidden, ids[:, :1], weights), "topk_weights"),
               ((0, hidden, ids.astype(np.float32), weights), "topk_ids"),
               ((0, hidden, np.full_like(ids, self.model.num_experts), weights), r"\[-1, "),
               ((0, hidden, ids, weights, np.zeros(3, bool)), "is_padding")]
        for args, message in bad:
            with self.subTest(message=message):
                with self.assertRaisesRegex(ValueError, message):
                    self.client.forward(*args)

    def test_tcp_transport_gives_the_grpc_answers(self):
        # Rank 0 serves TCP channels, rank 1 does not: its share takes the gRPC call.
        for layer in range(self.model.num_layers):
            for wire_dtype in ("f32", "bf16"):
                with self.subTest(layer=layer, wire=wire_dtype):
                    hidden, ids, weights, padding = self.batch(seed=50 + layer)
                    want = self.client.forward(layer, hidden, ids, weights, padding,
                                               wire_hidden_dtype=wire_dtype, transport="grpc")
                    # The second call reuses the channel; "auto" (the default) takes it too.
                    for transport in ("tcp", "tcp", "auto"):
                        got = self.client.forward(layer, hidden, ids, weights, padding,
                                                  wire_hidden_dtype=wire_dtype,
                                                  transport=transport)
                        self.assertEqual(got.shards_called, 2)
                        np.testing.assert_array_equal(got.output, want.output)
        with self.assertRaisesRegex(ValueError, "transport"):
            self.client.forward(0, *self.batch(seed=1)[:3], transport="udp")

    def test_tcp_channel_refusals(self):
        shard0 = grpc.insecure_channel(self.map.shards[0].address)
        shard1 = grpc.insecure_channel(self.map.shards[1].address)
        try:
            with self.assertRaises(tcp_channel.TcpChannelError) as caught:
                tcp_channel.open_channel(shard1, "127.0.0.1", timeout=10)
            self.assertEqual(caught.exception.code(), grpc.StatusCode.UNIMPLEMENTED)
            channel = tcp_channel.open_channel(shard0, "127.0.0.1", timeout=10)
            self.addCleanup(channel.close)
            hidden, ids, weights, _ = self.batch(seed=8)
            request = pb.shard_pb2.ForwardRequest(
                layer=0, map_version=self.map.version,
                hidden_states=pb.shard_pb2.HiddenStates(
                    format=pb.shard_pb2.ACTIVATION_F32,
                    data=pb.tensor_pb2.Tensor(dtype=pb.tensor_pb2.F32, shape=hidden.shape)),
                topk_ids=wire.to_tensor(ids, pb.tensor_pb2.I32),
                topk_weights=wire.to_tensor(weights, pb.tensor_pb2.F32),
                output_dtype=pb.tensor_pb2.F32)
            channel.send(request, hidden.tobytes()[:-4], timeout=10)  # one value short
            with self.assertRaises(tcp_channel.TcpChannelError) as caught:
                channel.receive(timeout=10)
            self.assertEqual(caught.exception.code(), grpc.StatusCode.INVALID_ARGUMENT)
            self.assertIn("hidden_states.data", caught.exception.details())
            self.assertFalse(channel.broken)
            channel.send(request, hidden.tobytes(), timeout=10)  # still in step
            response, data = channel.receive(timeout=10)
            self.assertEqual(list(response.output.shape), [len(hidden), self.model.hidden_size])
            self.assertEqual(len(data), hidden.nbytes)
        finally:
            shard0.close()
            shard1.close()

    def test_server_refusal_is_a_moe_serve_error(self):
        # A deadline too short to reach any shard: DEADLINE_EXCEEDED, not retried forever.
        hidden, ids, weights, _ = self.batch(seed=4, tokens=4096)
        with self.assertRaises(moe.MoeServeError) as caught:
            self.client.forward(0, hidden, ids, weights, deadline=1e-4)
        self.assertEqual(caught.exception.code, grpc.StatusCode.DEADLINE_EXCEEDED)


if __name__ == "__main__":
    unittest.main()
