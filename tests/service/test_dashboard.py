"""/metrics, the stats endpoint and the dashboard page agree; the page works in a real Chromium."""

from __future__ import annotations

import base64
import json
import re
import time
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from prefix_cache.service.tenants import DASHBOARD_COOKIE_TTL_S
from prefix_cache.service.upstream import Upstream
from tests.support.browser import (
    CHROMEDRIVER,
    CHROMIUM,
    browser_errors,
    headless_chromium,
    wait_for_js,
)
from tests.support.loopback import local_client
from tests.support.paths import ARTIFACTS, GRAFANA_DASHBOARD
from tests.support.recording_upstream import Recorder
from tests.support.sidecar import bearer, served, sidecar_app, unique_system, write_keys_file

ACME, GLOBEX, ADMIN = "sk-dash-acme", "sk-dash-globex", "sk-dash-admin"
METRICS = "sk-dash-metrics"  # what Prometheus scrapes with


@pytest.fixture(scope="module")
def app(tmp_path_factory: pytest.TempPathFactory, demo_tokenizer: Any,
        recorder_server: tuple[Recorder, str]) -> Any:
    keys = write_keys_file(tmp_path_factory.mktemp("dash") / "keys.yaml",
                           {ACME: "acme", GLOBEX: "globex"}, admin_keys=[ADMIN],
                           metrics_keys=[METRICS])
    return sidecar_app(served("demo", demo_tokenizer, Upstream(recorder_server[1])),
                       keys_file=keys)


def burst(base: str) -> tuple[int, int]:
    """A scripted burst: per tenant, 3 distinct static parts each asked 4 times."""
    hits = misses = 0
    with local_client(base_url=base) as http:
        for key in (ACME, GLOBEX):
            systems = [unique_system(key) for _ in range(3)]
            for round_ in range(4):
                for system in systems:
                    r = http.post("/v1/prefix/boundary", headers=bearer(key),
                                  json={"messages": [system, {"role": "user", "content": f"q{round_}"}]})
                    assert r.status_code == 200, r.text
                    hits += r.json()["cache"] == "hit"
                    misses += r.json()["cache"] == "miss"
    return hits, misses


def chats(base: str) -> None:
    """Chat completions relayed to the recording upstream: per tenant a miss, then hits."""
    with local_client(base_url=base) as http:
        for key in (ACME, GLOBEX):
            system = unique_system(key)
            for i in range(3):
                r = http.post("/v1/chat/completions", headers=bearer(key), json={
                    "model": "demo", "stream": i == 2,
                    "messages": [system, {"role": "user", "content": f"q{i}"}]})
                assert r.status_code == 200, r.text


def history(base: str) -> dict[str, Any]:
    with local_client(base_url=base) as http:
        r = http.get("/dashboard/history.json?seconds=3600", headers=bearer(ADMIN))
    assert r.status_code == 200, r.text
    return r.json()


def chart_points(driver: Any) -> dict[str, list[int]]:
    """Per chart, per series: how many points hold a value."""
    return driver.execute_script(
        "const out = {}; for (const [id, c] of Object.entries(window.dashboard.charts)) {"
        "  out[id] = c.data.slice(1).map(ys => ys.filter(v => v !== null && v !== undefined).length);"
        "} return out;")


def scrape(base: str) -> dict[tuple[str, tuple], float]:
    with local_client(base_url=base) as http:
        text = http.get("/metrics", headers=bearer(METRICS)).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def total(samples: dict, name: str, **match: str) -> float:
    return sum(v for (n, labels), v in samples.items()
               if n == name and all(dict(labels).get(k) == val for k, val in match.items()))


def stats(base: str) -> dict[str, Any]:
    with local_client(base_url=base) as http:
        r = http.get("/dashboard/stats.json", headers=bearer(ADMIN))
    assert r.status_code == 200, r.text
    return r.json()


def test_metrics_stats_and_counts_agree(base: str) -> None:
    before_m, before_s = scrape(base), stats(base)["metrics"]
    hits, misses = burst(base)
    assert (hits, misses) == (18, 6)
    after_m, after_s = scrape(base), stats(base)["metrics"]
    for result, n in (("hit", hits), ("miss", misses)):
        assert total(after_m, "prefix_cache_requests_total", result=result) - \
            total(before_m, "prefix_cache_requests_total", result=result) == n
    assert after_s["hits"] - before_s["hits"] == hits
    assert after_s["misses"] - before_s["misses"] == misses
    assert after_s["hits"] == total(after_m, "prefix_cache_requests_total", result="hit")
    assert after_s["hit_rate"] == pytest.approx(
        after_s["hits"] / (after_s["hits"] + after_s["misses"]))
    tenants = {t["name"]: t for t in after_s["tenants"]}
    assert tenants["acme"]["hit"] >= 9 and tenants["globex"]["miss"] >= 3
    assert total(after_m, "prefix_cache_store_entries") >= 6


def test_grafana_queries_exist_in_live_metrics(base: str) -> None:
    burst(base)
    chats(base)  # the request-level metrics (and the variables' label values) need requests
    exposed = {name for name, _ in scrape(base)}
    dash = json.loads(GRAFANA_DASHBOARD.read_text())
    queried = {m for p in dash["panels"] for t in p["targets"]
               for m in re.findall(r"\b(prefix_cache_[a-z0-9_]+)", t["expr"])}
    # The engine row's metrics exist only with an in-process engine: test_engine_serving checks
    # them against a live sidecar that has one.
    # Likewise the upstream pool's, which exist only with an upstream: test_upstream_pool.
    queried = {m for m in queried
               if not m.startswith(("prefix_cache_engine_", "prefix_cache_upstream_",
                                    "prefix_cache_kv_cache_usage_perc"))}
    assert queried and not queried - exposed, sorted(queried - exposed)


def test_dashboard_needs_the_admin_key(base: str) -> None:
    with local_client(base_url=base) as http:
        for path in ("/dashboard", "/dashboard/stats.json"):
            r = http.get(path)
            assert r.status_code == 401 and r.headers["www-authenticate"].startswith("Basic")
            assert "admin key" in r.json()["error"]["message"]
            assert http.get(path, headers=bearer(ACME)).status_code == 401
        basic = base64.b64encode(f"admin:{ADMIN}".encode()).decode()
        page = http.get("/dashboard", headers={"authorization": f"Basic {basic}"})
        assert page.status_code == 200 and 'id="chart-ttft"' in page.text and "http" not in re.sub(
            r"<!--.*?-->", "", page.text).split("<script>")[0].split("<style>")[1].split("</style>")[0]
        cookie = page.cookies.get("prefix_cache_dashboard")
        assert cookie
        assert http.get("/dashboard/stats.json", cookies={"prefix_cache_dashboard": cookie}).status_code == 200
        assert http.get("/dashboard/stats.json", cookies={"prefix_cache_dashboard": "forged"}).status_code == 401


def test_the_login_cookie_expires_in_the_browser_and_on_the_server(app: Any, base: str) -> None:
    keyring = app.state.service.keyring
    with local_client(base_url=base) as http:
        page = http.get("/dashboard", headers=bearer(ADMIN))
        assert f"Max-Age={DASHBOARD_COOKIE_TTL_S}" in page.headers["set-cookie"]

        def stats(cookie: str) -> int:
            return http.get("/dashboard/stats.json",
                            cookies={"prefix_cache_dashboard": cookie}).status_code

        assert stats(page.cookies["prefix_cache_dashboard"]) == 200
        expired = keyring.dashboard_cookie(now=time.time() - DASHBOARD_COOKIE_TTL_S - 1)
        assert stats(expired) == 401
        expires, mac = keyring.dashboard_cookie().split(".")
        assert stats(f"{int(expires) + 3600}.{mac}") == 401       # its expiry moved: no match
        far = keyring.dashboard_cookie(now=time.time() + 10 * DASHBOARD_COOKIE_TTL_S)
        assert stats(far) == 401                                   # past any lifetime given


def test_metrics_endpoint_is_prometheus_text(base: str) -> None:
    with local_client(base_url=base) as http:
        r = http.get("/metrics", headers=bearer(METRICS))
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    assert "# TYPE prefix_cache_requests_total counter" in r.text


@pytest.mark.skipif(not (CHROMIUM and CHROMEDRIVER), reason="Debian chromium/chromedriver not installed")
def test_page_in_headless_chromium(base: str) -> None:
    pytest.importorskip("selenium.webdriver")
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.support.ui import Select
    with headless_chromium() as driver:
        host = base.split("://", 1)[1]
        driver.get(f"http://admin:{ADMIN}@{host}/dashboard?poll_ms=300")  # the login prompt's answer

        def wait_for(js: str) -> Any:
            return wait_for_js(driver, js)

        wait_for("return window.dashboard && window.dashboard.renders >= 2")
        burst(base)
        chats(base)
        seen = driver.execute_script("return window.dashboard.historyRenders")
        wait_for(f"return window.dashboard.historyRenders > {seen} + 1")
        time.sleep(0.7)  # one more poll after the burst, so page and endpoint see the same counts
        last = driver.execute_script("return window.dashboard.last.metrics")
        now = stats(base)["metrics"]
        assert (last["hits"], last["misses"]) == (now["hits"], now["misses"])
        shown = driver.find_element("id", "kpi-hit-rate").text
        assert shown == f"{now['hit_rate'] * 100:.1f}%"
        assert driver.find_element("id", "kpi-requests").text.startswith(f"{now['requests_total']:,}")
        # After traffic the charts hold points: TTFT of hits and of misses on one chart.
        before = chart_points(driver)
        assert before["chart-hit-rate"][0] >= 1 and before["chart-rps"][0] >= 1
        assert before["chart-ttft"][0] >= 1 and before["chart-ttft"][1] >= 1
        assert before["chart-tokens"][1] >= 1  # prompt tokens computed
        # The page draws what the endpoint serves (the closed intervals: the current one moves).
        served_rates = history(base)["series"]["hit_rate"]
        drawn = driver.execute_script("const c = window.dashboard.charts['chart-hit-rate'];"
                                      "return [c.data[0], c.data[1]];")
        closed = dict((t, v) for t, v in served_rates[:-1])
        assert {t: v for t, v in zip(*drawn, strict=True) if t in closed} == closed
        # The selectors: one tenant's series.
        Select(driver.find_element("id", "tenant")).select_by_value("acme")
        wait_for("return window.dashboard.charts['chart-hit-rate'].data[1].length > 0 && "
                 "document.getElementById('tenant').value === 'acme'")
        options = driver.execute_script(
            "return [...document.querySelectorAll('#model option')].map(o => o.value)")
        assert "demo" in options
        # A tooltip with the time and the values, in the chart's unit.
        over = driver.find_element("css selector", "#chart-ttft .u-over")
        ActionChains(driver).move_to_element(over).perform()
        wait_for("const t = document.querySelector('#chart-ttft .tip');"
                 "return t && t.style.display === 'block' && t.textContent.includes('hit')")
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        driver.save_screenshot(str(ARTIFACTS / "dashboard.png"))
        tenant_cells = driver.execute_script(
            "return [...document.querySelectorAll('#tenants tbody td:first-child')].map(e => e.textContent)")
        assert {"acme", "globex"} <= set(tenant_cells)
        # A reload keeps the history: it is the server's.
        driver.refresh()
        wait_for("return window.dashboard && window.dashboard.historyRenders >= 1")
        after = chart_points(driver)
        for chart in ("chart-hit-rate", "chart-ttft", "chart-tokens"):
            assert all(a >= b for a, b in zip(after[chart], before[chart], strict=True)), chart
        driver.save_screenshot(str(ARTIFACTS / "dashboard-reloaded.png"))
        assert not browser_errors(driver)
        assert not driver.find_element("id", "engines").is_displayed()  # no in-process engine


# What the issue-53 operator read wrong: legends blank until hovered, time labels on top of
# one another, the TTFT axis stopped at 60 s, "hit" without saying which cache.
AXIS_LABELS_JS = """
const out = {};
for (const [id, u] of Object.entries(window.dashboard.charts)) {
  const axis = u.axes[0], ctx = document.createElement('canvas').getContext('2d');
  ctx.font = axis.font[0];
  const xs = (axis._splits || []).map(v => u.valToPos(v, 'x'));
  const widths = (axis._values || []).map(t => ctx.measureText(String(t)).width);
  let gap = Infinity;   // the least room between two neighbouring labels, in px
  for (let i = 1; i < xs.length; i++) gap = Math.min(gap, xs[i] - xs[i - 1] - (widths[i] + widths[i - 1]) / 2);
  out[id] = {labels: axis._values, gap: gap};
}
return out;
"""


@pytest.mark.skipif(not (CHROMIUM and CHROMEDRIVER), reason="Debian chromium/chromedriver not installed")
def test_legends_axes_and_what_each_hit_is_in_headless_chromium(app: Any, base: str) -> None:
    pytest.importorskip("selenium.webdriver")
    from prefix_cache.http.request_record import RequestRecord

    chats(base)
    # Misses whose first token took 200 s (a loaded engine): the axis must reach them. More of
    # them than every request this module made, so they are the p50 of whichever 10 s interval
    # they share with the earlier tests' quick misses (six were not: CI ran the module fast).
    metrics = app.state.service.metrics
    for _ in range(stats(base)["metrics"]["requests_total"] + 1):
        started = time.perf_counter() - 250.0
        metrics.request_done(RequestRecord("chat", started, tenant="acme", model="demo",
                                           cache="miss", status=200,
                                           first_content=started + 200.0, ended=started + 250.0,
                                           prompt_tokens=100, generation_tokens=10))
    with headless_chromium() as driver:
        host = base.split("://", 1)[1]
        driver.get(f"http://admin:{ADMIN}@{host}/dashboard?poll_ms=300")
        wait_for_js(driver, "return window.dashboard && window.dashboard.historyRenders >= 2 "
                            "&& window.dashboard.renders >= 1")
        # No cursor on any chart: each legend shows its series' latest value, not "–".
        legend = driver.execute_script(
            "return [...document.querySelectorAll('#chart-ttft .u-legend .u-series')]"
            ".map(r => r.textContent)")
        assert legend[0].endswith("latest") and len(legend) == 3, legend
        assert all("–" not in row and ("s" in row) for row in legend[1:]), legend
        # TTFT: the miss p50 estimated above 60 s, and the axis spans it.
        top, drawn = driver.execute_script(
            "const u = window.dashboard.charts['chart-ttft'];"
            "return [u.scales.y.max, Math.max(...u.data[2].filter(v => v !== null))];")
        assert drawn > 60.0 and top >= drawn, (top, drawn)
        # Time labels: short, and none overlaps its neighbour.
        for chart, axis in driver.execute_script(AXIS_LABELS_JS).items():
            if axis["labels"]:
                assert axis["gap"] > 4, (chart, axis)
                assert all(len(label) <= 8 for label in axis["labels"]), (chart, axis)
        # Each kind of hit named for its cache, the tenants' tokens, the "other" note.
        text = driver.find_element("tag name", "body").text
        for words in ("boundary cache hit rate", "Boundary cache", "Static KV",
                      "Conversation KV", "reused (KV hits)", "computed (prefilled)"):
            assert words in text, words
        assert 'first 20 tenants seen; later tenants are counted together as "other"' in text
        usage = driver.execute_script(
            "return [...document.querySelectorAll('#usage tbody tr')].map("
            "r => [...r.children].map(c => c.textContent))")
        acme = next(row for row in usage if row[0] == "acme")
        row = next(u for u in stats(base)["metrics"]["usage"] if u["tenant"] == "acme")
        assert acme[2:5] == [f"{row['prompt_tokens']:,}", f"{row['reused_tokens']:,}",
                             f"{row['computed_tokens']:,}"]
        assert row["reused_tokens"] + row["computed_tokens"] == row["prompt_tokens"]
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        driver.save_screenshot(str(ARTIFACTS / "dashboard-labels.png"))
        assert not browser_errors(driver)
