"""Which replica of a pool serves a request: the routing policies, as pure functions.

- ``prefix_affinity`` (a pool's default): rendezvous (highest-random-weight) hashing of
  (tenant, static-prefix key) over the healthy replicas, with bounded load (consistent hashing
  with bounded loads, Mirrokni, Thorup and Zadimoghaddam 2018): a replica whose in-flight
  requests would pass ``c`` times the mean -- and the floor, a few requests any replica takes --
  passes the request on to the next replica in that key's order. The same key always prefers the same replica, so an agent's turns land where
  its earlier turns' static-prefix KV is; when a replica leaves, only its keys move (each to
  its own next replica), and they come back when it returns. A request without a static
  prefix has nothing to keep together: it goes least-loaded.
- ``least_loaded``: the replica with the fewest requests in flight (ties rotate).
- ``round_robin``: each replica in turn.

Every route is a whole order, the chosen replica first: the pool retries a failed request
once on the next one. The state (in-flight counts, health, the turn counter) lives in the
pool (``pool.py``); nothing here does I/O or keeps state.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Literal, get_args

import xxhash

Policy = Literal["prefix_affinity", "least_loaded", "round_robin"]
POLICIES: tuple[str, ...] = get_args(Policy)
DEFAULT_POLICY: Policy = "prefix_affinity"
DEFAULT_LOAD_FACTOR = 1.25
# A replica with fewer requests in flight than this is never too busy for its own keys: at low
# load a spill costs a whole static-prefix prefill elsewhere, while a few more requests in one
# engine's batch cost little (SGLang's cache-aware router has an absolute threshold likewise).
DEFAULT_LOAD_FLOOR = 4
# Why a replica served a request: its key's first choice, the next one because the first was
# over the load bound, the retry after a failure, or the other two policies.
CHOICES: tuple[str, ...] = ("affinity", "spill", "least_loaded", "round_robin", "failover")
_HASH_SEED = 0x5EED_2018  # fixed: every sidecar (and worker) orders a key's replicas alike


@dataclass(frozen=True, slots=True)
class ReplicaLoad:
    """What a policy sees of one replica."""

    in_flight: int
    healthy: bool = True


@dataclass(frozen=True, slots=True)
class Route:
    """Replica indexes in the order to try them (the chosen one first), and why the first."""

    order: tuple[int, ...]
    choice: str


def routing_key(tenant: str, key: str, session: str | None = None) -> bytes:
    """What prefix affinity hashes: the tenant and the static-prefix key, and the client's
    session id where it named one (``session_hint.py``). Tenants are kept apart even when their
    static prefixes (and so their engines' KV) are the same. With a session, the sessions that
    share a static prefix spread over the replicas, each one staying on its own: the static
    prefix is computed once per replica that holds such a session, and every later turn finds
    its conversation's KV, where without it those sessions share one replica until the load
    bound spills a turn elsewhere (docs/routing.md, "Sessions")."""
    head = tenant.encode() + b"\x00" + key.encode()
    return head if session is None else head + b"\x00" + session.encode()


def affinity_order(key: bytes, replicas: Sequence[str]) -> list[int]:
    """Indexes of ``replicas`` (their stable names) by rendezvous weight for ``key``, highest
    first: a replica's rank for a key does not depend on which other replicas exist."""
    return list(_ranked(key, tuple(replicas)))


@lru_cache(maxsize=1 << 14)  # an agent's every turn asks again: hash its replicas once
def _ranked(key: bytes, replicas: tuple[str, ...]) -> tuple[int, ...]:
    weights = [xxhash.xxh3_64_intdigest(name.encode() + b"\x00" + key, seed=_HASH_SEED)
               for name in replicas]
    return tuple(sorted(range(len(replicas)), key=lambda i: (-weights[i], i)))


def load_bound(total_in_flight: int, replicas: int, factor: float, floor: int = 1) -> int:
    """The most requests in flight one replica may hold after taking a new one:
    ``ceil(c * (m + 1) / n)``, the bound of consistent hashing with bounded loads, and never
    below ``floor``."""
    return max(1, floor, math.ceil(factor * (total_in_flight + 1) / replicas))


def healthy_indexes(loads: Sequence[ReplicaLoad]) -> list[int]:
    """The replicas to route over: the healthy ones; all of them when none is (a replica that
    may be down still beats refusing every request)."""
    healthy = [i for i, load in enumerate(loads) if load.healthy]
    return healthy or list(range(len(loads)))


def route(policy: str, loads: Sequence[ReplicaLoad], names: Sequence[str], *,
          key: bytes | None, turn: int, factor: float = DEFAULT_LOAD_FACTOR,
          floor: int = DEFAULT_LOAD_FLOOR) -> Route:
    """The order to try the replicas in for one request (see the module docstring).

    ``key`` is ``routing_key(...)``, or None for a request without a static prefix; ``turn``
    is a counter the caller advances per request (round robin, tie breaks).
    """
    if not loads or len(loads) != len(names):
        raise ValueError(f"route needs one name per replica, got {len(loads)} and {len(names)}")
    candidates = healthy_indexes(loads)
    if policy == "round_robin":
        start = turn % len(candidates)
        return Route(tuple(candidates[start:] + candidates[:start]), "round_robin")
    if policy == "least_loaded" or (policy == "prefix_affinity" and key is None):
        return Route(_least_loaded(candidates, loads, turn), "least_loaded")
    if policy != "prefix_affinity":
        raise ValueError(f"routing policy {policy!r} is not one of {', '.join(POLICIES)}")
    assert key is not None
    allowed = set(candidates)
    order = [i for i in affinity_order(key, names) if i in allowed]
    bound = load_bound(sum(loads[i].in_flight for i in order), len(order), factor, floor)
    for rank, index in enumerate(order):
        if loads[index].in_flight + 1 <= bound:
            rest = [i for i in order if i != index]
            return Route((index, *rest), "affinity" if rank == 0 else "spill")
    return Route(tuple(order), "affinity")  # unreachable: the least loaded is under the bound


def _least_loaded(candidates: list[int], loads: Sequence[ReplicaLoad],
                  turn: int) -> tuple[int, ...]:
    n = len(loads)
    return tuple(sorted(candidates, key=lambda i: (loads[i].in_flight, (i - turn) % n)))


def eject_seconds(failures: int, base_s: float, max_doublings: int = 4) -> float:
    """How long a replica is left out after ``failures`` failures in a row: ``base_s``,
    doubled per further failure, at most ``2**max_doublings`` times ``base_s``."""
    if failures < 1:
        return 0.0
    return base_s * 2 ** min(failures - 1, max_doublings)
