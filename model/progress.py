"""Progress of long work (fetching, verifying, converting a model) on a terminal and in a log.

On a terminal, tqdm's bars. Without one (CI, `nohup`, a service's log) tqdm still redraws its bar
with carriage returns, which a log shows as one line written when the bar closes, minutes later:
there each redraw is a line of its own, at most one per LOG_LINE_SECONDS, and a ticker redraws that
often even while nothing advances. Work that has no counter of its own (a conversion) says
`still ...` every LOG_LINE_SECONDS either way, with this process's resident memory.
"""

from __future__ import annotations

import contextlib
import io
import resource
import sys
import threading
import time
from collections.abc import Callable, Iterator

from tqdm import tqdm

LOG_LINE_SECONDS = 20.0  # at most this long without a line in a log


@contextlib.contextmanager
def progress_bar(enabled: bool, **tqdm_args) -> Iterator[tqdm]:
    """A tqdm bar on stderr: as tqdm draws it on a terminal, as timed lines in a log."""
    if not enabled or sys.stderr.isatty():
        with tqdm(**tqdm_args, disable=not enabled) as bar:
            yield bar
        return
    with (
        tqdm(**tqdm_args, file=_Lines(sys.stderr), mininterval=LOG_LINE_SECONDS, ascii=True) as bar,
        every(LOG_LINE_SECONDS, bar.refresh),
    ):
        yield bar


@contextlib.contextmanager
def timed_step(say: Callable[[str], None], doing: str) -> Iterator[None]:
    """`still <doing>: N s, X GiB resident` every LOG_LINE_SECONDS while the block runs, then what it
    took: its time and this process's peak resident memory."""
    started = time.monotonic()

    def still() -> None:
        say(f"still {doing}: {time.monotonic() - started:.0f} s, {gib(resident_bytes())} resident")

    with every(LOG_LINE_SECONDS, still):
        yield
    took = time.monotonic() - started
    say(f"done {doing} in {took:.0f} s (peak resident memory of this process: {gib(peak_resident_bytes())})")


@contextlib.contextmanager
def every(seconds: float, action: Callable[[], None]) -> Iterator[None]:
    """Call `action` every `seconds` from a thread of its own while the block runs."""
    stop = threading.Event()

    def tick() -> None:
        while not stop.wait(seconds):
            action()

    thread = threading.Thread(target=tick, name="progress", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def resident_bytes() -> int:
    """This process's resident memory now (Linux; 0 where /proc has no statm)."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * resource.getpagesize()
    except (OSError, IndexError, ValueError):
        return 0


def peak_resident_bytes() -> int:
    """This process's peak resident memory so far (Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def gib(size: int) -> str:
    return f"{size / 2**30:.1f} GiB"


class _Lines(io.TextIOBase):
    """What tqdm writes, as lines: each redraw (`\\r` + the bar + padding) becomes one line."""

    def __init__(self, sink) -> None:
        self._sink = sink

    def write(self, text: str) -> int:
        line = text.replace("\r", "").rstrip()
        if line:
            self._sink.write(line + "\n")
            self._sink.flush()
        return len(text)

    def flush(self) -> None:
        self._sink.flush()
