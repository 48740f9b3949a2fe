"""Top log-probabilities on the wire: per position, the most likely token ids and their log p, as
`TopLogprobs` messages. The target packs them into its Verify and Decode replies, the orchestrator
reads them from there and packs them again into its Generate stream: one pair of helpers for both."""

from collections.abc import Iterable

from specd.v1 import common_pb2

TopRows = list[tuple[list[int], list[float]]]  # per position: (token ids, log p), most likely first


def top_logprobs_messages(rows: Iterable[tuple[list[int], list[float]]]) -> list[common_pb2.TopLogprobs]:
    return [common_pb2.TopLogprobs(token_ids=token_ids, logprobs=logprobs) for token_ids, logprobs in rows]


def top_logprobs_rows(messages: Iterable[common_pb2.TopLogprobs]) -> TopRows:
    """As plain lists (what a Ray worker streams back, what the APIs format)."""
    return [(list(message.token_ids), list(message.logprobs)) for message in messages]
