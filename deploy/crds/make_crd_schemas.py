#!/usr/bin/env python3
"""Writes the JSON schemas deploy/checks.py validates the chart's custom resources against, from the upstream CRDs.

Each schema is the `openAPIV3Schema` of one served version of a CustomResourceDefinition, read at a pinned release
tag of its upstream repository, made strict the way `kubectl apply` (field validation `Strict`) and
kubernetes-validate's strict schemas are: an object schema that lists `properties` and allows nothing else
(no `additionalProperties`, no `x-kubernetes-preserve-unknown-fields`) refuses unknown fields. `metadata` is
left to the API server, as in the CRDs. CEL rules (`x-kubernetes-validations`) are not evaluated.

| schema | CRD | release |
|---|---|---|
| inference.networking.k8s.io_v1_inferencepool.json | config/crd/bases/inference.networking.k8s.io_inferencepools.yaml | kubernetes-sigs/gateway-api-inference-extension v1.6.0 |
| gateway.networking.k8s.io_v1_httproute.json | config/crd/standard/gateway.networking.k8s.io_httproutes.yaml | kubernetes-sigs/gateway-api v1.6.1 (standard channel) |

It also writes `llm-d-router_epp.json`, what the chart's endpoint picker settings are checked against, from
llm-d/llm-d-router v0.10.0 (the endpoint picker's home since the inference extension moved it there): the
`apiVersion`/`kind` and plugin types of the EndpointPickerConfig in its chart's default configuration
(`config/charts/routerlib/templates/_config.yaml`), the command-line flags its chart passes the endpoint picker
(`_deployment.yaml`), and the metric names its `core-metrics-extractor` reads for the `vllm` engine (the default;
`pkg/epp/framework/plugins/datalayer/extractor/metrics/factories.go`).

Usage (any clone of the two repositories with their tags; nothing is downloaded):
    python3 deploy/crds/make_crd_schemas.py --inference-extension PATH --gateway-api PATH --llm-d-router PATH [--check]
--check: exit 1 when a committed schema differs from what would be written.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
SOURCES = [
    ("inference_extension", "v1.6.0", "config/crd/bases/inference.networking.k8s.io_inferencepools.yaml", "v1",
     "inference.networking.k8s.io_v1_inferencepool.json"),
    ("gateway_api", "v1.6.1", "config/crd/standard/gateway.networking.k8s.io_httproutes.yaml", "v1",
     "gateway.networking.k8s.io_v1_httproute.json"),
]


def strict(schema, top=True):
    """A copy of `schema` where every object with `properties` refuses unknown fields."""
    if isinstance(schema, list):
        return [strict(s, False) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: strict(v, False) if k not in ("properties",) else {n: strict(p, False) for n, p in v.items()}
           for k, v in schema.items()}
    if ("properties" in out and "additionalProperties" not in out
            and not out.get("x-kubernetes-preserve-unknown-fields")):
        out["additionalProperties"] = False
    if top:
        out["properties"]["metadata"] = {"type": "object"}
    return out


ROUTER_TAG = "v0.10.0"
ROUTER_CONFIG = "config/charts/routerlib/templates/_config.yaml"
ROUTER_DEPLOYMENT = "config/charts/routerlib/templates/_deployment.yaml"
ROUTER_METRICS = "pkg/epp/framework/plugins/datalayer/extractor/metrics/factories.go"


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True).stdout


def router_facts(repo: Path) -> dict:
    """What the llm-d-router release says about its endpoint picker (see the module docs)."""
    config = git(repo, "show", f"{ROUTER_TAG}:{ROUTER_CONFIG}")
    default = config.split("default-plugins.yaml: |", 1)[1].split("payload-agnostic.yaml: |", 1)[0]
    api = sorted(set(re.findall(r"^\s*apiVersion: (\S+)\n\s*kind: EndpointPickerConfig$", default, re.M)))
    plugins = sorted(set(re.findall(r"^\s*- type: ([a-z][a-z0-9-]*)$", default, re.M)))
    flags = sorted(set(re.findall(r"^\s*- (--[a-z][a-z0-9-]*)", git(repo, "show", f"{ROUTER_TAG}:{ROUTER_DEPLOYMENT}"),
                                  re.M)))
    go = git(repo, "show", f"{ROUTER_TAG}:{ROUTER_METRICS}")
    vllm = re.search(r'Name:\s+"vllm",(.*?)\}', go, re.S).group(1)
    metrics = dict(re.findall(r'(\w+Spec):\s+"([^"]*)"', vllm))
    if len(api) != 1 or not plugins or not flags or not metrics:
        sys.exit(f"llm-d-router {ROUTER_TAG}: could not read {api}, {plugins}, {flags}, {metrics}")
    return {
        "$comment": f"llm-d/llm-d-router {ROUTER_TAG} ({git(repo, 'rev-parse', ROUTER_TAG + '^{commit}').strip()}): "
                    f"{ROUTER_CONFIG}, {ROUTER_DEPLOYMENT}, {ROUTER_METRICS}; deploy/crds/make_crd_schemas.py",
        "config_api_version": api[0],
        "default_plugin_types": plugins,
        "epp_flags": flags,
        "vllm_metrics": metrics,
    }


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--inference-extension", required=True, type=Path)
    ap.add_argument("--gateway-api", required=True, type=Path)
    ap.add_argument("--llm-d-router", required=True, type=Path)
    ap.add_argument("--check", action="store_true")
    args = ap.parse_args()
    stale, outputs = [], []
    for repo_arg, tag, path, version, out_name in SOURCES:
        repo = getattr(args, repo_arg)
        commit = git(repo, "rev-parse", f"{tag}^{{commit}}").strip()
        crd = yaml.safe_load(git(repo, "show", f"{tag}:{path}"))
        served = [v for v in crd["spec"]["versions"] if v["name"] == version and v.get("served")]
        if not served:
            sys.exit(f"{path} at {tag}: no served version {version}")
        schema = strict(served[0]["schema"]["openAPIV3Schema"])
        schema["$comment"] = (f"openAPIV3Schema of {crd['spec']['names']['kind']} {crd['spec']['group']}/{version} "
                              f"from {path} at {tag} ({commit}), strict: deploy/crds/make_crd_schemas.py")
        outputs.append((out_name, schema, f"{tag} {commit[:12]}"))
    outputs.append(("llm-d-router_epp.json", router_facts(args.llm_d_router), ROUTER_TAG))
    for out_name, doc, source in outputs:
        text = json.dumps(doc, indent=1, sort_keys=True) + "\n"
        out = HERE / out_name
        if args.check:
            if not out.exists() or out.read_text() != text:
                stale.append(out_name)
        else:
            out.write_text(text)
            print(f"wrote deploy/crds/{out_name} ({len(text):,} B) from {source}")
    if stale:
        print(f"stale: {stale}; run deploy/crds/make_crd_schemas.py", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
