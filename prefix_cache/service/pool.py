"""A model's pool of upstream replicas: routing (``routing.py``), health and one retry.

- **Passive ejection.** A replica that cannot be reached, times out, or answers a 5xx (or a
  status that is not relayed) is left out of routing for a backoff (``routing.eject_seconds``:
  doubled per failure in a row); its first success clears the count. A 5xx is judged by the
  retry: when the next replica answers the same request with a 5xx too, the request is at
  fault (a poison request) and neither replica is ejected. A stream that breaks
  after its first byte ejects it too. When every replica is out, all are tried anyway.
- **Active health.** ``GET /readyz`` probes each replica: a failed probe ejects it the same
  way, a passed one routes to an ejected replica again before its backoff ends.
- **One retry.** A request whose replica fails before any byte reached the client is sent
  once more, to the next replica of its route. Once the answer has started (a 2xx is open and
  handed to the relay) nothing is retried: a stream is never retried after its first byte.
- **In flight** counts from the send until the relayed answer is closed (the pool wraps the
  response's byte stream), which is what the load bound and ``least_loaded`` compare.

The state is this worker's own (with ``--workers N`` each worker routes on its own counts; the
affinity order, a pure function of the key, is the same in all of them). One pool of one
replica behaves exactly as a lone upstream: same request, same errors, no retry.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

from ..http.errors import UpstreamStatusError, UpstreamUnavailable
from .routing import (
    CHOICES,
    DEFAULT_LOAD_FACTOR,
    DEFAULT_LOAD_FLOOR,
    DEFAULT_POLICY,
    POLICIES,
    ReplicaLoad,
    Route,
    eject_seconds,
    route,
    routing_key,
)
from .settings import DEFAULT_EJECT_S
from .upstream import FirstByte, Upstream

log = logging.getLogger("prefix_cache.service")


class PoolObserver:
    """Sees a pool's events as they happen (metrics); this base ignores them."""

    def routed(self, replica: str, choice: str) -> None:
        """A request was sent to ``replica`` (now in flight there), chosen by ``choice``."""

    def ended(self, replica: str) -> None:
        """A request sent to ``replica`` is no longer in flight."""

    def ejected(self, replica: str) -> None:
        """``replica`` failed and is left out of routing for a backoff."""

    def retried(self, replica: str) -> None:
        """A request that failed on ``replica`` is sent to the next one."""


@dataclass
class Replica:
    """One replica of a pool and what the pool knows of it."""

    upstream: Upstream
    in_flight: int = 0
    failures: int = 0               # in a row; a success clears it
    ejected_until: float = 0.0      # monotonic time it is routed to again
    ejected_at: float = float("-inf")  # when its latest ejection began
    ejections: int = 0
    retries: int = 0                # requests that failed here and were sent to another
    requests: Counter[str] = field(default_factory=Counter)  # by routing choice

    @property
    def name(self) -> str:
        return self.upstream.base_url

    def healthy(self, now: float) -> bool:
        return now >= self.ejected_until


class UpstreamPool:
    """The replicas of one model (all of one kind and settings) and how requests are routed."""

    def __init__(self, replicas: Sequence[Upstream], policy: str | None = None, *,
                 load_factor: float = DEFAULT_LOAD_FACTOR, load_floor: int = DEFAULT_LOAD_FLOOR,
                 eject_s: float = DEFAULT_EJECT_S, first_byte: FirstByte | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not replicas:
            raise ValueError("an upstream pool needs at least one replica")
        names = [u.base_url for u in replicas]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"upstream {duplicates[0]!r} is listed twice in one pool")
        policy = policy or DEFAULT_POLICY
        if policy not in POLICIES:
            raise ValueError(f"routing policy {policy!r} is not one of {', '.join(POLICIES)}")
        if load_factor < 1.0:
            raise ValueError(f"routing load factor must be >= 1, got {load_factor}")
        if load_floor < 1:
            raise ValueError(f"routing load floor must be >= 1, got {load_floor}")
        if eject_s <= 0:
            raise ValueError(f"upstream ejection time must be > 0 s, got {eject_s}")
        self.replicas = [Replica(u) for u in replicas]
        self.names = names
        self.policy = policy
        self.load_factor = load_factor
        self.load_floor = load_floor
        self.eject_s = eject_s
        self.first_byte = first_byte  # None: an answer may take until the client's timeout
        self._clock = clock
        self._turns = itertools.count()
        self.observer = PoolObserver()  # the service sets its metrics (pool_metrics.py)

    def __len__(self) -> int:
        return len(self.replicas)

    # -- routing ----------------------------------------------------------------------------

    def route(self, tenant: str, key: str, session: str | None = None) -> Route:
        """Where a request of ``tenant`` with static-prefix ``key`` ("" for none) and the
        client's ``session`` id (None for none) goes."""
        now = self._clock()
        loads = [ReplicaLoad(r.in_flight, r.healthy(now)) for r in self.replicas]
        hashed = routing_key(tenant, key, session) if key or session else None
        return route(self.policy, loads, self.names, turn=next(self._turns), key=hashed,
                     factor=self.load_factor, floor=self.load_floor)

    async def open(self, client: httpx.AsyncClient, content: bytes, api: str = "chat", *,
                   tenant: str = "default", key: str = "",
                   session: str | None = None) -> httpx.Response:
        """``Upstream.open`` on the routed replica, retried once on the next one if it fails
        before answering; the open response's close ends its in-flight count."""
        chosen = self.route(tenant, key, session)
        attempts = chosen.order[:2]
        suspect: tuple[Replica, float] | None = None  # a 5xx, judged by what the retry gets
        for attempt, index in enumerate(attempts):
            replica = self.replicas[index]
            retry_left = attempt + 1 < len(attempts)
            started = self._start(replica, chosen.choice if attempt == 0 else "failover")
            try:
                response = await replica.upstream.open(client, content, api, self.first_byte)
            except UpstreamStatusError as exc:
                self._end(replica)
                if exc.status < 500:
                    self._succeeded(replica)  # the client's error, relayed: the replica is fine
                    raise
                if suspect is not None:
                    # The same request failed on two replicas: a poison request, not two bad
                    # replicas (Envoy's outlier detection counts what is the host's alone).
                    log.warning("upstream %s and %s both answered %d to one request: "
                                "neither is ejected", suspect[0].name, replica.name, exc.status)
                    raise
                if not retry_left:
                    self._failed(replica, f"answered {exc.status}", started)
                    raise
                suspect = (replica, started)
            except UpstreamUnavailable as exc:  # unreachable, timed out, a status not relayed
                self._end(replica)
                self._failed(replica, str(exc), started)
                self._judge(suspect)
                if not retry_left:
                    raise
            except BaseException:  # cancelled (the client left): not the replica's fault
                self._end(replica)
                raise
            else:
                self._judge(suspect)
                response.stream = _TrackedStream(response.stream, lambda ok, r=replica, t=started: (
                    self._finished(r, ok, t)))
                return response
            replica.retries += 1
            self.observer.retried(replica.name)
            log.warning("upstream %s failed; retrying on %s", replica.name,
                        self.replicas[attempts[attempt + 1]].name)
        raise AssertionError("unreachable: the last attempt raises")

    # -- health -----------------------------------------------------------------------------

    def _start(self, replica: Replica, choice: str) -> float:
        """Count a request sent to ``replica``; when it was sent."""
        replica.requests[choice] += 1
        replica.in_flight += 1
        self.observer.routed(replica.name, choice)
        return self._clock()

    def _end(self, replica: Replica) -> None:
        replica.in_flight -= 1
        self.observer.ended(replica.name)

    def _finished(self, replica: Replica, ok: bool, started: float) -> None:
        self._end(replica)
        if ok:
            self._succeeded(replica)
        else:
            self._failed(replica, "the answer broke off", started)

    def _judge(self, suspect: tuple[Replica, float] | None) -> None:
        """A replica that answered a 5xx to a request another replica then answered (or could
        not be asked): its failure counts."""
        if suspect is not None:
            self._failed(suspect[0], "answered a 5xx that another replica did not", suspect[1])

    def _succeeded(self, replica: Replica) -> None:
        replica.failures = 0

    def _failed(self, replica: Replica, why: str, started: float | None = None) -> None:
        """Eject ``replica``; a failure of a request sent (``started``) before its current
        ejection began is the same outage seen again (five streams broken by one crash) and
        neither lengthens the backoff nor counts as another ejection."""
        now = self._clock()
        if started is not None and started < replica.ejected_at and not replica.healthy(now):
            return
        replica.failures += 1
        backoff = eject_seconds(replica.failures, self.eject_s)
        replica.ejected_at = now
        replica.ejected_until = now + backoff
        replica.ejections += 1
        self.observer.ejected(replica.name)
        if len(self.replicas) > 1:
            log.warning("upstream %s ejected for %.1f s (%s)", replica.name, backoff, why)

    def observe_probes(self, answers: Mapping[str, dict[str, Any]]) -> dict[str, Any]:
        """The pool's readiness from its replicas' probes (``Upstream.probe``, by health URL):
        ready when any replica answers; a replica that failed its probe is ejected, one that
        passed is routed to again. One replica: its probe, as a lone upstream reports it."""
        probed = [answers[r.upstream.health_url] for r in self.replicas]
        now = self._clock()
        for replica, answer in zip(self.replicas, probed, strict=True):
            if not answer["ok"]:
                if replica.healthy(now):  # already out: the same outage, not another ejection
                    self._failed(replica, "health check failed")
            elif not replica.healthy(now):
                replica.ejected_until = now  # back up: routed again before its backoff ends
        if len(self.replicas) == 1:
            return probed[0]
        return {"ok": any(a["ok"] for a in probed), "policy": self.policy,
                "replicas": {r.name: {**a, **self._row(r, now)}
                             for r, a in zip(self.replicas, probed, strict=True)}}

    # -- stats ------------------------------------------------------------------------------

    def _row(self, replica: Replica, now: float) -> dict[str, Any]:
        return {"in_flight": replica.in_flight, "ejected": not replica.healthy(now),
                "ejections": replica.ejections, "retries": replica.retries,
                "requests": sum(replica.requests.values()),
                "choices": {c: replica.requests[c] for c in CHOICES}}

    def snapshot(self) -> list[dict[str, Any]]:
        """Per replica: requests (by routing choice), in flight, ejections, retries."""
        now = self._clock()
        return [{"replica": r.name, **self._row(r, now)} for r in self.replicas]


class _TrackedStream(httpx.AsyncByteStream):
    """A response's byte stream that reports, once, when it is closed and whether it broke."""

    def __init__(self, inner: Any, done: Callable[[bool], None]) -> None:
        self._inner = inner
        self._done: Callable[[bool], None] | None = done
        self._broken = False

    async def __aiter__(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self._inner:
                yield chunk
        except httpx.HTTPError:
            self._broken = True
            raise

    async def aclose(self) -> None:
        try:
            await self._inner.aclose()
        finally:
            done, self._done = self._done, None
            if done is not None:
                done(not self._broken)
