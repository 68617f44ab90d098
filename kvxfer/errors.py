"""The one error tree of kvxfer. Backend errors are mapped into it where they arise.

    KVXferError
    ├── LayoutError          a layout or pool was described or used wrongly   (also a ValueError)
    ├── PlanError            two layouts / slot sets / head slices cannot be planned (also a ValueError)
    ├── CompatibilityError   a P/D pair refused at launch, with every mismatch in words
    ├── TransportError
    │   ├── ConnectError     a peer could not be reached or registered
    │   ├── TransferTimeout  a transfer passed its deadline
    │   ├── PeerError        the peer died, stalled or reported a failure
    │   └── RejectedWrite    incoming runs fell outside what the receiver granted
    ├── RequestError         a KVSender/KVReceiver request ended badly (Failed / Aborted / TimedOut)
    └── StorageError         an offloaded record is missing, truncated, corrupt, or for another layout
"""
from __future__ import annotations


class KVXferError(Exception):
    """Base of every error kvxfer raises on purpose."""


class LayoutError(KVXferError, ValueError):
    """A layout, pool or slot set is invalid; the message names the field and both values."""


class PlanError(KVXferError, ValueError):
    """Source and destination cannot be planned together; the message says why."""


class CompatibilityError(KVXferError):
    """A prefill/decode pair cannot talk; `mismatches` lists every reason in words."""

    def __init__(self, mismatches: list[str]):
        self.mismatches = list(mismatches)
        super().__init__("incompatible peers:\n  - " + "\n  - ".join(self.mismatches))


class TransportError(KVXferError):
    """A data-plane failure."""


class ConnectError(TransportError):
    """A peer could not be reached, or the transport is not installed. ``transient``: trying again
    may work (the registry was unreachable or busy, or a key is still held by a predecessor)."""

    def __init__(self, *args, transient: bool = False):
        super().__init__(*args)
        self.transient = transient


class TransferTimeout(TransportError):
    """A transfer did not complete before its deadline."""


class PeerError(TransportError):
    """The peer died, stalled, or reported a failure."""


class RejectedWrite(TransportError):
    """Incoming runs fell outside the registered regions or the request's grant."""


class RequestError(KVXferError):
    """A request ended in Failed, Aborted or TimedOut; `reason` says why."""

    def __init__(self, reason: str):
        self.reason = reason
        super().__init__(reason)


class StorageError(KVXferError):
    """A stored record is missing, truncated, corrupt, or was written for another layout."""
