"""A userspace TCP proxy that adds a round-trip time, for labs where kernel netem is missing.

Every chunk read from either side is written to the other side RTT/2 after it arrived, in
order; chunks in flight do not wait for each other, so this is latency, not a bandwidth
cap (like `tc qdisc ... netem delay`). `rtt_ms` may change while connections are open.

Two network faults, each switched on and off while connections are open (issue 40's lab):
- `cut` (a black hole: packets dropped, not refused): nothing is delivered either way and new
  connections are accepted but go nowhere, so a caller sees silence, never a reset; what was sent
  meanwhile arrives once the cut ends, as TCP's retransmissions would deliver it after a partition.
- `loss` (a fraction of packets lost): over TCP a lost segment arrives late, after a retransmission
  timeout, and holds up everything behind it. A proxy sees the stream, not the segments, so each
  chunk is taken as lost with probability `loss` and delivered one RTO later, the RTO doubling while
  losses follow each other in that direction (Linux's 200 ms minimum, up to LOSS_RTO_MAX_S), and
  the chunks behind it wait (in-order delivery). An emulation: kernel netem was not available
  where this was written ("Specified qdisc kind is unknown").
"""

import asyncio
import random
import time

LOSS_RTO_S = 0.2  # Linux's minimum retransmission timeout
LOSS_RTO_MAX_S = 3.2  # after four losses in a row


class DelayProxy:
    def __init__(self, upstream: str, rtt_ms: float = 0.0):
        self.upstream_host, port = upstream.rsplit(":", 1)
        self.upstream_port = int(port)
        self.rtt_ms = rtt_ms
        self.loss = 0.0  # the fraction of chunks lost (delivered a retransmission timeout late)
        self.open = asyncio.Event()  # cleared while the link is cut (a black hole)
        self.open.set()
        self.random = random.Random(0)  # the losses, reproducibly
        self.server: asyncio.Server | None = None
        self.address = ""  # where it listens, once started
        self.writers: set[asyncio.StreamWriter] = set()  # both ends of every open connection
        self.connections = 0  # accepted so far

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        """Listen; returns host:port, the address clients should dial instead of the upstream."""
        self.server = await asyncio.start_server(self._serve, host, port)
        self.address = f"{host}:{self.server.sockets[0].getsockname()[1]}"
        return self.address

    def cut(self) -> None:
        """Black-hole the link: from now on nothing is delivered, either way, until `restore`."""
        self.open.clear()

    def restore(self) -> None:
        """End a cut: what was held is delivered, in order."""
        self.open.set()

    async def stop(self) -> None:
        """Stop listening and close every connection (each pipe then ends as on EOF)."""
        if self.server:
            self.server.close()
        for writer in list(self.writers):
            writer.close()
        await asyncio.sleep(0)

    async def _serve(self, client_reader, client_writer) -> None:
        self.connections += 1
        await self.open.wait()  # a cut link accepts (a black hole answers nothing, refuses nothing)
        try:
            upstream_reader, upstream_writer = await asyncio.open_connection(self.upstream_host, self.upstream_port)
        except OSError:
            client_writer.close()
            return
        self.writers |= {client_writer, upstream_writer}
        try:
            await asyncio.gather(self._pipe(client_reader, upstream_writer), self._pipe(upstream_reader, client_writer))
        finally:
            for writer in (client_writer, upstream_writer):
                writer.close()
                self.writers.discard(writer)

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One direction: read as it comes, deliver each chunk one-way-delay after it arrived."""
        in_flight: asyncio.Queue = asyncio.Queue()
        delivering = asyncio.create_task(self._deliver(in_flight, writer))
        rto = LOSS_RTO_S
        try:
            while chunk := await reader.read(65536):
                late = 0.0
                if self.loss and self.random.random() < self.loss:
                    late, rto = rto, min(LOSS_RTO_MAX_S, rto * 2)
                else:
                    rto = LOSS_RTO_S
                in_flight.put_nowait((time.monotonic() + self.rtt_ms / 2000 + late, chunk))
        except OSError:
            pass  # a reset ends this direction like EOF
        in_flight.put_nowait((time.monotonic() + self.rtt_ms / 2000, b""))  # EOF travels with the same delay
        await delivering

    async def _deliver(self, in_flight: asyncio.Queue, writer: asyncio.StreamWriter) -> None:
        while True:
            due, chunk = await in_flight.get()
            await asyncio.sleep(max(0.0, due - time.monotonic()))
            await self.open.wait()  # held while the link is cut
            try:
                if not chunk:
                    writer.write_eof()
                    return
                writer.write(chunk)
                await writer.drain()
            except (OSError, RuntimeError):  # the other side is gone (RuntimeError: write_eof after close)
                return
