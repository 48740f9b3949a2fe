"""The peer benchmark (`specd bench`): specd against Hugging Face `generate` on the same prompts
and settings. This module runs the systems; `specd.bench.figures` turns the runs into the
report's figures, and `specd.bench.report` prints and plots them.

Five systems, batch 1, greedy, every one producing exactly max_new_tokens tokens (EOS is
ignored by all five: HF's models get a generation config without an eos_token_id, specd's
requests ask for `ignore_eos`):

- `hf_target`    transformers `target.generate(do_sample=False)`, in this process;
- `hf_assisted`  `target.generate(assistant_model=draft)`, greedy, transformers' own
                 assistant schedule (its defaults), in this process;
- `hf_lookup`    `target.generate(prompt_lookup_num_tokens=N)`, greedy prompt lookup decoding
                 (no draft model: candidates are copied from where the last n-gram occurred
                 earlier in the prompt or output; N = BenchSettings.lookup_tokens, 10 as
                 transformers' docs suggest, its other settings transformers' defaults), in this
                 process: the peer to beat on edit prompts (bench/prompts_edit.jsonl);
- `specd_target` specd with speculation off (K = 0) through the gRPC services and the Ray
                 orchestrator (a LocalStack: three processes, or --server);
- `specd_spec`   specd speculative: K chosen every step (adaptive, the default), or a fixed
                 K = draft_tokens; its draft as the service loads it (int4 on a CPU by default);
- peers (`--peer NAME=URL`, `PeerSystem`): any OpenAI-compatible server (vLLM, llama.cpp's
                 llama-server with its own draft, TGI, SGLang, specd's own HTTP API), a system
                 named NAME: the same prompt token ids, greedy, max_tokens = max_new_tokens and
                 `ignore_eos`, streamed from /v1/completions (bench/openai_client.py).

Runs are interleaved per prompt (A B C D E, A B C D E, ...; the peers last) so slow drift of the
machine falls on all alike, and each system is warmed up once on a short prompt before timing.
Every system gets the same prompt token ids (the tokenizer's, without special tokens, as
the orchestrator tokenizes text); specd and the peers are timed on the client, from sending the
request to the end of its stream, so gRPC, HTTP and orchestration count against them. A peer
answers text, not token ids, so its output is compared with specd_target's text, and its tokens
are the server's own count (`usage`).

torch, transformers and gRPC are imported where they are used, so importing this module is cheap.
"""

from __future__ import annotations

import copy
import os
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from specd.bench.figures import SYSTEMS, build_report
from specd.deploy.roles import RoleConfig

QUICK_PROMPTS = 4
QUICK_TOKENS = 32
DEFAULT_TOKENS = 64
LOOKUP_TOKENS = 10  # hf_lookup's prompt_lookup_num_tokens (the value transformers' docs suggest)
WARMUP_PROMPT = "def add(a, b):\n"
# code-editing prompts (rename, type hints, docstrings, async, bug fixes, translations): outputs that
# repeat much of the prompt, where prompt lookup decoding shines (bench/README.md)
EDIT_PROMPTS = Path(__file__).resolve().parent / "prompts_edit.jsonl"

# called after each timed run with a label such as "prompt 3/24 specd_spec"
Advance = Callable[[str], None]


@dataclass
class BenchSettings:
    """What to run: the prompts, the pair and how to serve it (the report copies these)."""

    prompts: list[str]
    kinds: list[str] = field(default_factory=list)  # one per prompt ("" when unknown)
    max_new_tokens: int = DEFAULT_TOKENS
    draft_tokens: int | None = None  # None: adaptive (the orchestrator chooses K every step)
    lookup_tokens: int = LOOKUP_TOKENS  # hf_lookup's prompt_lookup_num_tokens
    drafter: str = ""  # specd_spec's drafter (orchestrator/lookup.py); "": the server's (hybrid)
    dtype: str | None = None  # None: load_model's default for the target's device
    # Each role's model and service settings (deploy/roles.py; None: the service's default, auto). The
    # devices are the HF baselines' too (the target and HF's assistant model); HF's run transformers.
    draft: RoleConfig = field(default_factory=lambda: RoleConfig("draft"))
    target: RoleConfig = field(default_factory=lambda: RoleConfig("target"))
    threads: int | None = None
    server: str | None = None  # a running orchestrator instead of a LocalStack
    peers: dict[str, str] = field(default_factory=dict)  # name -> URL of an OpenAI-compatible server, a system each
    timeout: float = 600.0  # seconds per specd request
    prompts_file: str | None = None
    quick: bool = False


@dataclass
class Run:
    """One system on one prompt."""

    token_ids: list[int]
    seconds: float
    stats: dict | None = None  # specd's SpeculationStats as a dict
    text: str | None = None  # the output's text (specd's and the peers'; a peer's only output)
    completion_tokens: int | None = None  # a peer's count (usage): it returns no token ids

    @property
    def tokens(self) -> int:
        return len(self.token_ids) if self.completion_tokens is None else self.completion_tokens


def load_prompts(path: Path | str) -> tuple[list[str], list[str]]:
    """Prompts and their kinds from a JSON-lines file of {"prompt": ..., "kind": ...} (loadtest's format)."""
    import json

    from specd.bench.workload import load_prompts as checked_prompts

    prompts = checked_prompts(path)  # raises workload.PromptsError with a line number on bad input
    kinds = [str(json.loads(line).get("kind", "")) for line in Path(path).read_text().splitlines() if line.strip()]
    return prompts, kinds


# ---------------------------------------------------------------- the systems


class HFSystems:
    """hf_target, hf_assisted and hf_lookup: transformers `generate` on models loaded in this process."""

    def __init__(self, draft, target):
        from transformers import GenerationConfig

        self.draft, self.target = draft, target
        # A clean generation config: greedy, no repetition penalty or sampling defaults a model
        # directory may carry, and no eos_token_id, so generation never stops early (EOS ignored).
        # It has to replace the models' own config during generate(): generate() fills every
        # unset (None) field of the one passed in from the model's, eos_token_id included.
        pad = target.tokenizer.pad_token_id
        pad = pad if pad is not None else (target.eos_token_ids or [0])[0]
        self.config = GenerationConfig(pad_token_id=pad)
        self.assistant_defaults = _assistant_defaults(self.config)

    def lookup_settings(self, lookup_tokens: int) -> dict:
        """The prompt-lookup settings generate() will use for `run(..., lookup_tokens=N)`."""
        return {"prompt_lookup_num_tokens": lookup_tokens, **_lookup_defaults(self.config)}

    def encode(self, prompt: str) -> list[int]:
        return list(self.target.tokenizer(prompt, add_special_tokens=False).input_ids)

    def run(
        self, prompt_ids: list[int], max_new_tokens: int, assisted: bool = False, lookup_tokens: int | None = None
    ) -> Run:
        """Greedy generate() on the target: alone (hf_target), with the draft as its assistant
        (assisted: hf_assisted) or with prompt lookup of `lookup_tokens` candidates (hf_lookup)."""
        import torch
        from transformers.utils import logging as hf_logging

        if assisted and lookup_tokens is not None:
            raise ValueError("assisted and prompt lookup generation are two different systems: choose one")
        device = self.target.model.device  # the prompt goes where the target computes
        ids = torch.tensor([prompt_ids], device=device)
        extra = {"assistant_model": self.draft.model} if assisted else {}
        if lookup_tokens is not None:
            extra["prompt_lookup_num_tokens"] = lookup_tokens
        models = (self.target.model, self.draft.model)
        saved = [model.generation_config for model in models]
        verbosity = hf_logging.get_verbosity()
        hf_logging.set_verbosity_error()  # assisted generate warns about its own internal call
        try:
            for model in models:  # restored below: the models may be shared (in-process services)
                model.generation_config = copy.deepcopy(self.config)
            with torch.inference_mode():
                started = time.perf_counter()
                output = self.target.model.generate(
                    ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_new_tokens, **extra
                )
                if device.type == "cuda":  # the clock stops when the GPU is done, not when work is queued
                    torch.cuda.synchronize(device)
                seconds = time.perf_counter() - started
        finally:
            hf_logging.set_verbosity(verbosity)
            for model, config in zip(models, saved):
                model.generation_config = config
        return Run(output[0, len(prompt_ids) :].tolist(), seconds)


def _assistant_defaults(config) -> dict:
    """The assisted-generation settings generate() will use (unset fields take transformers' defaults)."""
    try:
        defaults = config._get_default_generation_params()
    except AttributeError:  # older transformers keep the defaults on the config itself
        defaults = {}
    names = ("num_assistant_tokens", "num_assistant_tokens_schedule", "assistant_confidence_threshold")
    return {
        name: getattr(config, name, None) if getattr(config, name, None) is not None else defaults.get(name)
        for name in names
    }


def _lookup_defaults(config) -> dict:
    """Prompt lookup's other setting as generate() will use it (transformers 5: unset, its candidate
    generator matches n-grams of up to 2 tokens)."""
    return {"max_matching_ngram_size": getattr(config, "max_matching_ngram_size", None) or 2}


class SpecdSystems:
    """specd_target and specd_spec: Generate calls to an orchestrator over gRPC."""

    def __init__(self, stub, timeout: float):
        self.stub, self.timeout = stub, timeout

    async def run(
        self, prompt_ids: list[int], max_new_tokens: int, draft_tokens: int | None, drafter: str = "", salt: str = ""
    ) -> Run:
        """One greedy Generate: K (None: the server's), the drafter ("": the server's), the cache salt
        (a request learns from, and reuses the prefixes of, only requests of its own salt)."""
        from google.protobuf.json_format import MessageToDict

        from specd.proto.client import complete
        from specd.v1 import common_pb2, specdecode_pb2

        request = specdecode_pb2.GenerateRequest(
            prompt_token_ids=prompt_ids,
            max_new_tokens=max_new_tokens,
            draft_tokens=draft_tokens,
            ignore_eos=True,
            sampling=common_pb2.SamplingParams(temperature=0.0),
            drafter=drafter,
            cache_salt=salt,
        )  # None: unset, the server's K
        completion = await complete(self.stub, request, timeout=self.timeout)
        seconds = time.perf_counter() - completion.started
        if completion.final is None:
            raise RuntimeError("the orchestrator ended the stream without a final message")
        stats = MessageToDict(
            completion.final.stats, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
        )
        return Run(completion.token_ids, seconds, stats, text=completion.text)


class PeerSystem:
    """A peer: an OpenAI-compatible server's streamed /v1/completions, greedy, with the prompt as token
    ids (the very tokens the other systems get), max_tokens and `ignore_eos`. Raises
    openai_client.TargetError when it cannot be reached or a request fails (the bench then stops:
    one peer's missing prompt would leave its figures meaningless)."""

    def __init__(self, name: str, url: str, timeout: float):
        self.name, self.url, self.timeout = name, url, timeout
        self.client, self.model = None, None

    async def open(self) -> None:
        from specd.bench.openai_client import TargetError, make_client, pick_model

        self.client = make_client(self.url, timeout=self.timeout)
        try:
            self.model, _ = await pick_model(self.client, None, f"--peer {self.name}={self.url}")
        except TargetError:
            await self.close()
            raise

    async def close(self) -> None:
        if self.client:
            await self.client.close()

    async def run(self, prompt_ids: list[int], max_new_tokens: int) -> Run:
        import openai

        from specd.bench.openai_client import TargetError, error_name, stream_completion

        try:
            streamed = await stream_completion(
                self.client, self.model, prompt_ids, max_new_tokens, timeout=self.timeout, ignore_eos=True
            )
        except openai.OpenAIError as error:
            raise TargetError(
                f"--peer {self.name}={self.url}: the request failed ({error_name(error)}: {error})"
            ) from None
        return Run(
            [], streamed.ended - streamed.started, text=streamed.text, completion_tokens=streamed.completion_tokens
        )


# ---------------------------------------------------------------- the run


async def run_bench(
    settings: BenchSettings,
    advance: Advance | None = None,
    say: Callable[[str], None] = print,
    models: tuple | None = None,
) -> dict:
    """Start what is needed, run the interleaved benchmark, return the report (`report.build_report`).

    `models`: an already loaded (draft, target) pair of LoadedModel to use for the HF systems, on
    the devices they are on (default: load settings.draft.model / target.model in settings.dtype
    here, each on its role's device, as specd's services place them, so HF and specd compute on the
    same GPU).
    """
    from specd.model.devices import resolve_device
    from specd.model.loading import default_dtype, load_model

    devices = {role: resolve_device(role, getattr(settings, role).device or "auto") for role in ("draft", "target")}
    dtype = settings.dtype or default_dtype(devices["target"])
    environment = {"load_average_before": load_average()}
    stack, peers = None, {name: PeerSystem(name, url, settings.timeout) for name, url in settings.peers.items()}
    try:
        for peer in peers.values():  # first: a peer that is not there fails in a second, not after loading
            await peer.open()
        address = settings.server
        if address is None:
            from specd.deploy.local import LocalStack, StackConfig

            stack = LocalStack(
                StackConfig(
                    dtype=dtype, threads=settings.threads, draft=settings.draft, target=settings.target, workers=1
                ),
                say=say,
            )
            await stack.start()
            address = stack.address
        if models is None:
            say(
                f"loading the HF baselines ({settings.draft.model} on {devices['draft']}, "
                f"{settings.target.model} on {devices['target']}) in {dtype}"
            )
            models = (
                load_model(settings.draft.model, dtype, settings.threads, device=devices["draft"]),
                load_model(settings.target.model, dtype, settings.threads, device=devices["target"]),
            )
        hf = HFSystems(*models)
        runs = await _run_all(settings, hf, address, advance, say, peers)
        server_info = runs.pop("server_info")
    finally:
        if stack:
            stack.stop()
        for peer in peers.values():
            await peer.close()
    environment["load_average_after"] = load_average()
    return build_report(
        settings,
        runs,
        [hf.encode(p) for p in settings.prompts],
        {
            "order": "interleaved per prompt: " + " ".join((*run_order(), *peers)),
            "warmup": f"each system once on {WARMUP_PROMPT!r}",
            "timing": "HF: generate() wall time in process; specd: client wall time of the Generate stream",
            "dtype": str(models[1].dtype).removeprefix("torch."),
            "hf_devices": {"draft": str(models[0].model.device), "target": str(models[1].model.device)},
            "server": settings.server,
            "server_info": server_info,
            "hf_assisted_generation": hf.assistant_defaults,
            "hf_prompt_lookup": hf.lookup_settings(settings.lookup_tokens),
            "peer_models": {name: peer.model for name, peer in peers.items()},  # what each peer was asked for
            **environment,
            **machine_facts(),
        },
    )


async def _run_all(
    settings: BenchSettings, hf: HFSystems, address: str, advance: Advance | None, say, peers: dict | None = None
) -> dict:
    from specd.bench.grpc_target import server_info
    from specd.proto.client import channel
    from specd.v1 import specdecode_pb2_grpc

    n, k = settings.max_new_tokens, settings.draft_tokens
    order = (*run_order(), *(peers or {}))
    runs: dict = {system: [] for system in order}
    async with channel(address) as open_channel:
        stub = specdecode_pb2_grpc.SpecDecodeStub(open_channel)
        specd = SpecdSystems(stub, settings.timeout)
        runs["server_info"] = info = await server_info(stub, settings.timeout)
        hf_dtype = str(hf.target.dtype).removeprefix("torch.")
        if info and info["dtype"] and info["dtype"] != hf_dtype:
            say(
                f"warning: the orchestrator serves {info['dtype']}, the HF baselines run in {hf_dtype}: "
                "speeds and greedy_match compare unlike things"
            )
        hf_device = str(hf.target.model.device)
        if info and info.get("target_device") and info["target_device"] != hf_device:
            say(
                f"warning: specd's target computes on {info['target_device']}, the HF target on {hf_device}: "
                "the speeds compare unlike devices"
            )
        systems = {
            "hf_target": lambda ids, tokens: _sync(hf.run(ids, tokens, assisted=False)),
            "hf_assisted": lambda ids, tokens: _sync(hf.run(ids, tokens, assisted=True)),
            "hf_lookup": lambda ids, tokens: _sync(hf.run(ids, tokens, lookup_tokens=settings.lookup_tokens)),
            "specd_target": lambda ids, tokens: specd.run(ids, tokens, 0),
            "specd_spec": lambda ids, tokens: specd.run(ids, tokens, k, settings.drafter),
            **{name: peer.run for name, peer in (peers or {}).items()},
        }
        say("warming up each system once")
        warmup_ids = hf.encode(WARMUP_PROMPT)
        for system in order:
            await systems[system](warmup_ids, min(n, 8))
        for index, prompt in enumerate(settings.prompts):
            prompt_ids = hf.encode(prompt)
            for system in order:  # interleaved: A B C D E (then the peers) on each prompt
                runs[system].append(run := await systems[system](prompt_ids, n))
                if advance:
                    advance(f"prompt {index + 1}/{len(settings.prompts)} {system}")
                if run.tokens != n:  # a peer that stopped early (no ignore_eos) or ran on: unlike work
                    say(f"warning: {system} made {run.tokens} tokens for prompt {index + 1}, not {n}")
    return runs


async def _sync(value):
    return value


def run_order() -> tuple[str, ...]:
    """SYSTEMS in the order they run on each prompt: specd_spec before specd_target, since the suffix
    drafter (orchestrator/suffix.py) guesses from the worker's recent outputs, and specd_target's
    output of the same prompt (greedy: the same tokens) would let it guess every token."""
    rest = [system for system in SYSTEMS if system != "specd_spec"]
    at = rest.index("specd_target")
    return (*rest[:at], "specd_spec", *rest[at:])


def load_average() -> list[float] | None:
    try:
        return [round(value, 2) for value in os.getloadavg()]
    except OSError:
        return None


def machine_facts() -> dict:
    import torch
    import transformers

    from specd.model.machine import cpu_flags, cpu_name

    flags = cpu_flags()
    cuda = torch.cuda.is_available()
    return {
        "cpu": cpu_name(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "cuda": cuda,
        "cuda_version": torch.version.cuda,
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if cuda else [],
        "machine": platform.machine(),
        "cpu_features": sorted(flags & {"avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile"}),
    }
