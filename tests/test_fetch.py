"""Preparing a default-pair model from its cached GGUF when an engine first loads it, with the tiny
pair's GGUF standing in for the default pair (it carries the real Qwen2.5 tokenizer,
tests/tiny_gguf.py): the llama.cpp engine needs the tokenizer files and no conversion; the
transformers engine converts once, under the model's lock; both describe the same tokenizer."""

from __future__ import annotations

import hashlib
import json
import shutil
import threading
import time
from pathlib import Path

import pytest

from specd.model import fetch as fetching
from specd.model import progress, store
from specd.model.fetch import resolve_model, resolve_tokenizer
from specd.model.loading import load_engine, load_model
from specd.model.store import ModelNotFetchedError, ModelSpec


def _spec_of(gguf: Path) -> ModelSpec:
    data = gguf.read_bytes()
    return ModelSpec(
        role="target",
        name="tiny-target",
        package_prefix="tiny-target-part",
        parts=1,
        version="1.0.0",
        sha256=hashlib.sha256(data).hexdigest(),
        size=len(data),
        description="the tiny target as a float32 GGUF",
    )


@pytest.fixture
def tiny_in_cache(tiny_gguf, tmp_path, monkeypatch) -> ModelSpec:
    """A cache holding the tiny target's GGUF as a fetch would leave it, and no more: the default
    pair is the tiny target alone (as `target` or `tiny-target`)."""
    spec = _spec_of(tiny_gguf["target"])
    monkeypatch.setenv("SPECD_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(store, "DEFAULT_PAIR", (spec,))
    store.gguf_path(spec).parent.mkdir(parents=True)
    shutil.copyfile(tiny_gguf["target"], store.gguf_path(spec))
    monkeypatch.setattr(fetching, "download_wheels", lambda *a, **k: pytest.fail("loading must not download"))
    return spec


def _count_calls(monkeypatch, name: str) -> list[Path]:
    calls, real = [], getattr(fetching, name)

    def counted(gguf: Path, out_dir: Path) -> None:
        calls.append(out_dir)
        real(gguf, out_dir)

    monkeypatch.setattr(fetching, name, counted)
    return calls


def test_the_engines_load_an_unconverted_name_and_agree_on_its_tokenizer(tiny_in_cache, tiny_dirs, monkeypatch, capfd):
    spec = tiny_in_cache
    tokenizers, conversions = _count_calls(monkeypatch, "save_tokenizer"), _count_calls(monkeypatch, "convert_gguf")

    llama = load_engine("target", "target", engine="llama.cpp")  # the default on a CPU: no conversion
    assert len(tokenizers) == 1 and conversions == []
    assert store.is_fetched(spec) and not store.model_dir(spec).exists()

    transformers = load_engine("target", "target", "float32", engine="transformers")  # converts, once
    err = capfd.readouterr().err
    assert "converting tiny-target from GGUF to float32 safetensors" in err and "done converting tiny-target" in err
    assert len(conversions) == 1 and store.is_converted(spec)
    load_model("tiny-target", "float32")
    assert len(conversions) == 1 and len(tokenizers) == 1  # the tokenizer was copied, not read again

    # The draft and the target compare these: one model must describe itself alike on both engines,
    # and alike from the GGUF and from a plain HF folder of the same tokenizer.
    hf = load_engine("target", str(tiny_dirs["target"]), "float32", engine="transformers")
    for engine in (llama, transformers):
        assert engine.description.tokenizer_fingerprint == hf.description.tokenizer_fingerprint
        assert engine.description.eos_token_ids == hf.description.eos_token_ids
    assert transformers.description.vocab_size == hf.description.vocab_size


def _fetched_without_reading_the_gguf(spec: ModelSpec, tiny_dirs) -> None:
    """The tokenizer folder as fetch leaves it, copied from the tiny model (reading a GGUF's
    tokenizer takes seconds)."""
    folder = store.tokenizer_dir(spec)
    folder.mkdir(parents=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(tiny_dirs["target"] / name, folder / name)
    manifest = {"name": spec.name, "role": spec.role, "gguf_sha256": spec.sha256, "verified": True}
    (folder / store.MANIFEST_NAME).write_text(json.dumps(manifest))


def test_concurrent_loads_convert_once_and_publish_whole(tiny_in_cache, tiny_dirs, monkeypatch):
    spec = tiny_in_cache
    _fetched_without_reading_the_gguf(spec, tiny_dirs)
    started = []

    def slow_convert(gguf: Path, out_dir: Path) -> None:
        started.append(out_dir)
        time.sleep(0.5)  # long enough for the other thread to find the lock taken
        (out_dir / "config.json").write_text("{}")

    monkeypatch.setattr(fetching, "convert_gguf", slow_convert)
    results, errors = [], []

    def load() -> None:
        try:
            results.append(resolve_model("target"))
        except Exception as error:  # noqa: BLE001 - reported below
            errors.append(error)

    threads = [threading.Thread(target=load) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == [] and results == [str(store.model_dir(spec))] * 3
    assert len(started) == 1
    assert sorted(p.name for p in store.model_dir(spec).iterdir()) == sorted(
        ["config.json", "tokenizer.json", "tokenizer_config.json", store.MANIFEST_NAME]
    )
    assert [p.name for p in store.model_dir(spec).parent.iterdir()] == [spec.name]  # no temp left


def test_one_conversion_at_a_time_of_any_model(tiny_in_cache, tiny_dirs, monkeypatch, capfd):
    """Two services loading two models at once convert one after the other: each takes GBs."""
    spec = tiny_in_cache
    _fetched_without_reading_the_gguf(spec, tiny_dirs)
    converting = threading.Event()
    release = threading.Event()

    def other_conversion() -> None:  # another model's conversion, holding the lock
        with fetching._lock("conversion"):
            converting.set()
            release.wait(5)

    monkeypatch.setattr(fetching, "convert_gguf", lambda gguf, out_dir: (out_dir / "config.json").write_text("{}"))
    other = threading.Thread(target=other_conversion)
    other.start()
    converting.wait(5)
    waiting = threading.Thread(target=resolve_model, args=("target",))
    waiting.start()
    time.sleep(0.5)
    assert not store.is_converted(spec)  # it waits for the other conversion
    release.set()
    other.join()
    waiting.join()
    assert store.is_converted(spec)
    assert "waiting for another process's conversion to finish" in capfd.readouterr().err


def test_a_missing_gguf_still_says_fetch_and_a_corrupted_one_is_not_used(tiny_in_cache, monkeypatch):
    spec = tiny_in_cache
    monkeypatch.setattr(fetching, "convert_gguf", lambda *a: pytest.fail("converted a bad GGUF"))
    gguf = store.gguf_path(spec)
    data = bytearray(gguf.read_bytes())
    data[-1] ^= 0xFF
    gguf.write_bytes(bytes(data))
    with pytest.raises(store.ModelFetchError, match="does not match its sha256: run `specd models fetch`"):
        resolve_model("target")
    gguf.unlink()
    for resolve in (resolve_model, resolve_tokenizer):
        with pytest.raises(ModelNotFetchedError, match="specd models fetch"):
            resolve("target")
    with pytest.raises(ModelNotFetchedError, match="specd models fetch"):
        load_model("target", "float32")


def test_progress_in_a_log_is_a_line_at_least_every_interval(monkeypatch, capsys):
    monkeypatch.setattr(progress, "LOG_LINE_SECONDS", 0.05)
    with progress.progress_bar(True, total=3, desc="download fake") as bar:  # capsys: stderr is no tty
        time.sleep(0.3)  # nothing advances (pip between two parts): the ticker still writes lines
        bar.update(3)
    lines = capsys.readouterr().err
    assert "\r" not in lines and lines.endswith("\n")
    assert lines.count("download fake") >= 4 and "3/3" in lines.splitlines()[-1]

    said = []
    with progress.timed_step(said.append, "converting fake"):
        time.sleep(0.2)
    assert any(line.startswith("still converting fake: ") and "resident" in line for line in said)
    assert said[-1].startswith("done converting fake in ") and "peak resident memory" in said[-1]


@pytest.mark.parametrize("output", [True, False], ids=["untied", "tied"])
def test_the_conversion_writes_what_transformers_own_path_writes(tiny_dirs, tmp_path, monkeypatch, output):
    """model/convert.py, one shard at a time (several here), against transformers' from_pretrained
    (GgufConfig(dequantize=True)) and save_pretrained: the same tensors bit for bit under the same
    names, the same config and generation config; and the converted folder loads and scores alike."""
    import torch
    from safetensors.torch import load_file
    from tiny_gguf import write_tiny_gguf
    from transformers import AutoModelForCausalLM, GgufConfig

    from specd.model import convert

    (tmp_path / "gguf").mkdir()
    gguf = write_tiny_gguf(tiny_dirs["target"], tmp_path / "gguf" / "model.gguf", [], output)  # no tokenizer
    reference = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32, quantization_config=GgufConfig(dequantize=True)
    )
    monkeypatch.setattr(convert, "SHARD_BYTES", 16 * 1024 * 1024)  # the embedding alone is 39 MB
    (tmp_path / "ours").mkdir()
    convert.convert_gguf(gguf, tmp_path / "ours")
    shards = sorted((tmp_path / "ours").glob("model-*.safetensors"))
    assert len(shards) >= 2
    ours = {name: tensor for shard in shards for name, tensor in load_file(shard).items()}
    expected = {name: tensor for name, tensor in reference.state_dict().items()}
    if not output:
        assert reference.config.tie_word_embeddings and "lm_head.weight" not in ours
        expected.pop("lm_head.weight")
    assert ours.keys() == expected.keys()
    for name, tensor in expected.items():
        assert ours[name].dtype == torch.float32 and torch.equal(ours[name], tensor), name
    reference.save_pretrained(tmp_path / "reference")  # what the conversion wrote before
    for name in ("config.json", "generation_config.json"):
        ours_json, theirs = (json.loads((tmp_path / folder / name).read_text()) for folder in ("ours", "reference"))
        theirs.pop("quantization_config", None)  # the GGUF's, which the old path dropped after saving
        assert ours_json == theirs, name
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "ours", dtype=torch.float32)
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.inference_mode():
        assert torch.equal(loaded(ids).logits, reference(ids).logits)
