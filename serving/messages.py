"""Message translation the draft and target servicers share: protobuf to and from the model
package's types, and engine errors to status codes with what the session holds
(docs/architecture.md §5).
"""

from collections.abc import Callable

import grpc
import numpy as np
import torch

from specd.model.devices import device_memory
from specd.model.errors import CapacityExceeded, CursorMismatch, EngineError, InvalidRequest, SessionNotFound
from specd.model.prefix_cache import PrefixStats
from specd.model.sampling import Sampling
from specd.model.scheduler import Scheduler
from specd.model.service import ModelService
from specd.model.sessions import Cursor
from specd.proto.contract import HELD_FINGERPRINT_KEY, HELD_TOKENS_KEY
from specd.proto.limits import MAX_CACHE_SALT_CHARS
from specd.v1 import common_pb2, draft_pb2

STATUS_OF = {
    InvalidRequest: grpc.StatusCode.INVALID_ARGUMENT,
    SessionNotFound: grpc.StatusCode.NOT_FOUND,
    CursorMismatch: grpc.StatusCode.FAILED_PRECONDITION,
    CapacityExceeded: grpc.StatusCode.RESOURCE_EXHAUSTED,
}


async def abort_with(context: grpc.aio.ServicerContext, error: EngineError) -> None:
    """End the call with the error's status code; a cursor mismatch also says what the session holds."""
    held = ()
    if isinstance(error, CursorMismatch):
        held = ((HELD_TOKENS_KEY, str(error.held_tokens)), (HELD_FINGERPRINT_KEY, str(error.held_fingerprint)))
    await context.abort(STATUS_OF[type(error)], str(error), held)


async def parsed(context: grpc.aio.ServicerContext, parse: Callable, *args):
    """parse(*args) on the event loop (message checks that need no model); refusals leave as status codes."""
    try:
        return parse(*args)
    except EngineError as error:
        await abort_with(context, error)


def cursor_from_proto(cursor: common_pb2.SessionCursor) -> Cursor:
    """The cursor, its salt checked (InvalidRequest: INVALID_ARGUMENT); run it through `parsed`."""
    if len(cursor.cache_salt) > MAX_CACHE_SALT_CHARS:
        raise InvalidRequest(
            f"cache_salt must be at most {MAX_CACHE_SALT_CHARS} characters, got {len(cursor.cache_salt)}"
        )
    return Cursor(cursor.session_id, cursor.start, cursor.fingerprint, list(cursor.tokens), salt=cursor.cache_salt)


def sampling_from_proto(sampling: common_pb2.SamplingParams) -> Sampling:
    return Sampling(
        sampling.temperature,
        sampling.top_p or 1.0,
        sampling.top_k,
        sampling.seed,
        presence_penalty=sampling.presence_penalty,
        frequency_penalty=sampling.frequency_penalty,
        repetition_penalty=sampling.repetition_penalty or 1.0,  # 0 (unset) means off
        logit_bias=dict(sampling.logit_bias),
        prompt_tokens=sampling.prompt_tokens,
    )


def q_row_to_proto(token_ids: torch.Tensor, probs: torch.Tensor) -> draft_pb2.SparseDistribution:
    return draft_pb2.SparseDistribution(token_ids=token_ids.tolist(), probs=probs.numpy().astype("<f4").tobytes())


def q_row_from_proto(row: draft_pb2.SparseDistribution) -> tuple[torch.Tensor, torch.Tensor]:
    if len(row.probs) % 4:
        raise InvalidRequest("q probs must be little-endian float32 (a multiple of 4 bytes)")
    probs = torch.from_numpy(np.frombuffer(row.probs, dtype="<f4").copy())
    return torch.tensor(list(row.token_ids), dtype=torch.long), probs


def model_info(service: ModelService, scheduler: Scheduler) -> common_pb2.ModelInfo:
    described, limits = service.engine.description, service.limits
    prefixes = prefix_stats(service)
    memory = device_memory(torch.device(described.device))  # live: free memory as of this call
    return common_pb2.ModelInfo(
        model=described.name,
        role=service.role,
        vocab_size=described.vocab_size,
        tokenizer_fingerprint=described.tokenizer_fingerprint,
        dtype=described.dtype,
        max_session_tokens=limits.max_session_tokens,
        max_sessions=limits.max_sessions,
        max_cached_tokens=limits.max_cached_tokens,
        max_draft_tokens=limits.max_draft_tokens,
        eos_token_ids=described.eos_token_ids,
        live_sessions=len(service.store.sessions),
        cached_tokens=service.store.cached_tokens,
        max_batch_size=limits.max_batch_size,
        max_batch_tokens=limits.max_batch_tokens,
        batch_sizes=dict(scheduler.batch_sizes),
        queued_calls=scheduler.queue_depth,
        quantization=described.quantization,
        batched_tokens=scheduler.batched_tokens,
        max_q_bytes=limits.max_q_bytes if service.role == "draft" else 0,
        device=described.device,
        device_name=memory.name,
        device_memory_total_bytes=memory.total_bytes,
        device_memory_free_bytes=memory.free_bytes,
        prefix_cache_budget_tokens=prefixes.budget_tokens,
        prefix_cache_tokens=prefixes.tokens,
        prefix_cache_entries=prefixes.entries,
        prefix_cache_blocks=prefixes.blocks,
        prefix_cache_bytes=prefixes.bytes,
        prefix_cache_hit_tokens=prefixes.hit_tokens,
        prefix_cache_miss_tokens=prefixes.miss_tokens,
        prefix_cache_evictions=prefixes.evictions,
        prefix_cache_failures=prefixes.failures,
        prefix_cache_answers=prefixes.answers,
        pass_seconds=service.passes.seconds if service.passes else (),
        pass_positions=service.passes.positions if service.passes else (),
        prefill_seconds_per_token=service.passes.prefill_per_token if service.passes else 0.0,
        scored_per_call=described.scored_per_call or 0,
        splits_rows=described.splits_rows,
    )


def prefix_stats(service: ModelService | None) -> PrefixStats:
    """What the service's prefix cache did and holds (all 0 while it loads, or for a service without one)."""
    stats = getattr(service, "prefix_stats", None)
    return stats() if stats else PrefixStats()
