"""The RPCs both model services answer alike (Info, Tokenizer, Prefill, Release): each handler
unpacks, runs the model service (model/service.py) on the model thread, packs. The draft's and
the target's servicers add their own (Propose; Verify, Decode)."""

from specd.model.service import ModelService
from specd.serving.messages import cursor_from_proto, parsed
from specd.serving.thread import ModelThread
from specd.v1 import common_pb2


class ModelServicer:
    """Put first among a servicer's bases, before the generated one, whose handlers answer UNIMPLEMENTED.
    `service_type`: the model service it runs (Drafter, Verifier); its methods are looked up there
    at each call, so a subclass's own (or a test's stand-in) is the one that runs."""

    service_type: type[ModelService] = ModelService

    def __init__(self, thread: ModelThread):
        self.thread = thread

    async def Info(self, request, context):
        return await self.thread.info(context)

    async def Tokenizer(self, request, context):
        files = await self.thread.call(context, self.service_type.tokenizer_files)
        return common_pb2.TokenizerResponse(files=files)

    async def Prefill(self, request, context):
        cursor = await parsed(context, cursor_from_proto, request.cursor)
        cached = await self.thread.call(context, self.service_type.prefill, cursor)
        return common_pb2.PrefillResponse(cached_tokens=cached)

    async def Release(self, request, context):
        committed = list(request.committed) or None
        released = await self.thread.call(context, self.service_type.release, request.session_id, committed)
        if committed and self.thread.service.store.answers:  # a chat's: kept after the reply, not waited for
            self.thread.later(self.service_type.keep_answers)
        return common_pb2.ReleaseResponse(released=released)
