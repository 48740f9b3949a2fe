"""specd.v1.TargetService: each handler unpacks, runs the target service on the model thread, packs."""

from collections.abc import Callable

from specd.model.errors import EngineError, InvalidRequest
from specd.proto.limits import MAX_DECODE_STEPS
from specd.proto.logprobs import top_logprobs_messages
from specd.serving.messages import cursor_from_proto, parsed, q_row_from_proto, sampling_from_proto
from specd.serving.server import ModelServer
from specd.serving.servicer import ModelServicer
from specd.target_service.verifier import Verification, Verifier, VerifyCall
from specd.v1 import target_pb2, target_pb2_grpc

SERVICE_NAME = "specd.v1.TargetService"


class TargetServicer(ModelServicer, target_pb2_grpc.TargetServiceServicer):
    """Info, Tokenizer, Prefill and Release: ModelServicer's."""

    service_type = Verifier

    async def Verify(self, request, context):
        call = await parsed(context, _verify_call, request)
        return _verify_response(await self.thread.batch(context, Verifier.verify_batch, call))

    async def Decode(self, request, context):
        """One token, or a run of `steps`: each step a call of its own on the model thread (other
        sessions' calls share its passes and take turns), continuing where the last one left off."""
        call, steps = await parsed(context, _decode_call, request)
        run = await self.thread.batch(context, Verifier.verify_batch, call)
        reused = _cached_prompt(run)  # the run's first call is the one that may open the session
        stops = set(request.stop_token_ids)
        while len(run.emitted_tokens) < steps and run.emitted_tokens[-1] not in stops:
            call = call.following(run)
            step = await self.thread.batch(context, Verifier.verify_batch, call, refusal=True)
            if isinstance(step, EngineError):  # refused (the session full, or released): the run ends here
                break
            run = run.then(step)
        return _verify_response(run, reused)


def _decode_call(request: target_pb2.DecodeRequest) -> tuple[VerifyCall, int]:
    """The run's first call, and how many tokens the run may emit."""
    if request.steps > MAX_DECODE_STEPS:
        raise InvalidRequest(f"steps must be in 0..{MAX_DECODE_STEPS} (0 or 1: one token), got {request.steps}")
    steps = max(1, request.steps)
    call = VerifyCall(
        cursor_from_proto(request.cursor),
        [],
        [],
        sampling_from_proto(request.sampling),
        request.return_logprobs,
        request.top_logprobs,
        request.prompt_logprobs,
        follow=steps > 1,
    )
    return call, steps


def _verify_call(request: target_pb2.VerifyRequest) -> VerifyCall:
    q_rows = [q_row_from_proto(row) for row in request.q]  # may refuse: INVALID_ARGUMENT
    return VerifyCall(
        cursor_from_proto(request.cursor),
        list(request.draft_tokens),
        q_rows,
        sampling_from_proto(request.sampling),
        request.return_logprobs,
        request.top_logprobs,
    )


def _cached_prompt(verification: Verification) -> int:
    """Of the call's cursor tokens, those the target took from its prefix cache (0 where the
    verifier does not say)."""
    return getattr(verification, "cached_prompt_tokens", 0)


def _verify_response(verification: Verification, cached_prompt: int | None = None) -> target_pb2.VerifyResponse:
    """The reply; `cached_prompt`: a Decode run's, from its first call (default: the verification's own)."""
    return target_pb2.VerifyResponse(
        accepted=verification.accepted,
        emitted_tokens=verification.emitted_tokens,
        logprobs=verification.logprobs,
        cached_tokens=verification.cached_tokens,
        top_logprobs=top_logprobs_messages(verification.top_logprobs),
        prompt_logprobs=verification.prompt_logprobs,
        prompt_top_logprobs=top_logprobs_messages(verification.prompt_top_logprobs),
        cached_prompt_tokens=_cached_prompt(verification) if cached_prompt is None else cached_prompt,
    )


def create_target_server(load_service: Callable[[], Verifier]) -> ModelServer:
    """A TargetService host: start(address) binds it, load() runs load_service and reports SERVING."""
    return ModelServer(SERVICE_NAME, target_pb2_grpc.add_TargetServiceServicer_to_server, TargetServicer, load_service)
