"""EPLB replica choice and the dispatch plan: which shard gets which tokens of a batch.

The replica rule is numerics.md section 4, the same pure function the shards and the C++ client
(client/dispatch.cc) run, so a client and a shard holding the same map version agree on every
token's physical slot: for a token with index t in the sender's batch,
h = (t * 2654435769) mod 2^32, and a route to logical expert e goes to the slot
logical_to_physical[e][h mod replica_count[e]], the expert's slots taken in ascending order.
"""

import dataclasses

import numpy as np

REPLICA_HASH_MULTIPLIER = 2654435769


def replica_hash(token_indices):
    """uint64 array of h = (t * 2654435769) mod 2^32 for each token index t (int64, wrapping as
    the C++ uint64 arithmetic does)."""
    t = np.asarray(token_indices, dtype=np.int64).astype(np.uint64)
    return (t * np.uint64(REPLICA_HASH_MULTIPLIER)) & np.uint64(0xFFFFFFFF)


class LayerPlacement:
    """One layer's map: physical_to_logical [P] (-1 = vacant slot) -> logical_to_physical."""

    def __init__(self, physical_to_logical, num_logical):
        p2l = np.asarray(physical_to_logical, dtype=np.int64)
        if p2l.ndim != 1 or np.any((p2l < -1) | (p2l >= num_logical)):
            raise ValueError("physical_to_logical must be [P] with entries in [-1, %d)"
                             % num_logical)
        self.num_logical = int(num_logical)
        self.physical_to_logical = p2l
        slots = [np.flatnonzero(p2l == e) for e in range(num_logical)]  # ascending
        self.replica_count = np.array([len(s) for s in slots], dtype=np.int64)
        if np.any(self.replica_count == 0):
            missing = np.flatnonzero(self.replica_count == 0).tolist()
            raise ValueError("logical experts %s have no slot" % missing)
        self.logical_to_physical = np.full((num_logical, int(self.replica_count.max())), -1,
                                           dtype=np.int64)
        for e, s in enumerate(slots):
            self.logical_to_physical[e, :len(s)] = s

    @property
    def num_physical(self):
        return len(self.physical_to_logical)

    def map_to_physical(self, topk_ids, h):
        """Physical slot of each route: topk_ids [T, K] logical ids, h [T] replica hashes;
        ids of -1 or outside [0, E) give -1."""
        ids = np.asarray(topk_ids, dtype=np.int64)
        valid = (ids >= 0) & (ids < self.num_logical)
        e = np.where(valid, ids, 0)
        replica = np.asarray(h, dtype=np.uint64)[:, None] % self.replica_count[e].astype(np.uint64)
        return np.where(valid, self.logical_to_physical[e, replica.astype(np.int64)], -1)


@dataclasses.dataclass
class DispatchPlan:
    # Ascending token rows sent to each rank: a token goes to every rank hosting one of its
    # routes, and to its shared-expert rank.
    tokens_by_rank: list
    # [T] int32: the one rank that adds each token's shared-expert output (-1: not requested, or
    # a padded token): the rank of the token's first valid route, else rank 0.
    shared_rank: np.ndarray


def plan_dispatch(placement, slot_to_rank, num_ranks, topk_ids, is_padding=None,
                  shared_experts=False):
    """The plan for topk_ids [T, K] (row t = token index t) under one layer's placement.
    slot_to_rank [P]; is_padding optional bool [T] (padded tokens are sent nowhere)."""
    ids = np.asarray(topk_ids)
    if ids.ndim != 2:
        raise ValueError("topk_ids must be [T, K], got shape %s" % (ids.shape,))
    t_count = ids.shape[0]
    slot_to_rank = np.asarray(slot_to_rank, dtype=np.int64)
    if slot_to_rank.shape != (placement.num_physical,):
        raise ValueError("slot_to_rank has %d entries for %d slots"
                         % (slot_to_rank.size, placement.num_physical))
    if np.any((slot_to_rank < 0) | (slot_to_rank >= num_ranks)):
        raise ValueError("slot_to_rank names a rank outside [0, %d)" % num_ranks)
    physical = placement.map_to_physical(ids, replica_hash(np.arange(t_count)))
    rank = np.where(physical >= 0, slot_to_rank[np.maximum(physical, 0)], -1)
    if is_padding is not None:
        padding = np.asarray(is_padding, dtype=bool)
        if padding.shape != (t_count,):
            raise ValueError("is_padding must be [%d], got shape %s" % (t_count, padding.shape))
        rank[padding] = -1
    else:
        padding = np.zeros(t_count, dtype=bool)
    shared_rank = np.full(t_count, -1, dtype=np.int32)
    if shared_experts and num_ranks > 0:
        has_route = rank >= 0
        first = np.where(has_route.any(axis=1),
                         rank[np.arange(t_count), has_route.argmax(axis=1)], 0)
        shared_rank = np.where(padding, -1, first).astype(np.int32)
    tokens_by_rank = [np.flatnonzero(np.any(rank == r, axis=1) | (shared_rank == r))
                      for r in range(num_ranks)]
    return DispatchPlan(tokens_by_rank=tokens_by_rank, shared_rank=shared_rank)
