"""Tenants: API keys -> namespaces, no entry shared across tenants, per-tenant quotas, admin."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from prefix_cache import MemoryStore
from prefix_cache.errors import StoreUnavailableError
from prefix_cache.http.errors import Forbidden, Unauthorized
from prefix_cache.service import ServiceSettings, create_app
from prefix_cache.service.served_models import ModelRegistry
from prefix_cache.service.tenants import KeyRing
from prefix_cache.service.upstream import Upstream
from prefix_cache.store.memory import entry_size
from prefix_cache.store.quota import TenantQuotaStore

from tests.support.loopback import local_client, openai_client
from tests.support.recording_upstream import Recorder
from tests.support.server_thread import ServerThread
from tests.support.sidecar import bearer, served, unique_system, write_keys_file
from tests.support.tools import make_tools
from tests.support.store_keys import key

openai = pytest.importorskip("openai", reason="the OpenAI SDK is the client under test")

ACME, GLOBEX, ADMIN = "sk-acme-1", "sk-globex-1", "sk-admin-1"


@pytest.fixture(scope="module")
def keys_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_keys_file(tmp_path_factory.mktemp("keys") / "keys.yaml",
                           {ACME: "acme", GLOBEX: "globex"}, admin_keys=[ADMIN])


@pytest.fixture(scope="module")
def models(recorder_server: tuple[Recorder, str], demo_tokenizer: Any) -> ModelRegistry:
    return ModelRegistry([served("rec", demo_tokenizer, Upstream(recorder_server[1])),
                          served("other", demo_tokenizer)])


@pytest.fixture(scope="module")
def app(keys_file: Path, models: ModelRegistry) -> Any:
    return create_app(ServiceSettings(keys_file=keys_file), models=models)


def body(system: dict[str, str], model: str = "rec", **extra: Any) -> dict[str, Any]:
    return {"model": model, "messages": [system, {"role": "user", "content": "Hi"}],
            "tools": make_tools(2), **extra}


# -- isolation -------------------------------------------------------------------------------


def test_two_tenants_with_one_system_prompt_never_share_an_entry(http: Any) -> None:
    system = unique_system()
    acme = [http.post("/v1/prefix/boundary", json=body(system), headers=bearer(ACME)).json()
            for _ in range(2)]
    globex = http.post("/v1/prefix/boundary", json=body(system), headers=bearer(GLOBEX)).json()
    assert [r["cache"] for r in acme] == ["miss", "hit"]
    assert globex["cache"] == "miss"  # acme's entry is invisible to globex
    assert acme[0]["key"].split(":")[1] == "acme" and globex["key"].split(":")[1] == "globex"
    assert acme[0]["key"] != globex["key"]
    assert acme[0]["specprefill_system_end"] == globex["specprefill_system_end"]


def test_a_client_sent_tenant_is_ignored(http: Any) -> None:
    system = unique_system()
    http.post("/v1/prefix/boundary", json=body(system), headers=bearer(ACME))
    spoof = http.post("/v1/prefix/boundary", json=body(system, tenant="acme", namespace="acme"),
                      headers=bearer(GLOBEX)).json()
    assert spoof["cache"] == "miss" and spoof["key"].split(":")[1] == "globex"


def test_tenant_chat_completions_through_the_sdk(base: str, recorder: Recorder) -> None:
    system = unique_system()
    for api_key, expected in ((ACME, "miss"), (ACME, "hit"), (GLOBEX, "miss")):
        raw = openai_client(base, api_key).chat.completions.with_raw_response.create(
            model="rec", messages=[system, {"role": "user", "content": "Hi"}])
        assert raw.headers["x-prefix-cache"] == expected
    assert all(ACME not in json.dumps(r.headers) for r in recorder.requests)


# -- authentication --------------------------------------------------------------------------


@pytest.mark.parametrize("headers, status, fragment", [
    ({}, 401, "missing API key"),
    ({"authorization": "Basic abc"}, 401, "missing API key"),
    (bearer("sk-nobody"), 401, "invalid API key"),
    (bearer(ADMIN), 403, "admin key"),
])
def test_v1_needs_a_tenant_key(http: Any, headers: dict[str, str], status: int,
                               fragment: str) -> None:
    for method, path in (("POST", "/v1/prefix/boundary"), ("POST", "/v1/chat/completions"),
                         ("GET", "/v1/models")):
        r = http.request(method, path, json=body(unique_system()), headers=headers)
        assert r.status_code == status, (path, r.text)
        error = r.json()["error"]
        assert fragment in error["message"] and set(error) == {"message", "type", "code"}
        if status == 401:
            assert r.headers["www-authenticate"] == "Bearer"


def test_sdk_with_a_wrong_key_gets_an_authentication_error(base: str) -> None:
    with pytest.raises(openai.AuthenticationError, match="invalid API key"):
        openai_client(base, "sk-wrong").models.list()
    assert [m.id for m in openai_client(base, ACME).models.list()] == ["rec", "other"]


@pytest.mark.parametrize("headers, status, code", [
    ({}, 401, "invalid_api_key"),
    (bearer("sk-nobody"), 401, "invalid_api_key"),
    (bearer(ACME), 403, "admin_key_required"),
])
def test_admin_refuses_without_the_admin_key(http: Any, headers: dict[str, str], status: int,
                                             code: str) -> None:
    for method, path, payload in (("GET", "/admin/stats", None),
                                  ("POST", "/admin/purge", {"tenant": "acme"})):
        r = http.request(method, path, json=payload, headers=headers)
        assert r.status_code == status and r.json()["error"]["code"] == code


def test_health_endpoints_need_no_key_but_details_do(http: Any) -> None:
    assert http.get("/healthz").status_code == 200
    ready = http.get("/readyz")
    assert ready.status_code == 200 and ready.json() == {"status": "ready"}
    for api_key in (ACME, "sk-unknown"):  # a tenant learns no more than anyone
        assert http.get("/readyz", headers=bearer(api_key)).json() == {"status": "ready"}
    detailed = http.get("/readyz", headers=bearer(ADMIN))
    assert detailed.status_code == 200 and detailed.json()["upstreams"]["rec"]["ok"] is True


# -- admin -------------------------------------------------------------------------------------


def test_admin_purges_a_tenant_and_only_that_tenant(http: Any) -> None:
    system = unique_system()
    for api_key in (ACME, GLOBEX):
        assert http.post("/v1/prefix/boundary", json=body(system), headers=bearer(api_key)).json()[
            "cache"] == "miss"
    purged = http.post("/admin/purge", json={"tenant": "acme"}, headers=bearer(ADMIN))
    assert purged.status_code == 200 and purged.json()["purged"] >= 1
    assert purged.json()["pattern"] == "spc:acme:*:*"
    again = {key: http.post("/v1/prefix/boundary", json=body(system), headers=bearer(key)).json()
             for key in (ACME, GLOBEX)}
    assert again[ACME]["cache"] == "miss" and again[GLOBEX]["cache"] == "hit"


def test_admin_purges_a_model(http: Any) -> None:
    system = unique_system()
    for model in ("rec", "other"):
        http.post("/v1/prefix/boundary", json=body(system, model), headers=bearer(ACME))
    r = http.post("/admin/purge", json={"model": "other"}, headers=bearer(ADMIN))
    assert r.json() == {"purged": r.json()["purged"], "pattern": "spc:*:other:*"}
    assert r.json()["purged"] >= 1
    after = {m: http.post("/v1/prefix/boundary", json=body(system, m), headers=bearer(ACME)).json()
             for m in ("rec", "other")}
    assert after["rec"]["cache"] == "hit" and after["other"]["cache"] == "miss"


@pytest.mark.parametrize("payload, status", [
    ({}, 400), ({"tenant": "*"}, 400), ({"tenant": "a:b"}, 400), ({"tenant": 5}, 400),
    ({"tenant": "acme", "everything": True}, 400),
    ({"tenant": "acme\n"}, 400), ({"model": "../../rec"}, 400), ({"model": "r*c"}, 400),
    ({"model": "rec/"}, 400), ({"tenant": "acme", "model": "a b"}, 400),
])
def test_admin_purge_refuses_what_it_cannot_name_exactly(http: Any, payload: dict[str, Any],
                                                         status: int) -> None:
    system = unique_system()
    http.post("/v1/prefix/boundary", json=body(system), headers=bearer(ACME))
    r = http.post("/admin/purge", json=payload, headers=bearer(ADMIN))
    assert r.status_code == status and set(r.json()["error"]) == {"message", "type", "code"}
    # Nothing was purged: a refused name is never rewritten into one that exists.
    again = http.post("/v1/prefix/boundary", json=body(system), headers=bearer(ACME))
    assert again.json()["cache"] == "hit"


def test_admin_purges_a_model_no_longer_served_by_its_label(http: Any) -> None:
    r = http.post("/admin/purge", json={"model": "retired-model.v2"}, headers=bearer(ADMIN))
    assert r.status_code == 200 and r.json() == {"purged": 0, "pattern": "spc:*:retired-model.v2:*"}


def test_a_tenant_name_with_a_newline_is_refused_in_the_keys_file(tmp_path: Path) -> None:
    path = tmp_path / "keys.json"
    path.write_text(json.dumps({"tenants": {"sk-1": "acme\n"}}))
    with pytest.raises(ValueError, match="tenant"):
        KeyRing.from_settings(ServiceSettings(keys_file=path))


def test_admin_stats(http: Any) -> None:
    system = unique_system()
    http.post("/v1/prefix/boundary", json=body(system), headers=bearer(GLOBEX))
    http.post("/v1/prefix/boundary", json=body(system), headers=bearer(GLOBEX))
    stats = http.get("/admin/stats", headers=bearer(ADMIN)).json()
    assert stats["tenants"] == ["acme", "globex"] and stats["models"] == ["rec", "other"]
    assert stats["cache"]["hits"] >= 1 and stats["cache"]["misses"] >= 1
    assert stats["store"]["backend"] == "memory"
    assert stats["store"]["tenants"]["globex"]["entries"] >= 1
    assert stats["store"]["tenant_max_entries"] == ServiceSettings().tenant_max_entries


# -- quotas through the service ------------------------------------------------------------------


def test_one_tenant_flooding_the_cache_evicts_only_its_own_entries(
        models: ModelRegistry, keys_file: Path) -> None:
    app = create_app(ServiceSettings(keys_file=keys_file, tenant_max_entries=3), models=models)
    with ServerThread(app) as url, local_client(base_url=url) as http:
        def ask(key: str, system: dict[str, str]) -> str:
            return str(http.post("/v1/prefix/boundary", json=body(system),
                                 headers=bearer(key)).json()["cache"])

        kept = unique_system("globex")
        assert ask(GLOBEX, kept) == "miss"
        flood = [unique_system("acme") for _ in range(6)]
        assert [ask(ACME, s) for s in flood] == ["miss"] * 6
        assert ask(GLOBEX, kept) == "hit"              # untouched by acme's flood
        assert ask(ACME, flood[-1]) == "hit"           # acme keeps its 3 most recent
        assert ask(ACME, flood[0]) == "miss"           # and lost its oldest
        usage = app.state.service.store.tenant_usage()
        assert usage["acme"]["entries"] == 3 and usage["globex"]["entries"] == 1
        assert app.state.service.store.stats().memory.evictions == 0  # the quotas did all the evicting


# -- units: KeyRing, TenantQuotaStore ---------------------------------------------------------------


def test_keyring_open_and_keyed() -> None:
    open_ring = KeyRing({})
    assert open_ring.is_open and open_ring.tenant_for(None) == "default"
    assert open_ring.tenant_for("Bearer anything") == "default"
    with pytest.raises(Forbidden, match="no admin keys"):
        open_ring.require_admin("Bearer anything")
    ring = KeyRing({"k1": "t1"}, ["adm"])
    assert ring.tenant_for("bearer  k1 ") == "t1" and ring.tenants == ["t1"]
    ring.require_admin("Bearer adm")
    with pytest.raises(Unauthorized):
        ring.tenant_for("Bearer k2")
    with pytest.raises(ValueError, match="tenant"):
        KeyRing({"k": "bad:name"})


def test_keys_from_settings_env_win_over_the_file(keys_file: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PREFIX_CACHE_API_KEYS", json.dumps({ACME: "acme-moved", "sk-new": "new"}))
    monkeypatch.setenv("PREFIX_CACHE_ADMIN_KEYS", "adm-a, adm-b")
    ring = KeyRing.from_settings(ServiceSettings(keys_file=keys_file))
    assert ring.tenant_for(f"Bearer {ACME}") == "acme-moved"
    assert ring.tenant_for("Bearer sk-new") == "new" and ring.tenant_for(f"Bearer {GLOBEX}") == "globex"
    ring.require_admin("Bearer adm-b")
    ring.require_admin(f"Bearer {ADMIN}")


def test_bad_keys_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "keys.json"
    path.write_text(json.dumps({"tenants": {"k": 1}}))
    with pytest.raises(ValueError, match="'tenants' must map"):
        KeyRing.from_settings(ServiceSettings(keys_file=path))
    path.write_text(json.dumps({"tenant": {}}))
    with pytest.raises(ValueError, match="unknown fields"):
        KeyRing.from_settings(ServiceSettings(keys_file=path))
    cut_short = tmp_path / "keys.yaml"   # a start never takes it as "run open" (issue 47, 1)
    for text in ("tenants:\n", ""):
        cut_short.write_text(text)
        with pytest.raises(ValueError, match="holds no key|must hold a mapping"):
            KeyRing.from_settings(ServiceSettings(keys_file=cut_short))


def test_quota_store_keeps_each_tenant_within_its_entries() -> None:
    store = TenantQuotaStore(MemoryStore(), max_entries=2, max_bytes=1 << 20)
    for i in range(3):
        store.put(key("a", i), b"v")
    store.put(key("b", 0), b"v")
    assert store.get(key("a", 0)) is None and store.get(key("a", 2)) == b"v"
    assert store.get(key("b", 0)) == b"v"
    store.get(key("a", 1))             # a read makes it recent: the next put evicts a:2
    store.put(key("a", 3), b"v")
    assert store.get(key("a", 1)) == b"v" and store.get(key("a", 2)) is None
    assert store.tenant_usage() == {"a": {"entries": 2, "bytes": 2 * entry_size(key("a", 1), b"v")},
                                    "b": {"entries": 1, "bytes": entry_size(key("b", 0), b"v")}}
    assert store.quota_evictions == 2


def test_quota_store_bytes_and_memory_sized_to_the_quotas() -> None:
    size = entry_size(key("a", 0), b"x" * 100)
    inner = MemoryStore(max_bytes=2 * 3 * size)         # two tenants, three entries' worth each
    store = TenantQuotaStore(inner, max_entries=100, max_bytes=3 * size)
    for i in range(3):
        store.put(key("b", i), b"x" * 100)
    for i in range(50):
        store.put(key("a", i), b"x" * 100)
    assert all(store.get(key("b", i)) is not None for i in range(3))
    assert inner.evictions == 0 and len(inner) == 6
    store.put(key("a", 99), b"x" * (4 * size))         # over the whole quota: not stored at all
    assert store.get(key("a", 99)) is None and len(inner) == 6


def test_quota_store_purge_delete_and_failed_puts_keep_the_books() -> None:
    store = TenantQuotaStore(MemoryStore(), max_entries=5, max_bytes=1 << 20)
    for i in range(3):
        store.put(key("a", i), b"v")
        store.put(key("b", i), b"v")
    assert store.purge("spc:a:*:*") == 3 and store.tenant_usage()["a"]["entries"] == 0
    assert store.delete(key("b", 0)) and store.tenant_usage()["b"]["entries"] == 2

    class Down(MemoryStore):
        def put(self, *args: Any, **kwargs: Any) -> None:
            raise StoreUnavailableError("down")

    failing = TenantQuotaStore(Down(), max_entries=5, max_bytes=1 << 20)
    with pytest.raises(StoreUnavailableError):
        failing.put(key("a", 0), b"v")
    # A failed put may have stored all the same (a memory tier, a timeout after Redis wrote):
    # the key stays on the books until a read shows it absent.
    assert failing.tenant_usage() == {"a": {"entries": 1, "bytes": entry_size(key("a", 0), b"v")}}
    assert failing.get(key("a", 0)) is None
    assert failing.tenant_usage() == {"a": {"entries": 0, "bytes": 0}}


async def test_quota_store_async_paths() -> None:
    store = TenantQuotaStore(MemoryStore(), max_entries=1, max_bytes=1 << 20)
    store.put(key("a", 0), b"v")
    store.put(key("a", 1), b"w")
    assert await store.aget(key("a", 0)) is None and await store.aget(key("a", 1)) == b"w"
    assert await store.apurge("spc:a:*:*") == 1
    assert store.delete(key("a", 1)) is False
