"""The Kubernetes manifests and the Dockerfile under deploy/, checked without a cluster or a Docker engine.

Core objects (Service, and every pod template as a PodTemplate) are validated strictly against the
Kubernetes OpenAPI schemas by kubernetes-validate; the KubeRay objects (RayCluster, RayJob) are
checked for the fields KubeRay requires and for what specd needs of them; commands are parsed by
specd's own command line.
"""

import json
import shlex
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from specd.cli import build_parser
from specd.cli.serve import DEFAULT_PORTS

ROOT = Path(__file__).resolve().parent.parent
KUBERAY = ROOT / "deploy" / "kuberay"
K8S_VERSION = kubernetes_validate.latest_version()


def manifests() -> list[dict]:
    return [doc for path in sorted(KUBERAY.glob("*.yaml")) for doc in yaml.safe_load_all(path.read_text()) if doc]


def of_kind(kind: str) -> list[dict]:
    found = [doc for doc in manifests() if doc["kind"] == kind]
    assert found, f"no {kind} under deploy/kuberay"
    return found


def specd_command(command: str):
    """argv parsed by specd's own parser (a typo or an unknown flag fails here)."""
    argv = shlex.split(command)
    assert argv[0] == "specd"
    return build_parser().parse_args(argv[1:])


def ray_resources(group: dict) -> dict:
    """KubeRay's rayStartParams.resources: a JSON object inside a quoted string."""
    return json.loads(json.loads(group["rayStartParams"]["resources"]))


def test_core_objects_validate_against_the_kubernetes_schema():
    core = [doc for doc in manifests() if "." not in doc["apiVersion"].split("/")[0]]  # no API group: built in
    assert {doc["kind"] for doc in core} >= {"Service"}
    for doc in core:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


@pytest.mark.parametrize("group", ["head", "target-gpu", "draft-cpu"])
def test_every_pod_template_is_a_valid_pod_template(group):
    cluster = of_kind("RayCluster")[0]["spec"]
    groups = {"head": cluster["headGroupSpec"], **{g["groupName"]: g for g in cluster["workerGroupSpecs"]}}
    template = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": group},
                "template": groups[group]["template"]}
    kubernetes_validate.validate(template, K8S_VERSION, strict=True)
    assert groups[group]["template"]["spec"]["containers"][0]["image"].startswith("specd:")


def test_raycluster_has_kuberays_required_fields_and_specds_node_kinds():
    cluster = of_kind("RayCluster")[0]
    assert cluster["apiVersion"] == "ray.io/v1" and cluster["metadata"]["name"]
    head = cluster["spec"]["headGroupSpec"]
    assert isinstance(head["rayStartParams"], dict) and head["template"]["spec"]["containers"]
    assert ray_resources(head) == {"orchestrator": 1}
    workers = {group["groupName"]: group for group in cluster["spec"]["workerGroupSpecs"]}
    for group in workers.values():
        assert group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]
        assert group["template"]["spec"]["containers"]
    target, draft = workers["target-gpu"], workers["draft-cpu"]
    assert ray_resources(target) == {"target": 1} and ray_resources(draft) == {"draft": 1}
    target_limits = target["template"]["spec"]["containers"][0]["resources"]["limits"]
    draft_limits = draft["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert int(target_limits["nvidia.com/gpu"]) >= 1 and "nvidia.com/gpu" not in draft_limits


def test_rayjob_deploys_specd_onto_that_cluster_and_the_service_exposes_it():
    cluster = of_kind("RayCluster")[0]["metadata"]["name"]
    job = of_kind("RayJob")[0]
    assert job["spec"]["clusterSelector"] == {"ray.io/cluster": cluster}
    args = specd_command(job["spec"]["entrypoint"])
    assert args.verb == "up" and args.ray_address == "auto"
    assert (args.draft_port, args.target_port) == (DEFAULT_PORTS["draft"], DEFAULT_PORTS["target"])
    service = of_kind("Service")[0]
    assert service["spec"]["selector"] == {"ray.io/cluster": cluster, "ray.io/node-type": "head"}
    assert {port["port"] for port in service["spec"]["ports"]} == {args.port, args.http_port, args.metrics_port}


def test_dockerfile_installs_what_the_readme_install_does_and_runs_a_real_command():
    lines = dockerfile_instructions(ROOT / "deploy" / "Dockerfile")
    assert lines[0][0] == "FROM" and lines[0][1].startswith("python:3.11")  # pyproject: requires-python 3.11
    copied = [args.split()[0] for kind, args in lines if kind == "COPY"]
    for path in copied:
        assert (ROOT / path).exists(), f"the Dockerfile copies {path}, which is not in the repository"
    assert {"pyproject.toml", "specd"} <= set(copied)
    installs = " ".join(args for kind, args in lines if kind == "RUN")
    assert "pip install" in installs and " . " in installs  # the project itself, with pyproject's exact pins
    assert "specd models fetch" in installs  # the default pair, as scripts/run.sh does
    command = json.loads(next(args for kind, args in lines if kind == "CMD"))
    args = specd_command(shlex.join(command))
    assert args.verb in {"up", "generate", "serve"}


def dockerfile_instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    joined, instructions = "", []
    for line in path.read_text().splitlines():
        if line.lstrip().startswith("#") or not line.strip():
            continue
        joined += line.rstrip("\\").strip() + " "
        if not line.endswith("\\"):
            kind, _, args = joined.strip().partition(" ")
            instructions.append((kind.upper(), args.strip()))
            joined = ""
    return instructions
