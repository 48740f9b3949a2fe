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


async def release_sessions(
    role: str, address: str, session_ids: list[str], security: ClientSecurity = ClientSecurity(), timeout_s: float = 5.0
) -> None:
    """Release these sessions on the `role` service at `address`, best effort (one it no longer holds, or
    a service that does not answer, is no error: idle eviction frees what this cannot)."""
    stub_of = draft_pb2_grpc.DraftServiceStub if role == "draft" else target_pb2_grpc.TargetServiceStub
    async with security.channel(address) as channel:
        stub = stub_of(channel)
        calls = [stub.Release(common_pb2.ReleaseRequest(session_id=sid), timeout=timeout_s) for sid in session_ids]
        await asyncio.gather(*calls, return_exceptions=True)


LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1", "[::1]")


def share_cores(draft_address: str, target_address: str, draft_info, target_info) -> bool:
    """Whether the two services compute on the same CPU cores, as far as the orchestrator can tell:
    both on the CPU (ModelInfo.device) and both reached at a loopback address (`specd up` on one
    machine). Then `auto` prices drafting ahead as taking its work from the target's verify."""
    on_cpu = draft_info.device in ("", "cpu") and target_info.device in ("", "cpu")
    hosts = {address.rsplit(":", 1)[0] for address in (draft_address, target_address)}
    return on_cpu and hosts <= set(LOOPBACK_HOSTS)


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


@dataclass
class Service:
    """One connected model service: its channel, stub and Info; a target's tokenizer too."""

    address: str
    channel: grpc.aio.Channel
    stub: draft_pb2_grpc.DraftServiceStub | target_pb2_grpc.TargetServiceStub
    info: common_pb2.ModelInfo
    tokenizer: Tokenizer | None = None  # a target's
    tokenizer_config: dict = field(default_factory=dict)  # a target's, with its chat template


async def connect_service(
    role: str, address: str, timeout_s: float = 600.0, security: ClientSecurity = ClientSecurity()
) -> Service:
    """Wait until the `role` ("draft" or "target") service at `address` serves, then connect; a
    target's tokenizer comes with it. `security`: the orchestrator's token and CA."""
    await wait_until_serving(address, timeout_s, security)
    channel = security.channel(address, CHANNEL_OPTIONS)
    if role == "draft":
        stub = draft_pb2_grpc.DraftServiceStub(channel)
        return Service(address, channel, stub, await stub.Info(common_pb2.InfoRequest()))
    stub = target_pb2_grpc.TargetServiceStub(channel)
    info, files = await asyncio.gather(
        stub.Info(common_pb2.InfoRequest()), stub.Tokenizer(common_pb2.TokenizerRequest())
    )
    tokenizer = Tokenizer.from_str(files.files["tokenizer.json"].decode())
    return Service(address, channel, stub, info, tokenizer, tokenizer_config(files.files))


def pair_of(draft: Service | None, target: Service) -> ServicePair:
    """A draft (None: the target alone) and a target that can work together, as a pair."""
    if draft:
        check_pair(draft.info, target.info)
    return ServicePair(
        draft.stub if draft else None,
        target.stub,
        draft.info if draft else None,
        target.info,
        target.tokenizer,
        tuple(service.channel for service in (draft, target) if service),
        target.tokenizer_config,
    )


async def connect_pair(
    draft_address: str | None,
    target_address: str,
    timeout_s: float = 600.0,
    security: ClientSecurity = ClientSecurity(),
) -> ServicePair:
    """Wait for both services, check they form a pair; `security`: the orchestrator's token and CA.
    `draft_address` None (or empty): the target alone, for the lookup drafters."""
    connecting = [connect_service("target", target_address, timeout_s, security)]
    if draft_address:
        connecting.append(connect_service("draft", draft_address, timeout_s, security))
    target, *draft = await asyncio.gather(*connecting)
    return pair_of(draft[0] if draft else None, target)


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
