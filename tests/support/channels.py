"""A ``ControlChannel`` owner of the test's own, for tests that drive the channel without an
endpoint: ``Quiet`` keeps what arrives (``got``), loses no sleep over lost peers, and asks for
a tick every 50 ms. Tests subclass it to watch peers, raise, or hold the thread."""
from __future__ import annotations


class Quiet:
    """The handler the channel calls from its thread: ``on_message`` per message, ``on_peer_lost``
    per peer it gives up on, ``on_tick`` each turn (returns seconds to the next)."""

    def __init__(self) -> None:
        self.got: list = []

    def on_message(self, peer, msg) -> None:
        self.got.append((peer, msg))

    def on_peer_lost(self, peer, why) -> None:
        pass

    def on_tick(self, now) -> float:
        return 0.05
