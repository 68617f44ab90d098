"""A TCP relay that adds delay and emulated loss: the stand-in for ``tc netem``, which this
kernel lacks (``hosts.qdisc_available("netem")`` is False).

Who calls what
--------------
A test starts it in a test host (``Host.popen``) between a client and a server::

    python tests/relay.py --listen 10.213.7.2:0 --target 10.213.7.3:5555 --delay 0.005 --loss 0.01

It prints one line ``{"port": P}`` on stdout once it listens, then forwards every connection
made to ``--listen`` to ``--target`` until killed.

What it models
--------------
- ``--delay D``: every chunk read from one side is written to the other ``D`` seconds after it
  was read (one-way latency, per direction; round trips gain ``2 D``).
- ``--loss p`` / ``--stall S``: TCP never loses bytes for the application, so loss is modelled
  as what the application sees of it: with probability ``p`` a chunk (up to ``--chunk``
  bytes, 64 KiB) is held ``S`` extra seconds, as a retransmission after a timeout would hold
  it, and every later chunk of that direction waits behind it (in-order delivery, head-of-
  line blocking). Bytes, their order and the stream's end are never changed.
- Not modelled: bandwidth limits (use ``tc ... tbf`` in a host), reordering, corruption, RSTs.
  Each direction queues at most ``--queue`` chunks, so a slow reader pushes back on the sender.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time


class Relay:
    """The relay's settings, counters, and its per-connection pumps."""

    def __init__(self, target: tuple[str, int], delay: float, loss: float, stall: float, chunk: int,
                 queue: int, seed: int | None):
        self.target, self.delay, self.loss, self.stall = target, delay, loss, stall
        self.chunk, self.queue = chunk, queue
        self.rng = random.Random(seed)
        self.stalls = self.chunks = self.conns = 0

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.conns += 1
        try:
            up_r, up_w = await asyncio.open_connection(*self.target)
        except OSError:
            writer.close()
            return
        await asyncio.gather(self._pump(reader, up_w), self._pump(up_r, writer), return_exceptions=True)
        for w in (writer, up_w):
            w.close()

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One direction: read chunks, stamp each with its release time, write them in order."""
        q: asyncio.Queue = asyncio.Queue(self.queue)

        async def read() -> None:
            last = 0.0
            try:
                while True:
                    data = await reader.read(self.chunk)
                    now = time.monotonic()
                    if not data:
                        break
                    self.chunks += 1
                    release = now + self.delay
                    if self.loss and self.rng.random() < self.loss:
                        self.stalls += 1
                        release += self.stall
                    last = max(last, release)      # in order: nothing overtakes a held chunk
                    await q.put((last, data))
            except (ConnectionError, OSError):
                pass
            await q.put((last, b""))               # end of stream, after everything before it

        async def write() -> None:
            while True:
                release, data = await q.get()
                wait = release - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)
                if not data:
                    try:
                        writer.write_eof()
                    except (OSError, RuntimeError):
                        pass
                    return
                writer.write(data)
                await writer.drain()

        await asyncio.gather(read(), write())


async def main_async(args) -> None:
    host, port = args.listen.rsplit(":", 1)
    thost, tport = args.target.rsplit(":", 1)
    relay = Relay((thost, int(tport)), args.delay, args.loss, args.stall, args.chunk, args.queue, args.seed)
    server = await asyncio.start_server(relay.serve, host, int(port))
    print(json.dumps({"port": server.sockets[0].getsockname()[1]}), flush=True)
    async with server:
        await server.serve_forever()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--listen", required=True, help="HOST:PORT to listen on (port 0: any)")
    ap.add_argument("--target", required=True, help="HOST:PORT to forward to")
    ap.add_argument("--delay", type=float, default=0.005, help="one-way delay per chunk, seconds")
    ap.add_argument("--loss", type=float, default=0.0, help="probability a chunk is stalled")
    ap.add_argument("--stall", type=float, default=0.2, help="extra hold of a stalled chunk, seconds")
    ap.add_argument("--chunk", type=int, default=64 << 10, help="largest chunk read at once, bytes")
    ap.add_argument("--queue", type=int, default=256, help="chunks queued per direction")
    ap.add_argument("--seed", type=int, default=None)
    args = ap.parse_args(argv)
    try:
        asyncio.run(main_async(args))
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
