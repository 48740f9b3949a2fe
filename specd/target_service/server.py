"""specd.v1.TargetService: each handler unpacks, runs the engine on the model thread, packs."""

from typing import Callable

from specd.serving import (
    ModelServer, ModelThread, cursor_from_proto, model_info, q_row_from_proto, sampling_from_proto,
)
from specd.target_service.engine import TargetEngine, Verification
from specd.v1 import common_pb2, target_pb2, target_pb2_grpc

SERVICE_NAME = "specd.v1.TargetService"


class TargetServicer(target_pb2_grpc.TargetServiceServicer):
    def __init__(self, thread: ModelThread):
        self.thread = thread

    async def Info(self, request, context):
        return await self.thread.peek(context, model_info)

    async def Tokenizer(self, request, context):
        files = await self.thread.call(context, TargetEngine.tokenizer_files)
        return common_pb2.TokenizerResponse(files=files)

    async def Prefill(self, request, context):
        cached = await self.thread.call(context, TargetEngine.prefill, cursor_from_proto(request.cursor))
        return common_pb2.PrefillResponse(cached_tokens=cached)

    async def Verify(self, request, context):
        return await self.thread.call(context, _verify, request)

    async def Decode(self, request, context):
        return await self.thread.call(context, _decode, request)

    async def Release(self, request, context):
        released = await self.thread.call(context, TargetEngine.release, request.session_id)
        return common_pb2.ReleaseResponse(released=released)


def _verify(engine: TargetEngine, request: target_pb2.VerifyRequest) -> target_pb2.VerifyResponse:
    q_rows = [q_row_from_proto(row) for row in request.q]  # parsed here so bad rows are INVALID_ARGUMENT
    verification = engine.verify(
        cursor_from_proto(request.cursor), list(request.draft_tokens), q_rows,
        sampling_from_proto(request.sampling), request.return_logprobs,
    )
    return _verify_response(verification)


def _decode(engine: TargetEngine, request: target_pb2.DecodeRequest) -> target_pb2.VerifyResponse:
    verification = engine.verify(
        cursor_from_proto(request.cursor), [], [], sampling_from_proto(request.sampling), request.return_logprobs
    )
    return _verify_response(verification)


def _verify_response(verification: Verification) -> target_pb2.VerifyResponse:
    return target_pb2.VerifyResponse(
        accepted=verification.accepted,
        emitted_tokens=verification.emitted_tokens,
        logprobs=verification.logprobs,
        cached_tokens=verification.cached_tokens,
    )


def create_target_server(load_engine: Callable[[], TargetEngine]) -> ModelServer:
    """A TargetService host: start(address) binds it, load() runs load_engine and reports SERVING."""
    return ModelServer(SERVICE_NAME, target_pb2_grpc.add_TargetServiceServicer_to_server, TargetServicer, load_engine)
