"""Unit tests of the replica rule, the dispatch plan and routing, against values worked out by hand
(numerics.md sections 4 and 7); no server needed."""

import math
import unittest

import numpy as np

import moe_serve_client as moe

# h = (t * 2654435769) mod 2^32 for t = 0..3, by hand:
#   t=1: 2654435769; t=2: 5308871538 - 4294967296 = 1013904242; t=3: 7963307307 - 4294967296.
HASHES = [0, 2654435769, 1013904242, 3668340011]


class ReplicaHashTest(unittest.TestCase):
    def test_small_indices(self):
        self.assertEqual(moe.replica_hash(np.arange(4)).tolist(), HASHES)

    def test_indices_beyond_32_bits_wrap_like_the_servers(self):
        for t in (5000000011, 2**40 + 3, 2**62 + 1):
            self.assertEqual(int(moe.replica_hash([t])[0]), (t * 2654435769) % 2**32, t)


class PlanTest(unittest.TestCase):
    # E = 4, P = 7: expert 0 in slots 0, 4, 5; expert 2 in slots 2, 6; experts 1 and 3 once.
    # Slots 0-3 on rank 0, 4-6 on rank 1.
    P2L = [0, 1, 2, 3, 0, 0, 2]
    SLOT_TO_RANK = [0, 0, 0, 0, 1, 1, 1]
    # Replica of expert 0 = h mod 3 (digit sums of HASHES: 0, 51, 26, 32 -> 0, 0, 2, 2);
    # replica of expert 2 = h mod 2 (parities: 0, 1, 0, 1).
    IDS = np.array([[0, 2], [2, 0], [0, -1], [3, 2], [-1, -1]], dtype=np.int32)
    PHYSICAL = [[0, 2], [6, 0], [5, -1], [3, 6], [-1, -1]]

    def setUp(self):
        self.placement = moe.LayerPlacement(self.P2L, 4)

    def test_logical_to_physical_is_ascending(self):
        self.assertEqual(self.placement.replica_count.tolist(), [3, 1, 2, 1])
        self.assertEqual(self.placement.logical_to_physical.tolist(),
                         [[0, 4, 5], [1, -1, -1], [2, 6, -1], [3, -1, -1]])

    def test_map_to_physical(self):
        h = moe.replica_hash(np.arange(5))
        self.assertEqual(self.placement.map_to_physical(self.IDS, h).tolist(), self.PHYSICAL)
        # Ids outside [0, E) have no slot.
        self.assertEqual(self.placement.map_to_physical([[4, -7]], h[:1]).tolist(), [[-1, -1]])

    def test_plan(self):
        plan = moe.plan_dispatch(self.placement, self.SLOT_TO_RANK, 2, self.IDS)
        self.assertEqual([r.tolist() for r in plan.tokens_by_rank], [[0, 1, 3], [1, 2, 3]])
        self.assertEqual(plan.shared_rank.tolist(), [-1] * 5)

    def test_plan_with_padding_and_shared_experts(self):
        padding = np.array([False, False, False, True, False])
        plan = moe.plan_dispatch(self.placement, self.SLOT_TO_RANK, 2, self.IDS, padding,
                                 shared_experts=True)
        # Shared rank = rank of the first valid route; padded -> -1; no route -> rank 0.
        self.assertEqual(plan.shared_rank.tolist(), [0, 1, 1, -1, 0])
        self.assertEqual([r.tolist() for r in plan.tokens_by_rank], [[0, 1, 4], [1, 2]])

    def test_rejects_bad_maps(self):
        with self.assertRaisesRegex(ValueError, "no slot"):
            moe.LayerPlacement([0, 1, 1], 3)
        with self.assertRaisesRegex(ValueError, "entries in"):
            moe.LayerPlacement([0, 5], 3)
        with self.assertRaisesRegex(ValueError, "slot_to_rank"):
            moe.plan_dispatch(self.placement, [0, 1], 2, self.IDS)


def softmax(row):
    e = [math.exp(v - max(row)) for v in row]
    return [v / sum(e) for v in e]


def sigmoid(v):
    return 1.0 / (1.0 + math.exp(-v))


class RouteTest(unittest.TestCase):
    LOGITS = np.array([[1.0, 2.0, 3.0, 0.5]], dtype=np.float32)

    def test_renormalize(self):
        ids, weights = moe.route(self.LOGITS, "renormalize", top_k=2)
        self.assertEqual(ids.dtype, np.int32)
        self.assertEqual(ids.tolist(), [[2, 1]])
        # e^3 / (e^3 + e^2) = 1 / (1 + e^-1)
        np.testing.assert_allclose(weights, [[1 / (1 + math.exp(-1)), 1 / (1 + math.exp(1))]],
                                   rtol=1e-6)
        naive = moe.route(self.LOGITS, "renormalize_naive", top_k=2)
        np.testing.assert_array_equal(naive[1], weights)

    def test_default_keeps_probabilities(self):
        ids, weights = moe.route(self.LOGITS, "default", top_k=3)
        self.assertEqual(ids.tolist(), [[2, 1, 0]])
        p = softmax([1.0, 2.0, 3.0, 0.5])
        np.testing.assert_allclose(weights, [[p[2], p[1], p[0]]], rtol=1e-6)

    def test_ties_go_to_the_lower_id(self):
        ids, _ = moe.route(np.array([[1.0, 3.0, 3.0, 3.0]], np.float32), "default", top_k=2)
        self.assertEqual(ids.tolist(), [[1, 2]])

    def test_sigmoid(self):
        ids, weights = moe.route(np.array([[0.0, 2.0]], np.float32), "sigmoid", top_k=1)
        self.assertEqual(ids.tolist(), [[1]])
        np.testing.assert_allclose(weights, [[sigmoid(2.0)]], rtol=1e-6)
        ids, weights = moe.route(np.array([[0.0, 0.0]], np.float32), "sigmoid_renorm", top_k=2)
        self.assertEqual(ids.tolist(), [[0, 1]])
        np.testing.assert_allclose(weights, [[0.5, 0.5]], rtol=1e-6)

    def test_router_bias_is_added_first(self):
        ids, _ = moe.route(self.LOGITS, "default", top_k=1, router_bias=[5.0, 0, 0, 0])
        self.assertEqual(ids.tolist(), [[0]])

    def test_deepseek_v3_picks_inside_the_best_group(self):
        # Groups {0, 1} and {2, 3}: scores s = sigmoid(z) = .881, .047 | .731, .731; group sums
        # .928 and 1.462, so only experts 2 and 3 qualify although expert 0 scores highest.
        z = np.array([[2.0, -3.0, 1.0, 1.0]], np.float32)
        ids, weights = moe.route(z, "deepseek_v3", top_k=2, n_group=2, topk_group=1,
                                 routed_scaling_factor=2.5, renormalize=True)
        self.assertEqual(ids.tolist(), [[2, 3]])
        np.testing.assert_allclose(weights, [[1.25, 1.25]], rtol=1e-6)
        # Without renormalization the weights are the sigmoid scores times the factor.
        _, raw = moe.route(z, "deepseek_v3", top_k=2, n_group=2, topk_group=1,
                           routed_scaling_factor=2.5, renormalize=False)
        np.testing.assert_allclose(raw, [[2.5 * sigmoid(1.0)] * 2], rtol=1e-6)
        # A correction bias changes the selection but not the weights' source.
        ids, weights = moe.route(z, "deepseek_v3", top_k=1, n_group=2, topk_group=2,
                                 correction_bias=[0.0, 0.0, 0.0, 0.2], renormalize=False)
        self.assertEqual(ids.tolist(), [[3]])
        np.testing.assert_allclose(weights, [[sigmoid(1.0)]], rtol=1e-6)

    def test_rejects_bad_arguments(self):
        for kwargs, message in (({"method": "softmax", "top_k": 1}, "unknown routing"),
                                ({"method": "default", "top_k": 0}, "top_k"),
                                ({"method": "default", "top_k": 5}, "top_k"),
                                ({"method": "deepseek_v3", "top_k": 1, "n_group": 3}, "divide")):
            with self.assertRaisesRegex(ValueError, message):
                moe.route(self.LOGITS, **kwargs)
        with self.assertRaisesRegex(ValueError, "finite"):
            moe.route(np.array([[np.nan, 1.0]], np.float32), "default", top_k=1)


if __name__ == "__main__":
    unittest.main()
