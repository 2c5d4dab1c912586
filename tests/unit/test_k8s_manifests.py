"""The KubeRay manifests in infra/k8s/ are valid RayJob / RayCluster objects and run what this repo ships.

They are validated against the v1 OpenAPI schemas of KubeRay's CRDs vendored in infra/k8s/schemas/ (see
their ``$comment`` for the release), with every object closed to unknown fields as ``kubectl apply
--validate=strict`` does; the CRDs' CEL rules (``x-kubernetes-validations``) are not evaluated here.
"""

from __future__ import annotations

import copy
import json
import re
import shlex
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from nemo_rl.config.cli import parse_args_and_load
from nemo_rl.config.master import GRPOMasterConfig

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "infra" / "k8s"


def _closed(schema: Any) -> Any:
    """The schema with unknown fields rejected wherever Kubernetes would prune or reject them."""
    if isinstance(schema, list):
        return [_closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _closed(v) for k, v in schema.items()}
    if (
        "properties" in out
        and "additionalProperties" not in out
        and not out.get("x-kubernetes-preserve-unknown-fields")
    ):
        out["additionalProperties"] = False
    return out


def _validator(kind: str) -> jsonschema.Draft7Validator:
    schema = json.loads((K8S / "schemas" / f"{kind}.v1.json").read_text())
    return jsonschema.Draft7Validator(_closed(schema))


def _load(name: str) -> dict[str, Any]:
    return yaml.safe_load((K8S / name).read_text())


def _errors(kind: str, doc: dict[str, Any]) -> list[str]:
    return [
        f"{'/'.join(map(str, e.absolute_path))}: {e.message}"
        for e in sorted(_validator(kind).iter_errors(doc), key=str)
    ]


@pytest.mark.parametrize(("name", "kind"), [("rayjob.yaml", "RayJob"), ("raycluster.yaml", "RayCluster")])
def test_manifest_matches_kuberay_crd(name: str, kind: str) -> None:
    doc = _load(name)
    assert doc["apiVersion"] == "ray.io/v1" and doc["kind"] == kind
    assert _errors(kind.lower(), doc) == []


def test_schema_check_catches_mistakes() -> None:
    job = _load("rayjob.yaml")
    typo = copy.deepcopy(job)
    typo["spec"]["rayClusterSpec"]["headGroupSpec"]["rayStartParam"] = {"num-gpus": "8"}
    wrong_type = copy.deepcopy(job)
    wrong_type["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["replicas"] = "one"
    bad_enum = copy.deepcopy(job)
    bad_enum["spec"]["rayClusterSpec"]["authOptions"]["mode"] = "password"
    deep_typo = copy.deepcopy(job)
    container = deep_typo["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][
        0
    ]
    container["resources"]["limit"] = container["resources"].pop("limits")
    cases = ((typo, "rayStartParam"), (wrong_type, "replicas"), (bad_enum, "mode"), (deep_typo, "'limit'"))
    for doc, where in cases:
        errors = _errors("rayjob", doc)
        assert errors and any(where in e for e in errors), errors


def _cluster_gpus(cluster: dict[str, Any]) -> tuple[int, int]:
    """(nodes, GPUs per node) of a RayClusterSpec, checking every group asks Kubernetes for what Ray gets."""
    groups = [(1, cluster["headGroupSpec"])] + [(g["replicas"], g) for g in cluster["workerGroupSpecs"]]
    per_node = set()
    for _, group in groups:
        gpus = int(group["rayStartParams"]["num-gpus"])
        (container,) = group["template"]["spec"]["containers"]
        for bound in ("limits", "requests"):
            assert int(container["resources"][bound]["nvidia.com/gpu"]) == gpus, container["name"]
        per_node.add(gpus)
    assert len(per_node) == 1, "every node must have the same GPUs (cluster.gpus_per_node)"
    return sum(n for n, _ in groups), per_node.pop()


def test_rayjob_runs_grpo_on_the_cluster_it_asks_for() -> None:
    job = _load("rayjob.yaml")
    assert job["spec"]["rayClusterSpec"] == _load("raycluster.yaml")["spec"], (
        "rayjob.yaml and raycluster.yaml differ"
    )
    entrypoint = job["spec"]["entrypoint"]
    command = shlex.split(entrypoint.split("&&", 1)[1])
    assert command[:2] == ["python", "examples/run_grpo_math.py"], command
    assert (ROOT / command[1]).exists()
    # The overrides are valid for the script's schema, and size the cluster this manifest creates.
    config, _ = parse_args_and_load(
        GRPOMasterConfig, ROOT / "examples" / "configs" / "grpo_math_1B.yaml", command[2:]
    )
    nodes, gpus = _cluster_gpus(job["spec"]["rayClusterSpec"])
    assert (config.cluster.num_nodes, config.cluster.gpus_per_node) == (nodes, gpus)
    # Checkpoints and logs on the shared volume, so a retry (backoffLimit) resumes.
    assert config.checkpointing.checkpoint_dir.startswith("/shared/")
    assert config.logger.log_dir.startswith("/shared/")
    assert job["spec"]["backoffLimit"] >= 1


def test_every_pod_mounts_the_shared_volume_and_a_large_dev_shm() -> None:
    cluster = _load("raycluster.yaml")["spec"]
    claim = _load("shared-pvc.yaml")
    assert claim["kind"] == "PersistentVolumeClaim" and "ReadWriteMany" in claim["spec"]["accessModes"]
    for group in [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]:
        pod = group["template"]["spec"]
        volumes = {v["name"]: v for v in pod["volumes"]}
        (container,) = pod["containers"]
        mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
        assert set(mounts.values()) <= set(volumes), "a volumeMount names no volume"
        assert volumes[mounts["/shared"]]["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"]
        assert volumes[mounts["/dev/shm"]]["emptyDir"]["medium"] == "Memory"
        assert container["workingDir"] == "/opt/nemo_rl"  # the Dockerfile's WORKDIR


def test_cluster_uses_the_locked_ray_and_token_auth() -> None:
    lock = (ROOT / "uv.lock").read_text()
    ray_version = re.search(r'name = "ray"\nversion = "([^"]+)"', lock)
    assert ray_version
    cluster = _load("raycluster.yaml")["spec"]
    assert cluster["rayVersion"] == ray_version.group(1)
    assert cluster["authOptions"]["mode"] == "token"
    assert "WORKDIR /opt/nemo_rl" in (ROOT / "Dockerfile").read_text()
