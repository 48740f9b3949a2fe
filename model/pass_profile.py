"""What a pass costs on this machine, measured once per machine and model: the engine's seconds to
score 1, 2, ... PROFILE_POSITIONS positions of one session (a decode step, then verifies of K = 1..8)
and WIDE_POSITIONS more (16 ... 128: what a pass of many streams' rows computes), after CONTEXT tokens
of prompt, and that prompt's prefill per token.

The orchestrator prices every step from what the services' calls cost (orchestrator/costs.py), but
a fresh worker knows nothing yet: its first speculative steps were a blind K = 4 and its first probes
guesses, and on a CPU where verifying K + 1 positions costs K + 1 decode steps (llama.cpp's exact
one-row kernels on 2 cores) those steps are what made a lone request slower with speculation on than
off (`specd generate`'s 0.88× on an AMD EPYC Zen 5). A service now measures its passes when it loads,
reports them in its Info (`ModelInfo.pass_seconds`), and the orchestrator starts from them: the first
step of the first request is already priced (speculation off where it cannot pay, K where it does).
Under load the orchestrator prices a pass of B streams drafting K at B·(K + 1) positions on the same
curve, scaled to what the passes it is served cost (costs.py PassCurve): the wide sizes give it the
curve's shape where a fit over live passes had none to go on.

Two services that load on one machine's CPU at once (`specd up`: the draft and the target on 2
cores) would time each other's load: measured so, a one-position pass of the default target took
2.7 s instead of 24 ms. So a service that computes on the CPU loads and measures holding a lock of
the machine's (`alone`, a file lock under the cache): CPU services on one machine load one at a
time (each with all the cores, rather than splitting them), GPU and simulated services as before.

The measurement takes a few seconds (the default target on 2 cores: about 6), so it is kept under
the model cache (`profiles/passes-*.json`), keyed by the machine (CPU model and flags, cores), the
model as the engine describes it (name, weights, dtype, device, the GPU's name), the engine and its settings,
and the threads: the next load of the same model on the same machine reads it instead. The lock keeps
out specd's own services only: a profile in which a pass costs more than a wider one (`disturbed`: a
test run or another server on the cores) is measured again, and kept only once it is in order.
"""

from __future__ import annotations

import fcntl
import json
import logging
import statistics
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from specd.model.engine import Engine, Row
from specd.model.machine import machine
from specd.model.store import cache_root, kept_path, read_kept, write_json

PROFILE_POSITIONS = 9  # a decode step, then verifies of K = 1..8 (the orchestrator's default K bound)
WIDE_POSITIONS = (16, 32, 64, 128)  # then passes as wide as many streams' rows: measured once each
CONTEXT = 128  # prompt tokens before the scored positions
REPEATS = 3  # each size's median of this many (up to PROFILE_POSITIONS)
SESSION = "pass-profile"  # the session the measurement uses, released after
FORMAT = 4  # the cached file's layout (1: no prefill_per_token; 2: the key held its own digest; 3: no wide sizes)
KEEP = 64  # profiles kept in the cache, the newest
SIZES = (*range(1, PROFILE_POSITIONS + 1), *WIDE_POSITIONS)  # the positions of the passes measured
# A pass that costs more than this many times a wider one ran beside other work on the cores (measured
# once beside a test run, the default target batched: 8 positions 2.2 s, 16 positions 0.26 s): the
# profile is measured again, and one that stays so is used for this load but not kept.
DISTURBED = 1.5

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PassProfile:
    """What this engine's passes cost here, one session alone."""

    seconds: tuple[float, ...]  # [i]: scoring positions[i] after CONTEXT tokens (1: a decode; n: a verify of n - 1)
    prefill_per_token: float  # a CONTEXT-token prompt's prefill, per token (what a draft's catch-up costs)
    positions: tuple[int, ...] = ()  # 1, 2, ... PROFILE_POSITIONS, then WIDE_POSITIONS


def pass_profile(engine: Engine, settings: dict | None = None) -> PassProfile | None:
    """The engine's PassProfile, from the cache where this machine measured this model and engine
    before, else measured now and kept; None where it could not be measured (the load goes on).
    `settings`: what else decides the cost (the engine's exactness, its threads)."""
    if modelled := getattr(engine, "modelled_pass_seconds", None):  # the simulated engine: no need to measure
        seconds = tuple(modelled(n, n) for n in SIZES)
        return PassProfile(seconds, (modelled(CONTEXT, 1) - modelled(1, 1)) / (CONTEXT - 1), SIZES)
    key = profile_key(engine, settings or {})
    path = kept_path("passes", key)
    try:
        if cached := read_kept(path, FORMAT, key):
            return PassProfile(tuple(cached["seconds"]), cached["prefill_per_token"], tuple(cached["positions"]))
    except (KeyError, TypeError):
        pass  # broken: measure
    started, name = time.perf_counter(), engine.description.name
    try:
        profile = measure(engine)
        if disturbed(profile):
            log.warning("%s: a pass cost more than a wider one (the cores busy?); measuring again", name)
            profile = measure(engine)
    except Exception as error:  # never fails a load: the orchestrator then learns the costs from the calls
        log.warning("%s: could not measure its passes (%s); none reported", name, error)
        return None
    if disturbed(profile):
        log.warning("%s: its passes measured out of order twice: used for this load, not kept", name)
        return profile
    log.info(
        "%s: measured its passes in %.1f s (1 / %d positions: %.1f / %.1f ms, prefill %.2f ms a token), kept in %s",
        name,
        time.perf_counter() - started,
        profile.positions[-1],
        profile.seconds[0] * 1000,
        profile.seconds[-1] * 1000,
        profile.prefill_per_token * 1000,
        path,
    )
    _write(path, {"format": FORMAT, "key": key, **asdict(profile), "measured": time.time()})
    return profile


def disturbed(profile: PassProfile) -> bool:
    """Whether a pass cost more than DISTURBED times a wider one: something else ran meanwhile."""
    seconds = profile.seconds
    return any(seconds[i] > DISTURBED * min(seconds[i + 1 :]) for i in range(len(seconds) - 1))


@contextmanager
def alone():
    """Hold the machine's load lock (a file lock under the cache: every process of this user on this
    machine that loads a CPU model takes it), so that no other CPU service loads or measures meanwhile."""
    path = cache_root() / "profiles" / ".loading.lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def measure(engine: Engine, sizes: tuple[int, ...] | None = None, repeats: int = REPEATS) -> PassProfile:
    """Seconds to score n positions of one session after CONTEXT prompt tokens for each n of `sizes`
    (default SIZES), each the median of `repeats` passes up to PROFILE_POSITIONS and one pass beyond
    (a wide pass varies less), the session cut back after each; and that prompt's prefill per token
    (after a short warm-up prompt: an engine's first calls allocate); the session is released."""
    sizes = SIZES if sizes is None else sizes
    vocab = engine.description.vocab_size
    prompt = [(7 * i + 3) % vocab for i in range(max(CONTEXT, *sizes))]
    try:
        engine.forward([Row(SESSION, prompt[:8], 1)])
        engine.forward([Row(SESSION, prompt[8:9], 1)])
        engine.release(SESSION)
        started = time.perf_counter()
        engine.forward([Row(SESSION, prompt[:CONTEXT], 1)])
        prefill = (time.perf_counter() - started) / CONTEXT
        seconds = []
        for n in sizes:
            times = []
            try:
                for _ in range(repeats if n <= PROFILE_POSITIONS else 1):
                    started = time.perf_counter()
                    engine.forward([Row(SESSION, prompt[:n], n)])
                    times.append(time.perf_counter() - started)
                    engine.crop(SESSION, CONTEXT)
            except Exception as error:
                if n <= PROFILE_POSITIONS:
                    raise
                name, widest = engine.description.name, sizes[len(seconds) - 1]
                log.warning("%s: a pass of %d positions failed (%s); its profile stops at %d", name, n, error, widest)
                break  # an engine that cannot score so many at once: the orchestrator extends the curve
            seconds.append(statistics.median(times))
        return PassProfile(tuple(seconds), prefill, tuple(sizes[: len(seconds)]))
    finally:
        engine.release(SESSION)


def profile_key(engine: Engine, settings: dict) -> dict:
    """What the measurement depends on (the cache file's key, model/store.py kept_path)."""
    described = engine.description
    gpu = torch.cuda.get_device_name(described.device) if described.device.startswith("cuda") else ""
    return {
        "machine": machine(),
        "model": [described.name, described.quantization, described.dtype, described.device, gpu],
        "engine": type(engine).__name__,
        "settings": {name: settings[name] for name in sorted(settings)},
        "positions": list(SIZES),
        "context": CONTEXT,
    }


def cached_profiles() -> list[dict]:
    """Every profile this machine's cache holds for this machine (`specd models list`)."""
    here, found = machine(), []
    for path in sorted((cache_root() / "profiles").glob("passes-*.json")):
        try:
            profile = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(profile, dict) and profile.get("format") == FORMAT and profile["key"].get("machine") == here:
            found.append(profile)
    return found


def _write(path: Path, content: dict) -> None:
    """Kept whole (several services may load at once), the oldest beyond KEEP dropped; never failing the load."""
    try:
        write_json(path, content)
        kept = sorted(path.parent.glob("passes-*.json"), key=lambda kept: kept.stat().st_mtime)
        for stale in kept[:-KEEP]:  # models come and go (a test's in a temporary folder): the newest KEEP stay
            stale.unlink(missing_ok=True)
    except OSError as error:
        log.warning("could not keep the pass profile in %s: %s", path, error)
