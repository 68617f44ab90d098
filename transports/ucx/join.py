"""Joining a UCX transport: the front worker, the HELLO it takes, the WELCOME that answers it.

``Join.connect`` runs in the caller's thread (it hands the work to the I/O thread and waits);
every other method runs on the I/O thread: ``on_join`` for a batch to the front worker
(``Inbox``), ``on_welcome`` (``Control``), ``do_connect`` (``connect``'s call).

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
* ``on_join`` checks that HELLO before anything is made for its sender: well formed, its
  secret the batch's, admitted (``Transport.admit``, when this transport requires admission),
  and its shared-memory settings equal to ours unless the peer is elsewhere with UCX error
  handling on (UCX then uses no shared memory between us). Refused: counted, nothing made.
* Accepted, the receiver makes its endpoint to the sender's data address and answers WELCOME
  over it: the address of its data worker and a control tag of 62 random bits; the sender's
  batches carry that tag from then on, and a batch under a tag this side did not hand out is
  dropped unread (``inbox``).
* The sender (``on_welcome``) closes its endpoint to the front, makes its data endpoint to the
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

import hmac
import logging
import os
import time

import numpy as np

from kvxfer.errors import ConnectError, TransportError
from kvxfer.grant import GrantTable

from . import bindings as ucp
from .admission import Admission
from .lifecycle import Lifecycle
from .options import UCXOptions
from .outbox import Outbox
from .peers import Peers
from .protocol import HELLO, MAX_SENDER, MAX_TOKEN, SECRET_BYTES, Hello, Malformed, Welcome, kind_of, parse_message
from .settings import MUST_MATCH, far_path, reach, settings_differ
from .state import Peer
from .turn import Calls
from .workers import Workers

log = logging.getLogger("kvxfer.transport.ucx")


class Join:
    """Peers joining us, and us joining peers (see the module docstring)."""

    def __init__(self, transport_id: str, options: UCXOptions, grants: GrantTable, workers: Workers, peers: Peers,
                 outbox: Outbox, admission: Admission, lifecycle: Lifecycle, calls: Calls):
        self.id, self.options, self.grants, self.workers, self.peers = transport_id, options, grants, workers, peers
        self.outbox, self.admission, self.lifecycle, self.calls = outbox, admission, lifecycle, calls

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
            self.admission.require()
        w = self.workers
        where = reach(w.host_id, str(descriptor.get("host", ""))[:200])
        differ = settings_differ(w.shm_settings, theirs)
        if differ and not far_path(where, w.tls_explicit):   # no shared memory between us: no matter
            raise ConnectError("UCX shared-memory settings differ from the peer's (a mismatch would hang "
                               f"transfers): {'; '.join(differ)}. Give both sides the same settings.")
        if not len(base) == len(sizes) == len(rkeys) or base.ndim != 1:
            raise ConnectError("UCX descriptor region lists differ in length")
        named = (f"UCX peer {peer_id[:8]} on {str(descriptor.get('hostname', '?'))[:255]!r} (worker address "
                 f"{addr[:8].hex()}..., {len(addr)} bytes)")
        try:
            peer = self.calls.call(self.do_connect, peer_id, addr, base, sizes, rkeys, where, token)
        except (TransportError, TimeoutError):
            raise
        except Exception as e:   # UCX refused the address (unreachable, malformed)
            raise ConnectError(f"{named}: cannot make an endpoint: {type(e).__name__}: {e}") from e
        timeout = self.options.connect_timeout
        p, end = self.peers.get(peer), time.monotonic() + timeout
        while p is not None and not p.answered and time.monotonic() < end and not self.calls.io.broken:
            time.sleep(0.002)
        if p is None or not p.answered:
            joined = p is not None and not p.joining
            try:   # what was made for it goes (``Lifecycle.disconnect``); a closed transport has nothing left
                self.calls.call(self.lifecycle.disconnect, peer)
            except TransportError:
                pass
            raise ConnectError(f"{named} did not answer over UCX within {timeout:g}s: " + (
                "its data address does not reach from here" if joined else
                "it refused our HELLO (not admitted, or shared-memory settings that differ: its log says "
                "which), or its address does not reach from here") +
                " (another host or network namespace without a common transport, a firewall, or the process is gone)")
        return peer

    # ---- I/O thread: receiver -----------------------------------------------------------------
    def on_join(self, sender: str, secret: bytes, raw: list) -> Peer | None:
        """A batch to the front worker: one HELLO, checked before anything is made for its sender
        (see the module docstring). Accepted: returns its peer, and the caller (``Inbox``) hands the
        HELLO to ``Control.on_message`` as any (WELCOME answers it); refused: counted, None."""
        if len(raw) != 1 or kind_of(raw[0]) != HELLO:
            self.grants.reject("?", "malformed message: a front worker takes one HELLO per batch")
            return None
        try:
            hello = parse_message(raw[0], self.options.max_control_bytes)
        except Malformed as e:
            self.grants.reject("?", f"malformed message: HELLO: {e}"[:200])
            return None
        assert isinstance(hello, Hello)
        why = self._refusal(sender, secret, hello)
        admission = self.admission
        p = self.peers.get(sender)
        if not why and p is not None and not hmac.compare_digest(secret, p.secret):
            # Bound to another channel. Admitted now, its id is bound to this one (the token says
            # so) once the old holds nothing here; before, or without admission, the old stays.
            if admission.required() and not admission.holds_any(p):
                admission.let_go(p, "its id joined again with an admission token")
                p = None
            else:
                why = "its id is bound to another channel" + (" that still holds memory here"
                                                              if admission.required() else "")
        if not why and p is None and len(self.peers) >= self.options.max_peers and not admission.evict_silent():
            self.grants.reject("?", f"too many peers: {len(self.peers)} already, none silent and holding nothing")
            return None
        if why:
            self.grants.reject("?", f"unknown peer: HELLO from {sender[:40]!r} refused: {why}"[:300])
            return None
        if p is None:
            try:
                p = self._add_peer(sender, hello.address, secret, False, hello.err)
            except Exception as e:   # an address UCX refuses
                self.grants.reject("?", f"malformed message: HELLO: {type(e).__name__}: {e}"[:200])
                return None
        if not p.tag_in:
            self.peers.bind_tag(p)
        p.admitted = p.admitted or admission.required()
        return p

    def _refusal(self, sender: str, secret: bytes, hello: Hello) -> str:
        """Why a front HELLO is refused ('' when it is not), before anything is made for it."""
        if not sender or len(sender) > MAX_SENDER:
            return f"a sender id of 1..{MAX_SENDER} characters"
        if not hmac.compare_digest(secret, hello.secret):
            return "its secret is not its batch's"
        if self.admission.required():
            want = self.admission.token_of(sender)
            if want is None:
                return "not admitted (Transport.admit)"
            if not hmac.compare_digest(hello.token, want):
                return "not the latest admission token of its id"
        w = self.workers
        where = reach(w.host_id, hello.host[:200])
        if not (far_path(where, w.tls_explicit) and hello.err):   # else UCX uses no shared memory to it
            differ = settings_differ(w.shm_settings, dict(zip(MUST_MATCH, hello.shm)))
            if differ:
                return f"shared-memory settings differ ({'; '.join(differ)})"
        return ""

    # ---- I/O thread: sender -------------------------------------------------------------------
    def on_welcome(self, p: Peer, m: Welcome, current: bool = True) -> None:
        """The receiver accepted our HELLO. Joining: our data endpoint to its data worker, the
        rkeys unpacked there, HELLO again over it. Else: the answer to that HELLO (connect() done),
        and the control tag to say what follows under (``current``: the answer to our latest
        HELLO: the receiver gives a new tag at each new epoch, ``Control.on_hello``)."""
        if not p.joining:
            p.answered = True
            if current:
                p.tag_out = m.ctag
            return
        w = self.workers
        front = p.ep
        p.ep = w.endpoint(w.far() if p.far else w.worker, m.address, p.err)
        p.eph, p.addr = p.ep.handle, m.address
        if p.err:
            self.peers.watch(p)
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
        self.outbox.send(p, w.hello(p))

    def do_connect(self, peer_id, addr, base, sizes, rkeys, where: str = "unknown", token: bytes = b"") -> str:
        """``connect`` on the I/O thread: a new peer joins through its front worker (``join``);
        a known one (it joined us, or we are connecting again) gets our rkeys' HELLO over the
        data path at once. Ourselves: our own data worker, no join."""
        w = self.workers
        p = self.peers.get(peer_id)
        if p is not None and p.closing:   # connected again while its disconnect was pending
            self.lifecycle.reopen(p)
        if p is None:
            secret, epoch, undrained = self.peers.retired.pop(peer_id, (os.urandom(SECRET_BYTES), -1, None))
            own = peer_id == self.id
            far = not own and far_path(where, w.tls_explicit)
            # UCX error handling (``Peer.err``: its death is reported, so what it held goes) costs
            # shared memory, so it is on where none is used: a far peer (FAR_TLS), and any peer not
            # in our kernel and network namespace when our UCX_TLS names no shared memory at all
            # ("tcp"; issue 35: without it, a killed sender across hosts held our receive ring
            # for good). On our own kernel and namespace its pid proves it dead instead.
            err = far or (not own and w.network_only and where != "same")
            # to its front worker (error handling off there: the data endpoint, made at its
            # WELCOME, has it as ``err`` says); ourselves: our data worker
            p = self._add_peer(peer_id, w.address if own else addr, secret, far, err=err, front=not own)
            p.my_epoch = epoch + 1   # above every HELLO it had from us: lifts a fence it may hold
            p.undrained = undrained   # our HELLO says what of those epochs may still land (``Fencing``)
            p.where, p.token, p.joining = where, token, not own
            self.peers.bind_tag(p)
            if own:
                p.tag_out = p.tag_in
        if p.sizes is None:
            p.rkeys_packed = [base, sizes, rkeys]
            if not p.joining:
                self._unpack(p)
            self.outbox.send(p, w.hello(p))   # joining: to its front worker, control tag 0
        return peer_id

    def _unpack(self, p: Peer) -> None:
        """Unpack ``p``'s rkeys on our data endpoint to it (``p.rkeys_packed``: regions' base,
        sizes, packed rkeys); from here on transfers to it may be submitted."""
        base, sizes, rkeys = p.rkeys_packed
        p.base, p.sizes, p.rkeys = base, sizes, ucp.unpack_rkeys(p.eph, rkeys)
        p.base_list, p.sizes_list = base.tolist(), sizes.tolist()
        p.rkeys_src, p.rkeys_packed = p.rkeys_packed, []   # kept: a new endpoint unpacks them again

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

    def _add_peer(self, peer_id: str, addr: bytes, secret: bytes, far: bool = False, err: bool = False,
                  front: bool = False) -> Peer:
        """An endpoint to ``addr`` (through the FAR_TLS worker when ``far``) and its ``Peer``.
        ``err``: UCX endpoint error handling on (``UCP_ERR_HANDLING_MODE_PEER``), for a peer in
        another host or network namespace only: it excludes shared memory and cma, which such a
        peer cannot use anyway; UCX then reports the failure of its connection (reset or closed:
        its process is gone: ``Peers.watch``). ``front``: ``addr`` is the peer's front worker
        (``join``): that endpoint has error handling off whatever ``err`` says (the data endpoint
        has it)."""
        w = self.workers
        ep = w.endpoint(w.far() if far else w.worker, addr, err and not front)
        p = self.peers.add(Peer(peer_id, ep, secret, far=far, err=err, eph=ep.handle, addr=b"" if front else addr,
                                front_addr=addr if front else b""))
        if err and not front:
            self.peers.watch(p)
        return p
