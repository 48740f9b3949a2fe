"""The architecture holds by construction (docs/architecture.md §1).

- The import contracts in pyproject.toml ([tool.importlinter]): the services never import each
  other or the orchestrator, the orchestrator never imports the model package or torch, the model
  package has no gRPC, the wire contract depends on nothing else of specd, nothing imports cli/.
- The code is linted and formatted (ruff, configured in pyproject.toml).
- The client side of specd runs without torch: a fresh interpreter that imports every module of
  the orchestrator, the wire contract, deploy, the load tester and the command line, and parses the
  client commands, has not loaded torch or transformers (each would cost seconds at every start).
"""

import ast
import json
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HEAVY = ("torch", "transformers", "torchao", "accelerate", "specd.model", "specd.serving")

# Every module of these packages, then the CLI's client commands as a user types them.
CLIENT_SIDE = r"""
import importlib, json, pkgutil, sys
packages = ["specd.v1", "specd.proto", "specd.orchestrator", "specd.deploy", "specd.cli"]
modules = ["specd.bench.loadtest", "specd.bench.loadtest_report", "specd.bench.report"]
for name in packages:
    package = importlib.import_module(name)
    modules += [info.name for info in pkgutil.walk_packages(package.__path__, name + ".")
                if not info.name.endswith("__main__")]
for name in modules:
    importlib.import_module(name)
from specd.cli import build_parser
for argv in (["generate", "hi", "--server", "127.0.0.1:1"], ["loadtest", "--server", "127.0.0.1:1"],
             ["serve", "orchestrator", "--draft", "a:1", "--target", "b:2"], ["up", "--ray-address", "auto"]):
    build_parser().parse_args(argv)
print(json.dumps({"modules": modules, "loaded": sorted(sys.modules)}))
"""


def tool(name: str) -> str:
    found = shutil.which(name, path=str(Path(sys.executable).parent))
    assert found, f"{name} is a test dependency: run scripts/setup.sh"
    return found


def test_the_import_contracts_hold():
    run = subprocess.run([tool("lint-imports"), "--no-cache"], cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "0 broken" in run.stdout, run.stdout


def test_the_client_side_loads_no_torch():
    run = subprocess.run([sys.executable, "-c", CLIENT_SIDE], cwd="/", capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    report = json.loads(run.stdout.splitlines()[-1])
    assert "specd.orchestrator.generation" in report["modules"] and "specd.cli.generate" in report["modules"]
    heavy = [name for name in report["loaded"] if name in HEAVY or name.startswith(tuple(f"{h}." for h in HEAVY))]
    assert heavy == [], f"the client side imported {heavy}"


def test_the_code_is_linted_and_formatted():
    lint = subprocess.run([tool("ruff"), "check", "--no-cache", "."], cwd=ROOT, capture_output=True, text=True)
    assert lint.returncode == 0, lint.stdout + lint.stderr
    formatted = subprocess.run(
        [tool("ruff"), "format", "--check", "--no-cache", "."], cwd=ROOT, capture_output=True, text=True
    )
    assert formatted.returncode == 0, f"run `.venv/bin/ruff format .`:\n{formatted.stdout}{formatted.stderr}"


COMPONENTS = ("cli", "bench", "deploy", "orchestrator", "draft_service", "target_service", "serving", "model", "proto")


def imported_components() -> set[tuple[str, str]]:
    """(component, component it imports) over every module of every component folder, lazy imports
    inside functions included; specd.v1 (the generated stubs) is proto/'s."""
    arrows = set()
    for component in COMPONENTS:
        for path in (ROOT / component).rglob("*.py"):
            if path.name.endswith(("_pb2.py", "_pb2_grpc.py")):
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Import):
                    names = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                else:
                    continue
                for name in names:
                    parts = name.split(".")
                    if parts[0] == "specd" and len(parts) > 1:
                        other = "proto" if parts[1] == "v1" else parts[1]
                        if other in COMPONENTS and other != component:
                            arrows.add((component, other))
    return arrows


def test_the_architecture_page_draws_the_import_graph():
    """docs/architecture.md §1's block of floors is the component import graph the code has."""
    page = (ROOT / "docs" / "architecture.md").read_text()
    block = page.split("<!-- the component import graph: tests/test_layering.py checks it -->\n```text\n", 1)[1]
    drawn, floors = set(), []
    for line in block.split("```", 1)[0].splitlines():
        if "-->" not in line:
            continue
        component, imports = (part.strip() for part in line.split("(", 1)[0].split("-->"))
        floors.append(component)
        if imports != "nothing of specd":
            drawn |= {(component, other.strip()) for other in imports.split(",")}
    assert sorted(floors) == sorted(COMPONENTS), floors
    derived = imported_components()
    assert drawn == derived, f"drawn, not in the code: {drawn - derived}; in the code, not drawn: {derived - drawn}"
    assert all(floors.index(a) < floors.index(b) for a, b in derived), "an arrow points up a floor"
