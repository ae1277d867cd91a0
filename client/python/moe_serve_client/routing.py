"""Routing from router logits to top-k expert ids and weights (numerics.md section 7), with the
conventions of the C++ library (kernels/routing.cc) so that both pick the same experts:

- every selection ranks by value, higher first, ties to the lower expert id; the K ids of a token
  are returned in that order;
- "default": softmax over all E, top-k, weights = probabilities (not renormalized);
- "renormalize" / "renormalize_naive": the same top-k, weights divided by their sum;
- "sigmoid" / "sigmoid_renorm": sigmoid scores, top-k, the latter renormalized;
- "deepseek_v3": s = sigmoid(z); selection on b = s + correction_bias; a group's score is the sum
  of its two best b (one when groups have a single expert); the topk_group best groups supply the
  candidates; top-k of b among them; weights s[ids], renormalized if asked, times
  routed_scaling_factor;
- a renormalization whose K weights sum to 0 gives 1/K each;
- router_bias (all methods) is added to the logits first.
Arithmetic is float32 throughout; sums may differ from the C++ order in the last bit.
"""

import numpy as np

ROUTING_METHODS = ("default", "renormalize", "renormalize_naive", "sigmoid", "sigmoid_renorm",
                   "deepseek_v3")


def _top(values, k):
    """Indices of the k largest values per row, higher first, ties to the lower index."""
    return np.argsort(-values, axis=1, kind="stable")[:, :k].astype(np.int32)


def _renormalize(w):
    total = w.sum(axis=1, keepdims=True, dtype=np.float32)
    even = np.full_like(w, np.float32(1.0) / np.float32(w.shape[1]))
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(total > 0, w / total, even).astype(np.float32)


def _sigmoid(z):
    return (np.float32(1.0) / (np.float32(1.0) + np.exp(-z))).astype(np.float32)


def _softmax(z):
    e = np.exp(z - z.max(axis=1, keepdims=True))
    return (e / e.sum(axis=1, keepdims=True, dtype=np.float32)).astype(np.float32)


def _bias(bias, num_experts, name):
    if bias is None:
        return np.zeros(num_experts, dtype=np.float32)
    bias = np.asarray(bias, dtype=np.float32)
    if bias.shape != (num_experts,) or not np.all(np.isfinite(bias)):
        raise ValueError("%s must be finite float32 [%d]" % (name, num_experts))
    return bias


def _deepseek_v3(z, top_k, n_group, topk_group, correction_bias, renormalize, scale):
    tokens, experts = z.shape
    if n_group < 1 or experts % n_group:
        raise ValueError("deepseek_v3: n_group %d does not divide E = %d" % (n_group, experts))
    group_size = experts // n_group
    if not 1 <= topk_group <= n_group or topk_group * group_size < top_k:
        raise ValueError("deepseek_v3: topk_group %d of %d groups of %d experts cannot supply "
                         "top_k = %d" % (topk_group, n_group, group_size, top_k))
    if not (np.isfinite(scale) and scale > 0):
        raise ValueError("deepseek_v3: routed_scaling_factor must be finite and > 0")
    s = _sigmoid(z)
    b = (s + _bias(correction_bias, experts, "correction_bias")).astype(np.float32)
    grouped = b.reshape(tokens, n_group, group_size)
    best = -np.sort(-grouped, axis=2)[:, :, :min(group_size, 2)]
    group_score = best.sum(axis=2, dtype=np.float32)
    groups = _top(group_score, topk_group)
    candidate = np.zeros((tokens, n_group), dtype=bool)
    np.put_along_axis(candidate, groups, True, axis=1)
    masked = np.where(np.repeat(candidate, group_size, axis=1), b, -np.inf)
    ids = _top(masked, top_k)
    weights = np.take_along_axis(s, ids, axis=1)
    if renormalize:
        weights = _renormalize(weights)
    return ids, (weights * np.float32(scale)).astype(np.float32)


def route(logits, method="renormalize", top_k=1, *, router_bias=None, n_group=1, topk_group=1,
          correction_bias=None, routed_scaling_factor=1.0, renormalize=True):
    """logits [T, E] -> (topk_ids int32 [T, K], topk_weights float32 [T, K]).

    n_group, topk_group, correction_bias, routed_scaling_factor and renormalize apply to
    "deepseek_v3" only. ValueError for unknown methods, K outside [1, E], non-finite logits."""
    z = np.asarray(logits, dtype=np.float32)
    if z.ndim != 2:
        raise ValueError("logits must be [T, E], got shape %s" % (z.shape,))
    tokens, experts = z.shape
    if method not in ROUTING_METHODS:
        raise ValueError("unknown routing method %r (expected one of %s)"
                         % (method, ", ".join(ROUTING_METHODS)))
    if not 1 <= top_k <= experts:
        raise ValueError("top_k %d outside [1, E = %d]" % (top_k, experts))
    z = (z + _bias(router_bias, experts, "router_bias")).astype(np.float32)
    if not np.all(np.isfinite(z)):
        raise ValueError("logits (plus router_bias) must be finite")
    if method == "deepseek_v3":
        return _deepseek_v3(z, top_k, n_group, topk_group, correction_bias, renormalize,
                            routed_scaling_factor)
    scores = _sigmoid(z) if method.startswith("sigmoid") else _softmax(z)
    ids = _top(scores, top_k)
    weights = np.take_along_axis(scores, ids, axis=1)
    if method not in ("default", "sigmoid"):
        weights = _renormalize(weights)
    return ids, weights.astype(np.float32)
