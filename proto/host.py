"""What every specd server process does around its server, torch-free so that the model services'
host (serving/server.py) and the orchestrator's (orchestrator/server.py) share it: run until
SIGINT/SIGTERM, then drain for up to --drain-seconds; a second signal cuts the drain short.
"""

import asyncio
import signal
from collections.abc import Callable

DEFAULT_DRAIN_SECONDS = 30.0  # --drain-seconds: Kubernetes' default terminationGracePeriodSeconds is 30


def stop_on_signals(hurry: Callable[[], None]) -> asyncio.Event:
    """An event SIGINT or SIGTERM sets (stop: drain, then exit); a second signal calls `hurry` (end
    the drain now). Call from the server's event loop."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, lambda: hurry() if stop.is_set() else stop.set())
    return stop
