"""The routing policies as pure functions (``prefix_cache.service.routing``), table-driven."""

from __future__ import annotations

from collections import Counter

import pytest

from prefix_cache.service.routing import (
    ReplicaLoad,
    Route,
    affinity_order,
    eject_seconds,
    healthy_indexes,
    load_bound,
    route,
    routing_key,
)

NAMES = [f"http://10.0.0.{i}:8080/v1" for i in range(4)]
IDLE = [ReplicaLoad(0)] * 4


def key(i: int, tenant: str = "t") -> bytes:
    return routing_key(tenant, f"spc:{tenant}:m:{i:032x}")


@pytest.mark.parametrize(("total", "replicas", "factor", "floor", "bound"), [
    (0, 4, 1.25, 1, 1),      # an idle pool: one each
    (1, 4, 1.25, 1, 1),      # ceil(1.25 * 2 / 4) = 1
    (3, 4, 1.25, 1, 2),      # ceil(1.25 * 4 / 4) = 2
    (7, 4, 1.25, 1, 3),      # ceil(1.25 * 8 / 4) = 3
    (99, 4, 1.25, 1, 32),    # ceil(125 / 4)
    (99, 4, 1.0, 1, 25),     # c = 1: the mean itself
    (10, 1, 1.25, 1, 14),    # one replica takes everything
    (3, 4, 1.25, 4, 4),      # the floor: a few in flight never spill
    (99, 4, 1.25, 4, 32),    # ... and does not matter under load
])
def test_load_bound(total: int, replicas: int, factor: float, floor: int, bound: int) -> None:
    assert load_bound(total, replicas, factor, floor) == bound


@pytest.mark.parametrize(("failures", "seconds"), [
    (0, 0.0), (1, 5.0), (2, 10.0), (3, 20.0), (5, 80.0), (9, 80.0)])
def test_eject_seconds_doubles_up_to_a_cap(failures: int, seconds: float) -> None:
    assert eject_seconds(failures, 5.0) == seconds


@pytest.mark.parametrize(("health", "expected"), [
    ([True, True, True], [0, 1, 2]),
    ([True, False, True], [0, 2]),
    ([False, False, False], [0, 1, 2]),   # none healthy: try them all rather than refuse
])
def test_healthy_indexes(health: list[bool], expected: list[int]) -> None:
    assert healthy_indexes([ReplicaLoad(0, h) for h in health]) == expected


def test_the_same_key_always_prefers_the_same_replica() -> None:
    for i in range(50):
        first = route("prefix_affinity", IDLE, NAMES, key=key(i), turn=0)
        again = route("prefix_affinity", IDLE, NAMES, key=key(i), turn=i + 7)
        assert first == again and first.choice == "affinity"
        assert sorted(first.order) == [0, 1, 2, 3]


def test_affinity_spreads_keys_evenly() -> None:
    counts = Counter(affinity_order(key(i), NAMES)[0] for i in range(4000))
    assert sorted(counts) == [0, 1, 2, 3]
    assert max(counts.values()) < 1.15 * 1000 and min(counts.values()) > 0.85 * 1000


def test_a_replica_leaving_moves_only_its_own_keys() -> None:
    before = {i: affinity_order(key(i), NAMES)[0] for i in range(2000)}
    loads = [ReplicaLoad(0), ReplicaLoad(0, healthy=False), ReplicaLoad(0), ReplicaLoad(0)]
    after = {i: route("prefix_affinity", loads, NAMES, key=key(i), turn=0) for i in range(2000)}
    for i, chosen in after.items():
        if before[i] != 1:
            assert chosen.order[0] == before[i]      # untouched
        else:
            # Its next replica in the key's own order: the keys of a replica that left spread
            # over all the others instead of piling onto one neighbour.
            assert chosen.order[0] == affinity_order(key(i), NAMES)[1]
        assert 1 not in chosen.order


def test_rendezvous_order_does_not_depend_on_the_other_replicas() -> None:
    for i in range(200):
        full = affinity_order(key(i), NAMES)
        without = affinity_order(key(i), NAMES[:2] + NAMES[3:])
        assert [NAMES[j] for j in full if j != 2] == [(NAMES[:2] + NAMES[3:])[j] for j in without]


def test_bounded_load_spills_to_the_next_in_the_key_order_and_comes_back() -> None:
    order = affinity_order(key(3), NAMES)
    first, second = order[0], order[1]
    busy = [ReplicaLoad(2 if i == first else 0) for i in range(4)]   # bound ceil(1.25*3/4) = 1
    spilled = route("prefix_affinity", busy, NAMES, key=key(3), turn=0, floor=1)
    assert spilled == Route((second, first, *order[2:]), "spill")
    # Under the default floor (4 in flight) the same two requests stay home.
    assert route("prefix_affinity", busy, NAMES, key=key(3), turn=0).choice == "affinity"
    hot = [ReplicaLoad(6 if i == first else 1) for i in range(4)]     # bound ceil(1.25*10/4) = 4
    assert route("prefix_affinity", hot, NAMES, key=key(3), turn=0).order[0] == second
    loaded = [ReplicaLoad(2) for _ in range(4)]                     # everyone at the mean
    assert route("prefix_affinity", loaded, NAMES, key=key(3), turn=0,
                 floor=1).choice == "affinity"
    assert route("prefix_affinity", IDLE, NAMES, key=key(3), turn=0).order[0] == first


def test_tenants_with_the_same_static_prefix_are_routed_independently() -> None:
    same = [affinity_order(routing_key("a", f"k{i}"), NAMES)[0]
            == affinity_order(routing_key("b", f"k{i}"), NAMES)[0] for i in range(400)]
    assert 0.15 < sum(same) / len(same) < 0.35     # about 1/4: independent draws


@pytest.mark.parametrize(("policy", "loads", "turn", "order", "choice"), [
    ("round_robin", [0, 0, 0, 0], 0, (0, 1, 2, 3), "round_robin"),
    ("round_robin", [0, 0, 0, 0], 5, (1, 2, 3, 0), "round_robin"),
    ("round_robin", [5, 0, 0, 0], 4, (0, 1, 2, 3), "round_robin"),    # blind to load
    ("least_loaded", [3, 1, 2, 1], 0, (1, 3, 2, 0), "least_loaded"),
    ("least_loaded", [3, 1, 2, 1], 2, (3, 1, 2, 0), "least_loaded"),  # ties rotate
    ("prefix_affinity", [3, 1, 2, 0], 0, (3, 1, 2, 0), "least_loaded"),  # no static prefix
])
def test_policies_without_a_key(policy: str, loads: list[int], turn: int,
                                order: tuple[int, ...], choice: str) -> None:
    chosen = route(policy, [ReplicaLoad(n) for n in loads], NAMES, key=None, turn=turn)
    assert chosen == Route(order, choice)


def test_unhealthy_replicas_are_left_out_of_every_policy() -> None:
    loads = [ReplicaLoad(0, healthy=i != 2) for i in range(4)]
    for policy in ("round_robin", "least_loaded", "prefix_affinity"):
        for turn in range(6):
            assert 2 not in route(policy, loads, NAMES, key=key(turn), turn=turn).order


@pytest.mark.parametrize(("policy", "names"), [("nearest", NAMES), ("round_robin", NAMES[:3])])
def test_bad_routes_are_refused(policy: str, names: list[str]) -> None:
    with pytest.raises(ValueError):
        route(policy, IDLE, names, key=key(0), turn=0)
