"""deploy/k8s/ validated offline: the core objects against Kubernetes' own schemas (strict: unknown
fields refused), the InferencePool against the schema of its published CRD (deploy/k8s/schemas/),
and the objects against each other and against the server they run."""

from __future__ import annotations

import copy
import json
from importlib import resources
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml
from referencing import Registry, Resource

from pie.service.cli import build_parser
from pie.service.servicer import SERVICE_NAME
from tests.deploy.deploy_readme import command, run

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
CORE = ["deployment.yaml", "service.yaml", "pdb.yaml"]
# The oldest Kubernetes the manifests are for (the preStop `sleep` action is on by default from
# 1.30), and the newest kubernetes-validate knows.
VERSIONS = ["1.30.0", kubernetes_validate.utils.latest_version()]
POOL_SCHEMA = K8S / "schemas" / "inferencepool-v1.json"
# The CRD's CEL rules (x-kubernetes-validations), which JSON schema cannot say: _cel_errors checks them.
CEL_RULES = {
    "self.kind != 'Service' || has(self.port)",
    "self.all(p1, self.exists_one(p2, p1.number==p2.number))",
}


def _docs(name: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all((K8S / name).read_text()) if d]


def _one(kind: str) -> dict[str, Any]:
    found = [d for name in [*CORE, "inferencepool.yaml"] for d in _docs(name) if d["kind"] == kind]
    assert len(found) == 1, kind
    return found[0]


def test_every_file_is_named_here() -> None:
    assert sorted(p.name for p in K8S.glob("*.yaml")) == sorted([*CORE, "inferencepool.yaml"])


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("name", CORE)
def test_core_objects_are_valid_kubernetes(name: str, version: str) -> None:
    for doc in _docs(name):
        kubernetes_validate.validate(doc, version, strict=True)


def test_the_strict_validation_refuses_what_kubernetes_would() -> None:
    deployment = copy.deepcopy(_one("Deployment"))
    deployment["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["grpc"]["serviceName"] = "x"
    with pytest.raises(kubernetes_validate.ValidationError, match="serviceName"):
        kubernetes_validate.validate(deployment, VERSIONS[-1], strict=True)
    service = copy.deepcopy(_one("Service"))
    service["spec"]["ports"][0]["port"] = "50051"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(service, VERSIONS[-1], strict=True)


@pytest.mark.slow  # a subprocess
def test_the_readme_validate_command() -> None:
    done = run(command("kubernetes-validate "), {})
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("passed") == sum(len(_docs(name)) for name in CORE), done.stdout


def _strict(schema: Any) -> Any:
    """The schema with unknown fields refused wherever it lists the fields (as `kubectl apply`'s
    strict field validation does); x-kubernetes-* keys, which JSON schema ignores, are kept."""
    if isinstance(schema, dict):
        out = {k: _strict(v) for k, v in schema.items()}
        if "properties" in out and "additionalProperties" not in out:
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [_strict(v) for v in schema]
    return schema


def _cel_rules(schema: Any) -> set[str]:
    if isinstance(schema, dict):
        found = {r["rule"] for r in schema.get("x-kubernetes-validations", [])}
        return found.union(*(_cel_rules(v) for v in schema.values()))
    if isinstance(schema, list):
        return set().union(*(_cel_rules(v) for v in schema))
    return set()


def _cel_errors(pool: dict[str, Any]) -> list[str]:
    """The CRD's CEL rules, checked as the API server would (with the schema's defaults)."""
    errors = []
    ref = pool["spec"]["endpointPickerRef"]
    if ref.get("kind", "Service") == "Service" and "port" not in ref:
        errors.append("endpointPickerRef: port is required when kind is 'Service'")
    numbers = [p["number"] for p in pool["spec"]["targetPorts"]]
    if len(set(numbers)) != len(numbers):
        errors.append("targetPorts: port number must be unique")
    return errors


def _pool_errors(pool: dict[str, Any]) -> list[str]:
    """Everything wrong with an InferencePool: its schema (strict), its metadata (Kubernetes'
    ObjectMeta) and the CEL rules."""
    schema = _strict(json.loads(POOL_SCHEMA.read_text()))
    errors = [f"{'.'.join(map(str, e.path))}: {e.message}"
              for e in jsonschema.Draft202012Validator(schema).iter_errors(pool)]
    version = f"v{VERSIONS[-1]}-local-strict"
    defs = json.loads(resources.files("kubernetes_validate").joinpath(
        f"kubernetes-json-schema/{version}/_definitions.json").read_text())
    registry = Registry().with_resource(defs["$id"], Resource.from_contents(defs))
    meta = {"$ref": f"{defs['$id']}#/$defs/io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta"}
    errors += [f"metadata: {e.message}"
               for e in jsonschema.Draft202012Validator(meta, registry=registry).iter_errors(pool["metadata"])]
    return errors + _cel_errors(pool)


def test_the_inference_pool_matches_the_published_crd() -> None:
    pool = _one("InferencePool")
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    assert _cel_rules(json.loads(POOL_SCHEMA.read_text())) == CEL_RULES  # a new rule needs its check
    assert _pool_errors(pool) == []


@pytest.mark.parametrize(("change", "error"), [
    (lambda p: p["spec"].update(targetPort=[{"number": 8000}]), "Additional properties"),
    (lambda p: p["spec"]["targetPorts"].append({"number": 8000}), "port number must be unique"),
    (lambda p: p["spec"]["targetPorts"][0].update(number=70000), "70000"),
    (lambda p: p["spec"]["endpointPickerRef"].pop("port"), "port is required"),
    (lambda p: p["spec"]["endpointPickerRef"].update(failureMode="FailSoft"), "FailSoft"),
    (lambda p: p["spec"].update(appProtocol="grpc"), "'grpc' is not one of"),
    (lambda p: p["spec"].pop("selector"), "'selector' is a required property"),
    (lambda p: p["metadata"].update(label={"a": "b"}), "metadata: Additional properties"),
])
def test_the_pool_validation_refuses_broken_pools(change, error: str) -> None:
    pool = copy.deepcopy(_one("InferencePool"))
    change(pool)
    assert any(error in e for e in _pool_errors(pool)), _pool_errors(pool)


def _container() -> dict[str, Any]:
    (container,) = _one("Deployment")["spec"]["template"]["spec"]["containers"]
    return container


def _serve_args() -> Any:
    container = _container()
    assert container["command"] == ["pie"] and container["args"][0] == "serve"
    return build_parser().parse_args(container["args"])  # an unknown flag or a bad value exits


def test_the_objects_select_the_pods_and_name_their_ports() -> None:
    deployment = _one("Deployment")
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
    for kind in ("Service", "PodDisruptionBudget", "InferencePool"):
        spec = _one(kind)["spec"]
        selector = spec["selector"] if kind == "Service" else spec["selector"]["matchLabels"]
        assert selector.items() <= labels.items(), kind
    service = _one("Service")
    assert service["spec"]["clusterIP"] == "None"  # headless: DNS names every ready pod
    ports = {p["name"]: p["containerPort"] for p in _container()["ports"]}
    assert {p["targetPort"]: p["port"] for p in service["spec"]["ports"]} == ports
    args = _serve_args()
    assert ports == {"grpc": args.port, "http": args.http_port, "metrics": args.metrics_port}
    assert args.host == "0.0.0.0"  # the kubelet's probes and the other pods reach it
    assert [p["number"] for p in _one("InferencePool")["spec"]["targetPorts"]] == [args.http_port]


def test_the_probes_ask_the_servers_health_services() -> None:
    container, args = _container(), _serve_args()
    for probe in ("startupProbe", "readinessProbe"):
        assert container[probe]["grpc"] == {"port": args.port, "service": SERVICE_NAME}, probe
    assert container["livenessProbe"]["grpc"] == {"port": args.port, "service": ""}
    assert container["startupProbe"]["periodSeconds"] * container["startupProbe"]["failureThreshold"] >= 600
    pod = _one("Deployment")["spec"]["template"]["spec"]
    pause = container["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert pod["terminationGracePeriodSeconds"] > pause + args.grace  # the drain ends before SIGKILL


def test_the_pool_reads_metrics_the_server_exports() -> None:
    source = (ROOT / "service" / "metrics.py").read_text()
    for name in ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc"):
        assert f'"{name}"' in source, name
        assert name in (K8S / "inferencepool.yaml").read_text(), name
