"""Shared fixtures: tiny random models of the real architecture, in-process services on port 0."""

import contextlib
import os
from pathlib import Path

import grpc
import pytest
import torch
from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

from specd.draft_service.drafter import Drafter
from specd.draft_service.server import create_draft_server
from specd.model.fetch import resolve_tokenizer
from specd.model.loading import load_model
from specd.model.transformers_engine import TransformersEngine
from specd.proto.limits import Limits
from specd.target_service.server import create_target_server
from specd.target_service.verifier import Verifier
from specd.v1 import draft_pb2_grpc, target_pb2_grpc

# The stacks tests start run what their flags say, not a configuration `specd bench --configurations`
# kept on this machine (deploy/choice.py): the tests of that choice turn it back on for themselves.
os.environ["SPECD_CHOICE"] = "off"


def pytest_addoption(parser):
    parser.addoption(
        "--phase",
        choices=("parallel", "serial"),
        default=None,
        help="scripts/test.sh's two runs: `parallel` (under pytest-xdist) takes the tests that may share the "
        "machine with another test, `serial` the rest (the real pair's and those marked serial)",
    )


def runs_alone(item) -> bool:
    return item.get_closest_marker("real") is not None or item.get_closest_marker("serial") is not None


def pytest_collection_modifyitems(config, items):
    """With --phase, the half of the tests that phase runs. The real pair's tests after all others,
    those over the session's llama.cpp pair (`real_stack`) last of all: the pair, loaded once, is then
    held by no other test's process memory, and tests/test_real_pair.py's float32 draft has gone before
    it loads. The order is otherwise kept."""
    if phase := config.getoption("--phase"):
        keep = [item for item in items if runs_alone(item) == (phase == "serial")]
        if dropped := [item for item in items if runs_alone(item) != (phase == "serial")]:
            config.hook.pytest_deselected(items=dropped)
        items[:] = keep
    items.sort(key=lambda item: (item.get_closest_marker("real") is not None, "real_stack" in item.fixturenames))


# Tiny models use the real Qwen2.5 tokenizer (scripts/test.sh fetches the pair first), so
# their vocabulary, ids and text behave exactly like the real pair's. SPECD_TEST_TOKENIZER names a
# folder holding just its files, for a machine with no model cache (scripts/gpu_check.sh).
TOKENIZER = os.environ.get("SPECD_TEST_TOKENIZER")
TINY_CONFIG = dict(
    vocab_size=151_936,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=4096,
    tie_word_embeddings=True,
)


def make_tiny_model(folder: Path, seed: int, noise: float = 0.0) -> Path:
    """A random tiny Qwen2; with `noise`, the seed's weights plus noise (a draft that half agrees)."""
    torch.manual_seed(seed)
    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER or resolve_tokenizer("draft"))
    model = Qwen2ForCausalLM(Qwen2Config(**TINY_CONFIG, eos_token_id=tokenizer.eos_token_id))
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn_like(parameter) * noise)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {"draft": make_tiny_model(root / "draft", 2, noise=0.007), "target": make_tiny_model(root / "target", 2)}


@pytest.fixture(scope="session")
def tiny_loaded(tiny_dirs):
    return {role: load_model(str(path), "float32") for role, path in tiny_dirs.items()}


@pytest.fixture(scope="session")
def tiny_gguf(tiny_dirs, tmp_path_factory) -> dict[str, Path]:
    """The tiny pair as float32 GGUF files for the llama.cpp engine, each in a folder with the
    tiny model's tokenizer files (the engine takes its tokenizer from there, model/loading.py)."""
    from tiny_gguf import tokenizer_fields, write_tiny_gguf

    from specd.model.store import find_spec, gguf_path

    source = gguf_path(find_spec("draft"))  # its tokenizer fields are the tiny models' tokenizer
    if not source.is_file():
        pytest.skip("the llama.cpp engine's tiny GGUFs copy the default draft's tokenizer: specd models fetch")
    root = tmp_path_factory.mktemp("gguf")
    tokenizer, files = tokenizer_fields(source), {}
    for role, folder in tiny_dirs.items():
        (root / role).mkdir()
        for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
            if (folder / name).is_file():
                (root / role / name).write_bytes((folder / name).read_bytes())
        files[role] = write_tiny_gguf(folder, root / role / "model.gguf", tokenizer)
    return files


# Engines of engine-parametrized service tests: name -> role -> make(limits), from the tiny pair.
SERVICE_ENGINES = ["transformers", "llama.cpp"]


@pytest.fixture(scope="session")
def tiny_engines(tiny_loaded, request):
    def engines(name: str):
        if name == "transformers":
            return {
                role: (lambda limits, loaded=loaded: TransformersEngine(loaded)) for role, loaded in tiny_loaded.items()
            }
        from specd.model.loading import load_engine

        files = request.getfixturevalue("tiny_gguf")
        return {
            role: (lambda limits, role=role: load_engine(role, str(files[role]), engine="llama.cpp", limits=limits))
            for role in files
        }

    return engines


# Parameters of device-parametrized tests: the CPU always; CUDA where a GPU is visible
# (scripts/gpu_check.sh runs the `gpu` half on one).
requires_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU here (scripts/gpu_check.sh)")
GPU = [pytest.mark.gpu, requires_gpu]
DEVICES = ["cpu", pytest.param("cuda", marks=GPU)]


@pytest.fixture(scope="session")
def tiny_on(tiny_dirs, tiny_loaded):
    """device -> the tiny pair loaded in float32 on that device ({"draft": ..., "target": ...})."""
    loaded = {"cpu": tiny_loaded}

    def on(device: str):
        if device not in loaded:
            loaded[device] = {role: load_model(str(path), "float32", device=device) for role, path in tiny_dirs.items()}
        return loaded[device]

    return on


class Services:
    """A draft and a target server in this process, with stubs on one channel each."""

    def __init__(self, draft_server, target_server):
        self.draft_server, self.target_server = draft_server, target_server
        self.draft_channel = grpc.aio.insecure_channel(f"127.0.0.1:{draft_server.port}")
        self.target_channel = grpc.aio.insecure_channel(f"127.0.0.1:{target_server.port}")
        self.draft = draft_pb2_grpc.DraftServiceStub(self.draft_channel)
        self.target = target_pb2_grpc.TargetServiceStub(self.target_channel)

    async def close(self):
        await self.draft_channel.close()
        await self.target_channel.close()
        await self.draft_server.stop(0)
        await self.target_server.stop(0)


async def start_services(draft_loaded, target_loaded, limits: Limits = Limits(), graphs: bool = False) -> Services:
    """`graphs`: both engines step batch-1 rows in their static slot (CUDA graphs on a GPU)."""
    return await serve_engines(
        lambda limits: TransformersEngine(draft_loaded, graphs),
        lambda limits: TransformersEngine(target_loaded, graphs),
        limits,
    )


async def serve_engines(make_draft, make_target, limits: Limits = Limits()) -> Services:
    """Services over engines made by `make_draft(limits)` and `make_target(limits)`."""
    draft_server = create_draft_server(lambda: Drafter(make_draft(limits), limits))
    target_server = create_target_server(lambda: Verifier(make_target(limits), limits))
    for server in (draft_server, target_server):
        await server.start("127.0.0.1:0")
        await server.load()
    return Services(draft_server, target_server)


async def serve_sim(role: str, model: str = "", scale: float = 0.5, port: int = 0):
    """One simulated `role` service (model/sim_engine.py; its model named `sim-<role>` unless given), on
    `port` (0: a free one), loaded: for the pools of replicas and their routing."""
    from specd.model.loaded import folder_tokenizer
    from specd.model.sim_engine import SimEngine, SimSettings

    tokenizer = folder_tokenizer(TOKENIZER or resolve_tokenizer("draft"))[0]
    engine = SimEngine(role, model or f"sim-{role}", tokenizer, SimSettings(scale=scale))
    server = (
        create_draft_server(lambda: Drafter(engine, Limits()))
        if role == "draft"
        else create_target_server(lambda: Verifier(engine, Limits()))
    )
    await server.start(f"127.0.0.1:{port}")
    await server.load()
    return server


class DraftBeside(Services):
    """A draft service of its own (a server here, or a process's: anything with a port) in front of
    another Services' target: close() stops a server of this process's draft alone."""

    def __init__(self, draft_server, services: Services):
        self.draft_server, self.target_server, self.target = draft_server, services.target_server, services.target
        self.draft_channel = grpc.aio.insecure_channel(f"127.0.0.1:{draft_server.port}")
        self.draft = draft_pb2_grpc.DraftServiceStub(self.draft_channel)

    async def close(self):
        await self.draft_channel.close()
        if hasattr(self.draft_server, "stop"):
            await self.draft_server.stop(0)


async def serve_draft_beside(make_draft, services: Services, limits: Limits = Limits()) -> DraftBeside:
    """A draft service over the engine `make_draft(limits)` makes, beside the target of `services`."""
    draft_server = create_draft_server(lambda: Drafter(make_draft(limits), limits))
    await draft_server.start("127.0.0.1:0")
    await draft_server.load()
    return DraftBeside(draft_server, services)


@contextlib.asynccontextmanager
async def real_service_process(role: str, log_path: Path, *flags: str):
    """`specd serve <role>` on the real `role` (`flags`: its engine, quantization) in a process of its
    own, on both cores, until the block ends: the real pair's transformers weights never load into the
    test process beside the session's llama.cpp pair."""
    from test_faults import DraftProcess  # Ray at import: not for the GPU test's machine (scripts/gpu_check.sh)

    service = DraftProcess(role, log_path)
    service.role, service.serving_timeout_s = role, 300
    service.extra_args = (*flags, "--threads", "2")  # the last --threads wins
    service.spawn()
    try:
        await service.serving()
        yield service
    finally:
        service.kill()


@contextlib.asynccontextmanager
async def real_draft_process(services: Services, log_path: Path, *flags: str):
    """The real draft in a `specd serve draft` process (real_service_process) in front of the target
    of `services`."""
    async with real_service_process("draft", log_path, *flags) as draft:
        yield DraftBeside(draft, services)


@pytest.fixture
async def tiny_services(tiny_loaded):
    services = await start_services(tiny_loaded["draft"], tiny_loaded["target"], Limits(max_sessions=8))
    yield services
    await services.close()


# The real pair on the llama.cpp engine (its GGUFs, the default on a CPU): llama.cpp allocates the KV
# up front, so a budget for the few sessions the real-pair tests open (2.4 GB with the weights).
REAL_LIMITS = Limits(max_cached_tokens=16 * 2048, max_session_tokens=2048)


def real_llama_cpp(role: str):
    """make(limits) of the real `role` on the llama.cpp engine (serve_engines' argument)."""
    from specd.model.loading import load_engine

    return lambda limits: load_engine(role, role, engine="llama.cpp", limits=limits)


@pytest.fixture(scope="session")
def ray_local():
    """One local Ray for the whole run (starting Ray takes seconds)."""
    import ray

    ray.init(
        include_dashboard=False, object_store_memory=256 * 1024 * 1024, logging_level="WARNING", configure_logging=False
    )
    yield ray
    ray.shutdown()


class Stack:
    """Tiny draft + target services and an orchestrator on Ray, all on port 0."""

    def __init__(self, services: Services, orchestrator):
        from specd.v1 import specdecode_pb2_grpc

        self.services = services
        self.orchestrator = orchestrator
        self.channel = grpc.aio.insecure_channel(f"127.0.0.1:{orchestrator.port}")
        self.client = specdecode_pb2_grpc.SpecDecodeStub(self.channel)

    async def live_sessions(self) -> tuple[int, int]:
        from specd.v1 import common_pb2

        draft = await self.services.draft.Info(common_pb2.InfoRequest())
        target = await self.services.target.Info(common_pb2.InfoRequest())
        return draft.live_sessions, target.live_sessions


async def start_stack(draft_loaded, target_loaded, limits: Limits = Limits()) -> Stack:
    return await stack_over(await start_services(draft_loaded, target_loaded, limits))


async def stack_over(services: Services) -> Stack:
    """An orchestrator on Ray over running services."""
    from specd.orchestrator.server import OrchestratorServer

    orchestrator = OrchestratorServer(
        f"127.0.0.1:{services.draft_server.port}", f"127.0.0.1:{services.target_server.port}", workers=2
    )
    await orchestrator.start("127.0.0.1:0")
    return Stack(services, orchestrator)


async def stop_stack(stack: Stack) -> None:
    await stack.channel.close()
    await stack.orchestrator.stop(0)
    await stack.services.close()


@pytest.fixture(scope="session")
async def tiny_stack(tiny_loaded, ray_local):
    stack = await start_stack(tiny_loaded["draft"], tiny_loaded["target"], Limits(max_sessions=32))
    yield stack
    await stop_stack(stack)


@pytest.fixture(scope="session")
async def real_stack(ray_local):
    """The real pair on the llama.cpp engine behind in-process services, and an orchestrator on Ray:
    loaded once per test session (1.6 GB of GGUF, no conversion), shared by every real-pair test of
    the orchestrator and its APIs. Exact by construction: a verify scores bit for bit as decode steps
    (model/llama_cpp_engine.py). The transformers engine's real-pair tests (tests/test_real_pair.py)
    run the float32 target in a process of its own: 7 GB, too much beside anything else."""
    stack = await stack_over(await serve_engines(real_llama_cpp("draft"), real_llama_cpp("target"), REAL_LIMITS))
    yield stack
    await stop_stack(stack)


@pytest.fixture(scope="session")
async def real_baselines(real_stack):
    """Speculation off on the real stack: the target's own greedy output per prompt of REAL_PROMPTS."""
    from specd.proto.client import complete, make_request

    return {
        p: await complete(real_stack.client, make_request(p, REAL_NEW_TOKENS, draft_tokens=0, ignore_eos=True))
        for p in REAL_PROMPTS
    }


REAL_PROMPTS = [
    "def fibonacci(n):",
    "import numpy as np\n\ndef softmax(x):",
    "# Write a function that parses an ISO 8601 date string\n",
]
REAL_NEW_TOKENS = 24


@pytest.fixture(scope="session")
async def tiny_http(tiny_stack):
    """The tiny stack's orchestrator also serving its OpenAI-compatible HTTP API: (base URL, model name)."""
    from specd.orchestrator.openai_api import HttpApi

    http = HttpApi(tiny_stack.orchestrator.core)
    port = await http.start("127.0.0.1", 0)
    yield f"http://127.0.0.1:{port}", http.api.model_name
    await http.stop()
