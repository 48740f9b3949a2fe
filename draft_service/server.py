"""specd.v1.DraftService: each handler unpacks, runs the draft service on the model thread, packs."""

from collections.abc import Callable

from specd.draft_service.drafter import Drafter, ProposeCall
from specd.serving.messages import cursor_from_proto, parsed, q_row_to_proto, sampling_from_proto
from specd.serving.server import ModelServer
from specd.serving.servicer import ModelServicer
from specd.v1 import draft_pb2, draft_pb2_grpc

SERVICE_NAME = "specd.v1.DraftService"


class DraftServicer(ModelServicer, draft_pb2_grpc.DraftServiceServicer):
    """Info, Tokenizer, Prefill and Release: ModelServicer's."""

    service_type = Drafter

    async def Propose(self, request, context):
        cursor = await parsed(context, cursor_from_proto, request.cursor)
        call = ProposeCall(cursor, request.num_draft_tokens, sampling_from_proto(request.sampling))
        proposal = await self.thread.batch(context, Drafter.propose_batch, call)
        return draft_pb2.ProposeResponse(
            draft_tokens=proposal.draft_tokens,
            q=[q_row_to_proto(token_ids, probs) for token_ids, probs in proposal.q],
            cached_tokens=proposal.cached_tokens,
        )


def create_draft_server(load_service: Callable[[], Drafter]) -> ModelServer:
    """A DraftService host: start(address) binds it, load() runs load_service and reports SERVING."""
    return ModelServer(SERVICE_NAME, draft_pb2_grpc.add_DraftServiceServicer_to_server, DraftServicer, load_service)
