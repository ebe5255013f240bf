"""Vendor a CustomResourceDefinition's OpenAPI schema for tests/unit/repo/test_k8s_manifests.py.

Takes the ``openAPIV3Schema`` of one served version out of an upstream CRD file, drops the
descriptions (they are most of the size; no validation reads them) and writes it as indented JSON
with a ``$comment`` naming the source, so that a reviewer can compare it with upstream:

    git -C trainer show v2.3.0:manifests/base/crds/trainer.kubeflow.org_trainjobs.yaml > crd.yaml
    python tests/unit/repo/k8s_schemas/vendor.py crd.yaml v1alpha1 \\
        "kubeflow/trainer v2.3.0 manifests/base/crds/trainer.kubeflow.org_trainjobs.yaml" \\
        tests/unit/repo/k8s_schemas/trainjob.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import yaml


def without_descriptions(schema):
    """The schema with every ``description`` keyword removed; a field *named* description stays."""
    if isinstance(schema, list):
        return [without_descriptions(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key == "description" and isinstance(value, str):
            continue
        if key == "properties":  # keys here are field names, not keywords
            out[key] = {name: without_descriptions(sub) for name, sub in value.items()}
        else:
            out[key] = without_descriptions(value)
    return out


def main(crd_file: str, version: str, source: str, out: str) -> None:
    crd = yaml.safe_load(Path(crd_file).read_text())
    (served,) = [v for v in crd["spec"]["versions"] if v["name"] == version]
    schema = {"$comment": f"openAPIV3Schema of {crd['spec']['names']['kind']} {version} from {source}, "
                          "descriptions removed (tests/unit/repo/k8s_schemas/vendor.py)",
              **without_descriptions(served["schema"]["openAPIV3Schema"])}
    Path(out).write_text(json.dumps(schema, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main(*sys.argv[1:])
