"""Loading a causal LM and its tokenizer with the dtype and threads the user asked for."""

import logging
import os
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from specd.model.loaded import LoadedModel, folder_tokenizer
from specd.model.machine import cpu_flags
from specd.model.store import find_gguf
from specd.proto.limits import AUTO_CACHED_TOKENS, ENGINES, QUANTIZATIONS, Limits, is_sim_engine


def default_dtype(device: torch.device | str = "cpu") -> str:
    """bfloat16 on a GPU, and on a CPU that computes it natively (AVX-512 bf16, AMX), else float32.

    Without native bf16 (AVX2 only) a one-token decode is memory-bound and bf16 reads half the
    bytes, but every pass of several rows (a batch of streams, a verify of K + 1 tokens, a prefill)
    converts in registers and is compute-bound. Measured on an AMD EPYC (Zen 2, AVX2, 2 threads),
    the 1.5B target, bf16 against float32 (with MKL's fast kernels, model/cpu_blas.py): a decode
    0.30 / 0.42 s, a 5-token verify 1.13 / 0.65 s, 8 streams' decode pass 2.23 / 0.75 s, a
    24-token prefill 5.3 / 1.2 s. A server under load, and speculation, want float32 there.
    """
    if torch.device(device).type == "cuda":
        return "bfloat16"
    return "bfloat16" if {"avx512_bf16", "amx_bf16"} & cpu_flags() else "float32"


def resolve_quantization(role: str, choice: str, device: torch.device | str = "cpu") -> str:
    """`--quantize auto` for a role: int4 weight-only for a CPU draft (measured fastest here at a small
    cost in acceptance: docs/performance/avx2.md), none for a target (it would change the output) or a GPU draft."""
    if choice != "auto":
        return choice
    return "int4" if role == "draft" and torch.device(device).type == "cpu" else "none"


def quantize(model: PreTrainedModel, scheme: str) -> torch.dtype:
    """Weight-only quantization of the Linear layers with torchao, in place; returns the compute dtype.

    Lossy: a quantized draft guesses differently (acceptance may drop), but the output of the
    server does not change, since the target decides every token. int4 packs weights for
    torch's CPU int4 matmul, which computes in bfloat16.
    """
    if scheme == "none":
        return model.dtype
    if scheme not in QUANTIZATIONS:
        raise ValueError(f"unknown quantization {scheme!r}; choose one of {', '.join(QUANTIZATIONS)}")
    from torchao.prototype.quantization.int4.inference_workflow import PrototypeInt4WeightOnlyConfig
    from torchao.quantization import Int8WeightOnlyConfig, quantize_

    if scheme == "int4":
        model.to(torch.bfloat16)
        config = PrototypeInt4WeightOnlyConfig(group_size=INT4_GROUP_SIZE)
    else:
        config = Int8WeightOnlyConfig()
    quantize_(model, config)
    return model.dtype


INT4_GROUP_SIZE = 128


def set_threads(threads: int | None) -> None:
    """Torch's threads: `threads`, else one per core this process may run on (its affinity: a
    container's cpuset or `taskset`, as `specd up` counts them, deploy/local.py usable_cores)."""
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    torch.set_num_threads(threads or usable or 1)


def load_model(
    name_or_path: str,
    dtype: str | None = None,
    threads: int | None = None,
    quantization: str = "none",
    device: torch.device | str = "cpu",
) -> LoadedModel:
    """Load for inference on `device`. `name_or_path`: a default-pair name (converted from its cached GGUF
    the first time, fetch.resolve_model), a local HF directory or a hub id."""
    from specd.model.fetch import resolve_model
    from specd.model.store import find_spec

    set_threads(threads)
    path = resolve_model(name_or_path)
    torch_dtype = getattr(torch, dtype or default_dtype(device))
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype).to(device)
    model.eval()
    torch_dtype = quantize(model, quantization)
    tokenizer = AutoTokenizer.from_pretrained(path)
    spec = find_spec(name_or_path)  # `target` is served as the default pair's target, by its name
    return LoadedModel(spec.name if spec else name_or_path, str(path), model, tokenizer, torch_dtype, quantization)


# The llama.cpp engine allocates its KV cache when it starts, a stream of --max-session-tokens per
# session (model/llama_cpp_engine.py): this many tokens in all when --max-cached-tokens is auto
# (float16 KV: 3.7 GB for the 1.5B target, 1.6 GB for the 0.5B draft), so 16 sessions of 8,192.
LLAMA_CPP_CACHED_TOKENS = 131_072


def choose_engine(choice: str, name_or_path: str, device: torch.device) -> str:
    """`--engine auto`: llama.cpp for a model on a CPU when it has a GGUF (the default pair does),
    transformers otherwise (a GPU, a plain HF model). An explicit choice is checked, not changed;
    the simulated engine (`sim`) only where it is named."""
    if is_sim_engine(choice):
        return choice
    if choice not in ENGINES:
        raise ValueError(f"--engine takes {', '.join(ENGINES)} or sim[:options], not {choice!r}")
    if choice == "transformers":
        return choice
    if choice == "llama.cpp":
        if device.type != "cpu":
            raise ValueError(f"the llama.cpp engine runs on the CPU (its build here has no GPU backend), not {device}")
        if find_gguf(name_or_path) is None:
            raise ValueError(
                f"--engine llama.cpp needs a GGUF: {name_or_path!r} is neither a default-pair name with its GGUF "
                "in the model cache (specd models fetch) nor a .gguf file"
            )
        return choice
    return "llama.cpp" if device.type == "cpu" and find_gguf(name_or_path) is not None else "transformers"


def load_llama_cpp_engine(name_or_path: str, threads: int | None, limits: Limits, exactness: str = "bitwise"):
    """The llama.cpp engine over the model's GGUF, with the tokenizer of the HF files beside it (a
    default-pair name's tokenizer folder, saved from its GGUF by `specd models fetch`: no conversion;
    or tokenizer files in the .gguf's folder), else the GGUF's own (reading it takes seconds).
    Its KV holds --max-sessions streams of --max-session-tokens, fewer where --max-cached-tokens
    (auto: LLAMA_CPP_CACHED_TOKENS) does not hold them all; the service then takes fewer sessions."""
    from specd.model.fetch import resolve_tokenizer
    from specd.model.llama_cpp_engine import LlamaCppEngine
    from specd.model.store import find_spec

    gguf = find_gguf(name_or_path)
    spec = find_spec(name_or_path)
    folder = resolve_tokenizer(name_or_path) if spec is not None else gguf.parent
    if (Path(folder) / "tokenizer.json").is_file():
        tokenizer, ids = folder_tokenizer(folder)
    else:
        tokenizer, ids = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name), None
    ids = ids if ids is not None else tokenizer.eos_token_id
    eos = sorted(set(ids if isinstance(ids, list) else [ids] if ids is not None else []))
    set_threads(threads)  # the same count for llama.cpp's threads and torch's (sampling, acceptance)
    cached = limits.max_cached_tokens if limits.max_cached_tokens != AUTO_CACHED_TOKENS else LLAMA_CPP_CACHED_TOKENS
    session_tokens = min(limits.max_session_tokens, cached)
    sessions = min(limits.max_sessions, cached // session_tokens)
    return LlamaCppEngine(
        gguf,
        spec.name if spec else name_or_path,
        tokenizer,
        eos,
        threads=torch.get_num_threads(),
        sessions=sessions,
        session_tokens=session_tokens,
        exactness=exactness,
    )


def load_sim_engine(role: str, name_or_path: str, choice: str):
    """The simulated engine (model/sim_engine.py) for a role, with the tokenizer of `name_or_path` (a
    default-pair name's tokenizer folder, or an HF folder): no weights load."""
    from specd.model.fetch import resolve_tokenizer
    from specd.model.sim_engine import SimEngine, SimSettings
    from specd.model.store import find_spec

    settings = SimSettings.parse(choice)
    spec = find_spec(name_or_path)
    tokenizer, _ = folder_tokenizer(resolve_tokenizer(name_or_path) if spec is not None else name_or_path)
    return SimEngine(role, spec.name if spec else name_or_path, tokenizer, settings)


def load_engine(
    role: str,
    model: str,
    dtype: str | None = None,
    threads: int | None = None,
    quantize: str = "auto",
    device: str = "auto",
    cuda_graphs: str = "auto",
    engine: str = "auto",
    limits: Limits = Limits(),
    exactness: str = "bitwise",
):
    """The Engine (model/engine.py) a `role` service runs `model` on: a default-pair name, a local
    HF directory, a hub id or a .gguf file, on the device `--device` names for the role
    (model/devices.py), with the engine `--engine` names (choose_engine). `cuda_graphs`: auto (on
    for a CUDA device), on or off. `limits`: the service's, which size the llama.cpp engine's KV
    cache; `exactness`: the llama.cpp engine's --exactness (the transformers engine has one way). An
    unknown or absent device raises DeviceUnavailable before anything loads."""
    from specd.model.devices import DeviceUnavailable, resolve_device
    from specd.model.transformers_engine import TransformersEngine  # it imports this module

    placed = resolve_device(role, device)
    if cuda_graphs not in ("auto", "on", "off"):
        raise ValueError(f"--cuda-graphs takes auto, on or off, not {cuda_graphs!r}")
    if cuda_graphs == "on" and placed.type != "cuda":
        raise DeviceUnavailable(f"--cuda-graphs on needs a CUDA device; this {role} runs on {placed}")
    chosen = choose_engine(engine, model, placed)
    logging.getLogger(__name__).info("the %s runs %s on the %s engine (--engine %s)", role, model, chosen, engine)
    if chosen == "llama.cpp":
        return load_llama_cpp_engine(model, threads, limits, exactness)
    if is_sim_engine(chosen):
        return load_sim_engine(role, model, chosen)
    loaded = load_model(model, dtype, threads, resolve_quantization(role, quantize, placed), placed)
    return TransformersEngine(loaded, graphs=placed.type == "cuda" and cuda_graphs != "off")
