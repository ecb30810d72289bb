"""What the sidecar tells a caller without a key (issue #15, item 9; docs/security.md).

Public: ``/healthz``, ``/readyz``'s status, ``/openapi.json``. Once any key is configured,
``/metrics`` (tenant names and traffic) and ``/readyz``'s report (models, upstreams, store)
need a metrics or admin key, the dashboard an admin key, ``/v1`` a tenant key. With no key of
any kind, everything is open (a service on a trusted network)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from prefix_cache.service.upstream import Upstream

from tests.support.loopback import local_client
from tests.support.recording_upstream import Recorder
from tests.support.server_thread import ServerThread
from tests.support.sidecar import bearer, served, sidecar_app, unique_system


ACME, ADMIN, METRICS = "sk-exp-acme", "sk-exp-admin", "sk-exp-metrics"
TENANT = "acme-secret-name"   # a name no anonymous caller should ever read
UPSTREAM_MODEL = "internal-upstream-model"


def serve(recorder_url: str, tokenizer: Any, **settings: Any) -> Iterator[Any]:
    app = sidecar_app(served(UPSTREAM_MODEL, tokenizer, Upstream(recorder_url)), **settings)
    with ServerThread(app) as url, local_client(base_url=url) as http:
        yield http


@pytest.fixture(scope="module")
def keyed(recorder_server: tuple[Recorder, str], demo_tokenizer: Any) -> Iterator[Any]:
    """Tenant, admin and metrics keys."""
    yield from serve(recorder_server[1], demo_tokenizer, api_keys={ACME: TENANT},
                     admin_keys=[ADMIN], metrics_keys=[METRICS])


@pytest.fixture(scope="module")
def tenants_only(recorder_server: tuple[Recorder, str], demo_tokenizer: Any) -> Iterator[Any]:
    """Tenant keys and nothing else: nobody may read metrics or the dashboard."""
    yield from serve(recorder_server[1], demo_tokenizer, api_keys={ACME: TENANT})


@pytest.fixture(scope="module")
def unlocked(recorder_server: tuple[Recorder, str], demo_tokenizer: Any) -> Iterator[Any]:
    yield from serve(recorder_server[1], demo_tokenizer)


def traffic(http: Any, key: str | None = ACME) -> None:
    body = {"messages": [unique_system(), {"role": "user", "content": "Hi"}]}
    r = http.post("/v1/prefix/boundary", json=body, headers=bearer(key) if key else {})
    assert r.status_code == 200, r.text


def test_metrics_need_a_metrics_or_admin_key_once_keys_exist(keyed: Any) -> None:
    traffic(keyed)
    for headers, status in (({}, 401), (bearer("sk-wrong"), 401), (bearer(ACME), 403)):
        r = keyed.get("/metrics", headers=headers)
        assert r.status_code == status, r.text
        assert TENANT not in r.text and UPSTREAM_MODEL not in r.text
        assert r.json()["error"]["type"] in ("invalid_request_error", "permission_error")
    for key in (METRICS, ADMIN):
        r = keyed.get("/metrics", headers=bearer(key))
        assert r.status_code == 200 and f'tenant="{TENANT}"' in r.text


def test_readyz_gives_anyone_the_status_and_only_observers_the_report(keyed: Any) -> None:
    for headers in ({}, bearer(ACME), bearer("sk-wrong")):
        r = keyed.get("/readyz", headers=headers)
        assert r.status_code == 200 and r.json() == {"status": "ready"}
    for key in (METRICS, ADMIN):
        report = keyed.get("/readyz", headers=bearer(key)).json()
        assert report["status"] == "ready" and report["upstreams"][UPSTREAM_MODEL]["ok"]
        assert report["store"]["backend"] == "memory"


def test_public_endpoints_answer_without_a_key(keyed: Any) -> None:
    assert keyed.get("/healthz").json() == {"status": "ok"}
    doc = keyed.get("/openapi.json")
    assert doc.status_code == 200 and doc.json()["openapi"].startswith("3.")
    assert TENANT not in doc.text and UPSTREAM_MODEL not in doc.text
    assert keyed.get("/v1/models").status_code == 401
    assert keyed.get("/dashboard/stats.json").status_code == 401


def test_without_metrics_or_admin_keys_metrics_and_the_dashboard_are_closed(
        tenants_only: Any) -> None:
    traffic(tenants_only)
    r = tenants_only.get("/metrics", headers=bearer(ACME))
    assert r.status_code == 403 and r.json()["error"]["code"] == "metrics_disabled"
    assert "PREFIX_CACHE_METRICS_KEYS" in r.json()["error"]["message"]
    assert tenants_only.get("/metrics").status_code == 403
    for path in ("/dashboard", "/dashboard/stats.json"):
        page = tenants_only.get(path)
        assert page.status_code == 401 and TENANT not in page.text
    assert tenants_only.get("/readyz").json() == {"status": "ready"}


def test_an_unlocked_service_is_open(unlocked: Any) -> None:
    traffic(unlocked, key=None)
    assert 'tenant="default"' in unlocked.get("/metrics").text
    assert unlocked.get("/readyz").json()["upstreams"][UPSTREAM_MODEL]["ok"] is True
    assert unlocked.get("/dashboard/stats.json").status_code == 200
