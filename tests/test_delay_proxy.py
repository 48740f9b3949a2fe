"""The lab's userspace proxy (deploy/delay_proxy.py): its round-trip time, and the two network faults
issue 40's lab runs through it: a cut (a black hole: silence, nothing refused, what was sent arrives
once it ends) and packet loss (late chunks, in order)."""

import asyncio
import time

from specd.deploy.delay_proxy import LOSS_RTO_S, DelayProxy


async def echo_server() -> asyncio.Server:
    async def echo(reader, writer):
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
        writer.close()

    return await asyncio.start_server(echo, "127.0.0.1", 0)


async def round_trip(reader, writer, data: bytes, timeout: float = 5.0) -> float:
    started = time.perf_counter()
    writer.write(data)
    await writer.drain()
    assert await asyncio.wait_for(reader.readexactly(len(data)), timeout) == data
    return time.perf_counter() - started


async def test_a_cut_link_answers_nothing_refuses_nothing_and_delivers_what_was_held_once_restored():
    server = await echo_server()
    proxy = DelayProxy(f"127.0.0.1:{server.sockets[0].getsockname()[1]}", rtt_ms=10)
    host, port = (await proxy.start()).rsplit(":", 1)
    try:
        reader, writer = await asyncio.open_connection(host, int(port))
        assert await round_trip(reader, writer, b"before") >= 0.01  # the RTT
        proxy.cut()
        writer.write(b"during")
        await writer.drain()
        late = asyncio.ensure_future(reader.readexactly(6))
        fresh = await asyncio.wait_for(asyncio.open_connection(host, int(port)), 1)  # accepted, not refused
        await asyncio.sleep(0.5)
        assert not late.done()  # silence, not a reset
        proxy.restore()
        assert await asyncio.wait_for(late, 2) == b"during"  # held, then delivered in order
        assert await round_trip(*fresh, b"new connection") < 2
        fresh[1].close()
        writer.close()
    finally:
        await proxy.stop()
        server.close()


async def test_lost_chunks_arrive_a_retransmission_timeout_late_and_in_order():
    server = await echo_server()
    proxy = DelayProxy(f"127.0.0.1:{server.sockets[0].getsockname()[1]}")
    try:
        reader, writer = await asyncio.open_connection(*(await proxy.start()).rsplit(":", 1))
        assert await round_trip(reader, writer, b"clean") < LOSS_RTO_S
        proxy.loss = 1.0  # every chunk lost: the first one RTO late each way, and the RTO doubles
        assert await round_trip(reader, writer, b"lossy") >= 2 * LOSS_RTO_S
        proxy.loss = 0.0
        assert await round_trip(reader, writer, b"clean again") < LOSS_RTO_S
        writer.close()
    finally:
        await proxy.stop()
        server.close()
