"""The parts of a re-handshake on a new endpoint (issue 35, ``Rehandshake.renew``) that can be
checked without a partition: the HELLO's ``drained`` field on the wire, what the receiver's
ledger releases for it, and the close callback of a replaced endpoint. The partition itself, a
35 s cut healed with transfers in flight, is ``test_multihost_heal.py``."""
from __future__ import annotations

import collections
import time
import weakref

import pytest

pytest.importorskip("ucxx")
pytestmark = pytest.mark.slow   # the full tier: the fast one measured 90.2 s with it (its limit is 90 s)

from kvxfer.grant import GrantTable  # noqa: E402
from kvxfer_transports.ucx.landing import Landing  # noqa: E402
from kvxfer_transports.ucx.peers import ep_closed  # noqa: E402
from kvxfer_transports.ucx.protocol import SHM_FIELDS, Hello, Malformed, parse_message  # noqa: E402
from kvxfer_transports.ucx.state import Incoming, Peer  # noqa: E402
from kvxfer_transports.ucx.turn import Leftovers  # noqa: E402


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
