"""The parts of a re-handshake on a new endpoint (issue 35, ``Rehandshake.renew``) that can be
checked without a partition: the HELLO's ``drained`` field on the wire, what the receiver's
ledger releases for it, the close callback of a replaced endpoint, and what a peer said before a
new epoch (a control tag per epoch, ``Peers.rebind_tag``: a stale BYE or "peer fenced" arriving
over a replaced endpoint neither fences nor re-handshakes). The partition itself, a 35 s cut
healed with transfers in flight, is ``test_multihost_heal.py``."""
from __future__ import annotations

import collections
import time
import weakref
from types import SimpleNamespace

import numpy as np
import pytest

pytest.importorskip("ucxx")
pytestmark = pytest.mark.slow   # the full tier: the fast one measured 90.2 s with it (its limit is 90 s)

from kvxfer.grant import GrantTable  # noqa: E402
from kvxfer_transports.ucx import bindings as ucp  # noqa: E402
from kvxfer_transports.ucx.control import FENCED, Control  # noqa: E402
from kvxfer_transports.ucx.fencing import Fencing  # noqa: E402
from kvxfer_transports.ucx.join import Join  # noqa: E402
from kvxfer_transports.ucx.landing import Landing  # noqa: E402
from kvxfer_transports.ucx.options import UCXOptions  # noqa: E402
from kvxfer_transports.ucx.peers import OLD_TAGS, Peers, ep_closed, undrained  # noqa: E402
from kvxfer_transports.ucx.protocol import SHM_FIELDS, Bye, Fail, Hello, Malformed, Welcome, parse_message  # noqa: E402
from kvxfer_transports.ucx.settings import MUST_MATCH  # noqa: E402
from kvxfer_transports.ucx.state import Incoming, Outgoing, Peer, Retired  # noqa: E402
from kvxfer_transports.ucx.turn import Leftovers  # noqa: E402
from kvxfer_transports.ucx.workers import Workers  # noqa: E402


def hello(epoch: int, drained: int = -1) -> Hello:
    return Hello(b"a" * 64, b"s" * 16, epoch, "host", 1, 2, True, True, b"", ("",) * SHM_FIELDS, 5, drained)


def test_a_hello_says_drained_only_when_an_older_epoch_still_drains():
    full = hello(3)
    assert full.drained == 3 and len(full.wire()) == 12   # the older wire: every earlier put landed
    assert parse_message(full.wire(), 1 << 20) == full
    renewed = hello(3, 2)
    assert len(renewed.wire()) == 13 and parse_message(renewed.wire(), 1 << 20) == renewed
    assert parse_message(renewed.wire(), 1 << 20).drained == 2


@pytest.mark.parametrize("bad", [4, -1, 1 << 62, "2", 2.0, None, True])
def test_a_drained_epoch_past_the_hello_s_own_or_not_an_int_is_malformed(bad):
    wire = hello(3).wire() + [bad]
    with pytest.raises(Malformed):
        parse_message(wire, 1 << 20)


class _Ep:
    handle = 0


def _incoming(p: Peer, xid: int, rid: str, epoch: int) -> Incoming:
    return Incoming(p, xid, rid, time.monotonic() + 10, 4096, b"", None, None, 4096, 1, dtag=1, puts=1, epoch=epoch)


def test_the_receiver_releases_only_what_the_drained_epochs_may_still_write():
    grants = GrantTable()
    landing = Landing(grants, Leftovers())
    p = Peer("sender", _Ep(), b"s" * 16)
    for xid, (rid, epoch) in enumerate([("a", 0), ("b", 1), ("c", 2), ("c", 2)]):
        landing.hold_puts(_incoming(p, xid, rid, epoch))
    other = Peer("other", _Ep(), b"t" * 16)
    landing.hold_puts(_incoming(other, 9, "d", 0))
    landing.drained(p, 1)        # epoch 0 landed; 1 and 2 may still write
    assert not landing.pending("a") and landing.pending("b") and landing.pending("c") and landing.pending("d")
    landing.drained(p, 2)
    assert not landing.pending("b") and landing.pending("c")
    landing.drained(p, 3)        # a HELLO after a flush: all of it
    assert not landing.pending("c") and landing.pending("d"), "another peer's entries are its own"
    assert landing.snapshot() == {"requests": 1, "bytes": 4096, "transfers": 1}


def test_a_replaced_endpoint_s_close_is_not_its_peer_s_failure():
    class Table:
        failed: collections.deque = collections.deque()
    table = Table()
    p = Peer("far", _Ep(), b"s" * 16, eph=0x2000)
    ep_closed(weakref.ref(table), weakref.ref(p), 0x1000)   # the endpoint ``renew`` replaced
    assert p.eph == 0x2000 and not table.failed
    ep_closed(weakref.ref(table), weakref.ref(p), 0x2000)   # its own endpoint
    assert p.eph == 0 and list(table.failed) == [p]


def _peers() -> Peers:
    return Peers(UCXOptions(), Leftovers())


def test_a_new_epoch_gives_a_new_tag_and_older_ones_still_route_bounded():
    peers = _peers()
    p = peers.add(Peer("far", _Ep(), b"s" * 16))
    peers.bind_tag(p)
    first = p.tag_in
    p.last_tag = first   # an older kvxfer: it says everything under the tag it joined with
    tags = [first]
    for _ in range(OLD_TAGS + 3):
        peers.rebind_tag(p)
        assert p.tag_in not in tags
        tags.append(p.tag_in)
    assert all(peers.by_tag.get(t) is p for t in [first, *tags[-OLD_TAGS:]]), "the latest and the one in use route"
    assert len(p.old_tags) == OLD_TAGS and first in p.old_tags
    let_go = [t for t in tags if t not in peers.by_tag]
    assert len(let_go) == 3 and all(t in peers.retired_tags for t in let_go)   # dropped quietly if they come
    peers.drop(p)
    assert not peers.by_tag and all(t in peers.retired_tags for t in tags)


class _Calls:
    """A stand-in for the parts ``Control`` hands messages to: records what was called."""

    def __init__(self):
        self.calls: list = []
        self.outgoing: dict = {}

    def __getattr__(self, name):
        return lambda *a, **k: self.calls.append((name, a))


def _control() -> tuple[Control, _Calls, Peers]:
    calls, peers = _Calls(), _peers()
    outbox = type("Outbox", (), {"send": lambda self, p, m: p.outbox.append(m)})()
    workers = type("Workers", (), {"address": b"a" * 8})()
    c = Control(UCXOptions(), GrantTable(), workers, outbox, calls, calls, calls, calls, calls, calls, calls, peers)
    return c, calls, peers


def _named(calls: _Calls, name: str) -> list:
    return [a for n, a in calls.calls if n == name]


def test_a_bye_said_before_the_peer_s_latest_hello_is_stale():
    c, calls, peers = _control()
    p = peers.add(Peer("prefill", _Ep(), b"s" * 16))
    peers.bind_tag(p)
    c.handle(p, hello(1))                   # it re-handshakes: our WELCOME gives it a new tag
    welcome = [m for m in p.outbox if isinstance(m, Welcome)][-1]
    assert welcome.ctag == p.tag_in and p.old_tags, "the WELCOME names the tag after the rebind"
    c.handle(p, Bye(), current=False)       # its BYE from before, over the endpoint it replaced
    assert not _named(calls, "peer_gone") and p.bye_at is None
    c.handle(p, Bye(), current=True)
    assert len(_named(calls, "peer_gone")) == 1 and p.bye_at is not None
    c.handle(p, hello(2))                   # connected again after a BYE: no longer closed
    assert p.bye_at is None


def test_peer_fenced_said_before_our_latest_hello_starts_no_rehandshake():
    c, calls, peers = _control()
    p = peers.add(Peer("decode", _Ep(), b"s" * 16))
    fenced = Fail(0, f"{FENCED}: flush, then HELLO with a new epoch")
    c.handle(p, fenced, current=False)
    assert not _named(calls, "begin")
    c.handle(p, fenced, current=True)
    assert len(_named(calls, "begin")) == 1
    o = Outgoing.__new__(Outgoing)   # an announce older than our latest HELLO, refused as fenced
    o.peer, o.state, o.stale, o.xid = p, "wait_go", True, 7
    calls.outgoing[7] = o
    c.handle(p, Fail(7, fenced.why), current=True)
    assert len(_named(calls, "begin")) == 1 and [a[0] for a in _named(calls, "requeue")] == [o]


def test_a_welcome_names_the_tag_only_when_it_answers_our_latest_hello():
    peers = _peers()
    j = Join("me", UCXOptions(), GrantTable(), None, peers, None, None, None, None)
    p = peers.add(Peer("decode", _Ep(), b"s" * 16, tag_out=5))
    j.on_welcome(p, Welcome(b"a" * 8, 9), current=False)
    assert p.answered and p.tag_out == 5
    j.on_welcome(p, Welcome(b"a" * 8, 9), current=True)
    assert p.tag_out == 9


def test_a_hello_queued_fence_hint_is_dropped_when_the_hello_lifts_the_fence():
    c, _, peers = _control()
    p = peers.add(Peer("prefill", _Ep(), b"s" * 16, fenced=True))
    p.outbox.append(Fail(0, f"{FENCED}: flush, then HELLO with a new epoch"))
    c.handle(p, hello(1))
    assert not p.fenced and not [m for m in p.outbox if isinstance(m, Fail)]


class _Failed:
    """An error-handling endpoint UCX reported failed (``Fencing.check_failed`` reads ``alive``)."""
    handle, alive = 0, False

    def raise_on_error(self):
        return None


def _fencing(peers: Peers):
    """A ``Fencing`` whose other parts only take calls: what ``check_failed`` keeps in
    ``peers.retired`` for a later connect is what is checked."""
    quiet = SimpleNamespace(fail_peer=lambda *a, **k: None, let_go=lambda *a: None, settle=lambda: None,
                            unfence_peer=lambda p: None, writes_impossible=lambda p: None)
    return Fencing("rx", UCXOptions(), GrantTable(), quiet, peers, quiet, quiet, quiet, quiet)


@pytest.mark.parametrize("failure, below", [("reset after 28.1s of silence", None), ("reset", None),
                                             ("UCXEndpointTimeoutError", 3)])
def test_a_lost_peer_we_wrote_to_is_retired_with_what_of_ours_may_still_land(failure, below):
    """Issue 35: a cut longer than the kernel's retransmissions ends the connection on both sides,
    each of which forgets the other. Our puts ended with our socket whatever reset it, so the next
    connect's HELLO lets the peer release what our failed transfers held there; a timeout proves
    nothing, so that HELLO says our epoch 3 may still land. Without the retire, the next connect
    started at epoch 0 with nothing drained, and the peer kept that memory fenced for good."""
    peers = _peers()
    p = peers.add(Peer("decode", _Failed(), b"s" * 16, err=True, sizes=np.zeros(1, np.int64), my_epoch=3))
    p.failed_at, p.failure = 100.0, failure
    kept_first, drop = [], peers.drop   # kept before it leaves ``peers``: another thread may look between
    peers.drop = lambda q: (kept_first.append(q.id in peers.retired), drop(q))[1]
    _fencing(peers).check_failed(100.0 + UCXOptions().fence_grace)
    assert "decode" not in peers and peers.retired["decode"] == (b"s" * 16, 3, below)
    assert kept_first == [True]


def test_a_lost_peer_we_never_wrote_to_is_not_retired():
    peers = _peers()
    p = peers.add(Peer("prefill", _Failed(), b"s" * 16, err=True))   # it writes to us: no sizes
    p.failed_at, p.failure = 100.0, "UCXEndpointTimeoutError"
    _fencing(peers).check_failed(100.0 + UCXOptions().fence_grace)
    assert "prefill" not in peers and not peers.retired


def test_undrained_is_the_oldest_epoch_whose_puts_may_still_land_and_the_hello_says_it():
    workers = SimpleNamespace(address=b"a" * 64, far_address=b"f" * 64, host_id="h", pid=1, start_ticks=2,
                              shm_settings={k: "" for k in MUST_MATCH})
    p = Peer("decode", _Ep(), b"s" * 16, my_epoch=5)
    assert undrained(p, ended=True) is None and undrained(p, ended=False) == 5
    p.old = [Retired(None, 0, ucp.EMPTY_TABLE, None, 2, drained=True), Retired(None, 0, ucp.EMPTY_TABLE, None, 4)]
    assert undrained(p, ended=True) == 4
    p.undrained = 1   # an endpoint forgotten before this connect that never drained
    assert undrained(p, ended=True) == 1
    assert Workers.hello(workers, p).drained == 1
    p.old, p.undrained = [], None
    assert Workers.hello(workers, p).drained == 5   # nothing may land: every epoch below ours
