"""Session affinity: agent sessions that share one static prefix (one client's system prompt and
tools, one tenant) over several engine replicas, routed by the sidecar's own policy
(``prefix_cache.service.routing.route``) with and without the client's session id in the
routing key (``session_hint.py``: Codex's ``prompt_cache_key``, Claude Code's
``metadata.user_id`` session, opencode's ``x-session-affinity``), side by side in one run.

    python bench/session_affinity.py [--replicas 4] [--turns 12] [--seed 0] [--update-docs]

The model: S sessions start together and each runs ``--turns`` turns; between its turns a session
thinks (exponential, mean ``--think`` time units). A turn served on the replica that served the
session's previous turn finds its conversation's KV there and holds that replica 1 unit; a turn
anywhere else recomputes its whole conversation (``--move-cost`` units); a replica that has
never seen the static prefix computes it too (``--prefix-cost`` more). In-flight counts feed the
load bound as in the pool. Reported per S and routing: the share of later turns (2nd on) served
from the replica holding their conversation, the static-prefix computations, and the work (time
units of replica busy time).
"""

from __future__ import annotations

import argparse
import heapq
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.engine import update_docs  # noqa: E402
from prefix_cache.service.routing import ReplicaLoad, route, routing_key  # noqa: E402

SESSIONS = (2, 4, 8, 16, 32, 64)
DOCS = ROOT / "docs" / "benchmarks.md"
MARK = "<!-- session-affinity -->"


def simulate(sessions: int, replicas: int, turns: int, hint: bool, seed: int, think: float,
             move_cost: float, prefix_cost: float) -> dict[str, float]:
    rng = random.Random(seed)
    names = [f"replica-{i}" for i in range(replicas)]
    in_flight = [0] * replicas
    seen_prefix = [False] * replicas
    holder: list[int | None] = [None] * sessions
    done = [0] * sessions
    kept = later = computed = 0
    work = 0.0
    counter = 0
    # (time, order, kind, session, replica): kind 0 = a turn arrives, 1 = it finishes
    events: list[tuple[float, int, int, int, int]] = []
    for s in range(sessions):
        heapq.heappush(events, (rng.random() * 0.1, counter, 0, s, -1))
        counter += 1
    while events:
        now, _, kind, s, replica = heapq.heappop(events)
        if kind == 1:
            in_flight[replica] -= 1
            done[s] += 1
            if done[s] < turns:
                counter += 1
                heapq.heappush(events, (now + rng.expovariate(1 / think), counter, 0, s, -1))
            continue
        key = routing_key("acme", "static-key", f"session-{s}" if hint else None)
        chosen = route("prefix_affinity", [ReplicaLoad(n) for n in in_flight], names,
                       key=key, turn=counter).order[0]
        cost = 1.0
        if holder[s] is not None:
            later += 1
            if chosen == holder[s]:
                kept += 1
            else:
                cost = move_cost
        if not seen_prefix[chosen]:
            seen_prefix[chosen] = True
            computed += 1
            cost += prefix_cost
        holder[s] = chosen
        in_flight[chosen] += 1
        work += cost
        counter += 1
        heapq.heappush(events, (now + cost, counter, 1, s, chosen))
    return {"kept": kept / later if later else 1.0, "prefix_computed": computed, "work": work}


def table(args: argparse.Namespace) -> str:
    rows = ["| sessions | later turns on their conversation's replica: no hint | with the hint "
            "| static-prefix computations: no hint | with | replica work: no hint | with "
            "| ratio |", "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for s in SESSIONS:
        off, on = (simulate(s, args.replicas, args.turns, h, args.seed, args.think,
                            args.move_cost, args.prefix_cost) for h in (False, True))
        rows.append(f"| {s} | {off['kept']:.1%} | {on['kept']:.1%} | {off['prefix_computed']} "
                    f"| {on['prefix_computed']} | {off['work']:.0f} | {on['work']:.0f} "
                    f"| {on['work'] / off['work']:.2f}x |")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--turns", type=int, default=12)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--think", type=float, default=2.0)
    parser.add_argument("--move-cost", type=float, default=8.0)
    parser.add_argument("--prefix-cost", type=float, default=4.0)
    parser.add_argument("--update-docs", action="store_true")
    args = parser.parse_args()
    text = table(args)
    print(text)
    if args.update_docs:
        update_docs(text, MARK, MARK, DOCS)


if __name__ == "__main__":
    main()
