"""specd.v1.SpecDecode over gRPC: the gRPC transport, translating between the wire and core.py, which
does the work. A leaf over the core, as the HTTP API is (openai_api.py); server.py hosts both."""

import grpc

from specd.orchestrator.core import BadRequest, Core, stats_proto
from specd.orchestrator.request import Delta, Failed, Finished
from specd.proto.logprobs import top_logprobs_messages
from specd.v1 import specdecode_pb2, specdecode_pb2_grpc

SERVICE_NAME = "specd.v1.SpecDecode"
REPLICAS_SERVICE_NAME = "specd.v1.Replicas"  # scaling.py: the pools of replicas, changed while serving
API_LABEL = "grpc"  # the `api` label of this API's requests in the metrics


class SpecDecodeServicer(specdecode_pb2_grpc.SpecDecodeServicer):
    def __init__(self, core: Core):
        self.core = core

    async def Generate(self, request, context):
        try:
            events = self.core.start(request, API_LABEL, context.time_remaining())
        except BadRequest as error:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
        async for event in events:
            if isinstance(event, Failed):
                await context.abort(grpc.StatusCode[event.code], event.message, retry_pushback(event))
            yield to_proto(event)

    async def Info(self, request, context):
        return await self.core.info()


def retry_pushback(failed: Failed) -> tuple[tuple[str, str], ...]:
    """Trailing metadata with gRPC's own retry hint (gRFC A6 `grpc-retry-pushback-ms`: a client with a
    retry policy waits that long), for a refusal that a retry may get past (request.py RETRY_AFTER_S)."""
    if failed.retry_after_s is None:
        return ()
    return (("grpc-retry-pushback-ms", str(round(failed.retry_after_s * 1000))),)


def to_proto(event: Delta | Finished) -> specdecode_pb2.GenerateResponse:
    if isinstance(event, Delta):
        delta = specdecode_pb2.Delta(
            text=event.text,
            token_ids=event.token_ids,
            logprobs=event.logprobs,
            top_logprobs=top_logprobs_messages(event.top_logprobs),
            prompt_logprobs=event.prompt_logprobs,
            prompt_top_logprobs=top_logprobs_messages(event.prompt_top_logprobs),
        )
        return specdecode_pb2.GenerateResponse(delta=delta)
    return specdecode_pb2.GenerateResponse(
        final=specdecode_pb2.Final(
            finish_reason=event.reason,
            usage=specdecode_pb2.Usage(
                prompt_tokens=event.prompt_tokens,
                completion_tokens=event.completion_tokens,
                cached_prompt_tokens=event.cached_prompt_tokens,
            ),
            stats=stats_proto(event.stats),
            seed=event.seed,
        )
    )
