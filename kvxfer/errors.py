"""The one error tree of kvxfer. Backend errors are mapped into it where they arise.

    KVXferError
    ├── LayoutError          a layout or pool was described or used wrongly   (also a ValueError)
    ├── PlanError            two layouts / slot sets / head slices cannot be planned (also a ValueError)
    ├── CompatibilityError   a P/D pair refused at launch, with every mismatch in words
    ├── ConfigError          an option or setting is invalid; names it, its value, what is allowed (also a ValueError)
    ├── ProtocolError        a peer's message or record failed its checks (also a ValueError)
    │   ├── WireError        a control message: carries its fixed ``Drop`` reason (kvxfer.control.messages)
    │   └── RegistryError    a registry request: carries its HTTP status (kvxfer.control.registry)
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


class ConfigError(KVXferError, ValueError):
    """An option or setting is invalid (a transport's options, say); the message names the option,
    the value given and what is allowed. Raised where the options are built, before anything starts."""


class ProtocolError(KVXferError, ValueError):
    """Something a peer sent (a message, a record, a registry request) failed its checks; the message
    names the field. Never escapes a thread that reads peers: it is counted and dropped or refused."""


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


def short(v) -> str:
    """``repr(v)`` cut to 80 characters: a value from a caller or a peer, quoted in an error message."""
    r = repr(v)
    return r if len(r) <= 80 else r[:77] + "..."
