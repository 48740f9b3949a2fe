"""A loaded model and the tokenizer helpers its engines share: what the engine factory
(loading.py) hands the engines, kept apart from it so that the engines import this and not the
factory that imports them."""

import hashlib
import json
import tempfile
import weakref
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import torch
from transformers import AutoTokenizer, GenerationConfig, PreTrainedModel, PreTrainedTokenizerBase


@dataclass
class LoadedModel:
    name: str  # the default pair's model name for a role (`target`), else as the user named it
    path: str  # where it was loaded from
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    dtype: torch.dtype
    quantization: str = "none"

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def vocab_size(self) -> int:
        return self.model.get_output_embeddings().weight.shape[0]

    @property
    def max_positions(self) -> int:
        return int(getattr(self.model.config, "max_position_embeddings", 32768))

    @property
    def eos_token_ids(self) -> list[int]:
        ids = self.model.generation_config.eos_token_id if self.model.generation_config else None
        ids = ids if ids is not None else self.tokenizer.eos_token_id
        ids = ids if isinstance(ids, list) else [ids] if ids is not None else []
        return sorted(set(ids))


def tokenizer_fingerprint(tokenizer: PreTrainedTokenizerBase) -> str:
    """sha256 over the vocabulary and special tokens: equal means the two sides agree on ids. Computed
    once per tokenizer object (0.3 s for Qwen2.5's 151,646 tokens); nothing here changes a vocabulary."""
    if (known := _FINGERPRINTS.get(tokenizer)) is None:
        vocab = sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])
        special = sorted(str(token) for token in tokenizer.all_special_tokens)
        known = _FINGERPRINTS[tokenizer] = hashlib.sha256(json.dumps([vocab, special]).encode()).hexdigest()
    return known


_FINGERPRINTS: "weakref.WeakKeyDictionary[PreTrainedTokenizerBase, str]" = weakref.WeakKeyDictionary()


def folder_tokenizer(folder: str | Path) -> tuple[PreTrainedTokenizerBase, int | list[int] | None]:
    """The tokenizer of an HF folder and its generation config's EOS id(s), read once per process while
    the folder's tokenizer.json is unchanged: transformers parses that 7 MB file in Python, a second or
    more each time, and a process that loads engines over one tokenizer (the tests; a draft and a target
    beside each other) paid it per engine. The engines share the object: they encode and decode with it
    and never change its settings."""
    return _folder_tokenizer(str(folder), (Path(folder) / "tokenizer.json").stat().st_mtime_ns)


@lru_cache(maxsize=8)
def _folder_tokenizer(folder: str, _stamp: int) -> tuple[PreTrainedTokenizerBase, int | list[int] | None]:
    try:
        ids = GenerationConfig.from_pretrained(folder).eos_token_id
    except OSError:
        ids = None
    return AutoTokenizer.from_pretrained(folder), ids


def tokenizer_files(tokenizer: PreTrainedTokenizerBase) -> dict[str, bytes]:
    """The files a remote orchestrator needs to rebuild the tokenizer (AutoTokenizer-loadable)."""
    with tempfile.TemporaryDirectory() as folder:
        tokenizer.save_pretrained(folder)
        return {path.name: path.read_bytes() for path in Path(folder).iterdir() if path.is_file()}
