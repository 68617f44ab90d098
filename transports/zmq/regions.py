"""The registered regions, as both sides of the zmq transport read and write them.

Who calls what: ``ZMQTransport.register`` calls ``Regions.set`` once at start-up (under the
transport's write lock, before peers send); the sender's framer reads sources through it and the
receiver writes into it, both on the I/O thread.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


class Regions:
    """``tensors``: byte views of the regions (ids = positions); ``host``: their numpy views (None
    for a device region); ``is_host``: per region, with one False more at the end; ``sizes``: bytes
    per region, as an int64 array and as ``size_list`` (what ``GrantTable.region_sizes`` holds)."""

    def __init__(self) -> None:
        self.tensors: list[torch.Tensor] = []
        self.host: list[np.ndarray | None] = []
        self.is_host = np.zeros(1, bool)
        self.sizes = np.zeros(0, np.int64)
        self.size_list: list[int] = []

    def set(self, views: Sequence[torch.Tensor]) -> None:
        self.tensors = list(views)
        self.host = [v.numpy() if v.device.type == "cpu" else None for v in views]
        self.is_host = np.array([h is not None for h in self.host] + [False], bool)
        self.size_list = [v.numel() for v in views]
        self.sizes = np.asarray(self.size_list, np.int64)

    @property
    def all_host(self) -> bool:
        return bool(self.is_host[:-1].all())
