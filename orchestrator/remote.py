"""Connecting to the model services: wait until they serve, check they form a pair, get the tokenizer."""

import asyncio
import json
import time
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tokenizers import Tokenizer

from specd.proto.auth import ClientSecurity
from specd.proto.limits import MAX_MESSAGE_BYTES
from specd.v1 import common_pb2, draft_pb2_grpc, target_pb2_grpc

CHANNEL_OPTIONS = [
    # The services' own limit: the target's tokenizer files, and q rows up to the draft's --max-q-bytes.
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    # Reconnect to a restarted service within about a second (gRPC's default backs off to 2 min).
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 500),
    ("grpc.max_reconnect_backoff_ms", 1000),
]


class PairMismatch(Exception):
    """Draft and target cannot work together (different vocabularies or tokenizers)."""


@dataclass
class ServicePair:
    """The connected services. Without a draft service (draft_stub and draft_info None) only the
    lookup drafters guess (lookup.py LOOKUP_ONLY), and they never call a draft."""

    draft_stub: draft_pb2_grpc.DraftServiceStub | None
    target_stub: target_pb2_grpc.TargetServiceStub
    draft_info: common_pb2.ModelInfo | None
    target_info: common_pb2.ModelInfo
    tokenizer: Tokenizer
    channels: tuple
    tokenizer_config: dict = field(default_factory=dict)  # the target's, with its chat template

    @property
    def has_draft(self) -> bool:
        return self.draft_info is not None

    @property
    def infos(self) -> list[common_pb2.ModelInfo]:
        """The Info of each service there is (the draft's first), for limits every service must respect."""
        return [info for info in (self.draft_info, self.target_info) if info is not None]

    @property
    def stubs(self) -> list:
        """A stub for each service there is (the draft's first), for calls every service gets (Release)."""
        return [stub for stub in (self.draft_stub, self.target_stub) if stub is not None]


async def wait_until_serving(
    address: str, timeout_s: float = 600.0, security: ClientSecurity = ClientSecurity()
) -> None:
    """Poll grpc.health.v1 until SERVING; one actionable error if it never comes."""
    deadline = time.monotonic() + timeout_s
    last = "no answer"
    async with security.channel(address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            try:
                reply = await health.Check(health_pb2.HealthCheckRequest(service=""), timeout=5.0)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
                last = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
            except grpc.aio.AioRpcError as error:
                last = error.code().name
            await asyncio.sleep(0.25)
    raise TimeoutError(f"{address} did not report SERVING within {timeout_s:.0f} s (last: {last}); is it running?")


async def connect_pair(
    draft_address: str | None,
    target_address: str,
    timeout_s: float = 600.0,
    security: ClientSecurity = ClientSecurity(),
) -> ServicePair:
    """Wait for both services, check they form a pair; `security`: the orchestrator's token and CA.
    `draft_address` None (or empty): the target alone, for the lookup drafters."""
    draft_address = draft_address or None
    addresses = [address for address in (draft_address, target_address) if address]
    await asyncio.gather(*(wait_until_serving(address, timeout_s, security) for address in addresses))
    target_channel = security.channel(target_address, CHANNEL_OPTIONS)
    target_stub = target_pb2_grpc.TargetServiceStub(target_channel)
    target_info, files = await asyncio.gather(
        target_stub.Info(common_pb2.InfoRequest()), target_stub.Tokenizer(common_pb2.TokenizerRequest())
    )
    draft_channel = draft_stub = draft_info = None
    if draft_address:
        draft_channel = security.channel(draft_address, CHANNEL_OPTIONS)
        draft_stub = draft_pb2_grpc.DraftServiceStub(draft_channel)
        draft_info = await draft_stub.Info(common_pb2.InfoRequest())
        check_pair(draft_info, target_info)
    tokenizer = Tokenizer.from_str(files.files["tokenizer.json"].decode())
    return ServicePair(
        draft_stub,
        target_stub,
        draft_info,
        target_info,
        tokenizer,
        tuple(channel for channel in (draft_channel, target_channel) if channel is not None),
        tokenizer_config(files.files),
    )


def tokenizer_config(files) -> dict:
    """tokenizer_config.json, with the chat template from chat_template.jinja where that is its own file."""
    config = json.loads(files["tokenizer_config.json"]) if "tokenizer_config.json" in files else {}
    if "chat_template.jinja" in files:
        config["chat_template"] = files["chat_template.jinja"].decode()
    return config


def check_pair(draft: common_pb2.ModelInfo, target: common_pb2.ModelInfo) -> None:
    """Refuse a pair that cannot share token ids (e.g. Qwen2 1.5B and 72B differ in vocabulary size)."""
    if draft.vocab_size != target.vocab_size:
        raise PairMismatch(
            f"draft {draft.model!r} has a vocabulary of {draft.vocab_size}, target {target.model!r} of "
            f"{target.vocab_size}: speculative decoding needs the same vocabulary; "
            f"pick a draft from the target's family"
        )
    if draft.tokenizer_fingerprint != target.tokenizer_fingerprint:
        raise PairMismatch(
            f"draft {draft.model!r} and target {target.model!r} have different tokenizers "
            f"({draft.tokenizer_fingerprint[:12]} vs {target.tokenizer_fingerprint[:12]}): "
            f"token ids would not mean the same"
        )
