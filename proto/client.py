"""A client of specd.v1.SpecDecode: stream a completion, or collect it with its stats."""

import time
from dataclasses import dataclass, field

import grpc

from specd.proto.auth import ClientSecurity
from specd.v1 import common_pb2, specdecode_pb2, specdecode_pb2_grpc


@dataclass
class Completion:
    """One Generate call's outcome, as `complete` collects it: the text and token ids streamed, the
    `Final` message (finish reason, usage, the seed, the speculation stats), and when each delta came."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    final: specdecode_pb2.Final | None = None
    token_times: list[float] = field(default_factory=list)  # perf_counter() when each delta arrived
    started: float = 0.0


def make_request(
    prompt: str,
    max_new_tokens: int = 128,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    seed: int | None = None,
    stop: list[str] = (),
    draft_tokens: int | None = None,
    ignore_eos: bool = False,
    drafter: str = "",
    cache_salt: str = "",
) -> specdecode_pb2.GenerateRequest:
    """`seed` None leaves it unset: the orchestrator draws one and reports it in Final.seed.
    `cache_salt`: the tenant's prefix-cache salt (requests share cached prompt prefixes only with
    requests of the same salt; empty: the unsalted ones)."""
    request = specdecode_pb2.GenerateRequest(
        prompt=prompt,
        max_new_tokens=max_new_tokens,
        stop=list(stop),
        ignore_eos=ignore_eos,
        drafter=drafter,
        cache_salt=cache_salt,
        sampling=common_pb2.SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k),
    )
    if seed is not None:
        request.sampling.seed = seed
    if draft_tokens is not None:
        request.draft_tokens = draft_tokens
    return request


async def complete(
    stub: specdecode_pb2_grpc.SpecDecodeStub, request, on_text=None, timeout: float | None = None
) -> Completion:
    """Run one Generate call to the end; on_text(delta_text) sees the text as it streams."""
    completion = Completion(started=time.perf_counter())
    async for reply in stub.Generate(request, timeout=timeout):
        if reply.HasField("final"):
            completion.final = reply.final
            continue
        completion.text += reply.delta.text
        completion.token_ids += reply.delta.token_ids
        completion.token_times.append(time.perf_counter())
        if on_text and reply.delta.text:
            on_text(reply.delta.text)
    return completion


def channel(address: str, security: ClientSecurity = ClientSecurity()) -> grpc.aio.Channel:
    """A channel to an orchestrator; `security` carries the bearer token and the CA for TLS."""
    return security.channel(address)
