"""Shared fixtures: tiny random models of the real architecture, in-process services on port 0."""

import shutil
from pathlib import Path

import grpc
import pytest
import torch
from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

from specd.draft_service.engine import DraftEngine
from specd.draft_service.server import create_draft_server
from specd.model.loading import load_model
from specd.model.sessions import Limits
from specd.model.store import resolve_model
from specd.target_service.engine import TargetEngine
from specd.target_service.server import create_target_server
from specd.v1 import draft_pb2_grpc, target_pb2_grpc

# Tiny models use the real Qwen2.5 tokenizer (scripts/test.sh fetches the pair first), so
# their vocabulary, ids and text behave exactly like the real pair's.
TINY_CONFIG = dict(
    vocab_size=151_936, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096, tie_word_embeddings=True,
)


def make_tiny_model(folder: Path, seed: int) -> Path:
    torch.manual_seed(seed)
    tokenizer = AutoTokenizer.from_pretrained(resolve_model("draft"))
    model = Qwen2ForCausalLM(Qwen2Config(**TINY_CONFIG, eos_token_id=tokenizer.eos_token_id))
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {"draft": make_tiny_model(root / "draft", 1), "target": make_tiny_model(root / "target", 2)}


@pytest.fixture(scope="session")
def tiny_loaded(tiny_dirs):
    return {role: load_model(str(path), "float32") for role, path in tiny_dirs.items()}


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


async def start_services(draft_loaded, target_loaded, limits: Limits = Limits()) -> Services:
    draft_server = create_draft_server(lambda: DraftEngine(draft_loaded, limits))
    target_server = create_target_server(lambda: TargetEngine(target_loaded, limits))
    for server in (draft_server, target_server):
        await server.start("127.0.0.1:0")
        await server.load()
    return Services(draft_server, target_server)


@pytest.fixture
async def tiny_services(tiny_loaded):
    services = await start_services(tiny_loaded["draft"], tiny_loaded["target"], Limits(max_sessions=8))
    yield services
    await services.close()
