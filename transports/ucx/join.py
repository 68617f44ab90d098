"""Joining a UCX transport: the front worker, the HELLO it takes, the WELCOME that answers it.

``UCXJoin`` is a mixin of ``UCXTransport``. ``connect`` runs in the caller's thread (it hands
the work to the I/O thread and waits); every other method runs on the I/O thread.

Why a front worker (issue 34). UCX's shared-memory transports (sysv, posix) trust whoever can
reach them: a peer that makes an endpoint to a worker's address writes that worker's receive
FIFO in shared memory with its *own* FIFO size and reads pointers the owner keeps there, and
the owner's endpoint back to the peer writes the peer's FIFO with the owner's size. Measured
(``tests/test_ucx_hostile_peers.py``, before this module): a same-host peer with UCX's default
FIFO (256 entries, kvxfer's is 4096) that said HELLO and sent 400 answered batches killed the
receiver (SIGSEGV: its endpoint to the peer wrote past the peer's 256 entries) or stopped every
shared-memory message to it (its read position waited for an entry the peer wrote elsewhere).
So a transport never hands a peer the address of a worker with shared memory, cma or RMA
before the peer is checked:

* ``descriptor()["address"]`` is the *front* worker's: TCP only (``settings.front_tls``), tag
  messages only (no RMA feature, so no emulated put or get reaches any memory through it). It
  takes exactly one thing: a batch of one HELLO, control tag 0, at most ``FRONT_BYTES``.
* ``_on_join`` checks that HELLO before anything is made for its sender: well formed, its
  secret the batch's, admitted (``Transport.admit``, when this transport requires admission),
  and its shared-memory settings equal to ours unless the peer is elsewhere with UCX error
  handling on (UCX then uses no shared memory between us). Refused: counted, nothing made.
* Accepted, the receiver makes its endpoint to the sender's data address and answers WELCOME
  over it: the address of its data worker and a control tag of 62 random bits; the sender's
  batches carry that tag from then on, and a batch under a tag this side did not hand out is
  dropped unread (``control``).
* The sender (``_on_welcome``) closes its endpoint to the front, makes its data endpoint to the
  WELCOME's address, unpacks the rkeys there and says HELLO again over it; the WELCOME that
  answers that one completes ``connect`` (a round trip over the data path).

Residual exposure, stated precisely. Shared memory stays trust-the-peer: a peer that knows a
data worker's address (handed only to peers that passed the checks above) or can attach this
process's shared-memory segments by other means (the same user or group, UCX creates them
0660, or root; found in ``/proc/sysvipc/shm`` by anyone on the host) can write anything there,
and a process with those rights could also ptrace this one. Below libucp, UCX's wire protocol
trusts the peer too (endpoint ids are pointers when error handling is off): a peer that crafts
UCX packets by hand instead of calling libucp can crash the process through any worker,
the front one included. What is checked here holds against peers that speak UCX through libucp
with any settings, and against every message of ours a peer can forge.
"""
from __future__ import annotations

import collections
import ctypes
import hmac
import logging
import os
import secrets
import threading
import time
import weakref
from typing import TYPE_CHECKING, Any

import numpy as np
from ucxx._lib import libucxx as ucx_api

from kvxfer.errors import ConnectError, TransportError

from . import bindings as ucp
from .protocol import HELLO, MAX_CTAG, MAX_TOKEN, SECRET_BYTES, Hello, Malformed, Welcome, kind_of, parse_message
from .settings import FAR_TLS, MUST_MATCH, far_path, front_tls, reach, settings_differ
from .state import Peer

if TYPE_CHECKING:
    from collections.abc import Callable

    from kvxfer.grant import GrantTable

    from .protocol import Message

log = logging.getLogger("kvxfer.transport.ucx")

FRONT_BYTES = 256 << 10   # the largest batch a front worker takes: one HELLO (its address is at most 64 KiB)
MAX_SENDER = 256          # characters of a sender id a front worker takes (ours are 32)


def make_front(config: dict[str, str], tls: str | None) -> tuple[Any, Any]:
    """The front worker's context and worker (``tls``: the user's explicit UCX_TLS, or None)."""
    ctx = ucx_api.UCXContext({**config, "TLS": front_tls(tls)},
                             feature_flags=(ucx_api.Feature.TAG, ucx_api.Feature.WAKEUP))
    worker = ucx_api.UCXWorker(ctx)
    worker.init_blocking_progress_mode()
    return ctx, worker


def _ep_closed(transport_ref: weakref.ref, peer_ref: weakref.ref) -> None:
    """ucxx's close callback of an ``err`` endpoint (inside a worker progress call, on the I/O
    thread): only queue the peer for ``UCXFencing._check_failed``. It also comes when we close the
    endpoint ourselves; the handler skips a peer already forgotten. Never raises into UCX."""
    try:
        t, p = transport_ref(), peer_ref()
        if p is not None:
            p.eph = 0   # ucxx closed it: as its handle reads from now on
        if t is not None and p is not None:
            t._failed_eps.append(p)
    except Exception:   # pragma: no cover - nothing here raises; UCX must never see it
        pass


class UCXJoin:
    """Joining half of ``UCXTransport`` (see the module docstring)."""

    # Declared for the type checker only (set in ``UCXTransport.__init__`` or by the other halves).
    id: str
    grants: GrantTable
    max_peers: int
    max_control_bytes: int
    connect_timeout: float
    _host_id: str
    _tls_explicit: bool
    _shm_settings: dict[str, str]
    _network_only: bool
    _address: bytes
    _worker: Any
    _peers: dict[str, Peer]
    _by_tag: dict[int, Peer]
    _retired_tags: collections.OrderedDict[int, None]
    _config: dict[str, str]
    _pid: int
    _start_ticks: int
    _workers: list
    _far_ctx: Any
    _far_worker: Any
    _far_address: bytes
    _closing: list[Peer]
    _zombies: list
    _retired: collections.OrderedDict[str, tuple[bytes, int]]
    io: Any                           # kit.IOThread
    commands: Any                     # kit.CommandQueue
    admission: bool | None
    _admission_on: bool
    _admitted: collections.OrderedDict[str, bytes]
    _admit_lock: threading.Lock
    _stop: bool
    _in: dict
    _out: dict
    _admission_required: Callable[[], bool]               # UCXAdmission
    _require_admission: Callable[[], None]
    _holds_any: Callable[[Peer], bool]
    _let_go: Callable[[Peer, str], None]
    _peer_gone: Callable[[Peer, str], None]
    _call: Callable[..., Any]
    _send: Callable[[Peer, Message], None]
    _rehello: Callable[[Peer], None]
    _on_message: Callable[[Peer, Any], None]
    _unwait: Callable[[Peer], None]                       # UCXInbox
    _evict_silent: Callable[[], bool]                     # UCXAdmission
    disconnect: Callable[[str], None]

    # ---- caller's thread --------------------------------------------------------------------
    def connect(self, descriptor: dict, token: bytes = b"") -> str:
        """Sender, once per receiver: join it through its front worker (its descriptor's address)
        with ``token`` (what its owner's ``admit`` gave for us; b"" where it requires none), then
        an endpoint to the data worker its WELCOME names (error handling off; through the
        FAR_TLS worker when the peer is on another host or network namespace), its rkeys there,
        and a round trip over it, all within ``connect_timeout`` (``ConnectError`` naming the
        address, and why when we can tell)."""
        try:
            peer_id, addr = str(descriptor["id"]), bytes.fromhex(descriptor["address"])
            base, sizes = (np.asarray(descriptor[k], np.int64) for k in ("region_base", "region_sizes"))
            rkeys = [bytes.fromhex(k) for k in descriptor["rkeys"]]
            theirs = {k: str(descriptor.get("shm_settings", {}).get(k, "")) for k in MUST_MATCH}
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise ConnectError(f"not a UCX transport descriptor ({type(e).__name__}: {e})") from e
        if type(token) is not bytes or len(token) > MAX_TOKEN:
            raise ConnectError(f"an admission token is bytes of at most {MAX_TOKEN}, got {type(token).__name__}")
        if token:   # we are part of a deployment that admits its peers: so do we, from now on
            self._require_admission()
        where = reach(self._host_id, str(descriptor.get("host", ""))[:200])
        differ = settings_differ(self._shm_settings, theirs)
        if differ and not far_path(where, self._tls_explicit):   # no shared memory between us: no matter
            raise ConnectError("UCX shared-memory settings differ from the peer's (a mismatch would hang "
                               f"transfers): {'; '.join(differ)}. Give both sides the same settings.")
        if not len(base) == len(sizes) == len(rkeys) or base.ndim != 1:
            raise ConnectError("UCX descriptor region lists differ in length")
        named = (f"UCX peer {peer_id[:8]} on {str(descriptor.get('hostname', '?'))[:255]!r} (worker address "
                 f"{addr[:8].hex()}..., {len(addr)} bytes)")
        try:
            peer = self._call(self._do_connect, peer_id, addr, base, sizes, rkeys, where, token)
        except (TransportError, TimeoutError):
            raise
        except Exception as e:   # UCX refused the address (unreachable, malformed)
            raise ConnectError(f"{named}: cannot make an endpoint: {type(e).__name__}: {e}") from e
        p, end = self._peers.get(peer), time.monotonic() + self.connect_timeout
        while p is not None and not p.answered and time.monotonic() < end and not self.io.broken:
            time.sleep(0.002)
        if p is None or not p.answered:
            joined = p is not None and not p.joining
            self.disconnect(peer)
            raise ConnectError(f"{named} did not answer over UCX within {self.connect_timeout:g}s: " + (
                "its data address does not reach from here" if joined else
                "it refused our HELLO (not admitted, or shared-memory settings that differ: its log says "
                "which), or its address does not reach from here") +
                " (another host or network namespace without a common transport, a firewall, or the process is gone)")
        return peer

    # ---- I/O thread: receiver -----------------------------------------------------------------
    def _on_join(self, sender: str, secret: bytes, raw: list) -> None:
        """A batch to the front worker: one HELLO, checked before anything is made for its sender
        (see the module docstring); accepted, it is handled as any HELLO (WELCOME answers it)."""
        if len(raw) != 1 or kind_of(raw[0]) != HELLO:
            self.grants.reject("?", "malformed message: a front worker takes one HELLO per batch")
            return
        try:
            hello = parse_message(raw[0], self.max_control_bytes)
        except Malformed as e:
            self.grants.reject("?", f"malformed message: HELLO: {e}"[:200])
            return
        assert isinstance(hello, Hello)
        why = self._join_refusal(sender, secret, hello)
        p = self._peers.get(sender)
        if not why and p is not None and not hmac.compare_digest(secret, p.secret):
            # Bound to another channel. Admitted now, its id is bound to this one (the token says
            # so) once the old holds nothing here; before, or without admission, the old stays.
            if self._admission_required() and not self._holds_any(p):
                self._let_go(p, "its id joined again with an admission token")
                p = None
            else:
                why = "its id is bound to another channel" + (" that still holds memory here"
                                                              if self._admission_required() else "")
        if not why and p is None and len(self._peers) >= self.max_peers and not self._evict_silent():
            self.grants.reject("?", f"too many peers: {len(self._peers)} already, none silent and holding nothing")
            return
        if why:
            self.grants.reject("?", f"unknown peer: HELLO from {sender[:40]!r} refused: {why}"[:300])
            return
        if p is None:
            try:
                p = self._add_peer(sender, hello.address, secret, False, hello.err)
            except Exception as e:   # an address UCX refuses
                self.grants.reject("?", f"malformed message: HELLO: {type(e).__name__}: {e}"[:200])
                return
        if not p.tag_in:
            self._bind_tag(p)
        p.admitted = p.admitted or self._admission_required()
        self._on_message(p, raw[0])

    def _join_refusal(self, sender: str, secret: bytes, hello: Hello) -> str:
        """Why a front HELLO is refused ('' when it is not), before anything is made for it."""
        if not sender or len(sender) > MAX_SENDER:
            return f"a sender id of 1..{MAX_SENDER} characters"
        if not hmac.compare_digest(secret, hello.secret):
            return "its secret is not its batch's"
        if self._admission_required():
            want = self._admitted.get(sender)
            if want is None:
                return "not admitted (Transport.admit)"
            if not hmac.compare_digest(hello.token, want):
                return "not the latest admission token of its id"
        where = reach(self._host_id, hello.host[:200])
        if not (far_path(where, self._tls_explicit) and hello.err):   # else UCX uses no shared memory to it
            differ = settings_differ(self._shm_settings, dict(zip(MUST_MATCH, hello.shm)))
            if differ:
                return f"shared-memory settings differ ({'; '.join(differ)})"
        return ""

    def _bind_tag(self, p: Peer) -> None:
        """Give ``p`` the control tag its batches must carry: 62 random bits, unused here."""
        while (tag := secrets.randbelow(MAX_CTAG - 1) + 1) in self._by_tag or tag in self._retired_tags:
            pass
        p.tag_in = tag
        self._by_tag[tag] = p

    def _drop_peer(self, p: Peer) -> None:
        """Forget ``p`` (its records only; the caller closed or is closing its endpoint). Its
        control tag is remembered a while, so its late batches are dropped without a count."""
        if self._peers.get(p.id) is p:
            del self._peers[p.id]
        self._unwait(p)
        if p.tag_in and self._by_tag.get(p.tag_in) is p:
            del self._by_tag[p.tag_in]
            self._retired_tags[p.tag_in] = None
            while len(self._retired_tags) > 4 * self.max_peers:
                self._retired_tags.popitem(last=False)

    # ---- I/O thread: sender -------------------------------------------------------------------
    def _on_welcome(self, p: Peer, m: Welcome) -> None:
        """The receiver accepted our HELLO. Joining: our data endpoint to its data worker, the
        rkeys unpacked there, HELLO again over it. Else: the answer to that HELLO (connect() done)."""
        if not p.joining:
            p.answered = True
            return
        front = p.ep
        p.ep = self._endpoint(self._far() if p.far else self._worker, m.address, p.err)
        p.eph = p.ep.handle
        if p.err:
            self._watch(p)
        try:
            front.close()   # nothing of ours is in flight on it: the WELCOME answered our only batch
        except Exception:
            log.exception("closing the front endpoint of peer %s", p.id[:8])
        p.tag_out, p.joining = m.ctag, False
        lanes = self._log_path(p, p.where)
        # With error handling on, UCX has no zero-copy put over TCP: it emulates puts with
        # active messages (32 KiB puts between namespaces 1.1 vs 3.2 GB/s without error
        # handling), so every run to such a peer travels in packed frames. RDMA keeps its puts.
        p.pack_all = p.err and bool(lanes) and all(t == "tcp" for t, _ in lanes)
        self._unpack(p)
        self._send(p, self._hello(p))

    # ---- I/O thread: endpoints --------------------------------------------------------------
    def _do_connect(self, peer_id, addr, base, sizes, rkeys, where: str = "unknown", token: bytes = b"") -> str:
        """``connect`` on the I/O thread: a new peer joins through its front worker (``join``);
        a known one (it joined us, or we are connecting again) gets our rkeys' HELLO over the
        data path at once. Ourselves: our own data worker, no join."""
        p = self._peers.get(peer_id)
        if p is not None and p.closing:   # connected again while its disconnect was pending
            p.closing = p.fenced_all_said = False
            self._closing.remove(p)
            if p.close_flush is not None:
                self._zombies.append((p.close_flush, None))
                p.close_flush = None
            self._rehello(p)   # it heard BYE and fenced us: flush, then HELLO with a new epoch
        if p is None:
            secret, epoch = self._retired.pop(peer_id, (os.urandom(SECRET_BYTES), -1))
            own = peer_id == self.id
            far = not own and far_path(where, self._tls_explicit)
            # UCX error handling (``Peer.err``: its death is reported, so what it held goes) costs
            # shared memory, so it is on where none is used: a far peer (FAR_TLS), and any peer not
            # in our kernel and network namespace when our UCX_TLS names no shared memory at all
            # ("tcp"; issue 35: without it, a killed sender across hosts held our receive ring
            # for good). On our own kernel and namespace its pid proves it dead instead.
            err = far or (not own and self._network_only and where != "same")
            # to its front worker (error handling off there: the data endpoint, made at its
            # WELCOME, has it as ``err`` says); ourselves: our data worker
            p = self._add_peer(peer_id, self._address if own else addr, secret, far, err=err, front=not own)
            p.my_epoch = epoch + 1   # above every HELLO it had from us: lifts a fence it may hold
            p.where, p.token, p.joining = where, token, not own
            self._bind_tag(p)
            if own:
                p.tag_out = p.tag_in
        if p.sizes is None:
            p.rkeys_packed = [base, sizes, rkeys]
            if not p.joining:
                self._unpack(p)
            self._send(p, self._hello(p))   # joining: to its front worker, control tag 0
        return peer_id

    def _unpack(self, p: Peer) -> None:
        """Unpack ``p``'s rkeys on our data endpoint to it (``p.rkeys_packed``: regions' base,
        sizes, packed rkeys); from here on transfers to it may be submitted."""
        base, sizes, rkeys = p.rkeys_packed
        handles = []
        for k in rkeys:
            h = ctypes.c_void_p()
            if k:
                ucp.check(ucp.rkey_unpack(p.eph, k, ctypes.byref(h)), "ucp_ep_rkey_unpack")
            handles.append(h.value or 0)
        p.base, p.sizes, p.rkeys = base, sizes, np.array(handles, np.uint64)
        p.base_list, p.sizes_list = base.tolist(), sizes.tolist()
        p.rkeys_packed = []

    def _far(self) -> Any:
        """The FAR_TLS worker, made on first use (its own context: its transports differ)."""
        if self._far_worker is None:
            self._far_ctx = ucx_api.UCXContext({**self._config, "TLS": FAR_TLS},
                                               feature_flags=(ucx_api.Feature.TAG, ucx_api.Feature.RMA,
                                                              ucx_api.Feature.WAKEUP))
            w = ucx_api.UCXWorker(self._far_ctx)
            w.init_blocking_progress_mode()
            self._far_address, self._far_worker = w.address.tobytes(), w
            self._workers.append(w)
        return self._far_worker

    def _log_path(self, p: Peer, where: str) -> list[tuple[str, str]]:
        """Say which transports reach ``p`` (INFO), and warn when another host is reached by TCP;
        returns them ((transport, device) per lane)."""
        lanes = ucp.ep_transports(p.eph)
        said = ", ".join(f"{t}/{d}" for t, d in lanes) or "unknown transports"
        place = {"same": "this host", "netns": "this host, another network namespace", "host": "another host"}.get(
            where, "a place it did not say")
        log.info("UCX transport %s: peer %s (%s) over %s%s", self.id[:8], p.id[:8], place, said,
                 " (no shared memory or cma: they do not reach it)" if p.far else "")
        if where == "host" and lanes and all(t == "tcp" for t, _ in lanes):
            log.warning("UCX transport %s: peer %s on another host is reached over TCP only (no RDMA transport "
                        "in this UCX; RAPIDS_LIBUCX_PREFER_SYSTEM_LIBRARY=true uses a system UCX)",
                        self.id[:8], p.id[:8])
        return lanes

    def _hello(self, p: Peer) -> Hello:
        return Hello(self._far_address if p.far else self._address, p.secret, p.my_epoch, self._host_id, self._pid,
                     self._start_ticks, p.err, eager=True, token=p.token,
                     shm=tuple(self._shm_settings[k] for k in MUST_MATCH), ctag=p.tag_in)

    @staticmethod
    def _endpoint(worker: Any, addr: bytes, err: bool) -> Any:
        return worker.create_endpoint_from_worker_address(ucx_api.UCXAddress.create_from_buffer(addr), err)

    def _watch(self, p: Peer) -> None:
        """UCX reports the failure of ``p``'s error-handling endpoint through the close callback,
        queued here and handled by ``UCXFencing._check_failed`` on the I/O loop's next tick
        (nothing runs inside UCX's call). Weak references: ucxx holds the callback in C++, where
        no collector sees a cycle."""
        p.ep.set_close_callback(_ep_closed, (weakref.ref(self), weakref.ref(p)))

    def _add_peer(self, peer_id: str, addr: bytes, secret: bytes, far: bool = False, err: bool = False,
                  front: bool = False) -> Peer:
        """An endpoint to ``addr`` (through the FAR_TLS worker when ``far``) and its ``Peer``.
        ``err``: UCX endpoint error handling on (``UCP_ERR_HANDLING_MODE_PEER``), for a peer in
        another host or network namespace only: it excludes shared memory and cma, which such a
        peer cannot use anyway; UCX then reports the failure of its connection (reset or closed:
        its process is gone: ``_watch``). ``front``: ``addr`` is the peer's front worker (``join``):
        that endpoint has error handling off whatever ``err`` says (the data endpoint has it)."""
        worker = self._far() if far else self._worker
        ep = self._endpoint(worker, addr, err and not front)
        p = self._peers[peer_id] = Peer(peer_id, ep, secret, far=far, err=err, eph=ep.handle)
        if err and not front:
            self._watch(p)
        return p
