"""The Kubernetes manifests are valid against Kubernetes' own schemas, and wired together.

Every document of every manifest in ``deploy/k8s`` is validated (strictly: unknown fields are
errors) with ``kubernetes-validate`` against the oldest Kubernetes release the manifests
support (native sidecars and the pod-index label need 1.29) and the newest the validator
knows. What a schema cannot see is checked on top: Services select the pods they front,
every mounted volume is declared, the lighthouse address the trainers dial is the Service's.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
MANIFESTS = sorted((DEPLOY / "k8s").glob("*.yaml"))
#: Oldest supported Kubernetes release (native sidecar containers, pod-index label).
OLDEST = "1.29"

pytestmark = pytest.mark.timeout(120)


def documents(path: Path) -> list[dict[str, Any]]:
    """The non-empty documents of a multi-document manifest."""
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def pod_specs(doc: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """The pod templates of a workload (Deployment, StatefulSet, Job, ...)."""
    template = doc.get("spec", {}).get("template")
    if template is not None:
        yield template


def containers(pod: dict[str, Any]) -> list[dict[str, Any]]:
    return pod["spec"].get("containers", []) + pod["spec"].get("initContainers", [])


@pytest.mark.parametrize("version", [OLDEST, kubernetes_validate.latest_version()])
@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_manifest_is_valid_kubernetes(path: Path, version: str) -> None:
    """Every document passes strict schema validation for the Kubernetes release."""
    docs = documents(path)
    assert docs, f"{path.name} is empty"
    for doc in docs:
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as e:
            pytest.fail(f"{path.name} {doc.get('kind')} {doc['metadata'].get('name')}: {e}")


def test_validation_catches_a_broken_manifest() -> None:
    """The check has teeth: a misspelt field or a wrong type is rejected."""
    doc = documents(DEPLOY / "k8s" / "lighthouse.yaml")[0]
    misspelt = yaml.safe_load(yaml.safe_dump(doc))
    misspelt["spec"]["replica"] = misspelt["spec"].pop("replicas", 1)
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(misspelt, OLDEST, strict=True)
    wrong_type = yaml.safe_load(yaml.safe_dump(doc))
    wrong_type["spec"]["template"]["spec"]["containers"][0]["ports"] = "29510"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(wrong_type, OLDEST, strict=True)


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_mounted_volumes_are_declared(path: Path) -> None:
    """Each volumeMount names a volume of its pod (a schema cannot check the reference)."""
    for doc in documents(path):
        for pod in pod_specs(doc):
            declared = {v["name"] for v in pod["spec"].get("volumes", [])}
            for c in containers(pod):
                for mount in c.get("volumeMounts", []):
                    assert mount["name"] in declared, (path.name, c["name"], mount["name"])


def test_services_select_their_pods() -> None:
    """Each Service's selector matches the labels of a pod template in the same manifest."""
    for path in MANIFESTS:
        docs = documents(path)
        pods = [pod for d in docs for pod in pod_specs(d)]
        for svc in (d for d in docs if d["kind"] == "Service"):
            selector = svc["spec"].get("selector", {})
            assert selector, f"{path.name}: Service {svc['metadata']['name']} selects nothing"
            assert any(
                all(p["metadata"].get("labels", {}).get(k) == v for k, v in selector.items())
                for p in pods
            ), f"{path.name}: Service {svc['metadata']['name']} selects no pod template"


def test_trainers_dial_the_lighthouse_service() -> None:
    """The replica groups' TORCHFT_LIGHTHOUSE is the lighthouse Service's name and port, and
    their replica group id comes from the pod ordinal (a restarted pod keeps its shard)."""
    lighthouse = {d["kind"]: d for d in documents(DEPLOY / "k8s" / "lighthouse.yaml")}
    svc = lighthouse["Service"]
    ports = {p["port"] for p in svc["spec"]["ports"]}
    trainers = {d["kind"]: d for d in documents(DEPLOY / "k8s" / "replica-groups.yaml")}
    pod = trainers["StatefulSet"]["spec"]["template"]
    env = {e["name"]: e for c in containers(pod) for e in c.get("env", [])}
    addr = env["TORCHFT_LIGHTHOUSE"]["value"]
    host, port = addr.removeprefix("http://").rsplit(":", 1)
    assert host == svc["metadata"]["name"] and int(port) in ports
    assert "pod-index" in env["REPLICA_GROUP_ID"]["valueFrom"]["fieldRef"]["fieldPath"]


def test_one_lighthouse_at_a_time() -> None:
    """The lighthouse Deployment never runs two lighthouses (two would issue rival quorums),
    not even during a rollout."""
    dep = {d["kind"]: d for d in documents(DEPLOY / "k8s" / "lighthouse.yaml")}["Deployment"]
    assert dep["spec"].get("replicas", 1) == 1
    assert dep["spec"]["strategy"]["type"] == "Recreate"


def test_probes_use_the_lighthouse_health_routes() -> None:
    """Lighthouse containers are probed on the routes the lighthouse serves."""
    seen = 0
    for path in MANIFESTS:
        for doc in documents(path):
            for pod in pod_specs(doc):
                for c in containers(pod):
                    if c["name"] != "lighthouse":
                        continue
                    seen += 1
                    assert c["readinessProbe"]["httpGet"]["path"] == "/readyz"
                    if "livenessProbe" in c:
                        assert c["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert seen >= 2  # the Deployment and the sidecar variant


@pytest.mark.parametrize("target", ["lighthouse", "trainer"])
def test_container_recipe_has_targets(target: str) -> None:
    """The container recipe builds both images."""
    text = (DEPLOY / "Dockerfile").read_text()
    assert f" AS {target}" in text


@pytest.mark.parametrize(
    ("manifest", "kind", "names"),
    [
        ("lighthouse.yaml", "Deployment", ["lighthouse"]),
        ("replica-groups.yaml", "StatefulSet", ["trainer"]),
        ("sidecar.yaml", "Job", ["lighthouse", "trainer"]),
    ],
)
def test_token_is_mounted_from_a_secret(manifest: str, kind: str, names: list[str]) -> None:
    """Every torchft container reads the job's token from the Secret, as a file."""
    doc = {d["kind"]: d for d in documents(DEPLOY / "k8s" / manifest)}[kind]
    pod = doc["spec"]["template"]
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    by_name = {c["name"]: c for c in containers(pod)}
    for name in names:
        c = by_name[name]
        path = next(e["value"] for e in c["env"] if e["name"] == "TORCHFT_TOKEN_FILE")
        mount = next(m for m in c["volumeMounts"] if path.startswith(m["mountPath"] + "/"))
        assert mount.get("readOnly") is True
        secret = volumes[mount["name"]]["secret"]
        assert secret["secretName"] == "torchft-token"
        assert path.endswith("/token")


def test_the_cluster_lighthouse_serves_rooms_across_namespaces() -> None:
    """The cluster-wide variant lives in its own namespace (its Service reachable from every
    job's namespace), bounds and expires rooms with flags the daemon knows, and is one
    lighthouse at a time like the per-job one."""
    docs = {d["kind"]: d for d in documents(DEPLOY / "k8s" / "cluster-lighthouse.yaml")}
    dep, svc = docs["Deployment"], docs["Service"]
    assert dep["metadata"]["namespace"] == svc["metadata"]["namespace"] == "torchft-system"
    assert dep["spec"].get("replicas", 1) == 1
    assert dep["spec"]["strategy"]["type"] == "Recreate"
    (c,) = [c for c in containers(dep["spec"]["template"]) if c["name"] == "lighthouse"]
    args = c["args"]
    flags = dict(zip(args[::2], args[1::2], strict=True))
    assert int(flags["--max_rooms"]) >= 1
    assert int(flags["--room_expiry_ms"]) > 0
    text = (DEPLOY / "k8s" / "cluster-lighthouse.yaml").read_text()
    assert "TORCHFT_JOB" in text, "the header tells jobs how to name their room"
    assert svc["spec"]["selector"] == dep["spec"]["selector"]["matchLabels"]
