"""Every request ends: faults injected in each state (Bootstrapping, WaitingForInput, Transferring).

Faults: kill the prefill process, kill the decode process, SIGSTOP either past the deadline,
drop or delay control messages (``request_peer.ControlProxy``), abort from either side.
Each request must end Failed with a reason within its phase deadline (plus the heartbeat
timeout and scheduling slack), each grant must be released exactly once, both allocators
must be full again, and no write may land after the end (a canary fills the released
slots before the stopped peer resumes).
"""
from __future__ import annotations

import re
import time

import pytest
import request_peer as rp
import torch
from support.deps import pregrants
from waiting import until

from kvxfer.control.bootstrap import BootstrapConfig, BootstrapServer
from kvxfer.endpoint.base import KVPoll, Outcome

pytestmark = pytest.mark.slow   # processes, waits of seconds (the full tier)

DEADLINE = 1.5                      # every phase
HEARTBEAT = [0.2, 1.0]              # interval, timeout
SLACK = 1.0                         # scheduling on a loaded 2-core machine
LIMIT = DEADLINE + HEARTBEAT[1] + SLACK
TIMEOUTS = {"bootstrap": DEADLINE, "waiting": DEADLINE, "transfer": DEADLINE, "lease": DEADLINE,
            "heartbeat": HEARTBEAT}
FAILED, BOOT, WAIT, XFER = int(KVPoll.Failed), KVPoll.Bootstrapping, KVPoll.WaitingForInput, KVPoll.Transferring
NEW_CANARY = 0xEE


class Pair:
    """Bootstrap + one side here (``local``) + the other side in a peer process (``remote``)."""

    def __init__(self, transport: str, local: str, proxy_rule=None, manual_clock: bool = False):
        self.cfg = rp.config(transport, timeouts=TIMEOUTS, pool={"num_pages": 64}, state_slots=0,
                             manual_clock=manual_clock)
        self.server = BootstrapServer(BootstrapConfig(ttl=3.0)).start()
        self.proxy = None
        if local == "decode":
            self.remote = rp.Peer("prefill", {**self.cfg, "bootstrap": self.server.url})
            peers = None
            if proxy_rule is not None:
                box = {}
                peers = rp.proxied_peers(self.server.url, box, make=lambda addr: rp.ControlProxy(addr, proxy_rule))
                self.proxy = next(iter(box.values()))
            self.local = rp.Side("decode", self.cfg, self.server.url, peers=peers)
        else:
            self.local = rp.Side("prefill", self.cfg, self.server.url)
            self.remote = rp.Peer("decode", {**self.cfg, "bootstrap": self.server.url})

    def close(self):
        self.local.close()
        self.remote.close()
        if self.proxy:
            self.proxy.close()
        self.server.stop()


def control_plane_only(transport: str) -> None:
    """Control messages always go over the ZMQ control channel, whatever moves the data; tests of
    them alone run once (with the zmq data plane) to keep this file short."""
    if transport != "zmq":
        pytest.skip("control-plane fault: the data transport takes no part (covered with zmq)")


@pytest.fixture
def pairs():
    made = []
    yield made
    for p in made:
        p.close()


def decode_states(pair: Pair, base: int) -> dict:
    """Receivers here in each state; the prefill peer drives the senders. Rooms base+0..2."""
    P, D = pair.remote, pair.local
    r_boot, _ = D.receiver(base, 8)                       # no prefill sender: never acknowledged
    P.call("sender", room=base + 1, tokens=8)
    r_wait, _ = D.receiver(base + 1, 8)
    P.call("sender", room=base + 2, tokens=8)
    r_xfer, _ = D.receiver(base + 2, 8)
    assert until(lambda: r_wait.poll() == WAIT and r_xfer.poll() == WAIT, 3), (r_wait, r_xfer)
    P.call("send", room=base + 2, range=[0, 4])
    assert until(lambda: r_xfer.poll() == XFER, 3), r_xfer
    assert r_boot.poll() == BOOT
    return {base: r_boot, base + 1: r_wait, base + 2: r_xfer}


def prefill_states(pair: Pair, base: int) -> dict:
    """Senders here in each state; the decode peer drives the receivers. Rooms base+0..2."""
    P, D = pair.local, pair.remote
    s_boot, _ = P.sender(base, 8)                        # decode never grants
    D.call("receiver", room=base, tokens=8, init=False)
    s_wait, _ = P.sender(base + 1, 8)
    D.call("receiver", room=base + 1, tokens=8)
    s_xfer, slots = P.sender(base + 2, 8)
    D.call("receiver", room=base + 2, tokens=8)
    assert until(lambda: s_wait.poll() == WAIT and s_xfer.poll() == WAIT, 3), (s_wait, s_xfer)
    s_xfer.send(slots[:4])
    assert s_xfer.poll() == XFER
    assert s_boot.poll() == BOOT
    return {base: s_boot, base + 1: s_wait, base + 2: s_xfer}


def assert_ended(reqs: dict, t0: float, pattern: str, limit: float = LIMIT) -> None:
    """Every request here Failed, with a reason matching ``pattern``, within ``limit`` of ``t0``."""
    for room, r in reqs.items():
        assert r.wait(max(0.0, t0 + limit - time.monotonic())) == KVPoll.Failed, (room, r)
        assert re.search(pattern, r.reason), (room, r.reason)
    assert time.monotonic() - t0 <= limit + 0.2


def assert_released_once(side: rp.Side, rooms, timeout: float = DEADLINE + 1) -> None:
    assert until(lambda: all(side.releases.get(r) == 1 for r in rooms), timeout), side.releases
    assert side.full(), "slots leaked"


def assert_remote_clean(peer: rp.Peer, rooms, timeout: float = LIMIT + DEADLINE) -> dict:
    """The peer process: its requests Failed, each released once, its allocator full."""
    st = peer.call("wait", rooms=list(rooms), timeout=timeout)
    assert all(v["state"] == FAILED and v["reason"] for v in st.values()), st
    ok = until(lambda: (lambda s: s["free_pages"] == s["capacity"] and
                         all(s["releases"].get(str(r)) == 1 for r in rooms))(peer.call("stats")), DEADLINE + 1)
    assert ok, peer.call("stats")
    return st


def fill_canary(side: rp.Side) -> list[torch.Tensor]:
    for b in side.kv.buffers:
        b.fill_(NEW_CANARY)
    return [b.clone() for b in side.kv.buffers]


# ------------------------------------------------------------------------------------
def test_kill_prefill(transport, pairs):
    pair = Pair(transport, "decode")
    pairs.append(pair)
    reqs = decode_states(pair, 100)
    t0 = time.monotonic()
    pair.remote.kill()
    assert_ended(reqs, t0, r"silent|timed out")
    assert_released_once(pair.local, reqs)


def test_kill_decode(transport, pairs):
    pair = Pair(transport, "prefill")
    pairs.append(pair)
    reqs = prefill_states(pair, 200)
    t0 = time.monotonic()
    pair.remote.kill()
    assert_ended(reqs, t0, r"silent|timed out|transfer failed")
    assert_released_once(pair.local, reqs)
    assert all(s.kv_releasable for s in reqs.values())


def test_stop_prefill_past_the_deadline(transport, pairs):
    """Decode's requests end while prefill is stopped. Their slots come back at once when prefill
    could only write after a GO; pregranted to it (eager writes), they stay held while it is
    stopped and come back once it wakes and answers decode's FENCE. Either way no write lands
    after the release."""
    pair = Pair(transport, "decode")
    pairs.append(pair)
    reqs = decode_states(pair, 300)
    t0 = time.monotonic()
    pair.remote.stop()
    pair.remote.post("send", room=302, range=[4, 8], last=True)   # runs late, when the peer resumes
    assert_ended(reqs, t0, r"silent|timed out")
    if pregrants(transport):
        time.sleep(HEARTBEAT[1])
        assert 302 not in pair.local.releases, "pregranted slots released while their sender could still put"
        pair.remote.cont()
        pair.remote.reply(10)              # the late send ran (accepted or not)
        assert_released_once(pair.local, reqs, timeout=LIMIT)
        canary = fill_canary(pair.local)
    else:
        assert_released_once(pair.local, reqs)
        canary = fill_canary(pair.local)   # the released slots now "belong to someone else"
        pair.remote.cont()
        pair.remote.reply(10)              # the late send ran (accepted or not)
    assert_remote_clean(pair.remote, [301, 302])   # 300 never had a prefill sender
    time.sleep(0.3)
    assert rp.same_bytes(pair.local.kv.buffers, canary), "a late write landed after the request ended"


def test_stop_decode_past_the_deadline(transport, pairs):
    pair = Pair(transport, "prefill")
    pairs.append(pair)
    reqs = prefill_states(pair, 400)
    t0 = time.monotonic()
    pair.remote.stop()
    reqs[402].send(pair.local.slots[402][4:], last=True)     # into a stopped peer
    failing = reqs
    if pregrants(transport):   # eager puts into a stopped process can complete: then 402 succeeds
        assert reqs[402].wait(LIMIT) in (KVPoll.Success, KVPoll.Failed), reqs[402]   # at its flush;
        failing = {room: r for room, r in reqs.items() if room != 402 or r.poll() == KVPoll.Failed}
    assert_ended(failing, t0, r"silent|timed out|transfer failed")   # decode's verdict decides (below)
    assert_released_once(pair.local, reqs)
    # Past decode's own deadlines too: a chunk it handles on waking is late, never a Success.
    time.sleep(max(0.0, t0 + DEADLINE + 0.2 - time.monotonic()))
    pair.remote.cont()
    assert_remote_clean(pair.remote, reqs)


def test_dropped_control_messages(transport, pairs):
    """Deadlines on manual clocks (both sides): the lost REQ and ACK end their requests as soon as
    the clocks pass the bootstrap deadline, not after waiting for it."""
    drop = {("d2p", "req", 500), ("p2d", "ack", 501), ("d2p", "abort", 502), ("d2p", "done", 502)}
    pair = Pair(transport, "decode", proxy_rule=lambda d, m: "drop" if (d, m.get("t"), m.get("room")) in drop
                else None, manual_clock=True)
    pairs.append(pair)
    P, D = pair.remote, pair.local
    reqs = {}
    for room in (500, 501, 502):
        P.call("sender", room=room, tokens=8)
        reqs[room], _ = D.receiver(room, 8)
    assert until(lambda: reqs[502].poll() == WAIT, 3)
    P.call("send", room=502, range=[0, 4])
    assert until(lambda: reqs[502].poll() == XFER, 3)
    t0 = time.monotonic()
    reqs[502].abort("dropped-abort test")              # prefill never hears of it
    # Released at once, or (eager writes: pregranted to prefill, which may put into them without
    # asking) once prefill answered decode's FENCE: only then do the slots "belong to someone else".
    assert until(lambda: D.releases.get(502) == 1, LIMIT), D.releases
    canary = fill_canary(D)
    P.call("send", room=502, range=[4, 8], last=True)  # a late write: the grant is gone
    D.clock.advance(DEADLINE + 0.1)                    # past the bootstrap deadline on both sides
    P.call("advance", seconds=DEADLINE + 0.1)
    assert_ended({500: reqs[500]}, t0, r"timed out in Bootstrapping", limit=1.0)
    # 501: decode's own deadline, or prefill's (its sender timed out waiting to send) told first
    assert_ended({501: reqs[501]}, t0, r"timed out in (Bootstrapping|WaitingForInput)", limit=1.0)
    assert reqs[502].outcome == Outcome.Aborted
    assert_released_once(D, reqs)
    st = assert_remote_clean(P, reqs)
    assert re.search(r"transfer failed|rejected|ended", st["502"]["reason"]), st["502"]
    assert re.search(r"aborted|timed out", st["501"]["reason"]), st["501"]
    assert rp.same_bytes(D.kv.buffers, canary), "a late write landed after the request ended"


def test_delayed_control_messages(transport, pairs):
    control_plane_only(transport)
    def rule(d, m):
        room = m.get("room")
        if (d, m.get("t"), room) == ("p2d", "ack", 600):
            return DEADLINE + 0.5          # arrives after the receiver gave up
        if (d, m.get("t"), room) == ("d2p", "req", 601):
            return DEADLINE / 3            # late, within the deadline
        return 0.2 if room == 602 else None  # everything of 602 a bit late
    pair = Pair(transport, "decode", proxy_rule=rule)
    pairs.append(pair)
    P, D = pair.remote, pair.local
    reqs = {}
    for room in (600, 601, 602):
        P.call("sender", room=room, tokens=8)
        reqs[room], _ = D.receiver(room, 8)
    t0 = time.monotonic()
    for room in (601, 602):
        assert until(lambda room=room: reqs[room].poll() == WAIT, DEADLINE), reqs[room]
        P.call("send", room=room, last=True)
    assert reqs[601].wait(LIMIT) == KVPoll.Success, reqs[601]
    assert reqs[602].wait(LIMIT) == KVPoll.Success, reqs[602]
    assert_ended({600: reqs[600]}, t0, r"timed out in Bootstrapping")
    time.sleep(0.7)                        # the late ACK arrives now and must change nothing
    assert reqs[600].poll() == KVPoll.Failed
    for room in (601, 602):
        D.free(room)
    assert_released_once(D, [600, 601, 602])
    st = P.call("wait", rooms=[600, 601, 602], timeout=LIMIT)
    assert st["600"]["state"] == FAILED and st["601"]["state"] == st["602"]["state"] == int(KVPoll.Success)


def test_abort_from_each_side_in_each_state(transport, pairs):
    control_plane_only(transport)
    pair = Pair(transport, "decode")
    pairs.append(pair)
    P, D = pair.remote, pair.local
    # decode aborts: its receiver in Bootstrapping (not initialised), WaitingForInput, Transferring
    P.call("sender", room=700, tokens=8)
    r700, _ = D.receiver(700, 8, init=False)
    mine = decode_states(pair, 701)        # 701 Bootstrapping (initialised), 702 waiting, 703 transferring
    by_decode = {700: r700, 702: mine[702], 703: mine[703]}
    # prefill aborts: its sender in Bootstrapping (decode not initialised), WaitingForInput, Transferring
    P.call("sender", room=710, tokens=8)
    r710, _ = D.receiver(710, 8, init=False)
    theirs = {710: r710}
    for room in (711, 712):
        P.call("sender", room=room, tokens=8)
        theirs[room], _ = D.receiver(room, 8)
    assert until(lambda: all(theirs[r].poll() == WAIT for r in (711, 712)), 3)
    P.call("send", room=712, range=[0, 4])
    assert until(lambda: theirs[712].poll() == XFER, 3)
    t0 = time.monotonic()
    for r in by_decode.values():
        r.abort("test")
    for room in (710, 711, 712):
        P.call("abort", room=room, reason="test")
    r710.init(D.slots[710])                # decode asks after prefill gave up: refused or times out
    assert_ended(by_decode, t0, r"aborted by decode: test", limit=0.2)
    assert_ended({711: theirs[711], 712: theirs[712]}, t0, r"aborted by prefill: test")
    assert_ended({710: r710}, t0, r"timed out|no prefill request|aborted")
    mine[701].abort("cleanup")
    assert_released_once(D, [*by_decode, 701, *theirs])
    st = assert_remote_clean(P, [700, 702, 703, 710, 711, 712])
    for room in (702, 703):
        assert "aborted by decode: test" in st[str(room)]["reason"] and st[str(room)]["outcome"] == "aborted"
    # 700: decode never asked for it, so its ABORT cannot name a grant of its own: prefill's sender
    # ends at its bootstrap deadline (an ABORT that ended it would let any peer end any room)
    assert "timed out in Bootstrapping" in st["700"]["reason"], st["700"]
