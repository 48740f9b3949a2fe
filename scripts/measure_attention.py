"""Which llama.cpp attention setting keeps the llama.cpp engine exact at long contexts, and what each costs.

ggml-cpu's flash attention takes one of three paths per call (ggml/src/ggml-cpu/ops.cpp,
ggml_compute_forward_flash_attn_ext_f16): for one query row of one KV stream over a view of 512 cells
or more (a lone decode step past 256 tokens: llama.cpp pads the view to 256 cells) it splits the cells
across threads and adds the partial softmax sums up (`use_split_kv_path`); from 64 query rows on it
tiles; otherwise each query row runs over the cells in order (`one_chunk`). The three round
differently, so a lone decode step past 256 tokens is not bit-equal to the same position scored in a
verify, or in a pass batched beside another session. The split and the tiles are taken only for an F16
or F32 K cache: with a BF16 or Q8_0 K cache every call takes `one_chunk`.

For each setting (the engine's ATTENTION) this loads the engine (model/llama_cpp_engine.py), whose
load-time probe picks the weights and scored positions per call that are exact (recorded), and scores,
with the engine's own calls:
- exactness: at each context length, 4 positions as 4 lone decode steps against the same positions in
  one pass (calls of the engine's size), and a decode step batched beside a session of another length
  against the same step alone;
- cost: a lone decode step at each context length (median of 12), and a prefill of 512 tokens.

    .venv/bin/python scripts/measure_attention.py [--gguf PATH] [--contexts 100,300,700] [--json out.json]
"""

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import llama_cpp as llama
import torch

from specd.model import llama_cpp_engine
from specd.model.engine import Row
from specd.model.llama_cpp_engine import GGML_TYPE_BF16

SETTINGS = {  # name -> (flash attention, K cache type, V cache type)
    "flash f16 (llama.cpp's default)": (llama.LLAMA_FLASH_ATTN_TYPE_ENABLED, llama.GGML_TYPE_F16, llama.GGML_TYPE_F16),
    "no flash, f16": (llama.LLAMA_FLASH_ATTN_TYPE_DISABLED, llama.GGML_TYPE_F16, llama.GGML_TYPE_F16),
    "flash, K bf16, V bf16": (llama.LLAMA_FLASH_ATTN_TYPE_ENABLED, GGML_TYPE_BF16, GGML_TYPE_BF16),
    "flash, K q8_0, V f16": (llama.LLAMA_FLASH_ATTN_TYPE_ENABLED, llama.GGML_TYPE_Q8_0, llama.GGML_TYPE_F16),
    "flash, K q8_0, V q8_0": (llama.LLAMA_FLASH_ATTN_TYPE_ENABLED, llama.GGML_TYPE_Q8_0, llama.GGML_TYPE_Q8_0),
}


def tokens(n: int, salt: int, vocab: int) -> list[int]:
    return [(salt * 7919 + 31 * i * i + 17 * i) % 50000 + 100 for i in range(n)]


def measure(engine, contexts: list[int]) -> dict:
    vocab = engine.vocab_size
    result = {"exact_verify": {}, "exact_batched": {}, "decode_ms": {}}
    for n in contexts:
        context = tokens(n + 4, n, vocab)
        steps = [engine.forward([Row("a", context[: n + 1], 1)])[0]]
        steps += [engine.forward([Row("a", [t], 1)])[0] for t in context[n + 1 :]]
        engine.crop("a", n)
        scored = engine.forward([Row("a", context[n:], 4)])[0]
        result["exact_verify"][n] = bool(torch.equal(scored, torch.cat(steps)))
        # a decode step alone against the same step beside another session of another length
        engine.crop("a", n + 1)
        alone = engine.forward([Row("a", [context[n + 1]], 1)])[0]
        engine.crop("a", n + 1)
        other = tokens(n // 2 + 40, n + 1, vocab)
        engine.forward([Row("b", other[:-1], 0)])
        both = engine.forward([Row("a", [context[n + 1]], 1), Row("b", other[-1:], 1)])[0]
        result["exact_batched"][n] = bool(torch.equal(alone, both))
        engine.release("b")
        times = []
        for _ in range(12):
            engine.crop("a", n)
            started = time.perf_counter()
            engine.forward([Row("a", [context[n]], 1)])
            times.append(time.perf_counter() - started)
        result["decode_ms"][n] = round(1000 * statistics.median(times), 1)
        engine.release("a")
    started = time.perf_counter()
    engine.forward([Row("p", tokens(513, 3, vocab), 1)])
    result["prefill_512_ms"] = round(1000 * (time.perf_counter() - started), 1)
    engine.release("p")
    return result


def main() -> None:
    from transformers import AutoTokenizer

    from specd.model.fetch import resolve_tokenizer
    from specd.model.store import find_spec, gguf_path

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gguf", type=Path, default=None, help="default: the default target's GGUF")
    parser.add_argument("--contexts", default="100,300,700")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    spec = find_spec("target")
    gguf = args.gguf or gguf_path(spec)
    tokenizer = AutoTokenizer.from_pretrained(resolve_tokenizer(spec.name))
    contexts = [int(n) for n in args.contexts.split(",")]
    chosen = llama_cpp_engine.ATTENTION
    report = {"cpu": platform.processor() or platform.machine(), "gguf": str(gguf), "settings": {}}
    for name, (flash, type_k, type_v) in SETTINGS.items():
        llama_cpp_engine.ATTENTION = ((flash, type_k, type_v),)
        engine = llama_cpp_engine.LlamaCppEngine(gguf, spec.name, tokenizer, [], args.threads, 4, 2048)
        figures = {"weights": "repacked" if engine.repacked else "plain", "call_tokens": engine.call_tokens}
        figures |= measure(engine, contexts)
        del engine
        report["settings"][name] = figures
        print(f"{name}: {json.dumps(figures)}", flush=True)
    llama_cpp_engine.ATTENTION = chosen
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
