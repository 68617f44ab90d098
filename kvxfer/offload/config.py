"""The offload manager's settings and the values its calls return."""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from ..errors import LayoutError, RequestError
from ..layout import TOKEN


@dataclass(frozen=True, slots=True, kw_only=True)
class OffloadConfig:
    """Per-rank offload settings; validated here, and against the pools by the manager."""
    stride: int                                   # tokens per offload copy; a multiple of the page size
    stream_spaces: tuple[str, ...] = (TOKEN,)     # append-only spaces, copied every stride
    replicated: bool | None = None                # KV identical on every rank (None: layout.kind == "mla")
    storage_dir: str | None = None                # the file tier; None: a full host pool makes offload wait
    group_timeout_s: float = 10.0                 # a collective waits this long before the group is broken

    def __post_init__(self):
        if isinstance(self.stride, bool) or not isinstance(self.stride, int) or self.stride < 1:
            raise LayoutError(f"OffloadConfig.stride must be a positive int (tokens), got {self.stride!r}")
        if not self.group_timeout_s > 0:
            raise LayoutError(f"OffloadConfig.group_timeout_s must be > 0, got {self.group_timeout_s}")
        object.__setattr__(self, "stream_spaces", tuple(self.stream_spaces))


class PollResult(NamedTuple):
    released: list[str]             # free these requests' device slots now (same list on every rank)
    failed: list[tuple[str, str]]   # (rid, reason): not offloaded; the device slots are still the engine's


class HostGrant(NamedTuple):
    """Where a direct-to-host receive lands: request ``positions[space]`` go to host ``slots[space]``."""
    positions: dict[str, np.ndarray]
    slots: dict[str, np.ndarray]


def check_ready(ready) -> None:
    """Refuse a ``ready`` object that is not event-like (see the readiness contract in ``manager``)."""
    if ready is not None and not (callable(getattr(ready, "query", None))
                                  and callable(getattr(ready, "synchronize", None))):
        raise RequestError(f"ready must have query() and synchronize() (a torch.cuda.Event), got "
                           f"{type(ready).__name__}")


__all__ = ["OffloadConfig", "PollResult", "HostGrant", "check_ready"]
