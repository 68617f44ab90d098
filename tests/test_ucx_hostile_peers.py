"""Hostile UCX peers against a decode-side UCX transport in a process of its own (issue 34).

The victim is ``xfer_peer`` running a ``UCXTransport`` that holds one 4 MiB canary region; the
attacker is ``hostile_ucx_wire`` in another process: raw ``ucxx`` with UCX settings of its own and
kvxfer's wire formats re-implemented from reading them. After each case: the victim process and
its I/O thread are alive, it is not broken, a fresh honest UCX peer (this process) moves a put run
and a packed run into a fresh grant byte-exact, no byte outside the honest grants changed (the
canary), and the victim's fds, threads and RSS grew by at most ``FDS``, ``THREADS``, ``RSS``.
"""
from __future__ import annotations

import base64
import itertools
import os
import time
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("ucxx")

import hostile_ucx_wire as hw  # noqa: E402
from xfer_peer import PeerProcess, enc, fill_pattern, plan_to_json, raw_plan, region_seed  # noqa: E402

from kvxfer.transport.registry import get_transport  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

REGION = 4 << 20
SEED = 5
OPTS = {"heartbeat": 0.2, "peer_timeout": 30.0, "connect_timeout": 5.0}
FDS, THREADS, RSS = 24, 2, 96 << 20   # growth bounds of the victim over the whole test
_slot = itertools.count(0)


def _env() -> dict:
    """The environment without UCX settings: each process's own come from its options."""
    return {k: v for k, v in os.environ.items() if not k.startswith("UCX_")}


class Victim:
    def __init__(self, tmp: Path, options: dict | None = None):
        self.proc = PeerProcess(tmp / "victim.err", env=_env())
        init = self.proc.call("init", transport="ucx", sizes=[REGION], fill="canary",
                              options={**OPTS, **(options or {})})
        self.descriptor, self.pid = init["descriptor"], init["pid"]
        self.base = None

    def health(self) -> dict:
        return self.proc.call("health")

    def close(self) -> None:
        self.proc.close()


class AttackerProcess:
    """``hostile_ucx_wire`` in a process of its own, with UCX ``config`` of its own."""

    def __init__(self, tmp: Path, config: dict, name: str = "attacker"):
        self.proc = PeerProcess(tmp / f"{name}.err", script=hw.__file__, env=_env())
        init = self.proc.call("init", config=config)
        self.address, self.pid = bytes.fromhex(init["address"]), init["pid"]
        self.secret = os.urandom(16)

    def connect(self, address_hex: str) -> int:
        return self.proc.call("connect", address=address_hex)["ep"]

    def send(self, ep: int, tag: int, data: bytes) -> bool:
        return self.proc.call("send", ep=ep, tag=tag, data=base64.b64encode(data).decode())["sent"]

    def close(self) -> None:
        self.proc.close()


def honest_transfer(v: Victim, options: dict | None = None) -> str:
    """A fresh honest UCX peer moves a 16 KiB put run and a 1 KiB packed run into a fresh grant of
    the victim; '' when both arrived and the bytes are exact, else what went wrong."""
    k = next(_slot)
    base = (1 << 20) + k * (32 << 10)
    assert base + (32 << 10) <= REGION
    rid = f"honest.{k}"
    s = get_transport("ucx", **{**OPTS, **(options or {})})
    try:
        src = torch.empty(REGION, dtype=torch.uint8)
        fill_pattern(src.numpy(), region_seed(SEED, 0))
        s.register([src])
        token = base64.b64decode(v.proc.call("admit", descriptor=s.descriptor())["token"])
        runs = (np.array([base, base + (16 << 10)]), np.array([16 << 10, 1 << 10]))
        v.proc.call("expect", request_id=rid, ranges={"region": enc(np.zeros(2, np.int64)), "start": enc(runs[0]),
                                                       "nbytes": enc(runs[1])})
        try:
            peer = s.connect(v.descriptor, token) if token else s.connect(v.descriptor)
        except Exception as e:
            return f"honest connect failed: {type(e).__name__}: {e}"
        for off, n in zip(*runs):
            z = np.zeros(1, np.int64)
            h = s.submit(peer, rid, raw_plan(z, [off], z, [off], [n]), timeout=5.0)
            if not h.wait(5.0):
                return f"honest transfer of {n} bytes failed: {h.error}"
        got, end = [], time.monotonic() + 5.0
        while len(got) < 2 and time.monotonic() < end:   # the attack's (refused) arrivals are not ours
            got += [a for a in v.proc.call("arrivals", count=1, wait_s=0.5)["arrivals"] if a["request_id"] == rid]
        if [a["ok"] for a in got] != [True, True]:
            return f"arrivals of {rid}: {got}"
        for off, n in zip(*runs):
            if not v.proc.call("matches", region=0, start=int(off), nbytes=int(n), seed=SEED)["same"]:
                return f"bytes {off}..{off + n} differ from what was sent"
        v.proc.call("forget", request_id=rid)
        return ""
    finally:
        s.close()


def connect_admitted(tx: PeerProcess, tx_desc: dict, v: Victim) -> str:
    """``tx`` (an xfer_peer sender) connects to the victim with the token the victim's admit gave."""
    return tx.call("connect", descriptor=v.descriptor, token=v.proc.call("admit", descriptor=tx_desc)["token"])["peer"]


def check(v: Victim, case: str, fds: int = FDS) -> None:
    """The invariants after one case (see the module docstring); ``fds``: their bound here."""
    assert v.proc.proc.poll() is None, f"{case}: the victim died ({v.proc.proc.poll()}): {v.proc.stderr_tail(8)}"
    why = honest_transfer(v)
    h = v.health()
    assert not why, f"{case}: {why}"
    assert h["broken"] is None and any(n.startswith("kvxfer-ucx-") for n in h["kvxfer_threads"]), f"{case}: {h}"
    assert v.proc.call("foreign", region=0, seed=SEED)["count"] == 0, f"{case}: bytes outside the grants changed"
    if v.base is None:
        v.base = h
        return
    grew = {k: h[k] - v.base[k] for k in ("fds", "threads", "rss")}
    assert grew["fds"] <= fds and grew["threads"] <= THREADS and grew["rss"] <= RSS, f"{case}: grew {grew}"


def campaign_attack(a: AttackerProcess, v: Victim, count: int = 400) -> None:
    """The campaign's case: a same-host peer with UCX's own FIFO size says HELLO (every form) and
    sends ``count`` small batches, each answered by the victim, then idles while the victim pings."""
    ep = a.connect(v.descriptor["address"])
    for form in hw.hello_forms(a.address, a.secret):
        a.send(ep, hw.CTRL_TAG, hw.batch("mallory", a.secret, [form]))
    a.proc.call("spray", ep=ep, sender="mallory", secret=base64.b64encode(a.secret).decode(), count=count)
    a.proc.call("recv", wait_s=3.0)   # the victim's answers and pings go on meanwhile


@pytest.mark.parametrize("admission", [False, None])
def test_a_same_host_peer_with_other_fifo_settings_cannot_crash_or_wedge_the_receiver(tmp_path, admission):
    """Shared-memory FIFO sizes other than the victim's (UCX's default 256, 64, 8192) and its own
    (4096): the campaign's HELLO + 400 answered batches, then 300 fuzzed messages each. Before
    the fix the victim died of SIGSEGV or stopped taking shared-memory messages (its FIFO read
    position waits for an element the peer wrote elsewhere). ``admission=False``: the settings
    check alone refuses them; None (the default; the honest peers are admitted, so it is on from
    the first check): a peer with UCX's FIFO that claims kvxfer's settings is refused too."""
    v = Victim(tmp_path, {"admission": admission})
    try:
        check(v, "before any attack")
        if admission is None:   # a liar: FIFO 256, HELLO says 4096 (no token: it was never admitted)
            a = AttackerProcess(tmp_path, {"SYSV_FIFO_SIZE": "256"}, name="liar")
            try:
                assert not a.proc.call("join", front=v.descriptor["address"], sender="liar")["joined"]
                campaign_attack(a, v)
                check(v, "FIFO 256 claiming 4096, not admitted")
            finally:
                a.close()
        for n, fifo in enumerate(("256", "4096", "64", "8192")):
            a = AttackerProcess(tmp_path, {"SYSV_FIFO_SIZE": fifo}, name=f"attacker{fifo}")
            try:
                campaign_attack(a, v)
                check(v, f"FIFO {fifo}: HELLO and 400 batches")
                ep = a.connect(v.descriptor["address"])
                a.proc.call("fuzz", ep=ep, seed=n, count=300, sender="mallory",
                            secret=base64.b64encode(a.secret).decode())
                a.proc.call("recv", wait_s=1.0)
                check(v, f"FIFO {fifo}: 300 fuzzed messages")
            finally:
                a.close()
            check(v, f"FIFO {fifo}: attacker gone")
    finally:
        v.close()


def test_fuzzing_a_joined_channel_never_crashes_the_receiver(tmp_path):
    """A peer with the victim's settings joins (it is welcomed) and sends 600 fuzzed messages on
    its channel (control batches under its tag, 0 or a random one; raw bytes on tags of every
    kind, up to 256 KiB), in 3 rounds; the invariants hold after each."""
    v = Victim(tmp_path)
    a = AttackerProcess(tmp_path, {"SYSV_FIFO_SIZE": "4096"})
    try:
        check(v, "before any attack")
        token = v.proc.call("admit", descriptor={"id": "fuzzer"})["token"]   # admitted, and hostile
        ch = a.proc.call("join", front=v.descriptor["address"], sender="fuzzer", token=token)
        assert ch["joined"], "a peer with the victim's settings was not welcomed"
        for seed in range(3):
            a.proc.call("fuzz", ep=ch["ep"], seed=100 + seed, count=200, sender="fuzzer", secret=ch["secret"],
                        tag=ch["tag"])
            a.proc.call("recv", wait_s=0.5)
            check(v, f"joined fuzz round {seed}")
    finally:
        a.close()
        v.close()


@pytest.mark.parametrize("stage", ["never", "always"])
def test_a_third_party_cannot_inject_frames_into_a_live_grant(tmp_path, stage):
    """Packed frames travel under tags that name their transfer. A third party that joined (its
    own HELLO, no grant, no capability) sprays data frames of the right size under the tags a
    transfer could have (data tags 1..63, frames 0..7) while an honest sender, its ANNOUNCE
    answered with GO, has not sent its frames yet. Before: data tags counted up from 1, so the
    honest request completed Success with the attacker's bytes (frames received in place,
    ``stage="never"``) or failed (frames through the receive ring, ``"always"``). Now the honest
    transfer lands byte-exact and no attacker byte is anywhere."""
    frame, runs = 64 << 10, 128   # 128 packed runs of 4 KiB: 8 frames of 64 KiB
    opts = {"frame_bytes": frame, "stage_host": stage}
    v = Victim(tmp_path, opts)
    tx = PeerProcess(tmp_path / "honest.err", env=_env())
    a = AttackerProcess(tmp_path, {"SYSV_FIFO_SIZE": "4096"})
    try:
        tx_desc = tx.call("init", transport="ucx", sizes=[REGION], fill="seed", seed=SEED,
                          options={**OPTS, **opts})["descriptor"]
        peer = connect_admitted(tx, tx_desc, v)
        token = v.proc.call("admit", descriptor={"id": "mallory"})["token"]   # its own HELLO: admitted
        ch = a.proc.call("join", front=v.descriptor["address"], sender="mallory", token=token)
        assert ch["joined"]
        off = np.arange(runs, dtype=np.int64) * 8192 + (2 << 20)    # every other 4 KiB: 128 runs, none merge
        n = np.full(runs, 4096, np.int64)
        z = np.zeros(runs, np.int64)
        v.proc.call("expect", request_id="live.1", ranges={"region": enc(z), "start": enc(off), "nbytes": enc(n)})
        tx.call("submit", peer=peer, request_id="live.1", plan=plan_to_json(raw_plan(z, off, z, off, n)),
                timeout=15.0, stall_s=3.0)   # ANNOUNCE out, GO back, then 3 s before any frame
        time.sleep(0.5)
        sent = a.proc.call("frames", ep=ch["ep"], dtags=[1, 64], frames=8, size=frame, byte=0xEE)["sent"]
        res = tx.call("wait", request_ids=["live.1"], wait_s=20.0)["results"]["live.1"]
        assert res["status"] == "DONE", f"the honest transfer failed: {res} ({sent} frames sprayed)"
        bad = [k for k in range(runs) if not v.proc.call("matches", region=0, start=int(off[k]), nbytes=4096,
                                                         seed=SEED)["same"]]
        assert not bad, f"{len(bad)} of {runs} runs hold other bytes than were sent ({sent} frames sprayed)"
        assert v.proc.call("foreign", region=0, seed=SEED)["count"] == 0, "bytes outside the grant changed"
        check(v, f"frame injection, {stage}")
    finally:
        a.close()
        tx.close()
        v.close()


def test_a_malformed_announce_for_a_live_request_fails_nothing(tmp_path):
    """A joined third party (no grant, no capability) sends ANNOUNCEs whose ids are valid and
    name a live request, with one bad field each (frame size 1, a run array of 5 bytes, a float
    put count, a 70-byte capability). Before: each failed the live request (an Arrival ok=False
    for it; decode ends the request on it). Now each is counted and answered like any malformed
    message, the request sees nothing, and its honest sender completes it byte-exact."""
    v = Victim(tmp_path)
    tx = PeerProcess(tmp_path / "honest.err", env=_env())
    a = AttackerProcess(tmp_path, {"SYSV_FIFO_SIZE": "4096"})
    try:
        tx_desc = tx.call("init", transport="ucx", sizes=[REGION], fill="seed", seed=SEED, options=OPTS)["descriptor"]
        peer = connect_admitted(tx, tx_desc, v)
        token = v.proc.call("admit", descriptor={"id": "mallory"})["token"]   # its own HELLO: admitted
        ch = a.proc.call("join", front=v.descriptor["address"], sender="mallory", token=token)
        assert ch["joined"]
        off, n, z = np.array([3 << 20], np.int64), np.array([64 << 10], np.int64), np.zeros(1, np.int64)
        v.proc.call("expect", request_id="live.2", ranges={"region": enc(z), "start": enc(off), "nbytes": enc(n)})
        runs = hw.runs_field((0, int(off[0]), int(n[0])))
        bad = [hw.announce(1, "live.2", runs, 1, frame=1), hw.announce(2, "live.2", b"\0" * 5, 0),
               hw.announce(3, "live.2", runs, 0.5), hw.announce(4, "live.2", runs, 1, cap=b"c" * 70)]
        before = v.proc.call("rejected")["rejected"].get("malformed header", 0)
        for m in bad:
            a.proc.call("send", ep=ch["ep"], tag=hw.CTRL_TAG | ch["tag"],
                        data=base64.b64encode(hw.batch("mallory", base64.b64decode(ch["secret"]), [m])).decode())
        end = time.monotonic() + 5.0
        while v.proc.call("rejected")["rejected"].get("malformed header", 0) < before + len(bad):
            assert time.monotonic() < end, v.proc.call("rejected")
            time.sleep(0.05)
        got = v.proc.call("arrivals", count=10, wait_s=0.5)["arrivals"]
        assert not [x for x in got if x["request_id"] == "live.2"], f"the live request saw the attack: {got}"
        tx.call("submit", peer=peer, request_id="live.2", plan=plan_to_json(raw_plan(z, off, z, off, n)), timeout=10.0)
        assert tx.call("wait", request_ids=["live.2"], wait_s=10.0)["results"]["live.2"]["status"] == "DONE"
        got = v.proc.call("arrivals", count=1, wait_s=5.0)["arrivals"]
        assert [(x["request_id"], x["ok"]) for x in got] == [("live.2", True)], got
        assert v.proc.call("matches", region=0, start=int(off[0]), nbytes=int(n[0]), seed=SEED)["same"]
        check(v, "malformed announces for a live request")
    finally:
        a.close()
        tx.close()
        v.close()


def test_an_admitted_id_cannot_be_squatted_and_unadmitted_hellos_make_nothing(tmp_path):
    """Decode admits a prefill rank (its registry record's descriptor) before its HELLO; a third
    party that HELLOs the decode transport first under that rank's id (public: it is in the
    record), with no token or a made-up one, is refused and makes nothing, and the rank's own
    connect with its token succeeds. Before: the id was bound to the first comer's channel
    secret, so the rank's connect failed. 1,000 HELLOs under fresh ids without a token leave the
    victim's peer table as it was. A second ``admit`` of the id (a re-handshake) voids the first
    token: a connect with it is refused, one with the new token works."""
    v = Victim(tmp_path)
    tx = PeerProcess(tmp_path / "honest.err", env=_env())
    a = AttackerProcess(tmp_path, {"SYSV_FIFO_SIZE": "4096"})
    try:
        tx_desc = tx.call("init", transport="ucx", sizes=[REGION], fill="seed", seed=SEED, options=OPTS)["descriptor"]
        token = v.proc.call("admit", descriptor=tx_desc)["token"]
        for made_up in ("", base64.b64encode(os.urandom(32)).decode()):
            ch = a.proc.call("join", front=v.descriptor["address"], sender=tx_desc["id"], token=made_up)
            assert not ch["joined"], "a third party joined under an admitted rank's id"
        assert v.proc.call("peers")["peers"] == [], "a refused HELLO left a peer entry"
        peer = tx.call("connect", descriptor=v.descriptor, token=token)["peer"]
        off, n, z = np.array([3 << 20], np.int64), np.array([64 << 10], np.int64), np.zeros(1, np.int64)
        v.proc.call("expect", request_id="sq.1", ranges={"region": enc(z), "start": enc(off), "nbytes": enc(n)})
        tx.call("submit", peer=peer, request_id="sq.1", plan=plan_to_json(raw_plan(z, off, z, off, n)), timeout=10.0)
        assert tx.call("wait", request_ids=["sq.1"], wait_s=10.0)["results"]["sq.1"]["status"] == "DONE"
        assert v.proc.call("matches", region=0, start=int(off[0]), nbytes=int(n[0]), seed=SEED)["same"]
        check(v, "after the squat")
        def refused() -> int:   # not admitted, or dropped unread in a flood past the front worker's budget
            r = v.proc.call("rejected")["rejected"]
            return r.get("unknown peer", 0) + r.get("too many peers", 0)
        before = refused()
        ep = a.connect(v.descriptor["address"])
        a.proc.call("hellos", ep=ep, count=1000, shm=["4096", "", "", ""])
        end = time.monotonic() + 20.0
        while refused() < before + 1000:
            assert time.monotonic() < end, v.proc.call("rejected")
            time.sleep(0.1)
        peers = v.proc.call("peers")["peers"]
        assert tx_desc["id"] in peers and not [p for p in peers if p.startswith("fresh-")], peers
        check(v, "after 1,000 unadmitted HELLOs")
        tx.call("disconnect", peer=peer)
        end = time.monotonic() + 20.0   # retired, not pending: a connect then would take the old channel back
        while peer in tx.call("peers")["peers"]:
            assert time.monotonic() < end, "the disconnect never ended"
            time.sleep(0.05)
        token2 = v.proc.call("admit", descriptor=tx_desc)["token"]
        with pytest.raises(RuntimeError, match="refused our HELLO"):
            tx.call("connect", descriptor=v.descriptor, token=token)
        assert tx.call("connect", descriptor=v.descriptor, token=token2)["peer"] == peer
        check(v, "after a re-admission")
    finally:
        a.close()
        tx.close()
        v.close()


def test_silent_peers_that_hold_nothing_give_their_places_back(tmp_path):
    """A receiver that admits anyone (admission=False, max_peers 16): 16 peers join under fresh
    ids and go silent, holding nothing. Before: they kept every place for good, and an honest
    peer's connect failed ("too many peers"). Now a HELLO that finds the table full takes the
    place of the peer silent longest (past peer_timeout) that holds nothing and that we did not
    connect to."""
    v = Victim(tmp_path, {"admission": False, "max_peers": 16, "peer_timeout": 1.5})
    a = AttackerProcess(tmp_path, {"SYSV_FIFO_SIZE": "4096"})
    try:
        check(v, "before any attack")
        time.sleep(2.0)   # the first honest peer said BYE and goes
        joined = sum(a.proc.call("join", front=v.descriptor["address"], sender=f"squat-{k}")["joined"]
                     for k in range(16))
        assert joined >= 15, f"only {joined} of 16 joined"
        time.sleep(3 * 1.5)   # silent: the attacker stops progressing its worker
        check(v, "16 silent peers in a table of 16", FDS + 2 * 16)   # an endpoint to a peer: 2 fds
        assert len(v.proc.call("peers")["peers"]) <= 16
    finally:
        a.close()
        v.close()


def test_control_batches_are_received_within_a_per_peer_budget(tmp_path):
    """A joined peer posts 48 control batches of 4 MiB at once (max_control_bytes 4 MiB).
    Before: each was given its own receive buffer as soon as it was probed (the victim's peak RSS
    grew by ~190 MiB); now a peer has at most max_control_bytes of batches being received, the
    rest wait in UCX (their rendezvous not started), so the peak grows by at most ``PEAK``."""
    PEAK = 48 << 20
    v = Victim(tmp_path, {"max_control_bytes": 4 << 20})
    a = AttackerProcess(tmp_path, {"SYSV_FIFO_SIZE": "4096"})
    try:
        check(v, "before any attack")
        token = v.proc.call("admit", descriptor={"id": "blaster"})["token"]
        ch = a.proc.call("join", front=v.descriptor["address"], sender="blaster", token=token)
        assert ch["joined"]
        before = v.health()["peak_rss"]
        sent = a.proc.call("blast", ep=ch["ep"], tag=hw.CTRL_TAG | ch["tag"], count=48, size=(4 << 20) - 64)
        end = time.monotonic() + 20.0
        while v.proc.call("rejected")["rejected"].get("malformed message", 0) < 48:
            assert time.monotonic() < end, (sent, v.proc.call("rejected"))
            time.sleep(0.1)
        grew = v.health()["peak_rss"] - before
        assert grew <= PEAK, f"peak RSS grew {grew >> 20} MiB receiving 48 batches of 4 MiB"
        check(v, "48 batches of 4 MiB")
    finally:
        a.close()
        v.close()


def test_messages_nobody_takes_do_not_pile_up(tmp_path):
    """80,000 messages of 2 KiB (below UCX's eager limit: their bytes travel with them) on tags of
    no kind kvxfer uses (top bits 00 and 11), to the descriptor's address, over TCP. Before,
    nothing received them: UCX kept them queued for good (the victim's RSS grew by their size).
    Now every turn drains them: RSS grows by at most ``RSS``."""
    v = Victim(tmp_path, {"tls": "tcp"})
    a = AttackerProcess(tmp_path, {"TLS": "tcp"})
    try:
        check(v, "before any attack")
        ep = a.connect(v.descriptor["address"])
        for kind in (0, hw.KIND_MASK):
            for _ in range(20):
                a.proc.call("blast", ep=ep, tag=kind | 12345, count=2000, size=2048)
        time.sleep(1.0)
        check(v, "80,000 messages on unused tags")
    finally:
        a.close()
        v.close()
