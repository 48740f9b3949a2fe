"""A userspace TCP proxy that adds a round-trip time, for labs where kernel netem is missing.

Every chunk read from either side is written to the other side RTT/2 after it arrived, in
order; chunks in flight do not wait for each other, so this is latency, not a bandwidth
cap (like `tc qdisc ... netem delay`). `rtt_ms` may change while connections are open.
"""

import asyncio
import time


class DelayProxy:
    def __init__(self, upstream: str, rtt_ms: float = 0.0):
        self.upstream_host, port = upstream.rsplit(":", 1)
        self.upstream_port = int(port)
        self.rtt_ms = rtt_ms
        self.server: asyncio.Server | None = None
        self.writers: set[asyncio.StreamWriter] = set()  # both ends of every open connection
        self.connections = 0  # accepted so far

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        """Listen; returns host:port, the address clients should dial instead of the upstream."""
        self.server = await asyncio.start_server(self._serve, host, port)
        return f"{host}:{self.server.sockets[0].getsockname()[1]}"

    async def stop(self) -> None:
        """Stop listening and close every connection (each pipe then ends as on EOF)."""
        if self.server:
            self.server.close()
        for writer in list(self.writers):
            writer.close()
        await asyncio.sleep(0)

    async def _serve(self, client_reader, client_writer) -> None:
        self.connections += 1
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
        try:
            while chunk := await reader.read(65536):
                in_flight.put_nowait((time.monotonic() + self.rtt_ms / 2000, chunk))
        except OSError:
            pass  # a reset ends this direction like EOF
        in_flight.put_nowait((time.monotonic() + self.rtt_ms / 2000, b""))  # EOF travels with the same delay
        await delivering

    @staticmethod
    async def _deliver(in_flight: asyncio.Queue, writer: asyncio.StreamWriter) -> None:
        while True:
            due, chunk = await in_flight.get()
            await asyncio.sleep(max(0.0, due - time.monotonic()))
            try:
                if not chunk:
                    writer.write_eof()
                    return
                writer.write(chunk)
                await writer.drain()
            except (OSError, RuntimeError):  # the other side is gone (RuntimeError: write_eof after close)
                return
