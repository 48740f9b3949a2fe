"""The Kubernetes manifests and the Dockerfiles under deploy/, checked without a cluster or a Docker engine.

Core objects (Service, and every pod template as a PodTemplate) are validated strictly against the
Kubernetes OpenAPI schemas by kubernetes-validate; the KubeRay objects (RayCluster, RayJob) are
checked for the fields KubeRay requires and for what specd needs of them; commands are parsed by
specd's own command line.
"""

import json
import shlex
import shutil
import subprocess
import sys
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
    template = {
        "apiVersion": "v1",
        "kind": "PodTemplate",
        "metadata": {"name": group},
        "template": groups[group]["template"],
    }
    kubernetes_validate.validate(template, K8S_VERSION, strict=True)
    image = groups[group]["template"]["spec"]["containers"][0]["image"]
    assert image.startswith("specd-orchestrator:" if group == "head" else "specd:")  # the head needs no torch


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


@pytest.mark.parametrize("role", ["service", "orchestrator"])
def test_each_role_has_a_dockerfile_that_installs_components_and_runs_a_real_command(role):
    lines = dockerfile_instructions(ROOT / "deploy" / f"{role}.Dockerfile")
    assert lines[0][0] == "FROM" and lines[0][1].startswith("python:3.11")  # pyproject: requires-python 3.11
    copied = [args.split()[0] for kind, args in lines if kind == "COPY"]
    for path in copied:
        assert (ROOT / path / "pyproject.toml").exists(), f"the Dockerfile copies {path}, not a component folder"
    installed = installed_components(lines)
    assert installed == set(copied), "every copied component is installed, and only those"
    assert {"proto", "orchestrator", "cli"} <= installed
    if role == "service":
        assert {"model", "serving", "draft_service", "target_service"} <= installed
        assert "specd models fetch" in " ".join(args for kind, args in lines if kind == "RUN")  # as scripts/run.sh
    command = json.loads(next(args for kind, args in lines if kind == "CMD"))
    args = specd_command(shlex.join(command))
    assert args.verb in {"up", "generate", "serve"}


def test_the_orchestrator_image_pulls_in_no_torch():
    """What the orchestrator image installs, with every component it depends on, names no torch,
    transformers or model component (its build also checks that no torch got installed)."""
    installed = installed_components(dockerfile_instructions(ROOT / "deploy" / "orchestrator.Dockerfile"))
    closure = dependency_closure(installed)
    assert installed >= {component_folder(name) for name in closure if name.startswith("specd-")}, (
        "the image must install every specd component its components depend on"
    )
    assert not closure & {"torch", "transformers", "torchao", "accelerate", "specd-model", "specd-serving"}


def installed_components(lines: list[tuple[str, str]]) -> set[str]:
    """The component folders a Dockerfile's RUN lines pip-install (`./proto ./orchestrator ...`)."""
    words = " ".join(args for kind, args in lines if kind == "RUN" and "pip install" in args).split()
    return {word.removeprefix("./") for word in words if word.startswith("./")}


def component_folder(distribution: str) -> str:
    """specd-draft-service -> draft_service."""
    return distribution.removeprefix("specd-").replace("-", "_")


def dependency_closure(components: set[str]) -> set[str]:
    """Names of every distribution the components depend on, following specd's own components."""
    import tomllib

    seen, todo = set(), [f"specd-{c.replace('_', '-')}" for c in components]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        if name.startswith("specd-"):
            project = tomllib.loads((ROOT / component_folder(name) / "pyproject.toml").read_text())["project"]
            todo += [dep.split("==")[0].split("[")[0].strip() for dep in project["dependencies"]]
    return seen


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


def test_the_orchestrator_role_installs_and_runs_without_torch(tmp_path):
    """What orchestrator.Dockerfile does, for real in a fresh venv (no Docker engine here): pip-install
    its components from this checkout, then the client commands run, and a model command says what
    is missing instead of a traceback."""
    components = sorted(installed_components(dockerfile_instructions(ROOT / "deploy" / "orchestrator.Dockerfile")))
    for component in components:  # a copy, as `COPY` makes: pip's in-tree build leaves build/ behind
        shutil.copytree(ROOT / component, tmp_path / component, ignore=shutil.ignore_patterns("build", "*.egg-info"))
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python, specd = venv / "bin" / "python", venv / "bin" / "specd"
    install = subprocess.run(
        [python, "-m", "pip", "install", "--quiet", *[f"./{c}" for c in components]],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert install.returncode == 0, install.stderr[-3000:]
    probe = subprocess.run(
        [python, "-c", "import importlib.util as u; print([m for m in ('torch', 'transformers') if u.find_spec(m)])"],
        capture_output=True,
        text=True,
    )
    assert probe.stdout.strip() == "[]", "the orchestrator role installed torch or transformers"
    for argv in (["generate", "--help"], ["serve", "orchestrator", "--help"], ["loadtest", "--help"]):
        run = subprocess.run([specd, *argv], capture_output=True, text=True, timeout=60)
        assert run.returncode == 0, run.stderr
    models = subprocess.run([specd, "models", "list"], capture_output=True, text=True, timeout=60)
    assert models.returncode == 2 and "specd.model" in models.stderr and "Traceback" not in models.stderr
