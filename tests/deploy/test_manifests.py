"""``deploy/`` against the app: every setting the manifests and the launchd job pass exists in
the settings model and validates; ports, probes, upstream and Redis addresses, the metrics
scrape and the keys agree across files and with the running app (YAML and plist parsed);
every claim, Secret and ConfigMap the pods use is defined, every image that runs the engine is
built with the mlx extra, the systemd unit's install steps make all it needs, and the engine
commands without mlx say so in one line."""

from __future__ import annotations

import argparse
import json
import os
import plistlib
import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from prefix_cache import cli
from prefix_cache.model_folders.demo import HOME_ENV
from prefix_cache.service import ServiceSettings
from prefix_cache.service.flags import flag_overrides
from prefix_cache.service.served_models import load_model_specs
from prefix_cache.service.settings import ENV_PREFIX, EngineServerSettings, env_name
from prefix_cache.service.tenants import KeysConfig
from prefix_cache.service.upstream import DEFAULT_HEALTH_PATH
from prefix_cache.model_folders.tokenizer_folders import CACHE_ENV

from tests.support.loopback import local_client
from tests.support.paths import DEPLOY, REPO
from tests.support.sidecar import served, sidecar_app


K8S = DEPLOY / "kubernetes"
PLIST = DEPLOY / "launchd" / "io.prefix-cache.sidecar.plist"
SETTINGS_VARS = {env_name(name) for name in ServiceSettings.model_fields}
FOLDER_VARS = {HOME_ENV, CACHE_ENV}   # where serve makes files (serve --help lists them)
ENGINE_VARS = {env_name(name, EngineServerSettings) for name in EngineServerSettings.model_fields}
FROM_SECRET = "sk-from-a-secret"
PUBLIC_PROBES = {"/healthz", "/readyz"}


# -- reading the files ----------------------------------------------------------------------------


def manifests() -> list[dict[str, Any]]:
    docs = [doc for path in sorted(K8S.glob("*.yaml"))
            for doc in yaml.safe_load_all(path.read_text()) if doc]
    assert docs and all({"apiVersion", "kind", "metadata"} <= set(d) for d in docs)
    return docs


def one(kind: str, name: str) -> dict[str, Any]:
    found = [d for d in manifests() if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, (kind, name)
    return found[0]


def container(name: str) -> dict[str, Any]:
    pod = one("Deployment", "prefix-cache-inference")["spec"]["template"]["spec"]
    return next(c for c in pod["containers"] if c["name"] == name)


def env_of(c: dict[str, Any]) -> dict[str, str]:
    """A container's variables; those from a Secret get a stand-in value."""
    return {e["name"]: e["value"] if "value" in e else FROM_SECRET for e in c.get("env", [])}


def secret_ref(c: dict[str, Any], variable: str) -> tuple[str, str]:
    ref = next(e for e in c["env"] if e["name"] == variable)["valueFrom"]["secretKeyRef"]
    return ref["name"], ref["key"]


def parse_command(argv: list[str]) -> argparse.Namespace:
    """``prefix-cache ...`` parsed by the real command line (unknown flags fail)."""
    assert Path(argv[0]).name == "prefix-cache", argv
    return cli.build_parser().parse_args(argv[1:])


@pytest.fixture
def settings_of(monkeypatch: pytest.MonkeyPatch) -> Any:
    """The settings ``serve`` would run with, given its argv and environment."""

    def make(argv: list[str], env: dict[str, str]) -> ServiceSettings:
        unknown = {v for v in env if v.startswith(ENV_PREFIX)} - SETTINGS_VARS - FOLDER_VARS
        assert unknown == set(), f"not settings: {sorted(unknown)}"
        args = parse_command(argv)
        assert args.command == "serve"
        for name in [v for v in os.environ if v.startswith(ENV_PREFIX)]:
            monkeypatch.delenv(name)
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        return ServiceSettings(**flag_overrides(vars(args)))   # validation errors fail here

    return make


# -- Kubernetes ---------------------------------------------------------------------------------


def test_the_sidecar_container_passes_only_valid_settings(settings_of: Any) -> None:
    sidecar = container("sidecar")
    settings = settings_of(sidecar["command"], env_of(sidecar))
    http = next(p for p in sidecar["ports"] if p["name"] == "http")
    assert settings.port == http["containerPort"] and settings.host == "0.0.0.0"
    assert settings.upstream_kind == "specprefill"
    # The keys file is where the Secret is mounted, with the file the Secret holds.
    mount = next(m for m in sidecar["volumeMounts"] if m["name"] == "keys")
    assert settings.keys_file == Path(mount["mountPath"]) / "keys.yaml"
    pod = one("Deployment", "prefix-cache-inference")["spec"]["template"]["spec"]
    volume = next(v for v in pod["volumes"] if v["name"] == "keys")["secret"]
    assert volume["secretName"] == "prefix-cache-keys"
    assert {"key": "keys.yaml", "path": "keys.yaml"} in volume["items"]


def test_probes_are_the_public_health_endpoints_on_the_served_port() -> None:
    sidecar = container("sidecar")
    ports = {p["name"]: p["containerPort"] for p in sidecar["ports"]}
    probes = {kind: sidecar[kind]["httpGet"] for kind in ("livenessProbe", "readinessProbe")}
    assert probes["livenessProbe"]["path"] == "/healthz"
    assert probes["readinessProbe"]["path"] == "/readyz"
    assert all(probe["port"] in ports for probe in probes.values())


def test_the_engine_is_on_loopback_where_the_sidecar_sends_its_requests(settings_of: Any) -> None:
    engine, sidecar = container("engine"), container("sidecar")
    assert set(v for v in env_of(engine) if v.startswith(ENV_PREFIX)) <= ENGINE_VARS
    args = parse_command(engine["command"])
    assert args.command == "serve-engine"
    # The engine's settings as serve-engine reads them (flags over its variables).
    args = EngineServerSettings(**flag_overrides(vars(args), EngineServerSettings))
    assert args.trust_namespace and args.host == "127.0.0.1"
    assert "ports" not in engine          # nothing outside the pod reaches it
    (url,) = settings_of(sidecar["command"], env_of(sidecar)).upstream or [""]
    upstream = urlsplit(url)
    assert (upstream.hostname, upstream.port) == ("127.0.0.1", args.port)
    # The sidecar's key for the engine is the engine's key: the same Secret entry.
    assert secret_ref(sidecar, "PREFIX_CACHE_UPSTREAM_API_KEY") == secret_ref(
        engine, "PREFIX_CACHE_ENGINE_API_KEY")
    health = f"http://127.0.0.1:{args.port}{DEFAULT_HEALTH_PATH}"   # what /readyz probes too
    for probe in ("startupProbe", "livenessProbe"):
        assert health in " ".join(engine[probe]["exec"]["command"])


def test_services_select_the_pods_and_ports_they_name(settings_of: Any) -> None:
    for deployment, service in (("prefix-cache-inference", "prefix-cache"),
                                ("prefix-cache-redis", "prefix-cache-redis")):
        pod = one("Deployment", deployment)["spec"]["template"]
        svc = one("Service", service)["spec"]
        assert svc["selector"].items() <= pod["metadata"]["labels"].items()
        names = {p["name"] for c in pod["spec"]["containers"] for p in c.get("ports", [])}
        assert {p["targetPort"] for p in svc["ports"]} <= names
    sidecar = container("sidecar")
    redis = urlsplit(settings_of(sidecar["command"], env_of(sidecar)).redis_url or "")
    svc = one("Service", "prefix-cache-redis")
    assert (redis.scheme, redis.hostname) == ("redis", svc["metadata"]["name"])
    assert redis.port in {p["port"] for p in svc["spec"]["ports"]}


def test_the_router_pool_lists_every_engine_pod_by_its_stable_name(settings_of: Any) -> None:
    engines = one("StatefulSet", "prefix-cache-engines")["spec"]
    headless = one("Service", engines["serviceName"])
    assert headless["spec"]["clusterIP"] == "None"
    assert headless["spec"]["selector"].items() <= engines["template"]["metadata"]["labels"].items()
    (engine,) = engines["template"]["spec"]["containers"]
    args = parse_command(engine["command"])
    assert args.command == "serve-engine" and args.trust_namespace
    router = one("Deployment", "prefix-cache-router")["spec"]["template"]
    (sidecar,) = router["spec"]["containers"]
    settings = settings_of(sidecar["command"], env_of(sidecar))
    (spec,) = load_model_specs(settings, demo_dir=lambda: Path("/models"))
    name = one("Service", "prefix-cache-engines")["metadata"]["name"]
    assert spec.upstreams == [f"http://{engines['serviceName']}-{i}.{name}:{args.port}/v1"
                              for i in range(engines["replicas"])]
    assert (spec.routing, spec.upstream_kind) == ("prefix_affinity", "specprefill")
    assert secret_ref(sidecar, "PREFIX_CACHE_UPSTREAM_API_KEY") == secret_ref(
        engine, "PREFIX_CACHE_ENGINE_API_KEY")
    # Only the routers reach the engines (they trust the namespace the caller names).
    policy = one("NetworkPolicy", "prefix-cache-engines")["spec"]
    assert policy["podSelector"]["matchLabels"].items() <= engines["template"]["metadata"][
        "labels"].items()
    (rule,) = policy["ingress"]
    (source,) = rule["from"]
    assert source["podSelector"]["matchLabels"].items() <= router["metadata"]["labels"].items()
    router_service = one("Service", "prefix-cache-router")["spec"]
    assert router_service["selector"].items() <= router["metadata"]["labels"].items()
    for kind, path in (("livenessProbe", "/healthz"), ("readinessProbe", "/readyz")):
        assert sidecar[kind]["httpGet"]["path"] == path


def test_the_service_monitor_scrapes_metrics_with_a_metrics_key(tmp_path: Path) -> None:
    monitor = one("ServiceMonitor", "prefix-cache")["spec"]
    service = one("Service", "prefix-cache")
    assert monitor["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    (endpoint,) = monitor["endpoints"]
    assert endpoint["path"] == "/metrics"
    assert endpoint["port"] in {p["name"] for p in service["spec"]["ports"]}
    credentials = endpoint["authorization"]["credentials"]
    secret = one("Secret", credentials["name"])["stringData"]
    token = secret[credentials["key"]]
    keys_file = tmp_path / "keys.yaml"
    keys_file.write_text(secret["keys.yaml"])
    keyring = KeysConfig.load(ServiceSettings(keys_file=keys_file)).keyring()
    assert keyring.may_observe(f"Bearer {token}")            # the token is a metrics key
    assert not keyring.may_observe(None) and not keyring.is_open


@pytest.fixture(scope="module")
def app(tmp_path_factory: pytest.TempPathFactory, demo_tokenizer: Any) -> Any:
    """The sidecar with the manifests' keys file (tenants, admin, metrics keys, limits)."""
    keys_file = tmp_path_factory.mktemp("deploy") / "keys.yaml"
    keys_file.write_text(one("Secret", "prefix-cache-keys")["stringData"]["keys.yaml"])
    return sidecar_app(served("boundaries", demo_tokenizer), keys_file=keys_file)


def test_the_probes_answer_without_a_key_on_the_deployed_configuration(base: str) -> None:
    sidecar = container("sidecar")
    paths = {sidecar[k]["httpGet"]["path"] for k in ("livenessProbe", "readinessProbe")}
    compose = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())
    paths |= set(re.findall(r"/(?:healthz|readyz)\b", " ".join(
        compose["services"]["sidecar"]["healthcheck"]["test"])))
    assert paths <= PUBLIC_PROBES and paths
    with local_client(base_url=base) as http:
        for path in paths:
            r = http.get(path)     # what the kubelet sends: no credentials
            assert r.status_code == 200, (path, r.text)
            assert set(r.json()) == {"status"}
        assert http.get("/metrics").status_code == 401   # but the metrics need the key


def test_prometheus_scrape_config_sends_a_bearer_key() -> None:
    config = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    (job,) = config["scrape_configs"]
    assert job["metrics_path"] == "/metrics"
    assert job["authorization"]["type"] == "Bearer" and job["authorization"]["credentials_file"]
    target = urlsplit("//" + job["static_configs"][0]["targets"][0])
    assert target.port == ServiceSettings.model_fields["port"].default


# -- launchd (macOS hosts where MLX runs) -------------------------------------------------------


def test_the_launchd_job_runs_serve_with_valid_settings(settings_of: Any) -> None:
    job = plistlib.loads(PLIST.read_bytes())
    assert job["Label"] == PLIST.stem and job["RunAtLoad"] is True
    env = job["EnvironmentVariables"]
    settings = settings_of(job["ProgramArguments"], env)
    assert (settings.host, settings.port) == ("127.0.0.1", 8000)   # loopback, the documented port
    assert settings.engine == "mlx" and settings.workers == 1      # in-process MLX: one worker
    assert settings.engine_options == json.loads(env["PREFIX_CACHE_ENGINE_OPTIONS"])
    from prefix_cache.engine.lookup import engine_factory

    engine_factory("mlx").check_options(settings.engine_options)   # no mlx needed to check
    assert job["StandardOutPath"] and job["StandardErrorPath"]
    assert job["ExitTimeOut"] > 10   # longer than uvicorn's graceful shutdown of streams


# -- what the manifests reference exists; the images can run what they are asked to --------------


def pod_specs() -> list[dict[str, Any]]:
    return [d["spec"]["template"]["spec"] for d in manifests()
            if d["kind"] in ("Deployment", "StatefulSet", "DaemonSet", "Job")]


def defined(kind: str) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in manifests() if d["kind"] == kind}


def test_every_claim_secret_and_config_the_pods_use_is_defined_in_deploy() -> None:
    claims, secrets, configs = (defined(k) for k in
                                ("PersistentVolumeClaim", "Secret", "ConfigMap"))
    for pod in pod_specs():
        for volume in pod.get("volumes", []):
            if "persistentVolumeClaim" in volume:
                assert volume["persistentVolumeClaim"]["claimName"] in claims, volume
            if "secret" in volume:
                secret = secrets[volume["secret"]["secretName"]]
                for item in volume["secret"].get("items", []):
                    assert item["key"] in secret["stringData"], item
            if "configMap" in volume:
                assert volume["configMap"]["name"] in configs, volume
        for c in pod["containers"]:
            for e in c.get("env", []):
                ref = e.get("valueFrom", {}).get("secretKeyRef")
                if ref:
                    assert ref["key"] in secrets[ref["name"]]["stringData"], ref
            mounted = {m["name"] for m in c.get("volumeMounts", [])}
            assert mounted <= {v["name"] for v in pod.get("volumes", [])}, c["name"]
    assert "models" in claims   # what every engine and sidecar mounts at /models


def dockerfile_builds() -> dict[str, dict[str, str]]:
    """The image tags the Dockerfile's header builds -> their build arguments."""
    builds = {}
    for line in (DEPLOY / "Dockerfile").read_text().splitlines():
        words = line.lstrip("# ").split("#")[0].split()
        if words[:2] == ["docker", "build"]:
            tag = words[words.index("-t") + 1]
            args = [words[i + 1] for i, w in enumerate(words) if w == "--build-arg"]
            builds[tag] = dict(a.split("=", 1) for a in args)
    return builds


def runs_the_engine(argv: list[str]) -> bool:
    args = parse_command(argv)
    return args.command == "serve-engine" or (args.command == "serve" and args.engine == "mlx")


def test_images_that_run_the_engine_are_built_with_the_mlx_extra() -> None:
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    assert re.search(r"^ARG EXTRAS=\"\"$", dockerfile, re.M)
    assert re.search(r"pip install [^\n]*-c constraints\.txt \"\.\$\{EXTRAS:\+\[\$EXTRAS\]\}\"",
                     dockerfile)
    assert re.search(r"^COPY [^\n]*constraints\.txt", dockerfile, re.M)
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    builds = dockerfile_builds()
    assert all(set(b.get("EXTRAS", "").split(",")) - {""} <= set(extras) for b in builds.values())
    containers = [c for pod in pod_specs() for c in pod["containers"]]
    ours = [c for c in containers if c["image"].split(":")[0].startswith("prefix-cache")]
    assert len(ours) >= 4
    for c in ours:
        assert c["image"] in builds, f"{c['image']} is built by no line of deploy/Dockerfile"
        engine = runs_the_engine(c["command"])
        has_mlx = "mlx" in builds[c["image"]].get("EXTRAS", "").split(",")
        assert engine <= has_mlx, f"{c['name']} runs the engine from {c['image']} (no mlx)"


# -- systemd ------------------------------------------------------------------------------------


def unit() -> tuple[dict[str, list[str]], list[list[str]]]:
    """The unit's [Service] settings (name -> values) and its header's install steps."""
    service: dict[str, list[str]] = {}
    steps, section = [], ""
    for line in (DEPLOY / "prefix-cache.service").read_text().splitlines():
        if line.startswith("#   "):
            steps.append(shlex.split(line[4:]))
        elif line.startswith("["):
            section = line
        elif section == "[Service]" and "=" in line and not line.startswith("#"):
            name, value = line.split("=", 1)
            service.setdefault(name, []).append(value)
    return service, steps


def installed(steps: list[list[str]]) -> dict[str, str]:
    """``install ... SRC DEST`` steps: destination -> source (the repository's file)."""
    made = {}
    for step in steps:
        if step[:1] == ["install"] and "-d" not in step:
            source, dest = step[-2], step[-1]
            assert (REPO / source).is_file(), f"the step installs {source}, not in the repository"
            made[dest] = source
    return made


def test_the_systemd_steps_make_everything_the_unit_needs(settings_of: Any) -> None:
    service, steps = unit()
    (user,) = service["User"]
    useradd = next(s for s in steps if s[:1] == ["useradd"])
    assert useradd[-1] == user and "--system" in useradd
    # The program: a venv the steps make, with the pinned versions.
    argv = shlex.split(service["ExecStart"][0])
    venv = Path(argv[0]).parent.parent
    assert ["python3", "-m", "venv", str(venv)] in steps
    assert [str(venv / "bin" / "pip"), "install", "-c", "constraints.txt", "."] in steps
    # The files it reads: installed by the steps, the settings' files too.
    files = installed(steps)
    (env_file,) = service["EnvironmentFile"]
    assert files[env_file] == "deploy/prefix-cache.env"
    env = dict(line.split("=", 1) for line in (REPO / files[env_file]).read_text().splitlines()
               if line and not line.startswith("#"))
    env.update(v.split("=", 1) for v in service["Environment"])
    for name, value in env.items():
        if name.endswith("_FILE"):
            assert value in files, f"{name}={value} is made by no step"
    assert any(dest.startswith("/etc/systemd/system/") for dest in files)
    for dest in files:   # their folders exist first
        folder = str(Path(dest).parent)
        assert folder == "/etc/systemd/system" or ["install", "-d", "-m", "755", folder] in steps
    settings = settings_of(argv, env)   # the unit's settings all valid
    # The one folder it writes: made by systemd for the user, where the settings look.
    (state,) = service["StateDirectory"]
    assert env["PREFIX_CACHE_HOME"] == f"/var/lib/{state}" == useradd[useradd.index(
        "--home-dir") + 1]
    assert "ReadWritePaths" not in service   # nothing else is written (ProtectSystem=strict)
    # It drains on stop, and systemd waits longer than the grace period.
    assert service["KillSignal"] in (["SIGTERM"], ["SIGINT"])
    assert float(service["TimeoutStopSec"][0]) > settings.shutdown_grace_s + 5


# -- without mlx ---------------------------------------------------------------------------------

NO_MLX = ("import sys; sys.modules.update(dict.fromkeys(('mlx', 'mlx.core', 'mlx_lm'))); "
          "from prefix_cache.cli import main; sys.exit(main(sys.argv[1:]))")


@pytest.mark.parametrize("command", ["serve-engine", "serve --engine mlx"])
def test_the_engine_commands_without_mlx_say_so_in_one_line(command: str, demo_folder: Path,
                                                            tmp_path: Path) -> None:
    """An image or a venv without the mlx extra (imports of mlx refused here, as on a machine
    without it): one line naming what to install, no traceback."""
    argv = [*command.split(), "--model", str(demo_folder), "--port", "0"]
    proc = subprocess.run([sys.executable, "-c", NO_MLX, *argv], cwd=REPO, capture_output=True,
                          text=True, timeout=120,
                          env={**os.environ, "PREFIX_CACHE_HOME": str(tmp_path)})
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "needs mlx and mlx-lm installed: pip install 'prefix-cache[mlx]'" in lines[0]
