"""The engine interface (model/engine.py), engine by engine: batching, rollback and release must
not change a single logit. Every test takes `make_engine`; a new engine joins by adding itself
to ENGINES (a factory from the tiny target's LoadedModel)."""

import pytest
import torch
from conftest import DEVICES

from specd.draft_service.drafter import Drafter, ProposeCall
from specd.model.engine import Engine, Row
from specd.model.errors import CapacityExceeded
from specd.model.sampling import Sampling
from specd.model.sessions import Cursor
from specd.model.transformers_engine import TransformersEngine
from specd.proto.contract import fingerprint
from specd.proto.limits import Limits

# Factories from the tiny target's LoadedModel. "static-slot" steps batch-1 rows in the static
# slot (model/static_slot.py): through CUDA graphs on a GPU, eagerly on a CPU; its batch-1 rows
# are checked against batched passes, which never use the slot.
ENGINES = {
    "transformers": TransformersEngine,
    "transformers-static-slot": lambda loaded: TransformersEngine(loaded, graphs=True),
}
PROMPTS = [list(range(1000, 1007)), list(range(2000, 2003)), list(range(3000, 3012))]


@pytest.fixture(params=DEVICES)
def device(request) -> str:
    return request.param


@pytest.fixture(params=list(ENGINES))
def make_engine(request, tiny_on, device):
    return lambda: ENGINES[request.param](tiny_on(device)["target"])


@pytest.fixture
def engine(make_engine) -> Engine:
    return make_engine()


def feed(engine: Engine, session_id: str, tokens: list[int], keep: int = 1) -> torch.Tensor:
    return engine.forward([Row(session_id, tokens, keep)])[0]


def assert_same(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual, expected, atol=1e-4, rtol=1e-4)


def test_description(engine, device):
    described = engine.description
    assert described.vocab_size == 151_936 and described.max_positions == 4096
    assert described.dtype == "float32" and described.device.startswith(device) and described.quantization == "none"
    assert described.eos_token_ids and len(described.tokenizer_fingerprint) == 64


def test_logits_are_float32_for_the_last_keep_positions(engine):
    logits = feed(engine, "s", PROMPTS[0], keep=3)
    assert logits.dtype == torch.float32 and logits.shape == (3, engine.description.vocab_size)
    assert str(logits.device) == engine.description.device  # logits stay on the engine's device
    assert feed(engine, "t", PROMPTS[0], keep=0).shape == (0, engine.description.vocab_size)
    assert_same(logits, feed(engine, "u", PROMPTS[0], keep=len(PROMPTS[0]))[-3:])


def test_extending_in_pieces_equals_feeding_at_once(engine):
    whole = feed(engine, "whole", PROMPTS[2], keep=len(PROMPTS[2]))
    feed(engine, "pieces", PROMPTS[2][:5], keep=0)
    assert_same(feed(engine, "pieces", PROMPTS[2][5:9], keep=4), whole[5:9])
    assert_same(feed(engine, "pieces", PROMPTS[2][9:], keep=3), whole[9:])


def test_one_pass_over_several_rows_equals_each_row_alone(engine):
    """Different cached lengths (one new session), new tokens and kept logits in one pass."""
    tails = [[11, 12, 13, 14], [21], [31, 32]]
    keeps = [4, 1, 2]
    for index, prompt in enumerate(PROMPTS[:2]):
        for tag in ("alone", "together"):
            feed(engine, f"{tag}-{index}", prompt, keep=0)
    together = engine.forward([Row(f"together-{i}", tail, keep) for i, (tail, keep) in enumerate(zip(tails, keeps))])
    for index, (tail, keep) in enumerate(zip(tails, keeps)):
        assert_same(together[index], feed(engine, f"alone-{index}", tail, keep))
    # the KV each session got back is its own: the next step still matches
    together = engine.forward([Row(f"together-{i}", [40 + i], 1) for i in range(3)])
    for index in range(3):
        assert_same(together[index], feed(engine, f"alone-{index}", [40 + index]))


def test_a_row_with_no_tokens_sits_the_pass_out(engine):
    for tag in ("alone", "together"):
        feed(engine, f"{tag}-0", PROMPTS[0], keep=0)
        feed(engine, f"{tag}-1", PROMPTS[1], keep=0)
    together = engine.forward([Row("together-0", [], 0), Row("together-1", [7, 8], 2)])
    assert together[0].shape == (0, engine.description.vocab_size)
    assert_same(together[1], feed(engine, "alone-1", [7, 8], keep=2))
    assert_same(feed(engine, "together-0", [9]), feed(engine, "alone-0", [9]))


def test_a_block_of_passes_equals_the_same_passes_one_by_one(engine):
    """The drafting loop: K passes over the same sessions, rows dropping out as their K ends."""
    for index, prompt in enumerate(PROMPTS):
        for tag in ("block", "loose"):
            feed(engine, f"{tag}-{index}", prompt[:-1], keep=0)
    steps = [[[p[-1]] for p in PROMPTS], [[5], [6], [7]], [[8], [], [9]], [[], [], [10]]]
    in_block = []
    with engine.passes([f"block-{i}" for i in range(3)]):
        for step in steps:
            in_block.append(engine.forward([Row(f"block-{i}", tokens, len(tokens)) for i, tokens in enumerate(step)]))
    for step, block_logits in zip(steps, in_block):
        for index, tokens in enumerate(step):
            assert_same(block_logits[index], feed(engine, f"loose-{index}", tokens, len(tokens)))
    assert_same(engine.forward([Row(f"block-{i}", [50], 1) for i in range(3)])[2], feed(engine, "loose-2", [50]))


def test_crop_then_forward_equals_a_fresh_session_fed_the_same_tokens(engine):
    feed(engine, "s", PROMPTS[2], keep=0)
    engine.crop("s", 6)
    engine.crop("s", 9)  # holds 6: nothing to drop
    assert_same(feed(engine, "s", [77, 78], keep=2), feed(engine, "fresh", PROMPTS[2][:6] + [77, 78], keep=2))
    engine.crop("s", 0)
    assert_same(feed(engine, "s", [5, 6]), feed(engine, "fresh-2", [5, 6]))


def test_crop_after_a_batched_pass_rolls_back_that_session_only(engine):
    for index, prompt in enumerate(PROMPTS[:2]):
        feed(engine, f"s{index}", prompt, keep=0)
    engine.forward([Row("s0", [1, 2, 3], 0), Row("s1", [4, 5], 0)])
    engine.crop("s0", len(PROMPTS[0]) + 1)
    assert_same(feed(engine, "s0", [9]), feed(engine, "fresh-0", PROMPTS[0] + [1, 9]))
    assert_same(feed(engine, "s1", [9]), feed(engine, "fresh-1", PROMPTS[1] + [4, 5, 9]))


def test_release_forgets_the_session(engine):
    feed(engine, "s", PROMPTS[0], keep=0)
    engine.release("s")
    engine.release("s")  # twice, or never opened: nothing to do
    engine.release("nobody")
    engine.crop("nobody", 3)
    assert_same(feed(engine, "s", PROMPTS[1]), feed(engine, "fresh", PROMPTS[1]))


def test_transformers_engine_frees_the_cache_on_release(tiny_loaded):
    engine = TransformersEngine(tiny_loaded["target"])
    engine.forward([Row("a", PROMPTS[0]), Row("b", PROMPTS[1])])
    assert set(engine.caches) == {"a", "b"}
    engine.release("a")
    assert set(engine.caches) == {"b"}


def test_tokenizer_files_rebuild_the_tokenizer(engine, tmp_path):
    from transformers import AutoTokenizer

    for name, data in engine.tokenizer_files().items():
        (tmp_path / name).write_bytes(data)
    assert AutoTokenizer.from_pretrained(tmp_path).encode("hello world")


def test_the_session_store_keeps_the_transformers_engine_in_step(tiny_loaded):
    """Every session the store holds has a cache of its length; whatever ends a session (Release,
    eviction) takes its cache along, and a refused Prefill leaves none."""
    service = Drafter(TransformersEngine(tiny_loaded["draft"]), Limits(max_sessions=3, idle_timeout_s=0))
    engine = service.engine
    for index, prompt in enumerate(PROMPTS):
        service.prefill(Cursor(f"s{index}", 0, 0, prompt[:-1]))
    with pytest.raises(CapacityExceeded):
        service.prefill(Cursor("one-too-many", 0, 0, PROMPTS[0]))
    cursors = [Cursor(f"s{i}", len(p) - 1, fingerprint(p[:-1]), p[-1:]) for i, p in enumerate(PROMPTS)]
    service.propose_batch([ProposeCall(cursor, 3, Sampling()) for cursor in cursors])
    assert set(engine.caches) == set(service.store.sessions) == {"s0", "s1", "s2"}
    for index in range(3):
        assert engine.caches[f"s{index}"].get_seq_length() == len(service.store.sessions[f"s{index}"].tokens)
    service.release("s0")
    assert set(engine.caches) == set(service.store.sessions) == {"s1", "s2"}
    service.evict_idle()
    assert engine.caches == {} and service.store.sessions == {}
