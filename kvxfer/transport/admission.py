"""Which senders may open a data path to a receiver: ``Transport.admit`` and the tokens it hands out.

Who calls what, and when:
    ``Admissions(required, capacity)``   a transport, at construction.
    ``admit(sender_id) -> token``        ``Transport.admit`` (decode's endpoint, any thread), once per
                                         prefill rank before its HELLO; again for the same id: a
                                         fresh token, and the old one stops working. b"" when
                                         admission is not required.
    ``check(sender_id, token) -> key``   the transport's I/O thread, when a sender presents a token
                                         (zmq: at the ZMTP handshake, through ZAP): the key of the
                                         admission in force for that sender, or None.
    ``current(key)``                     the I/O thread, per message: is the admission behind
                                         ``key`` still in force (not replaced by a newer ``admit``)?

Keys are ``"<sender id>#<n>"``, n counting admissions, so a re-admitted sender's old connections
hold a key that is no longer current. At most ``capacity`` senders are admitted at once; admitting
one more forgets the least recently admitted (a long-lived decode rank outlives many prefill ranks,
and nothing tells it which are gone).
"""
from __future__ import annotations

import collections
import hmac
import itertools
import secrets
import threading

from ..errors import ConfigError

TOKEN_BYTES = 32
MAX_TOKEN = 64          # the contract's bound on a token (``Transport.admit``)
MAX_SENDER_ID = 255     # bytes of a sender id (a ZMTP PLAIN user name holds at most 255)


class Admissions:
    """The admitted senders of one receiver and their tokens. Thread-safe."""

    def __init__(self, required: bool, capacity: int = 4096):
        if capacity < 1:
            raise ConfigError(f"admission capacity {capacity} must be >= 1")
        self.required, self.capacity = required, capacity
        self._lock = threading.Lock()
        self._by_id: collections.OrderedDict[str, tuple[bytes, str]] = collections.OrderedDict()
        self._current: set[str] = set()
        self._n = itertools.count(1)

    def admit(self, sender_id: str) -> bytes:
        """A fresh token for ``sender_id`` (b"" when admission is not required)."""
        if not isinstance(sender_id, str) or not 0 < len(sender_id.encode()) <= MAX_SENDER_ID:
            raise ConfigError(f"a sender id is a string of 1..{MAX_SENDER_ID} bytes, got {sender_id!r:.80}")
        if not self.required:
            return b""
        token = secrets.token_bytes(TOKEN_BYTES)
        with self._lock:
            old = self._by_id.pop(sender_id, None)
            if old is not None:
                self._current.discard(old[1])
            key = f"{sender_id}#{next(self._n)}"
            self._by_id[sender_id] = (token, key)
            self._current.add(key)
            while len(self._by_id) > self.capacity:
                _, (_, gone) = self._by_id.popitem(last=False)
                self._current.discard(gone)
        return token

    def check(self, sender_id: str, token: bytes) -> str | None:
        """The key of ``sender_id``'s admission when ``token`` is its current token, else None."""
        with self._lock:
            entry = self._by_id.get(sender_id)
        if entry is None or not hmac.compare_digest(entry[0], token):
            return None
        return entry[1]

    def current(self, key: str | None) -> bool:
        with self._lock:
            return key in self._current

    def __len__(self) -> int:
        with self._lock:
            return len(self._by_id)
