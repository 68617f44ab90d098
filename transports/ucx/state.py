"""The records the parts of ``UCXTransport`` share: a connected ``Peer``, an ``Incoming`` transfer
(receiver side) and an ``Outgoing`` one (sender side). Plain state, no behaviour: the parts all
import it, and it imports none of them. Each record is owned by the part that keeps it (``Peers``,
``Receiver.incoming``, ``Sender.outgoing``); the others read and mark it on the I/O thread."""
from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from ucxx._lib import libucxx as ucx_api

from kvxfer.transport.base import TransferHandle
from kvxfer.transport.kit import PeerClock

from . import bindings as ucp
from .frames import StagedFrames
from .protocol import Announce

PackedRuns = tuple[np.ndarray, np.ndarray, np.ndarray]   # region, offset, nbytes of packed runs


@dataclass(eq=False)
class Peer:
    id: str
    ep: ucx_api.UCXEndpoint          # error handling off, except for ``err`` peers
    secret: bytes                    # the channel secret every batch to or from it carries
    eph: int = 0                     # ep's ucp_ep_h, 0 once closed (ucxx's ``ep.handle`` drops the GIL at each read)
    clock: PeerClock = field(default_factory=PeerClock)
    base: np.ndarray | None = None   # remote region addresses, sizes, rkeys: set by connect()
    sizes: np.ndarray | None = None
    base_list: list = field(default_factory=list)   # the same as Python ints (few-runs path)
    sizes_list: list = field(default_factory=list)
    rkeys: np.ndarray = field(default_factory=lambda: ucp.EMPTY_TABLE)   # uint64 per region (0: empty region)
    gone: bool = False               # silent past peer_timeout; cleared when it speaks again
    far: bool = False                # reached through the FAR_TLS worker (another host or network namespace)
    err: bool = False                # endpoint error handling on (a peer in another host or network namespace
                                     # reached without a user-chosen TLS): UCX reports its connection's failure
    failed_at: float | None = None   # ``err``: its endpoint reported a failure at
    pack_all: bool = False           # every run travels packed (``err`` over TCP only: UCX emulates puts there)
    failure: str = ""                # what the failure was (``lifecycle.failure_of``): "reset" proves writes over
    answered: bool = False           # sender: its WELCOME answered our HELLO over the data path (connect() waits)
    tag_in: int = 0                  # the control tag its batches to us carry (we chose it: ``join``)
    old_tags: list = field(default_factory=list)   # tags it had before the latest new epoch (``rebind_tag``)
    last_tag: int = 0                # the tag its latest batch came under (``inbox``)
    tag_out: int = 0                 # the control tag of ours to it (its WELCOME or HELLO chose it; 0: its front)
    joining: bool = False            # sender: our HELLO went to its front worker; no WELCOME yet (``join``)
    admitted: bool = False           # receiver: it joined with an admission token (``join``)
    ctrl_bytes: int = 0              # its control batches being received or handled (``inbox``)
    ctrl_wait: collections.deque = field(default_factory=collections.deque)   # its batches waiting for that budget
    where: str = "unknown"           # sender: where it is (``settings.reach``), from its descriptor
    token: bytes = b""               # sender: its owner's admission token for us, sent in every HELLO
    rkeys_packed: list = field(default_factory=list)   # sender while joining: unpacked at its WELCOME
    outbox: list = field(default_factory=list)   # control messages to send it (``Outbox``)
    outbox_due: bool = False         # one of them is not lazy: they leave at the end of this turn
    last_send: Any = None            # the latest control send to it
    next_ping: float = 0.0
    open_in: int = 0                 # incoming transfers open from it
    bye_at: float | None = None      # when it said BYE: its transport closed, it never comes back
    # fencing (see the module docstring)
    fenced: bool = False             # receiver: went silent; its ANNOUNCEs are refused until it re-handshakes
    epoch: int = 0                   # receiver: the epoch of its latest HELLO
    my_epoch: int = 0                # sender: the epoch of our latest HELLO to it
    rehello: ucp.Flush = None           # sender: the endpoint flush after which we send HELLO(my_epoch + 1)
    waiting: list = field(default_factory=list)   # sender: transfers to announce after that HELLO
    # re-handshake on a new endpoint (``err`` peers: ``Rehandshake.renew``)
    addr: bytes = b""                # its data worker's address (our endpoint to it goes there)
    front_addr: bytes = b""          # sender: its front worker's address (where we joined it)
    rkeys_src: list = field(default_factory=list)   # sender: its regions' base, sizes, packed rkeys (kept)
    old: list = field(default_factory=list)   # sender: ``Retired`` endpoints whose puts may still be on their way
    undrained: int | None = None     # sender: the oldest epoch of a forgotten endpoint (a failure before this
                                     # connect proved nothing, ``Fencing.check_failed``) whose puts may still land
    old_ctrl: list = field(default_factory=list)   # receiver: endpoints ``renew_control`` replaced (kept open)
    ep_used: bool = False            # sender: a put or frame of ours went over ``ep``
    drained: int = 0                 # receiver: its latest HELLO's ``drained`` (its epochs below have landed)
    host: str = ""                   # its HELLO's identity: same kernel and namespaces as ours?
    pid: int = 0
    start: int = 0
    dead_since: float | None = None  # proven dead (process gone) at; held memory is freed after a grace
    closing: bool = False            # disconnect(): freed once nothing of it is held (``Lifecycle.retire_closing``)
    close_flush: ucp.Flush | None = None   # the endpoint flush before it is closed
    closing_since: float = 0.0
    # eager writes (``eager``)
    sends_eager: bool = False        # receiver: its HELLO said it takes PREGRANTs and answers FENCEs
    pregranted: dict = field(default_factory=dict)     # sender: request id -> ByteRanges it may put to now (ordered)
    pregranted_bytes: int = 0        # sender: what those take (``eager.INTERVAL_COST`` an interval)
    fence_flushes: list = field(default_factory=list)  # sender: (flush, request ids) to answer FENCED after
    fence_answers: bool = False      # sender: it pregranted us once (``EagerSends.park`` waits for its PREGRANTs)
    fenced_all_said: bool = False    # sender: we told it FENCED-all (closing, or disconnecting it)
    flush_failed: bool = False       # sender: a flush of our puts to it failed (never FENCED-all then)


@dataclass(eq=False)
class Incoming:
    """An incoming transfer (receiver side)."""
    peer: Peer                       # the transport's Peer
    xid: int
    rid: str
    deadline: float
    nbytes: int
    notify: bytes
    packed: PackedRuns | None        # region, offset, nbytes arrays of the packed runs; None once landed
    staging: StagedFrames | None     # their frames through the receive ring (CUDA, or staged by the sender)
    frame_bytes: int
    frames: int
    iov: ucp.IovFrames | None = None  # or receives posted into the runs themselves (host, unstaged)
    dtag: int = 0                    # tag of the frames (0: no GO sent)
    puts: int = 0                    # announced runs the sender puts (one-sided) after GO
    cap: bytes = b""                 # the capability its ANNOUNCE carried (checked against the grant)
    got: int = 0
    done: bool = False
    epoch: int = 0                   # the sender's epoch when it was announced (``Landing``: what a HELLO drains)


@dataclass(eq=False)
class Retired:
    """Sender: an endpoint a re-handshake replaced (``Rehandshake.renew``). What we put or sent over
    it may still be on its way (a TCP connection in retransmit backoff after a partition) until
    its flush completes; until then the peer holds what those writes may land in."""
    ep: Any
    eph: int
    rkeys: np.ndarray
    flush: Any                       # ucp.Flush; None once it ended
    epoch: int                       # the epoch it carried
    drained: bool = False            # its flush completed: what it carried has landed (or never will)


def oldest_undrained(p: Peer) -> int | None:
    """Sender: the oldest of our epochs to ``p`` whose puts may still land there, on an endpoint
    other than the current one: a replaced one not drained (``Retired``), or one forgotten before
    this connect (``Peer.undrained``). None: every older put landed. Our HELLO says it
    (``drained``), and no FENCED is answered while there is one."""
    older = [r.epoch for r in p.old if not r.drained]
    return min(older if p.undrained is None else [*older, p.undrained], default=None)


@dataclass(eq=False)
class Outgoing:
    """An outgoing transfer (sender side), owned by the I/O thread once enqueued."""
    xid: int
    peer: Peer                       # the transport's Peer
    handle: TransferHandle
    announce: Announce
    puts: bytes                      # int64 rows (src addr, dst addr, nbytes, src region, dst region): ``post_puts``
    staging: StagedFrames | None     # packed frames gathered into the send ring (CUDA sources; host to far peers)
    frame_bytes: int
    iov: ucp.IovFrames | None = None  # or the packed runs' frames, read in place (host sources)
    state: str = "queued"            # queued -> wait_go -> flushing -> wait_ack; eager: queued -> flushing -> done;
                                     # queued -> wait_pregrant -> queued -> (either) while it waits for a PREGRANT
    dtag: int = 0                    # the data tag GO gave (staged frames)
    flush: ucp.Flush | None = None
    abort: str = ""                  # why it failed, for the ABORT sent once its puts are flushed
    stale: bool = False              # announced before a re-handshake began: a GO for it is refused
    eager: bool = False              # put without GO (pregranted): announced with its puts, DONE after the flush
    eph: int = 0                     # the endpoint its puts and frames went over (``Rehandshake.check_old``)
    parked: bool = False             # it waited for its PREGRANT once (``EagerSends.park``): never again
