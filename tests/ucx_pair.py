"""Two UCX transports in this process, the sender connected to the receiver: for tests of the
UCX transport's own parts (``test_ucx_hotpath``, ``test_ucx_caller_turn``)."""
from __future__ import annotations

from collections.abc import Iterator

import torch

from kvxfer.transport.registry import get_transport

CANARY = 0xA5


def connected_pair(region: int, seed: int, **options) -> Iterator[tuple]:
    """(receiver, sender, peer id, source, destination): one region of ``region`` bytes each (the
    source random from ``seed``, the destination ``CANARY``); both closed after."""
    rx, tx = get_transport("ucx", **options), get_transport("ucx", **options)
    try:
        src = torch.randint(0, 256, (region,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
        dst = torch.full((region,), CANARY, dtype=torch.uint8)
        rx.register([dst])
        tx.register([src])
        yield rx, tx, tx.connect(rx.descriptor()), src, dst
    finally:
        tx.close()
        rx.close()
