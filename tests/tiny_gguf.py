"""A tiny HF Qwen2 written as a float32 GGUF, for the llama.cpp engine's tests: the same weights as
the transformers engine runs, so the two engines' logits can be compared position by position.

The tensors follow llama.cpp's qwen2 names (its convert_hf_to_gguf.py maps them the same way; Qwen2
needs no permutation of q and k); the tokenizer's fields are copied from the default pair's draft
GGUF, which holds the same Qwen2.5 tokenizer the tiny models use.
"""

from pathlib import Path

import gguf
import torch
from transformers import AutoModelForCausalLM

LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
TOP_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}


def gguf_name(hf_name: str) -> str:
    if hf_name in TOP_NAMES:
        return TOP_NAMES[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)  # model.layers.N.<rest>
    return f"blk.{layer}.{LAYER_NAMES[rest]}"


def write_tiny_gguf(hf_dir: Path, out: Path, tokenizer: list[tuple], output: bool = True) -> Path:
    """`tokenizer`: tokenizer_fields of a GGUF with the same tokenizer, or [] for the weights alone.
    `output`: an output.weight of its own (untied, as the default pair's GGUFs have it); without, the
    embedding serves as output."""
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    config = model.config
    rope = getattr(config, "rope_theta", None) or config.rope_parameters["rope_theta"]
    writer = gguf.GGUFWriter(str(out), "qwen2")
    writer.add_name("tiny qwen2")
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(float(rope))
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    for key, value, kind, sub_type in tokenizer:
        writer.add_key_value(key, value, kind, sub_type=sub_type)
    if not tokenizer:  # weights alone (reading 151,936 tokens' strings takes a GGUF reader seconds)
        writer.add_vocab_size(config.vocab_size)
    state = model.state_dict()
    for name, tensor in state.items():
        if name != "lm_head.weight":
            writer.add_tensor(gguf_name(name), tensor.contiguous().numpy())
    if output:
        writer.add_tensor("output.weight", model.get_output_embeddings().weight.detach().contiguous().numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def tokenizer_fields(path: Path) -> list[tuple]:
    """(key, value, type, array element type) of every tokenizer.* field of a GGUF."""
    fields = gguf.GGUFReader(str(path)).fields.items()
    return [
        (key, field.contents(), field.types[0], field.types[-1] if len(field.types) > 1 else None)
        for key, field in fields
        if key.startswith("tokenizer.")
    ]
