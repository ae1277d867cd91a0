"""The installed package against a secured cluster: a coordinator and a shard (serving TCP
channels) with TLS, client certificates required and bearer tokens (--tls_cert / --tls_key /
--tls_ca / --tls_require_client_cert / --auth_tokens_file), and the plaintext reference shard of
test_cluster.py.

  MOE_TEST_SECURE_COORDINATOR=HOST:PORT MOE_TEST_REFERENCE=HOST:PORT MOE_TEST_PKI=DIR \
    MOE_TEST_FRONTEND_TOKEN=TOKEN python -m unittest test_secure

DIR holds ca.pem (the CA), node.pem / node.key (signed by it, for 127.0.0.1) and rogue.pem /
rogue.key (signed by another CA). A client with the CA, a certificate and the frontend token
gets the reference's outputs over gRPC, over TLS TCP channels and by default; one without the
token is refused UNAUTHENTICATED, one with a foreign certificate or none, or in plaintext, cannot
connect (UNAVAILABLE).
"""

import os
import unittest

import grpc
import numpy as np

import moe_serve_client as moe
from moe_serve_client import pb
from moe_serve_client import wire

COORDINATOR = os.environ.get("MOE_TEST_SECURE_COORDINATOR", "")
REFERENCE = os.environ.get("MOE_TEST_REFERENCE", "")
PKI = os.environ.get("MOE_TEST_PKI", "")
TOKEN = os.environ.get("MOE_TEST_FRONTEND_TOKEN", "")
RTOL = 1e-5


def pki(name):
    return os.path.join(PKI, name)


@unittest.skipUnless(COORDINATOR and REFERENCE and PKI and TOKEN,
                     "needs MOE_TEST_SECURE_COORDINATOR, MOE_TEST_REFERENCE, MOE_TEST_PKI and "
                     "MOE_TEST_FRONTEND_TOKEN")
class SecureClusterTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.client = moe.connect(COORDINATOR, wait=60.0, tls_ca=pki("ca.pem"),
                                 tls_cert=pki("node.pem"), tls_key=pki("node.key"),
                                 auth_token=TOKEN)
        cls.model = cls.client.cluster_map().model
        cls.reference_channel = grpc.insecure_channel(REFERENCE)
        cls.reference = pb.shard_pb2_grpc.ExpertShardStub(cls.reference_channel)

    @classmethod
    def tearDownClass(cls):
        cls.client.close()
        cls.reference_channel.close()

    def reference_forward(self, layer, hidden, ids, weights):
        request = pb.shard_pb2.ForwardRequest(
            layer=layer,
            hidden_states=pb.shard_pb2.HiddenStates(
                format=pb.shard_pb2.ACTIVATION_BF16,
                data=wire.to_tensor(wire.float_to_bf16_bits(hidden), pb.tensor_pb2.BF16)),
            topk_ids=wire.to_tensor(ids, pb.tensor_pb2.I32),
            topk_weights=wire.to_tensor(weights, pb.tensor_pb2.F32),
            output_dtype=pb.tensor_pb2.F32)
        return wire.from_tensor(self.reference.Forward(request, timeout=30.0).output)

    def test_forward_over_every_transport(self):
        self.assertTrue(self.client.cluster_map().shards[0].address)
        rng = np.random.default_rng(7)
        for transport, tokens in (("grpc", 12), ("tcp", 12), ("auto", 12), ("auto", 300)):
            hidden = rng.standard_normal((tokens, self.model.hidden_size), dtype=np.float32)
            logits = rng.standard_normal((tokens, self.model.num_experts), dtype=np.float32)
            ids, weights = moe.route(logits, "renormalize", top_k=self.model.top_k)
            got = self.client.forward(1, hidden, ids, weights, transport=transport).output
            want = self.reference_forward(1, hidden, ids, weights)
            scale = float(np.abs(want).max())
            self.assertGreater(scale, 0.0)
            np.testing.assert_allclose(got, want, rtol=RTOL, atol=RTOL * scale,
                                       err_msg="%s, %d tokens" % (transport, tokens))

    def refused(self, **security):
        with self.assertRaises(moe.MoeServeError) as caught:
            moe.connect(COORDINATOR, wait=1.0, **security)
        return str(caught.exception)

    def test_refusals(self):
        tls = dict(tls_ca=pki("ca.pem"), tls_cert=pki("node.pem"), tls_key=pki("node.key"))
        self.assertIn("UNAUTHENTICATED", self.refused(**tls))
        self.assertIn("UNAUTHENTICATED", self.refused(auth_token="not-a-token", **tls))
        self.assertIn("UNAVAILABLE", self.refused(tls_ca=pki("ca.pem"), tls_cert=pki("rogue.pem"),
                                                  tls_key=pki("rogue.key"), auth_token=TOKEN))
        self.assertIn("UNAVAILABLE", self.refused(tls_ca=pki("ca.pem"), auth_token=TOKEN))
        self.assertIn("UNAVAILABLE", self.refused(auth_token=TOKEN))  # plaintext

    def test_bad_arguments(self):
        with self.assertRaises(ValueError):
            moe.connect(COORDINATOR, wait=1.0, tls_ca=pki("ca.pem"), tls_cert=pki("node.pem"))
        with self.assertRaises(ValueError):
            moe.connect(COORDINATOR, wait=1.0, tls_cert=pki("node.pem"), tls_key=pki("node.key"))
        with self.assertRaises(ValueError):
            moe.connect(COORDINATOR, wait=1.0, auth_token="")
        with self.assertRaises(FileNotFoundError):
            moe.connect(COORDINATOR, wait=1.0, tls_ca=pki("missing.pem"))


if __name__ == "__main__":
    unittest.main()
