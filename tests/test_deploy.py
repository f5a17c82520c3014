"""The Kubernetes manifests and container recipe parse and carry what operators rely on."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"


def load(name: str) -> dict[str, dict[str, Any]]:
    """Loads a multi-document manifest, keyed by kind."""
    docs = [d for d in yaml.safe_load_all((DEPLOY / "k8s" / name).read_text()) if d]
    by_kind: dict[str, dict[str, Any]] = {}
    for d in docs:
        assert "apiVersion" in d and "kind" in d and d["metadata"]["name"], d
        by_kind[d["kind"]] = d
    return by_kind


def container(pod_spec: dict[str, Any], name: str) -> dict[str, Any]:
    for c in pod_spec.get("containers", []) + pod_spec.get("initContainers", []):
        if c["name"] == name:
            return c
    raise AssertionError(f"no container {name}")


def env_of(c: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in c.get("env", [])}


def test_lighthouse_deployment_and_service() -> None:
    """The lighthouse Deployment has one port, probes on /readyz and /healthz, resources."""
    m = load("lighthouse.yaml")
    dep, svc = m["Deployment"], m["Service"]
    assert dep["spec"]["replicas"] == 1
    assert dep["spec"]["strategy"]["type"] == "Recreate"
    c = container(dep["spec"]["template"]["spec"], "lighthouse")
    assert "--min_replicas" in c["args"]
    assert [p["containerPort"] for p in c["ports"]] == [29510]
    assert c["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert c["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert c["resources"]["requests"] and c["resources"]["limits"]
    labels = dep["spec"]["template"]["metadata"]["labels"]
    assert all(labels[k] == v for k, v in svc["spec"]["selector"].items())
    assert [p["port"] for p in svc["spec"]["ports"]] == [29510]
    # Metrics are scraped from the same port; the event log lives on a writable volume
    # (the root filesystem is read-only).
    notes = dep["spec"]["template"]["metadata"]["annotations"]
    assert notes["prometheus.io/path"] == "/metrics" and notes["prometheus.io/port"] == "29510"
    log = c["args"][c["args"].index("--event_log") + 1]
    mount = next(v for v in c["volumeMounts"] if log.startswith(v["mountPath"] + "/"))
    volumes = {v["name"] for v in dep["spec"]["template"]["spec"]["volumes"]}
    assert mount["name"] in volumes


def test_replica_groups_statefulset() -> None:
    """Replica groups restart one pod at a time and get their id from the pod ordinal."""
    m = load("replica-groups.yaml")
    sts = m["StatefulSet"]
    spec = sts["spec"]
    assert spec["podManagementPolicy"] == "Parallel"
    pod = spec["template"]["spec"]
    assert pod["restartPolicy"] == "Always"
    c = container(pod, "trainer")
    env = env_of(c)
    assert env["TORCHFT_LIGHTHOUSE"] == "http://torchft-lighthouse:29510"
    assert "pod-index" in env["REPLICA_GROUP_ID"]["fieldRef"]["fieldPath"]
    assert int(env["NUM_REPLICA_GROUPS"]) == spec["replicas"]
    assert c["command"] == ["torchrun"] and "--standalone" in c["args"]
    assert m["Service"]["spec"]["clusterIP"] == "None"


def test_sidecar_variant() -> None:
    """The sidecar variant runs the lighthouse as a native sidecar next to the launcher."""
    job = load("sidecar.yaml")["Job"]
    pod = job["spec"]["template"]["spec"]
    lh = container(pod, "lighthouse")
    assert lh["restartPolicy"] == "Always"
    assert lh["readinessProbe"]["httpGet"]["path"] == "/readyz"
    trainer = container(pod, "trainer")
    assert trainer["command"][-1] == "torchft.launch"
    assert "--lighthouse=http://localhost:29510" in trainer["args"]
    assert job["spec"]["backoffLimit"] == 0


@pytest.mark.parametrize("target", ["lighthouse", "trainer"])
def test_container_recipe_has_targets(target: str) -> None:
    """The container recipe builds both images."""
    text = (DEPLOY / "Dockerfile").read_text()
    assert f" AS {target}" in text


@pytest.mark.parametrize(
    ("manifest", "kind", "containers"),
    [
        ("lighthouse.yaml", "Deployment", ["lighthouse"]),
        ("replica-groups.yaml", "StatefulSet", ["trainer"]),
        ("sidecar.yaml", "Job", ["lighthouse", "trainer"]),
    ],
)
def test_token_is_mounted_from_a_secret(manifest: str, kind: str, containers: list[str]) -> None:
    """Every torchft container reads the job's token from the Secret, as a file."""
    pod = load(manifest)[kind]["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    for name in containers:
        c = container(pod, name)
        path = env_of(c)["TORCHFT_TOKEN_FILE"]
        mount = next(m for m in c["volumeMounts"] if path.startswith(m["mountPath"] + "/"))
        assert mount.get("readOnly") is True
        secret = volumes[mount["name"]]["secret"]
        assert secret["secretName"] == "torchft-token"
        assert path.endswith("/token")
