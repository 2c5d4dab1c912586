"""Write the v1 OpenAPI schemas of KubeRay's RayJob and RayCluster CRDs, as vendored in this folder.

    python infra/k8s/schemas/vendor_kuberay_crds.py KUBERAY_CHECKOUT --ref v1.7.0 --commit <sha>

KUBERAY_CHECKOUT is a checkout of the kuberay repository (ray-project/kuberay) at the release to vendor; the
CRDs are read from ray-operator/config/crd/bases/. Descriptions are dropped (they are most of the size and
validate nothing); everything else of `spec.versions[v1].schema.openAPIV3Schema` is kept as is, and the
source goes into the schema's `$comment`. tests/unit/test_k8s_manifests.py validates infra/k8s/ against them.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import yaml

HERE = Path(__file__).resolve().parent
CRDS = {"rayjob": "ray.io_rayjobs.yaml", "raycluster": "ray.io_rayclusters.yaml"}


def _without_descriptions(node: Any) -> Any:
    if isinstance(node, dict):
        return {k: _without_descriptions(v) for k, v in node.items() if k != "description"}
    if isinstance(node, list):
        return [_without_descriptions(v) for v in node]
    return node


def main() -> None:
    """Read the CRDs from a kuberay checkout and write ``<kind>.v1.json`` next to this script."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkout", type=Path, help="a kuberay checkout at the release to vendor")
    parser.add_argument("--ref", required=True, help="the release tag, e.g. v1.7.0")
    parser.add_argument("--commit", required=True, help="the commit the tag points to")
    args = parser.parse_args()
    for kind, name in CRDS.items():
        path = args.checkout / "ray-operator" / "config" / "crd" / "bases" / name
        crd = yaml.safe_load(path.read_text())
        (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
        schema = _without_descriptions(version["schema"]["openAPIV3Schema"])
        schema = {
            "$comment": (
                f"openAPIV3Schema of {crd['metadata']['name']} v1 from the kuberay repository (ray-project/kuberay) "
                f"{args.ref} (commit {args.commit}), ray-operator/config/crd/bases/{name}, descriptions removed; "
                "regenerate with infra/k8s/schemas/vendor_kuberay_crds.py"
            ),
            **schema,
        }
        out = HERE / f"{kind}.v1.json"
        out.write_text(json.dumps(schema, separators=(",", ":"), sort_keys=True) + "\n")
        print(f"wrote {out} ({out.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
