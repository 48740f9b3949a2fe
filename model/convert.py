"""A GGUF dequantized into a float32 safetensors model, one tensor at a time.

transformers' own path (`from_pretrained(gguf_file=..., GgufConfig(dequantize=True))`, then
`save_pretrained`) holds the whole float32 model, then a serialized copy of it: 8.7 GiB at its peak
for the 1.5B target, whose GGUF unties the output layer (7.1 GB of float32). This keeps one shard at
a time instead (SHARD_BYTES; a tensor larger than that is a shard of its own), 3.9 GiB at the peak
for the target with the GGUF's pages and torch (AMD EPYC Zen 4), and writes the same files:
the same tensors under the same names (transformers' GGUF name map and tensor processors, on a model
built on the meta device), config.json and generation_config.json as `save_pretrained` writes them,
and a safetensors index over the shards. tests/test_fetch.py compares it with transformers' path.
"""

from __future__ import annotations

import json
from pathlib import Path

SHARD_BYTES = 512 * 1024 * 1024  # float32 bytes of one safetensors shard


def convert_gguf(gguf: Path, out_dir: Path) -> None:
    """Dequantize `gguf` into a float32 safetensors model (config, weights) saved in `out_dir`."""
    # Heavy imports here, so `specd models list` and the orchestrator stay torch-free.
    import numpy as np
    import torch
    from gguf import GGUFReader, dequantize
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import (
        TENSOR_PROCESSORS,
        TensorProcessor,
        get_gguf_hf_weights_map,
        load_gguf_checkpoint,
        read_field,
    )

    parsed = load_gguf_checkpoint(str(gguf))  # metadata only: the config's fields, no tensors
    fields = dict(parsed["config"])  # what AutoConfig.from_pretrained(gguf_file=...) builds from
    config = AutoConfig.for_model(fields.pop("model_type"), **fields, dtype=torch.float32)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    reader = GGUFReader(str(gguf))
    architecture = read_field(reader, "general.architecture")[0]
    processor = TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config=parsed["config"])
    names = get_gguf_hf_weights_map(skeleton, processor)
    wanted = set(skeleton.state_dict())

    kept = [tensor for tensor in reader.tensors if names.get(tensor.name) in wanted]
    shards, size = [[]], 0
    for tensor in kept:
        if shards[-1] and size + 4 * int(tensor.n_elements) > SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append(tensor)
        size += 4 * int(tensor.n_elements)
    weight_map, total = {}, 0
    for index, shard in enumerate(shards, start=1):
        filename = f"model-{index:05d}-of-{len(shards):05d}.safetensors"
        tensors = {}
        for tensor in shard:
            result = processor.process(
                weights=dequantize(tensor.data, tensor.tensor_type),
                name=tensor.name,
                tensor_key_mapping=names,
                parsed_parameters=parsed,
            )
            name = names[result.name]
            tensors[name] = torch.from_numpy(np.copy(result.weights)).to(torch.float32).contiguous()
            weight_map[name] = filename
            total += tensors[name].numel() * 4
        save_file(tensors, out_dir / filename, metadata={"format": "pt"})
    missing = wanted - set(weight_map) - _tied(skeleton)
    if missing:
        raise ValueError(f"{gguf.name}: no tensor for {sorted(missing)[:5]} ({len(missing)} in all)")
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    skeleton.config.architectures = [type(skeleton).__name__]  # as save_pretrained writes it
    skeleton.config.save_pretrained(out_dir)
    if skeleton.can_generate():
        skeleton.generation_config.save_pretrained(out_dir)


def _tied(model) -> set[str]:
    """Parameters the model ties to another (an lm_head tied to the embedding): no tensor of their own."""
    keys = getattr(model, "all_tied_weights_keys", None) or getattr(model, "_tied_weights_keys", None) or {}
    return set(keys) if model.config.tie_word_embeddings else set()
