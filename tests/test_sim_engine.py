"""The simulated engine (model/sim_engine.py): its settings, its deterministic tokens and agreement
rate, its simulated pass costs, and a sim pair through the real services and the orchestrator's loop."""

import argparse
import time

import pytest
from conftest import TOKENIZER, serve_engines
from fake_services import Tokenless

from specd.cli.common import engine_choice
from specd.model.engine import Row
from specd.model.fetch import resolve_tokenizer
from specd.model.loaded import folder_tokenizer
from specd.model.loading import choose_engine, load_engine
from specd.model.sim_engine import PEAK, PROFILES, SimEngine, SimSettings
from specd.orchestrator.generation import Generation
from specd.orchestrator.request import Finished, GenerationRequest

PROMPT = [9707, 11, 1879, 0, 1096, 374, 264, 1273, 315, 279, 46633]


@pytest.fixture(scope="module")
def tokenizer():
    return folder_tokenizer(TOKENIZER or resolve_tokenizer("draft"))[0]


def sim(tokenizer, role: str, **settings) -> SimEngine:
    return SimEngine(role, f"sim-{role}", tokenizer, SimSettings(**settings))


def test_settings_parse_and_refuse_with_the_options_named():
    assert SimSettings.parse("sim") == SimSettings("gpu", 0.8, 1.0)
    assert SimSettings.parse("sim:profile=cpu,alpha=0.5,scale=20") == SimSettings("cpu", 0.5, 20.0)
    for bad in ("sim:profile=tpu", "sim:alpha=1.5", "sim:scale=0", "sim:speed=2", "sim:alpha=high"):
        with pytest.raises(ValueError, match="sim"):
            SimSettings.parse(bad)
    assert engine_choice("sim:alpha=0.9") == "sim:alpha=0.9" and engine_choice("llama.cpp") == "llama.cpp"
    with pytest.raises(argparse.ArgumentTypeError, match="invalid choice"):
        engine_choice("simulated")


def test_auto_never_chooses_it_and_load_engine_builds_it_by_name(tokenizer):
    assert choose_engine("auto", "target", __import__("torch").device("cpu")) != "sim"
    engine = load_engine("target", TOKENIZER or "target", engine="sim:profile=cpu,scale=0.5")
    assert isinstance(engine, SimEngine) and engine.costs == PROFILES["cpu"]["target"]
    assert engine.description.dtype == "simulated (cpu, scale 0.5)" and not engine.description.padded


def test_the_token_is_a_function_of_the_context_on_any_session_and_after_a_rollback(tokenizer):
    target = sim(tokenizer, "target")
    first = target.forward([Row("a", PROMPT, 3)])[0]
    assert first.shape == (3, len(tokenizer)) and (first.max(dim=1).values == PEAK).all()
    chosen = first.argmax(dim=1).tolist()
    # Another session, the same tokens in other calls: the same tokens chosen
    target.forward([Row("b", PROMPT[:5], 0)])
    again = target.forward([Row("b", PROMPT[5:], 3)])[0]
    assert again.argmax(dim=1).tolist() == chosen
    # A rollback, then other tokens: a new context, so (almost surely) another token
    target.crop("a", len(PROMPT) - 1)
    assert target.forward([Row("a", [PROMPT[-1]], 1)])[0].argmax().item() == chosen[-1]
    target.crop("a", len(PROMPT) - 1)
    assert target.forward([Row("a", [PROMPT[-1] + 1], 1)])[0].argmax().item() != chosen[-1]
    # A prefix cache's copy restores the same context
    copy = target.snapshot("b", len(PROMPT))
    target.restore("c", copy, len(PROMPT) - 1)
    assert target.reusable("c") == len(PROMPT) - 1 and copy.held_tokens == len(PROMPT)
    assert target.forward([Row("c", PROMPT[-1:], 1)])[0].argmax().item() == chosen[-1]
    target.release("c")
    assert target.reusable("c") == 0


@pytest.mark.parametrize("alpha", [0.0, 0.3, 0.9])
def test_the_draft_agrees_with_the_target_at_alpha(tokenizer, alpha):
    target, draft = sim(tokenizer, "target"), sim(tokenizer, "draft", alpha=alpha)
    contexts = [[i, i * 7 % 1000, 5] for i in range(3000)]
    agreed = sum(draft.next_token(c, len(c)) == target.next_token(c, len(c)) for c in contexts)
    assert abs(agreed / len(contexts) - alpha) < 0.03
    assert all(token < tokenizer.vocab_size for c in contexts[:100] for token in [draft.next_token(c, len(c))])


def test_a_pass_waits_for_what_its_profile_prices(tokenizer):
    """0.1 s a pass at scale 25 of the GPU profile's 4 ms, plus 4 ms a scored and a prefilled position."""
    target = sim(tokenizer, "target", scale=25)
    rows = [Row("a", PROMPT, 1), Row("b", [1, 2], 2)]
    costs = target.costs
    expected = 25 * (costs.pass_s + 3 * costs.row_token_s + (len(PROMPT) - 1) * costs.prefill_token_s)
    assert target.seconds(rows) == pytest.approx(expected)
    started = time.perf_counter()
    target.forward(rows)
    took = time.perf_counter() - started
    assert expected <= took < expected + 0.5


async def test_a_sim_pair_through_the_services_speculates_at_alpha_and_keeps_the_targets_output(tokenizer):
    """Greedy output with speculation equals target-only; guesses are accepted as α says: each
    position with chance α once those before it were, so accepted / drafted at K = 4 is about
    (α + α² + α³ + α⁴) / 4 (0.44 at α = 0.7)."""
    services = await serve_engines(
        lambda limits: sim(tokenizer, "draft", alpha=0.7, scale=0.1), lambda limits: sim(tokenizer, "target", scale=0.1)
    )
    try:

        async def generate(draft_tokens: int) -> tuple[list[int], object]:
            request = GenerationRequest(list(PROMPT), 64, draft_tokens=draft_tokens, ignore_eos=True, drafter="model")
            tokens, stats = [], None
            async for event in Generation(request, services.draft, services.target, Tokenless(), set()).run():
                if isinstance(event, Finished):
                    stats = event.stats
                else:
                    tokens += event.token_ids
            return tokens, stats

        off, _ = await generate(0)
        on, stats = await generate(4)
        assert on == off and len(on) == 64
        assert abs(stats.acceptance_rate - sum(0.7**i for i in range(1, 5)) / 4) < 0.12, stats.acceptance_rate
    finally:
        await services.close()
