"""UCX control messages: one frozen dataclass each, packed and validated here and nowhere else.

On the wire a control message is a msgpack list ``[kind, field...]`` (never pickle). Messages
to one peer leave as one tagged batch per I/O-loop turn::

    [sender id, channel secret, [message, ...]]        tag CTRL_TAG | control tag

Joining. A transport's ``descriptor()`` names its *front* worker (no shared memory, no cma, no
RMA: ``join``), never the worker that moves data. A sender's first batch goes there, control
tag 0, and holds one HELLO: its data address, the channel secret (16 random bytes the
connecting side makes per peer; both directions carry it afterwards, so a third party that
knows a transport's id cannot speak for it), its shared-memory settings, the admission token
(``Transport.admit``) and the control tag the receiver must put on its messages to it. The
receiver checks it (admitted, settings equal where shared memory could be used) before it makes
anything for the peer, then answers WELCOME from its data worker: that worker's address and the
control tag the sender must use. Every later batch travels between the data workers under those
tags; a batch under a tag this side did not hand out is dropped unread.

``parse_batch`` checks the outer shape; ``parse_message`` checks one message against exact
types (a bool is no int, a float no id), ranges and sizes, and returns its dataclass or raises
``Malformed``. ``Malformed.answer`` is (transfer id, request id) when the message was an
ANNOUNCE whose ids are valid (the receiver answers its sender with a FAIL, counts it, and
touches no request: anyone could name a live one); any other bad message cannot be answered,
and is counted and dropped.

Data frames carry no header: tag ``DATA_BIT | dtag << FRAME_BITS | frame index``, dtag from GO.
Which bytes frame ``k`` holds follows from the ANNOUNCE alone (``frames.cut`` when ``staged``,
else every ``frame_bytes`` bytes), so both sides agree without more on the wire.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import msgpack
import numpy as np

from kvxfer.errors import ProtocolError
from kvxfer.transport.base import MAX_TOKEN

CTRL_TAG, DATA_BIT, KIND_MASK = 1 << 63, 1 << 62, 3 << 62
FRAME_BITS = 24  # data tag = DATA_BIT | dtag << FRAME_BITS | frame index
MAX_DTAG = 1 << (62 - FRAME_BITS)
HELLO, ANNOUNCE, GO, DONE, ACK, FAIL, ABORT, PING, BYE, PREGRANT, FENCE, FENCED, WELCOME = range(13)
MAX_CTAG = 1 << 62          # control tags: CTRL_TAG | tag, 1 <= tag < MAX_CTAG (0: a HELLO to a front worker)
MAX_ID = 1 << 63
MAX_SENDER = 256           # characters of a sender id a front worker takes (ours are 32)
FRONT_BYTES = 256 << 10    # the largest batch a front worker takes: one HELLO (its address is at most 64 KiB)
MAX_REQUEST_ID = 4096      # characters
MAX_NOTIFY = 1 << 20       # bytes
MAX_ADDRESS = 1 << 16      # bytes of a worker address
MAX_WHY = 1024             # characters of a failure reason (longer ones are cut)
MAX_TIMEOUT = 86400.0
SECRET_BYTES = 16
MAX_CAPABILITY = 64        # bytes of a grant capability (kvxfer.grant.MAX_CAPABILITY)
SHM_FIELDS = 4             # shared-memory settings a HELLO carries (``settings.MUST_MATCH``, in order)
MAX_SETTING = 64           # characters of one
MAX_HOST = 256             # characters of a host identity
MAX_RIDS = 4096            # request ids in one PREGRANT, FENCE or FENCED
MAX_PREGRANT_BYTES = 1 << 20   # of one request's granted ranges in a PREGRANT (65,536 intervals)
RUN_BYTES = 24
# An ANNOUNCE's eager flag (pregranted puts, without GO: ``eager``). STARTED: sent with the puts,
# DONE follows their flush (the receiver tracks the transfer: its deadline, its sender's death).
# FLUSHED: sent after the flush, announce and DONE at once (what senders before STARTED send).
EAGER_FLUSHED, EAGER_STARTED = 1, 2
_I8 = np.dtype("<i8")


class Malformed(ProtocolError):
    """A message that is not one of ours; ``answer``: (xid, request id) if it can be refused."""

    def __init__(self, why: str, answer: tuple[int, str] | None = None):
        super().__init__(why)
        self.answer = answer


@dataclass(frozen=True, slots=True)
class Hello:
    """Connecting side -> peer: its data worker's address and the channel secret; first to the
    peer's front worker (control tag 0), then again over the data path. ``epoch`` counts the
    handshakes on this channel: a sender that was silent to the peer (or fenced by it) flushes
    its endpoint and only then sends a HELLO with a higher epoch, which therefore also says
    "every put I issued before this has landed". ``host`` (boot id and PID-namespace) and
    ``pid`` let a receiver on the same kernel prove the sender dead (``Fencing``). ``err``:
    the sender's endpoint has UCX error handling on; the receiver's to it must match (endpoints
    of both modes do not talk). ``token``: what ``admit`` gave the receiver's owner for us;
    ``shm``: our ``settings.MUST_MATCH`` values; ``ctag``: the control tag the peer's messages
    to us must carry. ``drained``: every put the sender issued in an epoch below it has landed
    (or never will); ``epoch`` after a flush, lower after a re-handshake on a new endpoint while
    the old one drains (``Rehandshake.renew``: a HELLO with the same epoch and a higher
    ``drained`` follows its flush). A HELLO without it (older senders) means ``epoch``."""
    address: bytes
    secret: bytes
    epoch: int = 0
    host: str = ""
    pid: int = 0
    start: int = 0       # the process's start time (clock ticks since boot): pids are reused
    err: bool = False
    eager: bool = False  # it takes PREGRANTs and answers FENCEs (``eager``)
    token: bytes = b""
    shm: tuple[str, ...] = ("",) * SHM_FIELDS
    ctag: int = 1
    drained: int = -1    # -1: ``epoch``

    def __post_init__(self):
        if self.drained < 0:
            object.__setattr__(self, "drained", self.epoch)

    def wire(self) -> list:
        w = [HELLO, self.address, self.secret, self.epoch, self.host, self.pid, self.start, int(self.err),
             int(self.eager), self.token, list(self.shm), self.ctag]
        return w + [self.drained] if self.drained != self.epoch else w   # the older wire when it says nothing new


@dataclass(frozen=True, slots=True)
class Welcome:
    """Receiver -> the sender of a HELLO it accepted, over the data path: the address of its data
    worker (the sender's data endpoint goes there) and the control tag every later batch of the
    sender must carry. Also the answer to a HELLO over the data path (a round trip there)."""
    address: bytes
    ctag: int

    def wire(self) -> list:
        return [WELCOME, self.address, self.ctag]


@dataclass(frozen=True, slots=True)
class Announce:
    """Sender -> receiver: a transfer's destination runs (put runs first) and packed bytes inline."""
    xid: int
    request_id: str
    timeout: float
    notify: bytes
    runs: bytes          # int64 LE, three rows: destination region, offset, length
    nput: int
    frame_bytes: int
    inline: bytes
    cap: bytes = b""     # the grant's capability (decode's REQ): checked before anything else
    staged: bool = False  # packed frames cut by ``frames.cut`` (whole runs), else every frame_bytes
    eager: int = 0        # pregranted, without GO (``eager``): EAGER_STARTED, or EAGER_FLUSHED (older senders)

    def wire(self) -> list:
        head = [ANNOUNCE, self.xid, self.request_id, self.timeout, self.notify, self.runs, self.nput,
                self.frame_bytes, self.inline, self.cap]
        if self.eager:
            return head + [int(self.staged), self.eager]
        return head + [1] if self.staged else head   # unstaged: the older wire, which older peers read

    def run_array(self) -> np.ndarray:
        return np.frombuffer(self.runs, _I8).reshape(3, -1)


@dataclass(frozen=True, slots=True)
class Go:
    xid: int
    dtag: int

    def wire(self) -> list:
        return [GO, self.xid, self.dtag]


@dataclass(frozen=True, slots=True)
class Done:
    xid: int

    def wire(self) -> list:
        return [DONE, self.xid]


@dataclass(frozen=True, slots=True)
class Ack:
    xid: int

    def wire(self) -> list:
        return [ACK, self.xid]


@dataclass(frozen=True, slots=True)
class Fail:
    xid: int
    why: str

    def wire(self) -> list:
        return [FAIL, self.xid, self.why[:MAX_WHY]]


@dataclass(frozen=True, slots=True)
class Abort:
    xid: int
    why: str

    def wire(self) -> list:
        return [ABORT, self.xid, self.why[:MAX_WHY]]


@dataclass(frozen=True, slots=True)
class Pregrant:
    """Receiver -> sender: it may put into these requests' grants without an ANNOUNCE/GO round
    trip (``eager``), and what each grant is: ``grants[i]``, ``ByteRanges.packed()`` of
    ``rids[i]``, which the sender checks its runs against before it puts. Sent only to a peer
    whose HELLO said ``eager``."""
    rids: tuple[str, ...]
    grants: tuple[bytes, ...]

    def __post_init__(self):
        if len(self.rids) != len(self.grants):
            raise ProtocolError("a PREGRANT carries one grant per request id")

    def wire(self) -> list:
        return [PREGRANT, list(self.rids), list(self.grants)]


@dataclass(frozen=True, slots=True)
class Fence:
    """Receiver -> sender: these requests ended: no eager put for them any more; answer FENCED
    once every put issued so far is flushed."""
    rids: tuple[str, ...]

    def wire(self) -> list:
        return [FENCE, list(self.rids)]


@dataclass(frozen=True, slots=True)
class Fenced:
    """Sender -> receiver, after an endpoint flush: nothing of these requests is on its way and
    none will be. ``all``: of any request (its transport is closing with nothing in flight)."""
    rids: tuple[str, ...]
    all: bool = False

    def wire(self) -> list:
        return [FENCED, list(self.rids), int(self.all)]


@dataclass(frozen=True, slots=True)
class Ping:
    def wire(self) -> list:
        return [PING]


@dataclass(frozen=True, slots=True)
class Bye:
    def wire(self) -> list:
        return [BYE]


Message = Hello | Announce | Go | Done | Ack | Fail | Abort | Ping | Bye | Pregrant | Fence | Fenced | Welcome


def pack_batch(sender: str, secret: bytes, msgs: list[Message]) -> bytes:
    return msgpack.packb([sender, secret, [m.wire() for m in msgs]], use_bin_type=True)


def parse_batch(buf: bytes, limit: int) -> tuple[str, bytes, list]:
    """(sender id, secret, raw messages) of one control batch; ValueError if it is not one."""
    try:
        batch = msgpack.unpackb(buf, raw=False, strict_map_key=True, max_str_len=MAX_REQUEST_ID,
                                max_bin_len=limit, max_array_len=1 << 20, max_map_len=0, max_ext_len=0)
    except Exception as e:  # msgpack raises many types on hostile input
        raise ProtocolError(f"not msgpack ({type(e).__name__})") from None
    if not (type(batch) is list and len(batch) == 3 and type(batch[0]) is str and type(batch[1]) is bytes
            and type(batch[2]) is list):
        raise ProtocolError("not [sender, secret, [messages]]")
    return batch[0], batch[1], batch[2]


def kind_of(m) -> int | None:
    """The kind of a raw message, or None when it has none."""
    return m[0] if type(m) is list and m and type(m[0]) is int else None


def _int(v, lo: int, hi: int, what: str) -> int:
    if type(v) is not int or not lo <= v < hi:
        raise ProtocolError(f"{what} is not an integer in [{lo}, {hi})")
    return v


def _bytes(v, limit: int, what: str) -> bytes:
    if type(v) is not bytes or len(v) > limit:
        raise ProtocolError(f"{what} is not bytes of at most {limit}")
    return v


def _str(v, limit: int, what: str) -> str:
    if type(v) is not str or len(v) > limit:
        raise ProtocolError(f"{what} is not a string of at most {limit} characters")
    return v


# Lengths a message may have: ANNOUNCE without its newer fields is kvxfer's older wire (no
# capability, which a grant with one refuses). A HELLO has every field but ``drained`` (older
# senders: ``epoch``): one without settings, token or control tag cannot join.
_SIZES = {HELLO: (12, 13), ANNOUNCE: (9, 10, 11, 12), GO: (3,), DONE: (2,), ACK: (2,), FAIL: (3,), ABORT: (3,),
          PING: (1,), BYE: (1,), PREGRANT: (3,), FENCE: (2,), FENCED: (3,), WELCOME: (3,)}


def _rids(v) -> tuple[str, ...]:
    if type(v) is not list or len(v) > MAX_RIDS:
        raise ProtocolError(f"request ids are not a list of at most {MAX_RIDS}")
    return tuple(_str(r, MAX_REQUEST_ID, "request id") for r in v)


def parse_message(m, limit: int) -> Message:
    """One message as its dataclass; ``Malformed`` (saying why) for anything else."""
    kind = kind_of(m)
    if kind not in _SIZES or len(m) not in _SIZES[kind]:
        raise Malformed(f"malformed message: not a known message of the right length (kind {kind!r})")
    try:
        if kind == HELLO:
            address, secret = _bytes(m[1], MAX_ADDRESS, "address"), _bytes(m[2], SECRET_BYTES, "secret")
            shm = m[10]
            if type(shm) is not list or len(shm) != SHM_FIELDS:
                raise ProtocolError(f"shared-memory settings are not a list of {SHM_FIELDS}")
            epoch = _int(m[3], 0, MAX_ID, "epoch")
            return Hello(address, secret, epoch, _str(m[4], MAX_HOST, "host"),
                         _int(m[5], 0, 1 << 31, "pid"), _int(m[6], 0, MAX_ID, "start time"),
                         _int(m[7], 0, 2, "error handling") == 1, _int(m[8], 0, 2, "eager flag") == 1,
                         _bytes(m[9], MAX_TOKEN, "token"), tuple(_str(v, MAX_SETTING, "setting") for v in shm),
                         _int(m[11], 1, MAX_CTAG, "control tag"),
                         _int(m[12], 0, epoch + 1, "drained epoch") if len(m) > 12 else epoch)
        if kind == WELCOME:
            return Welcome(_bytes(m[1], MAX_ADDRESS, "address"), _int(m[2], 1, MAX_CTAG, "control tag"))
        if kind == PING:
            return Ping()
        if kind == BYE:
            return Bye()
        if kind == PREGRANT:
            rids, grants = _rids(m[1]), m[2]
            if type(grants) is not list or len(grants) != len(rids):
                raise ProtocolError("grants are not a list of one per request id")
            grants = tuple(_bytes(g, MAX_PREGRANT_BYTES, "grant") for g in grants)
            if any(len(g) % 16 for g in grants):
                raise ProtocolError("a grant is not int64 (start, end) pairs")
            return Pregrant(rids, grants)
        if kind == FENCE:
            return Fence(_rids(m[1]))
        if kind == FENCED:
            return Fenced(_rids(m[1]), _int(m[2], 0, 2, "all flag") == 1)
        xid = _int(m[1], 0, MAX_ID, "transfer id")
        if kind == GO:
            return Go(xid, _int(m[2], 1, MAX_DTAG, "data tag"))
        if kind in (DONE, ACK):
            return (Done if kind == DONE else Ack)(xid)
        if kind in (FAIL, ABORT):
            why = m[2] if type(m[2]) is str else ""
            return (Fail if kind == FAIL else Abort)(xid, why[:MAX_WHY])
    except ValueError as e:
        raise Malformed(f"malformed message: {e}") from None
    # ANNOUNCE: with valid ids it can be refused; other fields are checked after them
    try:
        xid = _int(m[1], 0, MAX_ID, "transfer id")
        rid = _str(m[2], MAX_REQUEST_ID, "request id")
    except ValueError as e:
        raise Malformed(f"malformed message: {e}") from None
    try:
        timeout = m[3]
        if type(timeout) not in (int, float) or not (math.isfinite(timeout) and 0 <= timeout <= MAX_TIMEOUT):
            raise ProtocolError(f"timeout {timeout!r}")
        notify = _bytes(m[4], MAX_NOTIFY, "notify")
        runs = _bytes(m[5], limit, "run array")
        if len(runs) % RUN_BYTES:
            raise ProtocolError("run array is not 3 rows of int64")
        nput = _int(m[6], 0, len(runs) // RUN_BYTES + 1, "put run count")
        frame = _int(m[7], 4096, 1 << 32, "frame size")
        inline = _bytes(m[8], limit, "inline bytes")
        cap = _bytes(m[9], MAX_CAPABILITY, "capability") if len(m) >= 10 else b""
        staged = _int(m[10], 0, 2, "staged flag") if len(m) >= 11 else 0
        eager = _int(m[11], 0, EAGER_STARTED + 1, "eager flag") if len(m) == 12 else 0
        if eager and staged:
            raise ProtocolError("an eager announce carries puts and inline bytes only, no frames")
    except ValueError as e:
        raise Malformed(f"malformed header: {e}", (xid, rid)) from None
    return Announce(xid, rid, float(timeout), notify, runs, nput, frame, inline, cap, bool(staged), eager)
