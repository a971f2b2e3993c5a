"""Kubernetes manifests (k8s/): each overlay renders with kustomize and every object validates
offline against the Kubernetes schemas; pods are sized, probed and non-root; passwords exist
only in a git-ignored file and reach pods by reference; scaling actors is one number; pods run
the same `tidal learner` / `tidal actor` commands the launcher does, and serve metrics that the
PodMonitors, the dashboard and the Prometheus scaler read by the names tidal gives them. No cluster needed."""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import re
import secrets
import shutil
import subprocess
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from tidal.config import load_config
from tidal.models import HUB_ID
from tidal.ops.cli import _split, parse
from tidal.ops.memory import Cluster, GiB, MiB, ModelShape, actor_host_terms, learner_host_terms, payload_bytes, plan
from tidal.tiny import cached_model_path

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "k8s"
OVERLAYS = ("cpu-demo", "gpu", "gpu-multinode")
NETWORKED = {"gpu-multinode"}  # overlays whose weights go over the network, with no shared volume
# the oldest Kubernetes release kubernetes-validate >= 1.30 ships schemas for
K8S_VERSION = "1.30.0"
RUN_CONFIG = "/etc/tidal/run.yaml"
SECRET_ENV = K8S / "base" / "redis.env"
SECRET_NAME = re.compile(r"pass|secret|token|auth|credential|api_?key", re.IGNORECASE)
# how each role's container starts `tidal`: an actor first reads its own Redis password from a file
ACTOR_PASSWORD_FILE = "/run/tidal-redis/password"
LAUNCH = {
    "learner": ["tidal"],
    "actor": ["sh", "-c", f'TIDAL_REDIS_PASSWORD="$(cat {ACTOR_PASSWORD_FILE})" exec tidal "$@"', "tidal"],
}
# custom resources (KEDA's, the Prometheus operator's): outside the offline schemas
CUSTOM_GROUPS = ("keda.sh/", "monitoring.coreos.com/")
# ids that are not bare "gpu": conftest skips items with a "gpu" keyword on machines without CUDA
for_each_overlay = pytest.mark.parametrize("overlay", OVERLAYS, ids=[f"overlays/{o}" for o in OVERLAYS])


# ---- rendering -----------------------------------------------------------------------------


def secret_keys(example: Path) -> list[str]:
    lines = [ln.strip() for ln in example.read_text().splitlines()]
    return [ln.split("=", 1)[0] for ln in lines if ln and not ln.startswith("#")]


@pytest.fixture(scope="module")
def tree(tmp_path_factory) -> tuple[Path, dict[str, str]]:
    """k8s/ copied, with redis.env filled from the committed example as the README says."""
    dst = tmp_path_factory.mktemp("k8s") / "k8s"
    shutil.copytree(K8S, dst, ignore=shutil.ignore_patterns(SECRET_ENV.name))
    passwords = {key: secrets.token_hex(24) for key in secret_keys(K8S / "base" / "redis.env.example")}
    (dst / "base" / SECRET_ENV.name).write_text("".join(f"{k}={v}\n" for k, v in passwords.items()))
    return dst, passwords


def kustomize(directory: Path) -> list[dict]:
    if shutil.which("kubectl") is None:
        pytest.skip(
            "kubectl is not on PATH: overlays cannot be rendered here "
            "(test_base_files_validate_and_are_safe still checks the base files)"
        )
    out = subprocess.run(["kubectl", "kustomize", str(directory)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, f"kubectl kustomize {directory} failed:\n{out.stderr}"
    return [doc for doc in yaml.safe_load_all(out.stdout) if doc]


@pytest.fixture(scope="module")
def rendered(tree) -> dict[str, list[dict]]:
    root, _ = tree
    return {name: kustomize(root / "overlays" / name) for name in OVERLAYS}


def overlay_with(tree_root: Path, name: str, body: str) -> Path:
    """A throwaway overlay next to the real ones (kustomize wants relative paths)."""
    path = tree_root / "overlays" / name
    path.mkdir(exist_ok=True)
    (path / "kustomization.yaml").write_text(body)
    return path


def find(objects: list[dict], kind: str, name: str) -> dict:
    hits = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(hits) == 1, f"expected one {kind}/{name}, found {len(hits)}"
    return hits[0]


def pod_spec(obj: dict) -> dict | None:
    return obj.get("spec", {}).get("template", {}).get("spec")


def containers(spec: dict):
    """(is_init, container) for every container of a pod spec."""
    yield from ((True, c) for c in spec.get("initContainers", []))
    yield from ((False, c) for c in spec.get("containers", []))


def nodes(tree):
    """Every mapping inside a YAML tree."""
    if isinstance(tree, dict):
        yield tree
        tree = list(tree.values())
    if isinstance(tree, list):
        for item in tree:
            yield from nodes(item)


def role_container(objects: list[dict], role: str) -> tuple[dict, dict]:
    sts = find(objects, "StatefulSet", f"tidal-{role}")
    spec = pod_spec(sts)
    return spec, next(c for c in spec["containers"] if c["name"] == role)


# ---- the checks every set of objects must pass -------------------------------------------------


def schema_problems(objects: list[dict]) -> list[str]:
    problems = []
    for obj in objects:
        try:
            kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
        except kubernetes_validate.SchemaNotFoundError:
            problems.append(
                f"{obj['kind']}/{obj['metadata']['name']}: not a built-in kind, cannot be validated offline"
            )
        except kubernetes_validate.ValidationError as err:
            problems.append(f"{obj['kind']}/{obj['metadata']['name']}: {err.message} at {list(err.path)}")
    return problems


def pod_problems(objects: list[dict]) -> list[str]:
    """Resources, probes, non-root, read-only root, secret env vars: for every container of every
    workload; no service-account token in any pod."""
    problems = []
    for obj in objects:
        spec = pod_spec(obj)
        if spec is None:
            continue
        pod_ctx = spec.get("securityContext", {})
        if spec.get("automountServiceAccountToken") is not False:  # no pod of tidal calls the API server
            problems.append(f"{obj['kind']}/{obj['metadata']['name']}: mounts a service-account token")
        for is_init, c in containers(spec):
            where = f"{obj['kind']}/{obj['metadata']['name']} container {c['name']}"
            if c.get("securityContext", {}).get("readOnlyRootFilesystem") is not True:
                problems.append(f"{where}: root filesystem is writable")
            res = c.get("resources", {})
            for part in ("requests", "limits"):
                missing = {"cpu", "memory"} - set(res.get(part, {}))
                if missing:
                    problems.append(f"{where}: no {part} for {sorted(missing)}")
            if not is_init:
                problems += [f"{where}: no {p}" for p in ("startupProbe", "livenessProbe") if p not in c]
            ctx = {**pod_ctx, **c.get("securityContext", {})}
            if ctx.get("runAsNonRoot") is not True or ctx.get("runAsUser", 1) == 0:
                problems.append(f"{where}: may run as root")
            if c.get("securityContext", {}).get("allowPrivilegeEscalation") is not False:
                problems.append(f"{where}: allowPrivilegeEscalation is not false")
            for env in c.get("env", []):
                if SECRET_NAME.search(env["name"]) and "secretKeyRef" not in env.get("valueFrom", {}):
                    problems.append(f"{where}: env {env['name']} looks secret but is not a secretKeyRef")
    return problems


# ---- tests ------------------------------------------------------------------------------------


def test_base_files_validate_and_are_safe():
    """The committed resources themselves, before kustomize: runs where kubectl is missing too."""
    objects = []
    for kustomization in [K8S / "base" / "kustomization.yaml", *K8S.glob("components/*/kustomization.yaml")]:
        for res in yaml.safe_load(kustomization.read_text()).get("resources", []):
            objects += [d for d in yaml.safe_load_all((kustomization.parent / res).read_text()) if d]
    built_in = [o for o in objects if not o["apiVersion"].startswith(CUSTOM_GROUPS)]
    assert not schema_problems(built_in) + pod_problems(built_in)


@for_each_overlay
def test_overlay_validates_against_the_kubernetes_schemas(rendered, overlay):
    objects = rendered[overlay]
    kinds = {o["kind"] for o in objects}
    shared_volumes = set() if overlay in NETWORKED else {"PersistentVolumeClaim"}  # StatefulSets claim their own
    assert {"StatefulSet", "Secret", "ConfigMap", "NetworkPolicy"} | shared_volumes <= kinds
    assert not schema_problems(objects)


@for_each_overlay
def test_every_container_is_sized_probed_and_non_root(rendered, overlay):
    assert not pod_problems(rendered[overlay])


@for_each_overlay
def test_passwords_reach_pods_only_by_reference(tree, rendered, overlay):
    _, passwords = tree
    objects = rendered[overlay]
    secret = next(o for o in objects if o["kind"] == "Secret")
    assert {k: base64.b64decode(v).decode() for k, v in secret["data"].items()} == passwords
    others = [o for o in objects if o["kind"] != "Secret"]
    assert not [k for k, pw in passwords.items() if pw in yaml.safe_dump(others)]
    # every reference names a key the Secret really has
    refs = [node["secretKeyRef"] for node in nodes(others) if "secretKeyRef" in node]
    assert refs and all(r["name"] == secret["metadata"]["name"] and r["key"] in passwords for r in refs)


def test_no_password_is_committed():
    """Secrets come from a git-ignored env file whose committed .example holds no values."""
    for path in K8S.rglob("*.yaml"):
        for doc in yaml.safe_load_all(path.read_text()):
            if not doc:
                continue
            assert doc.get("kind") != "Secret", f"{path}: a Secret object in a committed manifest"
            for gen in doc.get("secretGenerator", []):
                literal_keys = [lit.split("=", 1)[0] for lit in gen.get("literals", [])]
                assert not [k for k in literal_keys if SECRET_NAME.search(k)], f"{path}: a literal password"
                for source in gen.get("envs", []) + gen.get("files", []):
                    source_path = path.parent / source
                    example = source_path.with_name(source_path.name + ".example")
                    assert example.is_file(), f"{path}: {source} has no committed {example.name}"
                    values = [
                        ln.split("=", 1)[1]
                        for ln in example.read_text().splitlines()
                        if ln.strip() and not ln.startswith("#")
                    ]
                    assert values and not any(v.strip() for v in values), f"{example}: values must stay empty"
                    if shutil.which("git") and (ROOT / ".git").exists():
                        ignored = subprocess.run(["git", "check-ignore", "-q", str(source_path)], cwd=ROOT)
                        assert ignored.returncode == 0, f"{source_path} is not git-ignored"
    # nor may it reach an image: the build context leaves k8s/ out
    assert "k8s" in (ROOT / ".dockerignore").read_text().split()


def test_scaling_actors_changes_only_the_replica_count(tree, rendered):
    root, _ = tree
    scaled = kustomize(
        overlay_with(root, "scale-3", "resources: [../cpu-demo]\nreplicas:\n  - name: tidal-actor\n    count: 3\n")
    )

    def diff(a, b, path=""):
        if isinstance(a, dict) and isinstance(b, dict):
            return [d for k in sorted(a.keys() | b.keys()) for d in diff(a.get(k), b.get(k), f"{path}.{k}")]
        if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
            return [d for i, (x, y) in enumerate(zip(a, b)) for d in diff(x, y, f"{path}[{i}]")]
        return [] if a == b else [path]

    def by_name(objects):
        return {(o["kind"], o["metadata"]["name"]): o for o in objects}

    before, after = by_name(rendered["cpu-demo"]), by_name(scaled)
    assert before.keys() == after.keys()
    changes = {key: diff(before[key], after[key]) for key in before}
    assert {key: d for key, d in changes.items() if d} == {("StatefulSet", "tidal-actor"): [".spec.replicas"]}
    assert after[("StatefulSet", "tidal-actor")]["spec"]["replicas"] == 3


def cli_subparser(name: str) -> argparse.ArgumentParser | None:
    from tidal.ops.cli import _parser

    sub = next(a for a in _parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices.get(name)


def run_config_of(objects: list[dict], spec: dict, container: dict, tmp_path: Path) -> Path:
    """The run.yaml the container sees: the ConfigMap mounted at /etc/tidal, written out."""
    mount = next(m for m in container["volumeMounts"] if m["mountPath"] == str(Path(RUN_CONFIG).parent))
    volume = next(v for v in spec["volumes"] if v["name"] == mount["name"])
    config_map = find(objects, "ConfigMap", volume["configMap"]["name"])
    path = tmp_path / Path(RUN_CONFIG).name
    path.write_text(config_map["data"][path.name])
    return path


@for_each_overlay
@pytest.mark.parametrize("role", ("learner", "actor"))
def test_pods_run_the_launchers_commands_on_the_mounted_config(rendered, overlay, role, tmp_path):
    objects = rendered[overlay]
    spec, container = role_container(objects, role)
    args = container["args"]
    assert container["command"] == LAUNCH[role] and args[:2] == [role, RUN_CONFIG]
    configs, overrides = _split(parse(args))
    assert configs == [RUN_CONFIG]
    index = {"actor": "2", "learner": "1"}[role]  # a learner pod's ordinal is its node rank: 2 nodes at most
    overrides = [o.replace("$(POD_NAME)", f"tidal-{role}-{index}").replace("$(POD_INDEX)", index) for o in overrides]
    cfg = load_config(run_config_of(objects, spec, container, tmp_path), overrides)
    # each actor logs in as its own user, the learner as `learner`
    assert (
        cfg.broker.type.value == "redis"
        and cfg.broker.redis.username == {"actor": "tidal-actor-2", "learner": "learner"}[role]
    )
    secrets_env = {e["name"] for e in container["env"] if "secretKeyRef" in e.get("valueFrom", {})}
    if role == "learner":
        assert cfg.broker.redis.password_env in secrets_env
    else:  # its own password, from the file its init container wrote, never the actors' secret
        assert not secrets_env
        assert f'{cfg.broker.redis.password_env}="$(cat {ACTOR_PASSWORD_FILE})"' in LAUNCH[role][2]
    if role == "actor":
        assert (cfg.actor.id, cfg.actor.index) == ("tidal-actor-2", 2)
        assert {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}} in container["env"]
    weights = ("nccl", "") if overlay in NETWORKED else ("file", "/weights")
    assert (cfg.weights.transport, cfg.weights.dir) == weights
    # the probes read the file this process touches
    assert f"{role}.health_file=/tmp/tidal-health" in container["args"]
    for probe in ("startupProbe", "livenessProbe"):
        command = container[probe]["exec"]["command"]
        assert command[:3] == ["tidal", "health", "/tmp/tidal-health"]
        cli_subparser("health").parse_args(command[2:])


@pytest.mark.parametrize("overlay", [o for o in OVERLAYS if o not in NETWORKED])
def test_learner_resumes_from_its_volume_and_shares_weights(rendered, overlay):
    objects = rendered[overlay]
    learner = find(objects, "StatefulSet", "tidal-learner")
    spec, container = role_container(objects, "learner")
    assert learner["spec"]["replicas"] == 1
    assert {"--resume", "run_dir=/data/run", "weights.dir=/weights"} <= set(container["args"])
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    assert mounts["/data"]["name"] in {t["metadata"]["name"] for t in learner["spec"]["volumeClaimTemplates"]}
    claims = {}
    for role in ("learner", "actor"):
        spec, container = role_container(objects, role)
        mount = next(m for m in container["volumeMounts"] if m["mountPath"] == "/weights")
        volume = next(v for v in spec["volumes"] if v["name"] == mount["name"])
        claims[role] = volume["persistentVolumeClaim"]["claimName"]
        assert mount.get("readOnly", False) == (role == "actor")
        shm = next(m for m in container["volumeMounts"] if m["mountPath"] == "/dev/shm")
        assert next(v for v in spec["volumes"] if v["name"] == shm["name"])["emptyDir"]["medium"] == "Memory"
    assert claims["learner"] == claims["actor"]
    assert find(objects, "PersistentVolumeClaim", claims["learner"])["spec"]["accessModes"] == ["ReadWriteMany"]


def test_a_learner_on_several_pods_meets_at_pod_0_and_streams_weights_from_every_pod(rendered):
    objects = rendered["gpu-multinode"]
    learner = find(objects, "StatefulSet", "tidal-learner")
    spec, container = role_container(objects, "learner")
    args = dict(a.split("=", 1) for a in container["args"] if "=" in a)
    assert learner["spec"]["replicas"] == int(args["learner.nodes"]) > 1
    # every pod starts at once (pod 0 waits for the others before any probe can pass) and is found by name
    assert learner["spec"]["podManagementPolicy"] == "Parallel"
    service = find(objects, "Service", learner["spec"]["serviceName"])
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"] is True
    pod0 = f"{learner['metadata']['name']}-0.{service['metadata']['name']}"
    assert args["learner.master_addr"] == pod0
    # every pod's ranks serve their own rows of each version, announced by the pod's own name
    env = {e["name"]: e for e in container["env"]}
    assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert args["weights.tcp_advertise"] == f"$(POD_NAME).{service['metadata']['name']}"
    assert args["learner.node_rank"] == "$(POD_INDEX)" and "--resume" in container["args"]
    gpus = int(container["resources"]["limits"]["nvidia.com/gpu"])
    assert int(args["learner.num_ranks"]) == learner["spec"]["replicas"] * gpus
    assert args["learner.fsdp.enabled"] == "true"
    ports = {p["containerPort"] for p in container["ports"]}
    assert {int(args["learner.master_port"]), int(args["weights.tcp_port"])} <= ports
    # nothing is shared between pods on disk: no volume claim but each learner pod's own
    assert [o for o in objects if o["kind"] == "PersistentVolumeClaim" and o["metadata"]["name"] != "redis"] == []
    for role in ("learner", "actor"):
        spec, container = role_container(objects, role)
        claims = [v for v in spec["volumes"] if "persistentVolumeClaim" in v]
        assert claims == [] and not {"/weights", "/models"} & {m["mountPath"] for m in container["volumeMounts"]}


def selects(selector: dict, labels: dict) -> bool:
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for expr in selector.get("matchExpressions", []):
        value, op = labels.get(expr["key"]), expr["operator"]
        ok = {
            "In": value in expr.get("values", []),
            "NotIn": value not in expr.get("values", []),
            "Exists": value is not None,
            "DoesNotExist": value is None,
        }[op]
        if not ok:
            return False
    return True


# who may open a connection to each workload's pods: the learner's ports (torchrun's store, the ranks'
# TCPStore, the weight server) and the actors' (NCCL's sockets) only from tidal's own pods; MLflow from
# the learner and pods labelled as its clients
MAY_CONNECT = {
    "redis": {"tidal-learner", "tidal-actor"},
    "tidal-learner": {"tidal-learner", "tidal-actor"},
    "tidal-actor": {"tidal-learner", "tidal-actor"},
    "mlflow": {"tidal-learner"},
}
MLFLOW_CLIENT = {"tidal.io/mlflow-client": "true"}
# besides: Prometheus, from its own namespace, may reach the metrics port of the learner and the actors
METRICS_PORT = "metrics"  # the container port's name, which NetworkPolicies and PodMonitors refer to
SCRAPED = {"tidal-learner", "tidal-actor"}
SCRAPER = {
    "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}},
    "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}},
}


def is_scrape_rule(rule: dict) -> bool:
    """An ingress rule that opens the metrics port alone."""
    return rule.get("ports") == [{"protocol": "TCP", "port": METRICS_PORT}]


def ingress_peers(objects: list[dict], labels: dict, scrape: bool = False) -> list[dict]:
    """Every peer the NetworkPolicies selecting pods with `labels` admit, through the rules that open the
    metrics port alone (`scrape`) or through the others; a rule without `from` admits everyone, and is
    returned as an empty peer."""
    policies = [p for p in objects if p["kind"] == "NetworkPolicy" and selects(p["spec"]["podSelector"], labels)]
    assert policies and all("Ingress" in p["spec"]["policyTypes"] for p in policies), labels
    rules = [rule for p in policies for rule in p["spec"].get("ingress", []) if is_scrape_rule(rule) == scrape]
    return [peer for rule in rules for peer in rule.get("from") or [{}]]


@for_each_overlay
def test_every_workload_admits_only_the_pods_that_need_it(rendered, overlay):
    objects = rendered[overlay]
    labels = {
        o["metadata"]["name"]: o["spec"]["template"]["metadata"]["labels"] for o in objects if pod_spec(o) is not None
    }
    assert set(labels) <= set(MAY_CONNECT), f"a workload without a rule here: {set(labels) - set(MAY_CONNECT)}"
    for name, own in labels.items():
        peers = ingress_peers(objects, own)
        assert all(set(peer) == {"podSelector"} for peer in peers), f"{name}: open to a namespace, IP block or all"
        admitted = {other for other, lab in labels.items() if any(selects(p["podSelector"], lab) for p in peers)}
        assert admitted == MAY_CONNECT[name], name
        clients = [
            p
            for p in peers
            if not selects(p["podSelector"], {})  # a selector matching any pod
            and not any(selects(p["podSelector"], lab) for lab in labels.values())
        ]
        assert [p["podSelector"] for p in clients] == ([{"matchLabels": MLFLOW_CLIENT}] if name == "mlflow" else [])
    if "mlflow" in labels:
        policy = next(p for p in objects if p["kind"] == "NetworkPolicy" and p["metadata"]["name"] == "mlflow")
        assert [port["port"] for rule in policy["spec"]["ingress"] for port in rule["ports"]] == [5000]


@for_each_overlay
def test_prometheus_reaches_only_the_metrics_port_of_learner_and_actors(rendered, overlay):
    objects = rendered[overlay]
    workloads = {o["metadata"]["name"]: o for o in objects if pod_spec(o) is not None}
    for name, workload in workloads.items():
        peers = ingress_peers(objects, workload["spec"]["template"]["metadata"]["labels"], scrape=True)
        assert peers == ([SCRAPER] if name in SCRAPED else []), name
    for role in ("learner", "actor"):  # the port the rule opens by name is one the pod has
        _, container = role_container(objects, role)
        assert METRICS_PORT in {p.get("name") for p in container.get("ports", [])}, role


@for_each_overlay
@pytest.mark.parametrize("role", ("learner", "actor"))
def test_pods_serve_metrics_on_the_port_they_expose(rendered, overlay, role, tmp_path):
    """The run config the pod gets turns the metrics endpoint on, on the pod's address, at the container
    port named `metrics`: the one the NetworkPolicies open and the PodMonitors scrape."""
    objects = rendered[overlay]
    _, container = role_container(objects, role)
    cfg = role_config(objects, role, tmp_path)
    assert cfg.tracking.metrics_host == "0.0.0.0", "a loopback endpoint is out of Prometheus' reach"
    ports = {p.get("name"): p["containerPort"] for p in container.get("ports", [])}
    assert cfg.tracking.metrics_port != 0 and ports.get(METRICS_PORT) == cfg.tracking.metrics_port


@for_each_overlay
def test_writable_paths_are_volumes_under_a_read_only_root(rendered, overlay):
    """Read-only roots (pod_problems); the health file, HOME and its caches live on an emptyDir at /tmp."""
    objects = rendered[overlay]
    for role in ("learner", "actor"):
        spec, container = role_container(objects, role)
        volume, _ = volume_of(spec, container, "/tmp/tidal-health")
        assert volume is not None and "emptyDir" in volume and volume["emptyDir"].get("sizeLimit")
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert volume_of(spec, container, env["HOME"])[0] is volume


@for_each_overlay
def test_learner_and_actors_load_one_pinned_model_snapshot(rendered, overlay, tmp_path):
    """A Hub model without a revision is whatever `main` is when each pod fetches it: learner and
    actors could train and sample different weights."""
    models = {}
    for role in ("learner", "actor"):
        cfg = role_config(rendered[overlay], role, tmp_path)
        if HUB_ID.match(cfg.model.path):
            assert re.fullmatch(r"[0-9a-f]{40}", cfg.model.revision), f"{overlay} {role}: {cfg.model.revision!r}"
        models[role] = (cfg.model.path, cfg.model.revision)
    assert models["learner"] == models["actor"]


@for_each_overlay
def test_each_actor_pod_holds_only_its_own_redis_password(tree, rendered, overlay, tmp_path):
    """The actors' secret reaches only the init container, which writes the pod's own password (the one
    redis-users.sh gives the pod's Redis user) to a memory volume the actor reads."""
    _, passwords = tree
    spec, container = role_container(rendered[overlay], "actor")
    init = next(c for c in spec["initContainers"] if c["name"] == "redis-password")
    refs = [e["valueFrom"]["secretKeyRef"]["key"] for e in init["env"] if "secretKeyRef" in e.get("valueFrom", {})]
    assert refs == ["actor-password"]
    assert not [e for e in container["env"] if "secretKeyRef" in e.get("valueFrom", {})]
    init_volume, init_mount = volume_of(spec, init, ACTOR_PASSWORD_FILE)
    volume, mount = volume_of(spec, container, ACTOR_PASSWORD_FILE)
    assert volume is init_volume and volume["emptyDir"]["medium"] == "Memory" and mount["readOnly"] is True
    script, _ = volume_of(spec, init, "/opt/redis-users/redis-users.sh")
    assert script["configMap"]["name"].startswith("tidal-redis-users")
    # the init container's command, run here with the script and the volume in tmp_path
    command = (
        init["command"][2]
        .replace("/opt/redis-users", str(K8S / "base"))
        .replace(str(Path(ACTOR_PASSWORD_FILE).parent), str(tmp_path))
    )
    subprocess.run(
        ["sh", "-c", command],
        check=True,
        env={"PATH": "/usr/bin:/bin", "POD_NAME": "tidal-actor-2", "ACTOR_PASSWORD": passwords["actor-password"]},
    )
    own = (tmp_path / "password").read_text().strip()
    acl = tmp_path / "users.acl"
    subprocess.run(
        ["sh", str(K8S / "base" / "redis-users.sh"), str(acl), str(K8S / "base" / "run.yaml")],
        check=True,
        capture_output=True,
        env={
            "PATH": "/usr/bin:/bin",
            "LEARNER_PASSWORD": passwords["learner-password"],
            "ACTOR_PASSWORD": passwords["actor-password"],
        },
    )
    words = [line.split() for line in acl.read_text().splitlines()]
    users = {w[1]: w[3] for w in words if w[3].startswith("#")}  # user -> "#<sha256 of its password>"
    assert users["tidal-actor-2"] == "#" + hashlib.sha256(own.encode()).hexdigest()
    assert users["tidal-actor-1"] != users["tidal-actor-2"] and passwords["actor-password"] not in own


def test_cpu_demo_finds_the_model_baked_into_the_image(rendered):
    """The image builds configs/tiny.yaml's model into /opt/tidal/models; pods must look there
    with a run whose model and task settings hash to the same cache entry."""
    dockerfile = (ROOT / "Dockerfile").read_text()
    prepare = re.search(r"tidal prepare (\S+) model\.cache_dir=(\S+)", dockerfile)
    assert prepare and prepare.group(1).endswith("configs/tiny.yaml")
    cache_dir = prepare.group(2)
    objects = rendered["cpu-demo"]
    for role in ("learner", "actor"):
        _, container = role_container(objects, role)
        assert f"model.cache_dir={cache_dir}" in container["args"]
    baked = load_config(ROOT / "configs" / "tiny.yaml", [f"model.cache_dir={cache_dir}"])
    pods = load_config(K8S / "base" / "run.yaml", [f"model.cache_dir={cache_dir}"])
    assert pods.model.path == ""
    assert cached_model_path(pods.model, pods.task) == cached_model_path(baked.model, baked.task)
    uid = re.search(r"^USER (\d+)", dockerfile, re.MULTILINE).group(1)
    spec, _ = role_container(objects, "learner")
    assert str(spec["securityContext"]["runAsUser"]) == uid
    assert re.search(r"^USER (\d+)", (ROOT / "Dockerfile.gpu").read_text(), re.MULTILINE).group(1) == uid


def test_gpu_overlay_asks_for_gpus_and_mounts_the_model(rendered):
    objects = rendered["gpu"]
    cfg = load_config(K8S / "overlays" / "gpu" / "run.yaml")
    for role in ("learner", "actor"):
        spec, container = role_container(objects, role)
        assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
        mount = next(m for m in container["volumeMounts"] if cfg.model.path.startswith(m["mountPath"] + "/"))
        assert mount["readOnly"] is True
        assert "model.cache_dir=/opt/tidal/models" not in container["args"]


def test_mlflow_is_an_optional_component(rendered):
    for overlay, wanted in (("cpu-demo", True), ("gpu", False)):
        objects = rendered[overlay]
        _, learner = role_container(objects, "learner")
        assert ("tracking.uri=http://mlflow:5000" in learner["args"]) == wanted
        services = {o["metadata"]["name"]: o for o in objects if o["kind"] == "Service"}
        assert ("mlflow" in services) == wanted
    assert find(rendered["cpu-demo"], "Service", "mlflow")["spec"]["ports"][0]["port"] == 5000


def test_keda_autoscaling_stays_outside_the_validated_overlays(tree):
    root, _ = tree
    for overlay in OVERLAYS:
        assert "keda" not in (K8S / "overlays" / overlay / "kustomization.yaml").read_text()
    body = "resources: [../cpu-demo]\ncomponents: [../../components/keda]\n"
    objects = kustomize(overlay_with(root, "keda-try", body))
    assert not schema_problems([o for o in objects if not o["apiVersion"].startswith(CUSTOM_GROUPS)])
    scaled = find(objects, "ScaledObject", "tidal-actor")
    auth = find(objects, "TriggerAuthentication", "tidal-redis-keda")
    secret = next(o for o in objects if o["kind"] == "Secret")
    assert all(
        ref["name"] == secret["metadata"]["name"] and ref["key"] in secret["data"]
        for ref in auth["spec"]["secretTargetRef"]
    )
    # KEDA reads with its own read-only user, never with the learner's password
    refs = {ref["parameter"]: ref["key"] for ref in auth["spec"]["secretTargetRef"]}
    assert refs == {"username": "keda-username", "password": "keda-password"}
    assert base64.b64decode(secret["data"]["keda-username"]).decode() == "keda"
    cfg = load_config(K8S / "base" / "run.yaml")
    trigger = scaled["spec"]["triggers"][0]
    assert scaled["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "StatefulSet", "name": "tidal-actor"}
    assert trigger["metadata"]["stream"] == f"{cfg.broker.redis.prefix}:{cfg.name}:prompts"
    assert trigger["metadata"]["consumerGroup"] == "actors" and "lagCount" in trigger["metadata"]
    # scaling 1..N down is the HPA's (KEDA's cooldownPeriod only covers scaling to zero): it waits too
    behavior = scaled["spec"]["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
    assert behavior["scaleDown"]["stabilizationWindowSeconds"] >= 300


# ---- metrics: Prometheus scrapes the learner and the actors, Grafana shows the run, KEDA scales on it ----

# the series tidal's processes serve (tidal/prometheus.py): the contract the dashboard and the scaler are held to
METRICS = {
    # the learner
    "tidal_learner_version": "gauge",
    "tidal_learner_rollout_wait_seconds_total": "counter",
    "tidal_learner_train_seconds_total": "counter",
    "tidal_learner_weight_push_seconds_total": "counter",
    "tidal_learner_sample_age_seconds": "histogram",
    "tidal_learner_discarded_tokens_total": "counter",
    "tidal_learner_trained_tokens_total": "counter",
    "tidal_learner_generated_tokens_total": "counter",
    "tidal_learner_actor_version_lag": "gauge",
    "tidal_broker_pending_groups": "gauge",
    "tidal_broker_unreturned_groups": "gauge",
    "tidal_broker_live_actors": "gauge",
    # each actor
    "tidal_actor_weight_version": "gauge",
    "tidal_actor_work_wait_seconds_total": "counter",
    "tidal_actor_weights_wait_seconds_total": "counter",
    "tidal_actor_weight_pull_seconds": "histogram",
    "tidal_actor_weight_pause_seconds": "histogram",
    "tidal_actor_generated_tokens_total": "counter",
    "tidal_actor_groups_total": "counter",
    "tidal_actor_inflight_samples": "gauge",
}
HISTOGRAM_SERIES = ("_bucket", "_sum", "_count")  # what a histogram is served as: each a counter


def test_the_contract_is_what_the_processes_serve():
    from tidal.actor.metrics import SPECS as ACTOR
    from tidal.learner.rank0.flow import SPECS as LEARNER

    served = {spec.name: spec.kind for spec in (*ACTOR, *LEARNER)}
    for module in (ROOT / "actor" / "metrics.py", ROOT / "learner" / "rank0" / "flow.py"):
        served |= dict.fromkeys(re.findall(r'histogram\(\s*"(tidal_\w+)"', module.read_text()), "histogram")
    assert {name: served.get(name) for name in METRICS} == METRICS


# a series name in PromQL, whether rate() or increase() reads it, and its label matchers
SERIES = re.compile(r"(?P<rate>\b(?:rate|irate|increase)\(\s*)?\b(?P<name>tidal_\w+)(?P<matchers>\{[^}]*\})?")
GRID_COLUMNS = 24  # a Grafana dashboard's width


def series_kind(name: str) -> str | None:
    """counter, gauge, or None for a series tidal does not serve; a histogram's parts are counters."""
    base = next((name.removesuffix(s) for s in HISTOGRAM_SERIES if name.endswith(s)), None)
    if base is not None and METRICS.get(base) == "histogram":
        return "counter"
    return {"counter": "counter", "gauge": "gauge"}.get(METRICS.get(name))


def series_problems(expr: str, run_matcher: str) -> list[str]:
    """What is wrong with the tidal series one PromQL expression reads: a name tidal does not serve, a
    selector that does not pick the run, a counter read without rate() or a gauge through it, buckets
    outside a quantile."""
    problems = []
    if expr.count("(") != expr.count(")") or expr.count("{") != expr.count("}"):
        problems.append(f"unbalanced brackets: {expr}")
    found = list(SERIES.finditer(expr))
    if not found:
        problems.append(f"reads no tidal series: {expr}")
    for m in found:
        name, kind, rated = m["name"], series_kind(m["name"]), m["rate"] is not None
        if kind is None:
            problems.append(f"{name}: not a series tidal serves")
        elif rated != (kind == "counter"):
            problems.append(f"{name}: a {kind} {'read through' if rated else 'read without'} rate()")
        if run_matcher not in (m["matchers"] or ""):
            problems.append(f"{name}: not filtered by {run_matcher}")
        if name.endswith("_bucket") and not re.search(r"histogram_quantile\(.*by \(le\)", expr):
            problems.append(f"{name}: buckets outside histogram_quantile(..., sum by (le) ...)")
    return problems


def test_series_problems_finds_what_it_should():
    """The checker itself: each mistake it exists for is caught, a right expression passes."""
    run = 'run="$run"'
    assert series_problems('sum(rate(tidal_learner_trained_tokens_total{run="$run"}[5m]))', run) == []
    assert series_problems('tidal_learner_trained_tokens_total{run="$run"}', run)  # a counter, raw
    assert series_problems('rate(tidal_broker_live_actors{run="$run"}[5m])', run)  # a gauge, rated
    assert series_problems('sum(rate(tidal_learner_trained_token_total{run="$run"}[5m]))', run)  # a typo
    assert series_problems("sum(rate(tidal_learner_trained_tokens_total[5m]))", run)  # every run at once
    assert series_problems('max(tidal_broker_live_actors{run="$run"}', run)  # unbalanced
    assert series_problems('rate(tidal_actor_weight_pull_seconds_bucket{run="$run"}[5m])', run)  # buckets alone
    assert series_problems('sum(rate(tidal_actor_weight_pull_seconds_count{run="$run"}[5m]))', run) == []
    assert series_problems('max(tidal_actor_weight_pull_seconds{run="$run"})', run)  # a histogram has no such series


@pytest.fixture(scope="module")
def with_metrics(tree) -> dict[str, list[dict]]:
    """Each overlay with the metrics components added, as a throwaway overlay."""
    root, _ = tree
    components = "[../../components/prometheus, ../../components/keda-prometheus]"
    return {
        name: kustomize(overlay_with(root, f"{name}-metrics", f"resources: [../{name}]\ncomponents: {components}\n"))
        for name in OVERLAYS
    }


def by_kind_and_name(objects: list[dict]) -> dict[tuple[str, str], dict]:
    return {(o["kind"], o["metadata"]["name"]): o for o in objects}


@for_each_overlay
def test_metrics_components_add_objects_and_change_none(rendered, with_metrics, overlay):
    before, after = by_kind_and_name(rendered[overlay]), by_kind_and_name(with_metrics[overlay])
    assert before.keys() <= after.keys() and all(after[key] == obj for key, obj in before.items())
    added = after.keys() - before.keys()
    assert added == {
        ("PodMonitor", "tidal-learner"),
        ("PodMonitor", "tidal-actor"),
        ("ConfigMap", "tidal-grafana-dashboard"),
        ("ScaledObject", "tidal-actor"),
    }
    built_in = [after[key] for key in added if not after[key]["apiVersion"].startswith(CUSTOM_GROUPS)]
    assert not schema_problems(built_in)
    for name in OVERLAYS:  # custom resources stay out of the validated overlays
        text = (K8S / "overlays" / name / "kustomization.yaml").read_text()
        assert "components/prometheus" not in text and "components/keda-prometheus" not in text


def pods_of(workload: dict, at_least: int = 3) -> list[tuple[str, dict]]:
    """(pod name, labels) of the pods a workload may have: its replicas, or `at_least` as a scaled one
    would, each StatefulSet pod with the ordinal label Kubernetes gives it."""
    name, labels = workload["metadata"]["name"], workload["spec"]["template"]["metadata"]["labels"]
    count = max(workload["spec"].get("replicas", 1), at_least)
    if workload["kind"] != "StatefulSet":
        return [(f"{name}-{i}", labels) for i in range(count)]
    return [(f"{name}-{i}", {**labels, "apps.kubernetes.io/pod-index": str(i)}) for i in range(count)]


@for_each_overlay
def test_pod_monitors_scrape_each_role_on_the_port_its_pods_expose(with_metrics, overlay):
    """The learner's monitor selects its pod 0 alone (only rank 0 serves metrics), the actors' every actor
    pod, and each names a container port the pods it selects have."""
    objects = with_metrics[overlay]
    workloads = [o for o in objects if pod_spec(o) is not None]
    monitors = {o["metadata"]["name"]: o for o in objects if o["kind"] == "PodMonitor"}
    wanted = {
        "tidal-learner": ["tidal-learner-0"],
        "tidal-actor": [pod for pod, _ in pods_of(find(objects, "StatefulSet", "tidal-actor"))],
    }
    assert set(monitors) == set(wanted)
    for name, monitor in monitors.items():
        assert "namespaceSelector" not in monitor["spec"]  # the run's namespace, where the monitor is
        endpoints = monitor["spec"]["podMetricsEndpoints"]
        assert [(e["port"], e["path"]) for e in endpoints] == [(METRICS_PORT, "/metrics")]
        assert all(e.get("interval") for e in endpoints), name
        selected = [
            (workload, pod)
            for workload in workloads
            for pod, labels in pods_of(workload)
            if selects(monitor["spec"]["selector"], labels)
        ]
        assert [pod for _, pod in selected] == wanted[name]
        for workload, pod in selected:
            ports = {p.get("name") for _, c in containers(pod_spec(workload)) for p in c.get("ports", [])}
            assert METRICS_PORT in ports, pod


def dashboard_of(objects: list[dict]) -> dict:
    config_map = find(objects, "ConfigMap", "tidal-grafana-dashboard")
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"  # what Grafana's sidecar loads
    (text,) = config_map["data"].values()
    return json.loads(text)


def test_dashboard_reads_only_the_series_tidal_serves(with_metrics):
    dashboard = dashboard_of(with_metrics["cpu-demo"])
    assert isinstance(dashboard["schemaVersion"], int) and dashboard["uid"] and len(dashboard["uid"]) <= 40
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    run_query = variables["run"]["query"]["query"]
    assert re.fullmatch(r"label_values\((tidal_\w+), run\)", run_query)
    assert series_kind(re.search(r"tidal_\w+", run_query).group()) is not None
    panels = dashboard["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    for panel in panels:
        where = f"panel {panel['title']!r}"
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, where
        assert panel["description"], where  # the question it answers
        targets = panel["targets"]
        assert targets and len({t["refId"] for t in targets}) == len(targets), where
        assert all(t.get("datasource", panel["datasource"]) == panel["datasource"] for t in targets), where
        problems = [p for t in targets for p in series_problems(t["expr"], 'run="$run"')]
        assert not problems, f"{where}: {problems}"


def test_dashboard_panels_tile_the_grid(with_metrics):
    """Every panel has a place of its own inside the grid's 24 columns."""
    cells = set()
    for panel in dashboard_of(with_metrics["cpu-demo"])["panels"]:
        grid = panel["gridPos"]
        assert all(isinstance(grid[k], int) for k in ("h", "w", "x", "y")), panel["title"]
        assert grid["w"] > 0 and grid["h"] > 0 and grid["x"] >= 0 and grid["x"] + grid["w"] <= GRID_COLUMNS
        mine = {
            (x, y) for x in range(grid["x"], grid["x"] + grid["w"]) for y in range(grid["y"], grid["y"] + grid["h"])
        }
        assert not mine & cells, f"panel {panel['title']!r} overlaps another"
        cells |= mine


# what the Prometheus scaler reads: the live actors, their idle share, the learner's share waiting
SCALER_INPUTS = (
    "tidal_broker_live_actors",
    "tidal_actor_work_wait_seconds_total",
    "tidal_learner_rollout_wait_seconds_total",
)


def scaler_value(query: str, live_actors: float, idle: float, learner_wait: float) -> float:
    """The scaler's query with every actor alike: each aggregation of a series (of its rate, for a
    counter of seconds: a share of time) replaced by its one value."""
    values = dict(zip(SCALER_INPUTS, (live_actors, idle, learner_wait)))
    aggregation = re.compile(r"\b(?:max|min|avg|sum)\s*\(\s*(?:rate\()?(tidal_\w+)\{[^}]*\}(?:\[\w+\]\))?\s*\)")
    arithmetic = aggregation.sub(lambda m: repr(values[m[1]]), query).replace("clamp_min(", "max(")
    assert re.fullmatch(r"[-+*/()., 0-9max]+", arithmetic), arithmetic
    return eval(arithmetic, {"__builtins__": {}}, {"max": max})


def test_keda_prometheus_asks_for_the_actors_the_learner_can_take(with_metrics):
    """live x (1 - idle) / (1 - wait), (1 - wait) no less than 0.25: the actors' busy time, scaled to what
    the learner would take if it never waited; ceil(value) replicas (AverageValue, threshold 1)."""
    objects = with_metrics["cpu-demo"]
    scaled = find(objects, "ScaledObject", "tidal-actor")
    assert scaled["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "StatefulSet", "name": "tidal-actor"}
    (trigger,) = scaled["spec"]["triggers"]
    assert (trigger["type"], trigger["metricType"]) == ("prometheus", "AverageValue")
    metadata = trigger["metadata"]
    assert float(metadata["threshold"]) == 1 and metadata["serverAddress"].startswith("http")
    assert metadata["ignoreNullValues"] == "false"  # no series holds the count instead of shrinking it
    query, cfg = metadata["query"], load_config(K8S / "base" / "run.yaml")
    assert not series_problems(query, f'run="{cfg.name}"')
    assert {m["name"] for m in SERIES.finditer(query)} == set(SCALER_INPUTS)
    for live, idle, wait, wanted in [
        (4, 0.0, 0.0, 4),  # both busy: as many as now
        (4, 0.0, 0.5, 8),  # the learner waits half its time: twice as many
        (4, 0.5, 0.0, 2),  # the actors idle half their time: half as many
        (4, 0.25, 0.5, 6),
        (4, 0.0, 0.99, 16),  # at most 4x in one step
        (4, 1.0, 0.0, 0),  # no actor has work: minReplicaCount
    ]:
        assert scaler_value(query, live, idle, wait) == pytest.approx(wanted), (live, idle, wait)
    redis = find(objects, "StatefulSet", "redis")
    users = next(
        int(e["value"]) for c in pod_spec(redis)["initContainers"] for e in c["env"] if e["name"] == "NUM_ACTOR_USERS"
    )
    spec = scaled["spec"]
    assert 1 <= spec["minReplicaCount"] <= spec["maxReplicaCount"] <= users  # each actor pod needs a Redis user
    # scaling 1..N down is the HPA's: it waits, as an actor's engine takes minutes to start
    assert (
        spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]["scaleDown"]["stabilizationWindowSeconds"] >= 300
    )


def test_the_two_actor_scalers_exclude_each_other(tree):
    """components/keda and components/keda-prometheus both scale tidal-actor: an overlay with both fails to
    build instead of giving the actors two autoscalers."""
    if shutil.which("kubectl") is None:
        pytest.skip("kubectl is not on PATH: overlays cannot be rendered here")
    root, _ = tree
    components = "[../../components/keda, ../../components/keda-prometheus]"
    path = overlay_with(root, "both-scalers", f"resources: [../cpu-demo]\ncomponents: {components}\n")
    out = subprocess.run(["kubectl", "kustomize", str(path)], capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "ScaledObject.v1alpha1.keda.sh/tidal-actor" in out.stderr


# ---- memory: each GPU overlay holds what the plan of its model needs (tidal/ops/memory.py, docs/gpu.md) ------

GPU_OVERLAYS = ("gpu", "gpu-multinode")
for_each_gpu_overlay = pytest.mark.parametrize("overlay", GPU_OVERLAYS, ids=[f"overlays/{o}" for o in GPU_OVERLAYS])
PLANNED_FOR = "tidal/memory-planned-for"  # the pod annotation naming the model the sizes are planned for
PLANNED_GPU = Cluster(81559 * MiB)  # an 80 GB GPU as its driver reports it, the smaller docs/gpu.md plans for


def quantity_bytes(quantity: str) -> int:
    """A Kubernetes quantity (64Gi, 500G, 512Mi) in bytes."""
    number, suffix = re.fullmatch(r"([0-9.]+)([A-Za-z]*)", str(quantity)).groups()
    scale = {
        "": 1,
        "Ki": 2**10,
        "Mi": 2**20,
        "Gi": 2**30,
        "Ti": 2**40,
        "k": 10**3,
        "M": 10**6,
        "G": 10**9,
        "T": 10**12,
    }[suffix]
    return int(float(number) * scale)


def role_config(objects: list[dict], role: str, tmp_path: Path):
    """The config a role's pod 0 runs: the mounted run.yaml with the container's overrides."""
    spec, container = role_container(objects, role)
    _, overrides = _split(parse(container["args"]))
    overrides = [o.replace("$(POD_NAME)", f"tidal-{role}-0").replace("$(POD_INDEX)", "0") for o in overrides]
    return load_config(run_config_of(objects, spec, container, tmp_path), overrides)


def planned_shape(objects: list[dict], role: str, cfg) -> ModelShape:
    """The shape of the model a pod's sizes are planned for (bench/models): the one its annotation
    names, which is the one model.path names where that is a Hub id."""
    sts = find(objects, "StatefulSet", f"tidal-{role}")
    name = sts["spec"]["template"]["metadata"]["annotations"][PLANNED_FOR]
    if HUB_ID.match(cfg.model.path):
        assert cfg.model.path.split("/")[1].removesuffix("-Instruct") == name
    return ModelShape.from_config(ROOT / "bench" / "models" / name)


def volume_of(spec: dict, container: dict, path: str) -> tuple[dict | None, dict]:
    """(the volume holding `path` in the container, its mount); None for a volume claim template."""
    mount = max(
        (m for m in container["volumeMounts"] if (path + "/").startswith(m["mountPath"].rstrip("/") + "/")),
        key=lambda m: len(m["mountPath"]),
    )
    return next((v for v in spec["volumes"] if v["name"] == mount["name"]), None), mount


def cache_bytes(objects: list[dict], role: str, spec: dict, container: dict) -> int | None:
    """The size of the volume HF_HOME is on: an emptyDir's sizeLimit, a claim template's request;
    None where the pod has no Hugging Face cache (its model comes from a mounted folder)."""
    home = next((e["value"] for e in container.get("env", []) if e["name"] == "HF_HOME"), None)
    if home is None:
        return None
    volume, mount = volume_of(spec, container, home)
    if volume is not None:
        return quantity_bytes(volume["emptyDir"]["sizeLimit"])
    claims = find(objects, "StatefulSet", f"tidal-{role}")["spec"]["volumeClaimTemplates"]
    claim = next(c for c in claims if c["metadata"]["name"] == mount["name"])
    return quantity_bytes(claim["spec"]["resources"]["requests"]["storage"])


@for_each_gpu_overlay
@pytest.mark.parametrize("role", ("learner", "actor"))
def test_gpu_overlay_pods_hold_their_memory_plan(rendered, overlay, role, tmp_path):
    """The Hugging Face cache holds 1.2 x the model's bf16 bytes; the memory-backed /dev/shm holds what
    the plan puts there (a tcp actor's staged version, the file channel's files); the memory limit holds
    every host term of the role; and the role's GPU budgets fit an 80 GB GPU."""
    objects = rendered[overlay]
    spec, container = role_container(objects, role)
    cfg = role_config(objects, role, tmp_path)
    shape = planned_shape(objects, role, cfg)
    cache = cache_bytes(objects, role, spec, container)
    assert cache is None or cache >= 1.2 * shape.num_params * 2, "the Hugging Face cache is too small"
    host = learner_host_terms(cfg, shape) if role == "learner" else actor_host_terms(cfg, shape)
    shm, _ = volume_of(spec, container, "/dev/shm")
    assert shm["emptyDir"]["medium"] == "Memory"
    assert quantity_bytes(shm["emptyDir"]["sizeLimit"]) >= sum(t.nbytes for t in host if t.shm)
    if cfg.weights.transport == "tcp" and role == "actor":
        assert quantity_bytes(shm["emptyDir"]["sizeLimit"]) >= payload_bytes(cfg, shape)
    limit = quantity_bytes(container["resources"]["limits"]["memory"])
    assert limit >= sum(t.nbytes for t in host), [(t.name, t.nbytes / GiB) for t in host]
    devices = ("learner GPU",) if role == "learner" else ("actor GPU, vLLM's share", "actor GPU, outside vLLM's share")
    result = plan(cfg, shape, PLANNED_GPU)
    assert [d for d in devices if not result.budget(d).fits] == [], result.table()


def test_multinode_pods_can_reach_each_other_over_rdma(rendered):
    """NCCL across pods: IPC_LOCK (to pin memory for RDMA) added to the base's dropped capabilities, and
    its interface, NICs and log level set on every learner and actor pod."""
    for role in ("learner", "actor"):
        _, container = role_container(rendered["gpu-multinode"], role)
        capabilities = container["securityContext"]["capabilities"]
        assert capabilities == {"drop": ["ALL"], "add": ["IPC_LOCK"]}
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert env["NCCL_DEBUG"] == "WARN" and env["NCCL_SOCKET_IFNAME"] and env["NCCL_IB_HCA"]
    for patch in ("learner.yaml", "actor.yaml"):  # an RDMA device request, left for the cluster to name
        assert re.search(r"^\s*# rdma/\w+: \"1\"$", (K8S / "overlays" / "gpu-multinode" / patch).read_text(), re.M)


# ---- Redis: the ACL file and the server flags on a real redis-server ------------------------------
