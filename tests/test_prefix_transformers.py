"""The transformers engine's part of the prefix cache (model/engine.py `reusable`, `snapshot`,
`restore`; docs/architecture.md §4, the prefix cache): a session restored from a snapshot of a
prefix, then forwarded over the rest of the prompt, gives the logits a fresh session forwarded over
the whole prompt gives: bit for bit alone (both prefill in the same block calls, and the engine's
load-time probe found them equal), in float32 up to other shapes' rounding in a padded batch, from
a session's own DynamicCache and from its static row, and through CUDA graphs (the `gpu` test)."""

import pytest
import torch
from conftest import DEVICES

from specd.model.engine import Row
from specd.model.transformers_engine import KVSnapshot, TransformersEngine

PROMPT = [1000 + (index * 37) % 5000 for index in range(150)]  # two 64-token blocks, then 22 more
PREFIX = 128
OTHERS = [list(range(2000, 2040)), list(range(3000, 3013))]

# In a padded batch beside other sessions a restored session's rows run in matmuls of other shapes
# than a lone fresh prefill's: float32-equal there, not bit for bit (pytest -s prints each comparison's
# largest difference). Alone, both run the same block calls: bit for bit (atol 0).
TOLERANCE = 1e-5


def assert_exact(actual: torch.Tensor, expected: torch.Tensor, what: str, atol: float = TOLERANCE) -> None:
    difference = (actual - expected).abs().max().item() if actual.numel() else 0.0
    print(f"max |restored - fresh| {what}: {difference:.3g}")
    assert torch.allclose(actual, expected, atol=atol, rtol=0), f"{what}: max difference {difference}"
    assert torch.equal(actual.argmax(-1), expected.argmax(-1)), what


def feed(engine: TransformersEngine, session_id: str, tokens: list[int], keep: int) -> torch.Tensor:
    return engine.forward([Row(session_id, tokens, keep)])[0]


def fresh_rest(engine: TransformersEngine, session_id: str, tokens: list[int], start: int) -> torch.Tensor:
    """A fresh session over all of `tokens`: the logits of every token from `start` on."""
    return feed(engine, session_id, tokens, len(tokens) - start)


@pytest.fixture(params=["dynamic", "static-rows"])
def kind(request) -> str:
    return request.param


def make(loaded, kind: str) -> TransformersEngine:
    """`static-rows`: passes of up to 8 sessions run in the static rows (eagerly on a CPU)."""
    return TransformersEngine(loaded, graphs=kind == "static-rows")


def prefilled_source(engine: TransformersEngine, kind: str) -> torch.Tensor:
    """Session "source": the whole prompt, then two decode steps; where it sits is the kind's."""
    feed(engine, "source", PROMPT, 0)
    feed(engine, "source", [7], 1)
    last = feed(engine, "source", [8], 1)
    if kind == "static-rows":
        assert engine.slots.row_of("source") is not None and "source" not in engine.caches
    else:
        assert "source" in engine.caches
    return last


def test_reusable_is_what_prefill_calls_computed_and_zero_for_an_unknown_session(tiny_loaded, kind):
    """The prompt (its block calls), not the decode steps after it; a crop inside keeps whole blocks."""
    engine = make(tiny_loaded["target"], kind)
    assert engine.prefixes_exact  # the load-time probe: restored and fresh equal bit for bit on this CPU
    assert engine.reusable("nobody") == 0
    prefilled_source(engine, kind)
    assert engine.reusable("source") == len(PROMPT) and engine.held("source") == len(PROMPT) + 2
    engine.crop("source", 100)
    assert engine.reusable("source") == 64


def test_a_prompt_restored_at_a_messages_end_goes_on_in_the_calls_of_a_fresh_prefill(tiny_loaded):
    """Issue 49: prefill calls end before every end-of-turn token too (model/prefix_cache.py
    `prefill_cuts`); restored at one inside a block, the rest of the prompt runs in the calls a fresh
    prefill makes, so all of it stays reusable and its logits are the fresh prefill's bit for bit."""
    engine = make(tiny_loaded["target"], "dynamic")
    end = 100  # inside the second block
    prompt = PROMPT[:end] + [engine.description.eos_token_ids[0]] + PROMPT[end:]
    fresh = feed(engine, "fresh", prompt, 1)
    assert engine.reusable("fresh") == len(prompt) - 1
    engine.restore("restored", engine.snapshot("fresh", end), end)
    assert torch.equal(feed(engine, "restored", prompt[end:], 1), fresh)
    assert engine.reusable("restored") == len(prompt) - 1
    engine.restore("mid-message", engine.snapshot("fresh", end - 1), end - 1)  # not a cut: reusable no further
    feed(engine, "mid-message", prompt[end - 1 :], 1)
    assert engine.reusable("mid-message") == end - 1


def test_where_the_probe_finds_restored_and_fresh_apart_nothing_is_reusable(tiny_loaded, monkeypatch):
    monkeypatch.setattr(TransformersEngine, "_prefix_exact", lambda engine: False)
    engine = make(tiny_loaded["target"], "dynamic")
    feed(engine, "source", PROMPT, 0)
    assert not engine.prefixes_exact and engine.reusable("source") == 0 and engine.held("source") == len(PROMPT)


def test_a_snapshot_is_a_device_copy_of_the_prefix_and_leaves_the_session_where_it_was(tiny_loaded, kind):
    engine = make(tiny_loaded["target"], kind)
    prefilled_source(engine, kind)
    row = engine.slots.row_of("source") if kind == "static-rows" else None
    snapshot = engine.snapshot("source", PREFIX)
    assert isinstance(snapshot, KVSnapshot) and snapshot.length == PREFIX
    layers, heads, head_dim = 2, 2, 16  # the tiny model (tests/conftest.py)
    assert snapshot.keys.shape == snapshot.values.shape == (layers, heads, PREFIX, head_dim)
    assert snapshot.nbytes == 2 * layers * heads * PREFIX * head_dim * 4  # float32
    assert snapshot.keys.device == engine.device and snapshot.keys.dtype == torch.float32
    if kind == "static-rows":
        assert engine.slots.row_of("source") == row and "source" not in engine.caches
        assert torch.equal(snapshot.keys, engine.slots.keys[:, row, :, :PREFIX])
    else:
        assert torch.equal(snapshot.keys[0], engine.caches["source"].layers[0].keys[0, :, :PREFIX])
    assert engine.reusable("source") == len(PROMPT)
    with pytest.raises(ValueError, match="holds"):
        engine.snapshot("source", len(PROMPT) + 3)
    assert engine.snapshot("nobody", 0).nbytes == 0


def test_a_restored_prefix_then_the_rest_equals_a_fresh_prefill(tiny_loaded, kind):
    """From the source's own cache, or its static row: the rest of the prompt, and decode steps after it."""
    engine = make(tiny_loaded["target"], kind)
    prefilled_source(engine, kind)
    snapshot = engine.snapshot("source", PREFIX)
    engine.restore("restored", snapshot, PREFIX)
    assert "restored" in engine.caches and engine.reusable("restored") == PREFIX  # a cache of its own
    # every row kept: a static row runs the restored rest (as a verify would), the fresh prefill runs alone
    bitwise = 0 if kind == "dynamic" else TOLERANCE
    assert_exact(
        feed(engine, "restored", PROMPT[PREFIX:], len(PROMPT) - PREFIX),
        fresh_rest(engine, "fresh", PROMPT, PREFIX),
        f"{kind} prefill",
        atol=bitwise,
    )
    for token in (11, 12, 13):
        got = feed(engine, "restored", [token], 1)
        assert_exact(got, feed(engine, "fresh", [token], 1), f"{kind} decode", atol=bitwise)
    # a shorter restore of the same snapshot: one block
    engine.restore("one-block", snapshot, 64)
    assert_exact(
        feed(engine, "one-block", PROMPT[64:], len(PROMPT) - 64),
        fresh_rest(engine, "fresh-64", PROMPT, 64),
        f"{kind} prefill",
        atol=bitwise,
    )
    # as a service restores: the rest of the prompt with its last position's logits, then decode steps
    engine.restore("as-served", snapshot, PREFIX)
    fresh = feed(engine, "fresh-served", PROMPT, 1)
    assert_exact(feed(engine, "as-served", PROMPT[PREFIX:], 1), fresh, f"{kind} served prefill", atol=0)
    assert engine.reusable("as-served") == engine.reusable("fresh-served") == len(PROMPT) - 1


def test_a_snapshot_from_a_static_row_restores_in_a_plain_engine_and_back(tiny_loaded):
    """A snapshot is plain KV: taken from a static row, it starts a session in an engine of DynamicCaches."""
    rows, dynamic = make(tiny_loaded["target"], "static-rows"), make(tiny_loaded["target"], "dynamic")
    prefilled_source(rows, "static-rows")
    prefilled_source(dynamic, "dynamic")
    dynamic.restore("from-rows", rows.snapshot("source", PREFIX), PREFIX)
    rows.restore("from-dynamic", dynamic.snapshot("source", PREFIX), PREFIX)
    expected = fresh_rest(dynamic, "fresh", PROMPT, PREFIX)
    assert_exact(feed(dynamic, "from-rows", PROMPT[PREFIX:], len(PROMPT) - PREFIX), expected, "rows -> dynamic")
    got = feed(rows, "from-dynamic", PROMPT[PREFIX:], len(PROMPT) - PREFIX)
    assert_exact(got, fresh_rest(rows, "fresh", PROMPT, PREFIX), "dynamic -> rows")


def test_two_sessions_restored_from_one_snapshot_never_touch_each_other_or_it(tiny_loaded, kind):
    engine = make(tiny_loaded["target"], kind)
    prefilled_source(engine, kind)
    snapshot = engine.snapshot("source", PREFIX)
    kept = KVSnapshot(snapshot.keys.clone(), snapshot.values.clone(), snapshot.nbytes)
    engine.restore("a", snapshot, PREFIX)
    engine.restore("b", snapshot, PREFIX)
    for layer in engine.caches["a"].layers + engine.caches["b"].layers:  # copies, not views of it
        assert layer.keys.untyped_storage().data_ptr() != snapshot.keys.untyped_storage().data_ptr()
    tail_a, tail_b = PROMPT[PREFIX:], [5, 6, 7, 8]
    # a alone (several passes, a rollback), then both in one pass, then b alone
    first_a = feed(engine, "a", tail_a, len(tail_a))
    engine.crop("a", PREFIX + 3)
    feed(engine, "a", [40, 41], 2)
    together = engine.forward([Row("a", [42], 1), Row("b", tail_b, len(tail_b))])
    later_b = feed(engine, "b", [9], 1)
    assert torch.equal(snapshot.keys, kept.keys) and torch.equal(snapshot.values, kept.values)
    assert_exact(first_a, fresh_rest(engine, "fresh-a", PROMPT, PREFIX), f"{kind} shared")
    engine.crop("fresh-a", PREFIX + 3)
    assert_exact(together[0], feed(engine, "fresh-a", [40, 41, 42], 1), f"{kind} shared")
    fresh_b = fresh_rest(engine, "fresh-b", PROMPT[:PREFIX] + tail_b, PREFIX)
    assert_exact(together[1], fresh_b, f"{kind} shared")
    assert_exact(later_b, feed(engine, "fresh-b", [9], 1), f"{kind} shared")
    engine.restore("c", snapshot, PREFIX)  # still as good as new
    assert_exact(feed(engine, "c", tail_a, len(tail_a)), first_a, f"{kind} shared", atol=0)


def test_crop_passes_and_release_of_the_source_leave_the_snapshot_intact(tiny_loaded, kind):
    """In the static rows the source's row is written over (its new tokens after a crop, then
    another session in the row it leaves): the snapshot is a copy, not the row."""
    engine = make(tiny_loaded["target"], kind)
    prefilled_source(engine, kind)
    snapshot = engine.snapshot("source", PREFIX)
    kept = snapshot.keys.clone(), snapshot.values.clone()
    engine.crop("source", 10)
    feed(engine, "source", list(range(500, 700)), 1)
    engine.release("source")
    feed(engine, "newcomer", list(range(900, 1100)), 1)  # takes the freed row, or a cache
    engine.release("newcomer")
    assert torch.equal(snapshot.keys, kept[0]) and torch.equal(snapshot.values, kept[1])
    engine.restore("restored", snapshot, PREFIX)
    assert_exact(
        feed(engine, "restored", PROMPT[PREFIX:], len(PROMPT) - PREFIX),
        fresh_rest(engine, "fresh", PROMPT, PREFIX),
        f"{kind} after source edits",
    )


def test_a_restored_session_runs_in_a_padded_batch_and_a_block_of_passes(tiny_loaded, kind):
    """Several rows of other lengths in one pass (a padded batch: the plain engine, or the static
    rows' engine past its 8 rows), then a block of passes; restore inside a block is refused."""
    engine = make(tiny_loaded["target"], kind)
    prefilled_source(engine, kind)
    snapshot = engine.snapshot("source", PREFIX)
    count = 9 if kind == "static-rows" else 3  # past the static rows: the padded batch
    others = [OTHERS[index % 2][: 10 + index] for index in range(count - 1)]
    for index, tokens in enumerate(others):
        feed(engine, f"other-{index}", tokens, 0)
    engine.restore("restored", snapshot, PREFIX)
    rest = PROMPT[PREFIX:]
    batch = [Row("restored", rest, len(rest))] + [Row(f"other-{i}", [60 + i, 61], 2) for i in range(count - 1)]
    got = engine.forward(batch)
    assert_exact(got[0], fresh_rest(engine, "fresh", PROMPT, PREFIX), f"{kind} padded batch")
    ids = ["restored"] + [f"other-{i}" for i in range(count - 1)]
    with engine.passes(ids):
        if engine.batch is not None:
            with pytest.raises(RuntimeError, match="inside a block"):
                engine.restore("late", snapshot, PREFIX)
            with pytest.raises(RuntimeError, match="inside a block"):
                engine.snapshot("restored", PREFIX)
        steps = [engine.forward([Row(session_id, [70 + step], 1) for session_id in ids])[0] for step in range(3)]
    for step, logits in enumerate(steps):
        assert_exact(logits, feed(engine, "fresh", [70 + step], 1), f"{kind} padded batch")
    assert engine.held("restored") == len(PROMPT) + 3
    assert engine.reusable("restored") == PREFIX  # the rest ran in a padded batch: not what a fresh prefill runs


def test_restore_starts_a_session_only(tiny_loaded, kind):
    engine = make(tiny_loaded["target"], kind)
    prefilled_source(engine, kind)
    snapshot = engine.snapshot("source", PREFIX)
    with pytest.raises(RuntimeError, match="already holds"):
        engine.restore("source", snapshot, PREFIX)
    with pytest.raises(ValueError, match="holds 128 tokens"):
        engine.restore("new", snapshot, PREFIX + 1)
    engine.crop("source", 0)  # holds nothing now (an empty cache or an empty row): may be restored
    engine.restore("source", snapshot, PREFIX)
    assert engine.reusable("source") == PREFIX and "source" in engine.caches
    if kind == "static-rows":
        assert engine.slots.row_of("source") is None
    engine.restore("empty", snapshot, 0)
    assert engine.reusable("empty") == 0
    assert_exact(feed(engine, "empty", PROMPT[:5], 1), feed(engine, "fresh", PROMPT[:5], 1), "empty restore", atol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_static_rows_restore_equals_a_fresh_prefill_through_cuda_graphs(tiny_on, device):
    """The GPU path: the source snapshotted from its static row after graphed decode steps; the
    restored session and a fresh one loaded into rows and stepped together through CUDA graphs
    (eagerly on a CPU). Float32 on the device: cuBLAS picks kernels by shape, so the tolerance
    on CUDA is a float32 one a little wider than the CPU's."""
    engine = TransformersEngine(tiny_on(device)["target"], graphs=True)
    atol = TOLERANCE if device == "cpu" else 1e-4
    prefilled_source(engine, "static-rows")
    snapshot = engine.snapshot("source", PREFIX)
    assert snapshot.keys.device.type == device  # device memory on a GPU
    kept = snapshot.keys.clone(), snapshot.values.clone()
    engine.restore("restored", snapshot, PREFIX)
    engine.restore("twin", snapshot, PREFIX)
    rest = PROMPT[PREFIX:]
    got = engine.forward([Row("restored", rest, len(rest)), Row("twin", rest[:4], 4)])  # eager (a prefill)
    expected = engine.forward([Row("fresh", PROMPT, len(rest)), Row("fresh-twin", PROMPT[: PREFIX + 4], 4)])
    assert_exact(got[0], expected[0], f"{device} rows prefill", atol)
    assert_exact(got[1], expected[1], f"{device} rows prefill", atol)
    ids = ["restored", "twin", "fresh", "fresh-twin"]
    for step in range(4):  # decodes and a verify-sized step: graphed on CUDA
        tokens = [80 + step] if step < 3 else [90, 91, 92, 93, 94]
        out = engine.forward([Row(session_id, tokens, len(tokens)) for session_id in ids])
        assert_exact(out[0], out[2], f"{device} rows graphed", atol)
        assert_exact(out[1], out[3], f"{device} rows graphed", atol)
    assert all(engine.slots.row_of(session_id) == index for index, session_id in enumerate(ids))
    assert (engine.graphs > 0) == (device == "cuda")
    engine.release("source")
    assert torch.equal(snapshot.keys, kept[0]) and torch.equal(snapshot.values, kept[1])


def test_heads_in_a_shared_pass_run_alone_first_and_are_reusable_bit_for_bit(tiny_loaded, kind):
    """Two prompts and a decode step in one pass: each head runs in its own canonical calls (then the
    kept rows together), so it is reusable, and a session restored from it scores as a lone fresh prefill."""
    engine = make(tiny_loaded["target"], kind)
    feed(engine, "decoding", OTHERS[0], 1)
    engine.forward([Row("a", PROMPT, 1), Row("b", OTHERS[1], 1), Row("decoding", [5], 1)])
    assert engine.reusable("a") == len(PROMPT) - 1 and engine.reusable("b") == len(OTHERS[1]) - 1
    engine.restore("restored", engine.snapshot("a", PREFIX), PREFIX)
    got = feed(engine, "restored", PROMPT[PREFIX:], 1)
    assert_exact(got, feed(engine, "fresh", PROMPT, 1), f"{kind} head of a shared pass", atol=0)
