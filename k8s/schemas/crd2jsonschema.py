#!/usr/bin/env python3
"""Turns CustomResourceDefinitions into the JSON schemas kubeconform reads.

Used once per vendored CRD version (see README.md beside this file), not by the tests: the
tests read the JSON this writes, which is committed. Needs PyYAML.

    python3 k8s/schemas/crd2jsonschema.py OUT_DIR CRD.yaml...

Writes OUT_DIR/<group>/<kind>_<version>.json (lower case) for every served version, the layout
of kubeconform's `-schema-location '.../{{.Group}}/{{.ResourceKind}}_{{.ResourceAPIVersion}}.json'`.
Strict like kubectl's validation: every object that lists its properties refuses others
(`additionalProperties: false`), the root included, unless it says
`x-kubernetes-preserve-unknown-fields`.
"""

import json
import os
import sys

import yaml


def strict(node):
    """Adds `additionalProperties: false` to every object schema that lists properties."""
    if isinstance(node, dict):
        if ("properties" in node and "additionalProperties" not in node
                and not node.get("x-kubernetes-preserve-unknown-fields")):
            node["additionalProperties"] = False
        for value in node.values():
            strict(value)
    elif isinstance(node, list):
        for value in node:
            strict(value)
    return node


def convert(crd, out_dir):
    spec = crd["spec"]
    group, kind = spec["group"], spec["names"]["kind"]
    written = []
    for version in spec.get("versions", []):
        schema = version.get("schema", {}).get("openAPIV3Schema")
        if schema is None or not version.get("served", True):
            continue
        path = os.path.join(out_dir, group, f"{kind}_{version['name']}.json".lower())
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            json.dump(strict(schema), f, indent=1, sort_keys=True)
            f.write("\n")
        written.append(path)
    return written


def main(argv):
    if len(argv) < 3:
        sys.exit(f"usage: {argv[0]} OUT_DIR CRD.yaml...")
    out_dir = argv[1]
    for name in argv[2:]:
        with open(name, encoding="utf-8") as f:
            docs = [d for d in yaml.safe_load_all(f) if d and d.get("kind") == "CustomResourceDefinition"]
        if not docs:
            sys.exit(f"{name}: no CustomResourceDefinition in it")
        for crd in docs:
            for path in convert(crd, out_dir):
                print(path)


if __name__ == "__main__":
    main(sys.argv)
