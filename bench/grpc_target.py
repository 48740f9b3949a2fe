"""specd's gRPC API (specd.v1.SpecDecode) as a load-test target: `GrpcTarget` at HOST:PORT streams
each request's Generate, timing every delta that carries tokens, and reads the server's Info for
the record (`server_info`: the served pair, devices and default K) and for how much the services
batched (their passes by calls per pass). Its runs carry specd's own figures (α, K, calls per
pass); the other kind of target, an OpenAI-compatible server, is openai_client.OpenAiTarget.
Every request is bounded by a timeout; failures are counted, never raised.
"""

import asyncio
import time
from collections import Counter

import grpc

from specd.bench.workload import RequestResult, Settings
from specd.proto.client import channel, make_request
from specd.v1 import common_pb2, specdecode_pb2, specdecode_pb2_grpc


def build_request(settings: Settings, index: int) -> specdecode_pb2.GenerateRequest:
    """Request number `index`: the prompts in turn, a seed of its own."""
    return make_request(
        settings.prompt(index),
        max_new_tokens=settings.max_new_tokens,
        temperature=settings.temperature,
        seed=settings.seed + index,
        draft_tokens=settings.draft_tokens,
        drafter=settings.drafter,
        ignore_eos=settings.ignore_eos,
    )


async def send_one(stub: specdecode_pb2_grpc.SpecDecodeStub, settings: Settings, index: int) -> RequestResult:
    """Stream one request to its end, timing each delta; errors land in `error`, never raised."""
    result = RequestResult(started=time.perf_counter(), index=index)
    try:
        async with asyncio.timeout(settings.timeout + 5):  # the gRPC deadline should fire first
            await _stream(stub, build_request(settings, index), settings.timeout, result)
    except grpc.aio.AioRpcError as error:
        result.error = error.code().name
    except TimeoutError:
        result.error = grpc.StatusCode.DEADLINE_EXCEEDED.name
    except Exception as error:  # a load test counts what goes wrong and carries on
        result.error = type(error).__name__
    result.ended = time.perf_counter()
    return result


async def _stream(stub, request, timeout: float, result: RequestResult) -> None:
    final = None
    async for reply in stub.Generate(request, timeout=timeout):
        if reply.HasField("final"):
            final = reply.final
        elif reply.delta.token_ids:
            result.delta_times.append(time.perf_counter())
            result.delta_tokens.append(len(reply.delta.token_ids))
            result.text += reply.delta.text
    if final is None:
        result.error = "NO_FINAL_MESSAGE"
        return
    result.completion_tokens = final.usage.completion_tokens or sum(result.delta_tokens)
    result.prompt_tokens = final.usage.prompt_tokens or None
    result.cached_prompt_tokens = cached_prompt_tokens(final)
    result.stats = final.stats


def cached_prompt_tokens(final) -> int | None:
    """The prompt tokens the server served from its prefix cache: `cached_prompt_tokens` of the Final's
    stats (or its usage, or the Final itself); None where this proto has no such field, or leaves it unset."""
    for message in (final.stats, final.usage, final):
        value = getattr(message, "cached_prompt_tokens", None)
        if value is None:
            continue
        try:
            if not message.HasField("cached_prompt_tokens"):  # an `optional` field the server left unset
                return None
        except ValueError:  # a plain proto3 scalar: no presence, its value is the answer
            pass
        return int(value)
    return None


class GrpcTarget:
    """A load-test target: specd's gRPC API (specd.v1.SpecDecode) at HOST:PORT, whose runs carry
    specd's figures (α, K, calls per pass). The other kind, an OpenAI-compatible server, is
    specd.bench.openai_client.OpenAiTarget; both have this interface."""

    backend = "grpc"
    speculation = True  # the runs carry α, K, acceptance by position and calls per pass

    def __init__(self, address: str):
        self.name = self.address = address
        self.info: dict | None = None

    async def open(self, timeout: float) -> None:
        self.channel = channel(self.address)
        self.stub = specdecode_pb2_grpc.SpecDecodeStub(self.channel)
        self.info = await server_info(self.stub, timeout)

    async def close(self) -> None:
        await self.channel.close()

    async def send(self, settings: Settings, index: int) -> RequestResult:
        return await send_one(self.stub, settings, index)

    async def passes(self, timeout: float) -> dict | None:
        return await _passes(self.stub, timeout)

    def describe(self) -> dict:
        return {"name": self.name, "backend": self.backend, "address": self.address, "server_info": self.info}


async def server_info(stub, timeout: float) -> dict | None:
    """The served pair and default K, for the record; None when the server does not answer."""
    try:
        info = await stub.Info(common_pb2.InfoRequest(), timeout=min(timeout, 10.0))
    except grpc.aio.AioRpcError:
        return None
    return {
        "draft_model": info.draft.model,
        "target_model": info.target.model,
        "dtype": info.target.dtype,
        "default_draft_tokens": None if info.adaptive_draft_tokens else info.default_draft_tokens,
        "max_draft_tokens": info.max_draft_tokens,
        "draft_quantization": info.draft.quantization,
        "draft_device": info.draft.device,
        "target_device": info.target.device,
        "target_device_name": info.target.device_name,
        "workers": info.workers,
    }


async def _passes(stub, timeout: float) -> dict[str, Counter] | None:
    """Passes each service has run so far, by calls per pass (its Info's batch_sizes); None if unanswered."""
    try:
        info = await stub.Info(common_pb2.InfoRequest(), timeout=min(timeout, 10.0))
    except grpc.aio.AioRpcError:
        return None
    return {
        role: (Counter(dict(service.batch_sizes)), service.batched_tokens)
        for role, service in (("draft", info.draft), ("target", info.target))
    }
