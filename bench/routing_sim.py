"""Routing simulation at fleet scale, pure Python (no engines): the sidecar's own policies
(``prefix_cache.service.routing.route``) over 64 replicas and 10,000 agents whose popularity
follows a Zipf law, with replicas failing and coming back, side by side in one run.

    python bench/routing_sim.py [--replicas 64] [--agents 10000] [--requests 200000]
                                [--zipf 1.0] [--kv-prefixes 320] [--update-docs]

The model. Requests arrive as a Poisson process; each names an agent (Zipf over the agents) and
is routed with the replicas' requests in flight and health, as the pool does. A replica keeps
the static-prefix KV of ``--kv-prefixes`` agents (LRU; twice an even share by default): a request
whose agent is there is a hit and holds its replica for 1 time unit, a miss prefills the static
prefix and holds it for ``--miss-cost`` units. The arrival rate puts ``--load`` requests in
flight per replica on average (at the hit cost). Failures: at 30% of the run a tenth of the
replicas go down together and come back empty at 50%; from 60% to 80% one more replica flaps
(down and back, empty, every 2% of the run). A down replica is out of routing at once (the pool
learns it from the first failed request or probe; that request's retry is not modelled).

Reported per policy: the static-prefix hit rate (all requests; and the requests after an
agent's first), the prefill work (misses), max/mean requests per replica over the run, and the
time-averaged max/mean of requests in flight (sampled at each arrival, over the replicas up).
"""

from __future__ import annotations

import argparse
import bisect
import heapq
import itertools
import json
import random
import sys
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.routing import command_line, publish  # noqa: E402
from prefix_cache.service.routing import (  # noqa: E402
    DEFAULT_LOAD_FACTOR,
    DEFAULT_LOAD_FLOOR,
    ReplicaLoad,
    route,
    routing_key,
)

POLICIES = ("round_robin", "least_loaded", "prefix_affinity")
MARK_START, MARK_END = "<!-- bench:routing-sim:start -->", "<!-- bench:routing-sim:end -->"


class LRU:
    """The agents whose static-prefix KV one replica holds."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.items: OrderedDict[int, None] = OrderedDict()

    def touch(self, agent: int) -> bool:
        """Whether ``agent`` was held (a hit); it is held now either way."""
        if agent in self.items:
            self.items.move_to_end(agent)
            return True
        self.items[agent] = None
        if len(self.items) > self.capacity:
            self.items.popitem(last=False)
        return False


def zipf_sampler(n: int, s: float, rng: random.Random) -> Any:
    weights = [1.0 / (k + 1) ** s for k in range(n)]
    cumulative = list(itertools.accumulate(weights))
    total = cumulative[-1]
    return lambda: bisect.bisect_left(cumulative, rng.random() * total)


def failures(args: argparse.Namespace) -> list[tuple[int, int, bool]]:
    """(request index, replica, up?) events, in order."""
    n, events = args.requests, []
    group = range(max(1, args.replicas // 10))
    events += [(int(0.3 * n), r, False) for r in group]
    events += [(int(0.5 * n), r, True) for r in group]
    flapper = args.replicas - 1
    for i, at in enumerate(range(int(0.6 * n), int(0.8 * n), max(1, int(0.02 * n)))):
        events.append((at, flapper, i % 2 == 1))
    events.append((int(0.8 * n), flapper, True))
    return sorted(events)


def simulate(policy: str, args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(args.seed)          # the same arrivals and agents for every policy
    pick = zipf_sampler(args.agents, args.zipf, rng)
    names = [f"http://replica-{i}:8080/v1" for i in range(args.replicas)]
    keys = {}
    caches = [LRU(args.kv_prefixes) for _ in names]
    in_flight = [0] * args.replicas
    up = [True] * args.replicas
    served = [0] * args.replicas
    ending: list[tuple[float, int]] = []
    rate = args.load * args.replicas          # arrivals per time unit at the hit cost
    events = failures(args)
    hits = later = later_hits = 0
    seen: set[int] = set()
    ratio_sum = 0.0
    now = 0.0
    turns = itertools.count()
    next_event = 0
    for i in range(args.requests):
        while next_event < len(events) and events[next_event][0] <= i:
            _, replica, is_up = events[next_event]
            up[replica] = is_up
            if is_up:
                caches[replica] = LRU(args.kv_prefixes)   # back from a restart: its KV is gone
            next_event += 1
        now += rng.expovariate(rate)
        while ending and ending[0][0] <= now:
            in_flight[heapq.heappop(ending)[1]] -= 1
        agent = pick()
        key = keys.get(agent)
        if key is None:
            key = keys[agent] = routing_key("tenant", f"spc:tenant:model:{agent:032x}")
        loads = [ReplicaLoad(n, h) for n, h in zip(in_flight, up, strict=True)]
        chosen = route(policy, loads, names, key=key, turn=next(turns),
                       factor=args.load_factor, floor=args.load_floor).order[0]
        hit = caches[chosen].touch(agent)
        hits += hit
        if agent in seen:
            later += 1
            later_hits += hit
        seen.add(agent)
        served[chosen] += 1
        in_flight[chosen] += 1
        heapq.heappush(ending, (now + (1.0 if hit else args.miss_cost), chosen))
        live = [in_flight[r] for r in range(args.replicas) if up[r]]
        mean = sum(live) / len(live)
        ratio_sum += max(live) / mean if mean else 1.0
    return {
        "hit_rate": hits / args.requests,
        "hit_rate_after_first": later_hits / later if later else 0.0,
        "misses": args.requests - hits,
        "max_mean_requests": max(served) / (sum(served) / args.replicas),
        "max_mean_in_flight": ratio_sum / args.requests,
    }


def table(report: dict[str, Any], args: argparse.Namespace, command: str) -> str:
    lines = [
        f"Pure Python, no engines (the sidecar's `routing.route`). {args.replicas} replicas, "
        f"{args.agents:,} agents (Zipf s={args.zipf}), {args.requests:,} requests, "
        f"{args.kv_prefixes} static prefixes of KV per replica (LRU), a miss {args.miss_cost:g}x "
        f"a hit's time, {args.load:g} requests in flight per replica on average at the hit "
        f"cost; a tenth of the replicas down from 30% to 50% of the run (back empty), one "
        f"more flapping from 60% to 80%. Load factor c={args.load_factor}, floor {args.load_floor}. "
        f"Command: "
        f"`{command}` ({report['seconds']:.0f} s)",
        "",
        "| policy | hit rate | hit rate after an agent's first request | misses (prefills) "
        "| max/mean requests per replica | max/mean in flight (time-averaged) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for policy in POLICIES:
        r = report["policies"][policy]
        lines.append(f"| {policy} | {r['hit_rate']:.1%} | {r['hit_rate_after_first']:.1%} | "
                     f"{r['misses']:,} | {r['max_mean_requests']:.2f} | "
                     f"{r['max_mean_in_flight']:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, default=64)
    parser.add_argument("--agents", type=int, default=10_000)
    parser.add_argument("--requests", type=int, default=200_000)
    parser.add_argument("--zipf", type=float, default=1.0)
    parser.add_argument("--kv-prefixes", type=int, default=320)
    parser.add_argument("--miss-cost", type=float, default=8.0)
    parser.add_argument("--load", type=float, default=4.0)
    parser.add_argument("--load-factor", type=float, default=DEFAULT_LOAD_FACTOR)
    parser.add_argument("--load-floor", type=int, default=DEFAULT_LOAD_FLOOR)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--update-docs", action="store_true")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    report: dict[str, Any] = {"policies": {}}
    for policy in POLICIES:
        report["policies"][policy] = simulate(policy, args)
        print(policy, json.dumps(report["policies"][policy]), file=sys.stderr, flush=True)
    report["seconds"] = time.perf_counter() - started
    text = table(report, args, command_line("python bench/routing_sim.py", argv))
    publish(text, report, args, MARK_START, MARK_END)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
