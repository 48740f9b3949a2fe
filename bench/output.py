"""How `specd bench` and `specd loadtest` write while they work, to a terminal or not.

On a terminal, `Progress` is rich's live bar, as it always was. Elsewhere (CI, `nohup`, `> log`,
a pipe) a live bar prints nothing until it stops, so there it writes plain lines instead: one
when a task starts, one when it ends, and one at least every `Progress.interval` seconds between
(a thread ticks, so a slow request, or an HF generate() that holds the event loop for minutes,
still shows), each with the task, how many of how many are done, and the task's time:

    [14:02:31] concurrency 4 (12/32 done, 0:00:40 elapsed)

`print_tables` prints tables whole: off a terminal rich assumes 80 columns and cuts cells down
to "…", so there each table gets the width it needs.
"""

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from rich.console import Console
from rich.measure import Measurement
from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn
from rich.progress import Progress as Bar

WIDEST = 10_000  # columns a table may measure up to off a terminal


@dataclass
class _Task:
    label: str
    total: int
    done: int = 0
    started: float = field(default_factory=time.monotonic)


class Progress:
    """The progress of tasks run one after another, each `done` of `total` steps (a context manager)."""

    interval = 20.0  # off a terminal: seconds between two lines at most (plus the thread's wake-up)

    def __init__(self, console: Console):
        self.console = console
        self.bar = None
        if console.is_terminal:
            columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
            self.bar = Bar(*columns, console=console)
        self._lock = threading.Lock()  # guards _task and _last, shared with the ticking thread
        self._task: _Task | None = None  # the task under way (no task yet: "starting")
        self._started = self._last = time.monotonic()  # _last: when the last progress line was written
        self._stop = threading.Event()
        self._ticker = threading.Thread(target=self._tick, name="progress-lines", daemon=True)

    def __enter__(self) -> "Progress":
        if self.bar:
            self.bar.start()
        else:
            self._ticker.start()
        return self

    def __exit__(self, *exc) -> None:
        if self.bar:
            self.bar.stop()
        else:
            self._stop.set()
            self._ticker.join()

    def task(self, label: str, total: int) -> Callable[..., None]:
        """Start a task of `total` steps; returns advance(label=None): one more step done (and the task's
        new label, if given)."""
        if self.bar:
            bar, task = self.bar, self.bar.add_task(label, total=total)
            return lambda label=None: bar.update(task, advance=1, description=label)
        state = _Task(label, total)
        with self._lock:
            self._task = state
            self._line()

        def advance(label: str | None = None) -> None:
            with self._lock:
                state.done += 1
                state.label = label or state.label
                if state.done == state.total:
                    self._line()

        return advance

    def say(self, message: str) -> None:
        """A message between the progress: logged on a terminal, a plain line elsewhere."""
        if self.bar:
            self.bar.console.log(message)
        else:
            self._write(message)

    def _tick(self) -> None:
        while not self._stop.wait(max(0.0, self._last + self.interval - time.monotonic())):
            with self._lock:
                if time.monotonic() - self._last >= self.interval:
                    self._line()

    def _line(self) -> None:
        """The task under way, how far it is and for how long (under the lock)."""
        now = time.monotonic()
        task = self._task
        if task is None:
            self._write(f"starting ({_clock(now - self._started)} elapsed)")
        else:
            self._write(f"{task.label} ({task.done}/{task.total} done, {_clock(now - task.started)} elapsed)")
        self._last = now

    def _write(self, text: str) -> None:
        self.console.print(f"[{datetime.now():%H:%M:%S}] {text}", markup=False, highlight=False, soft_wrap=True)


def print_tables(console: Console, *tables) -> None:
    """Print each table whole: on a terminal as rich lays it out, elsewhere as wide as it needs."""
    for table in tables:
        if console.is_terminal:
            console.print(table)
            continue
        needed = Measurement.get(console, console.options.update_width(WIDEST), table).maximum
        width, console.width = console.width, max(console.width, needed)
        try:
            console.print(table)
        finally:
            console.width = width


def _clock(seconds: float) -> str:
    return str(timedelta(seconds=int(seconds)))
