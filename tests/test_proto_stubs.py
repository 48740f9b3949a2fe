"""The committed stubs in proto/specd/v1/ are exactly what proto/generate.sh makes from the .proto files."""

import difflib
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
COMMITTED = ROOT / "proto" / "specd" / "v1"
STUB_NAME = re.compile(r".+_pb2(_grpc)?\.pyi?")
FIX = "the committed stubs are stale: run proto/generate.sh (with the project's .venv) and commit proto/specd/v1/"


def _stub_files(folder: Path) -> set[str]:
    return {path.name for path in folder.iterdir() if path.is_file() and STUB_NAME.fullmatch(path.name)}


def test_committed_stubs_match_generated_ones(tmp_path):
    run = subprocess.run(
        ["bash", str(ROOT / "proto" / "generate.sh"), str(tmp_path)],
        env={**os.environ, "PYTHON": sys.executable},
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, f"proto/generate.sh failed ({run.returncode}):\n{run.stdout}{run.stderr}"
    generated_dir = tmp_path / "specd" / "v1"
    generated = sorted(path for path in generated_dir.rglob("*") if path.is_file())
    assert generated, f"proto/generate.sh wrote nothing under {generated_dir}"

    problems = []
    for path in generated:
        relative = path.relative_to(generated_dir)
        committed = COMMITTED / relative
        if not committed.is_file():
            problems.append(f"proto/specd/v1/{relative} is missing")
        elif committed.read_bytes() != path.read_bytes():
            diff = difflib.unified_diff(
                committed.read_text(errors="replace").splitlines(),
                path.read_text(errors="replace").splitlines(),
                f"committed proto/specd/v1/{relative}",
                f"generated proto/specd/v1/{relative}",
                lineterm="",
                n=1,
            )
            problems.append(f"proto/specd/v1/{relative} differs:\n" + "\n".join(list(diff)[:20]))

    orphans = _stub_files(COMMITTED) - {path.name for path in generated if path.parent == generated_dir}
    problems += [f"proto/specd/v1/{name} has no .proto source (delete it)" for name in sorted(orphans)]

    assert not problems, f"{FIX}\n" + "\n".join(problems)
