"""A decode rank's HELLOs to its prefill ranks go out at once from one thread (issue 38: connect
time flat as peers grow, no thread per peer): ``handshake.hello_all`` over a channel whose replies
the test gives by hand (``PendingCalls``, as the channel thread does). Fast tier, but for the
test that waits out a timeout."""
from __future__ import annotations

import threading
import time

import pytest
from waiting import until

from kvxfer.control.handshake import BUSY, hello_all
from kvxfer.control.messages import Refuse, Welcome
from kvxfer.control.peers import PendingCalls
from kvxfer.control.records import RankInfo
from kvxfer.errors import CompatibilityError, ConnectError
from kvxfer.layout import token_major_layout
from kvxfer.ranks import RankSpec


def info(role: str, tp_rank: int = 0) -> RankInfo:
    layout = token_major_layout(layers=2, heads=2, head_dim=8, num_slots=64, dtype="float16")
    return RankInfo(spec=RankSpec(role=role, num_kv_heads=2, num_layers=2, tp_rank=tp_rank),
                    control=f"tcp://127.0.0.1:{20000 + tp_rank}", data={}, layout=layout.to_dict())


class HandChannel:
    """The part of ``ControlChannel`` that ``hello_all`` uses; the test answers each call."""
    secret = None

    def __init__(self):
        self.calls, self.sent, self.connects = PendingCalls(), [], []
        self.lock = threading.Lock()

    def connect(self, peer: str, address: str) -> None:
        self.connects.append(peer)

    def start_call(self, peer, build):
        c = self.calls.open(peer, lambda t: ConnectError(f"no answer from {peer} within {t}s"))
        with self.lock:
            self.sent.append((peer, build(c.id)))
        return c

    def answer(self, peer: str, reply) -> None:
        """Answer the latest HELLO sent to ``peer``."""
        with self.lock:
            msg = next(m for p, m in reversed(self.sent) if p == peer)
        assert self.calls.answer(peer, msg.i, reply(msg.i))

    def to(self, peer: str) -> int:
        with self.lock:
            return sum(p == peer for p, _ in self.sent)


def run(ch: HandChannel, peers: list[str], **kw) -> tuple[threading.Thread, list]:
    out: list = []
    args = dict(timeout=1.5, deadline=time.monotonic() + 10, tokens=lambda k: {}, fanout=64, busy_retry=0.1)
    args.update(kw)
    t = threading.Thread(target=lambda: out.append(hello_all(ch, {p: f"tcp://127.0.0.1:{20000 + i}"
                                                                  for i, p in enumerate(peers)},
                                                             info("decode"), **args)))
    t.start()
    return t, out


def welcome(i):
    return Welcome(re=i, info=info("prefill").to_dict())


def test_every_hello_goes_out_before_any_answer_and_each_answer_is_read_as_it_comes():
    ch, peers = HandChannel(), [f"p{k}" for k in range(16)]
    threads = threading.active_count()
    t, out = run(ch, peers)
    assert until(lambda: len(ch.sent) == 16, 5), f"{len(ch.sent)} of 16 HELLOs sent with none answered"
    assert threading.active_count() == threads + 1, "a thread per HELLO"
    assert sorted(ch.connects) == sorted(peers)
    for p in peers:
        ch.answer(p, welcome)
    t.join(5)
    assert out == [[]]


@pytest.mark.slow   # waits ~1 s for a timeout: the full tier (keeps the fast tier under 90 s)
def test_busy_is_asked_again_a_silent_rank_times_out_and_a_mismatch_is_named():
    ch = HandChannel()
    t, out = run(ch, ["ok", "busy", "silent", "other"])
    assert until(lambda: len(ch.sent) == 4, 5)
    ch.answer("ok", welcome)
    ch.answer("busy", lambda i: Refuse(re=i, why=[f"{BUSY} answering 64 handshakes"]))
    ch.answer("other", lambda i: Refuse(re=i, why=["P page_size 16 vs D page_size 24"]))
    assert until(lambda: ch.to("busy") == 2, 5), "the busy rank was not asked again"
    ch.answer("busy", welcome)
    t.join(10)
    errors = out[0]
    assert len(errors) == 2, errors
    assert any(isinstance(e, CompatibilityError) and "page_size" in str(e) for e in errors), errors
    assert any(isinstance(e, ConnectError) and "no answer from silent" in str(e) for e in errors), errors
    assert ch.to("silent") == 1 and ch.to("ok") == 1


def test_at_most_fanout_hellos_are_in_flight():
    ch, peers = HandChannel(), [f"p{k}" for k in range(5)]
    t, out = run(ch, peers, fanout=2)
    assert until(lambda: len(ch.sent) == 2, 5)
    time.sleep(0.2)
    assert len(ch.sent) == 2, "more than fanout HELLOs in flight"
    for k in range(5):
        assert until(lambda k=k: len(ch.sent) > k, 5)
        ch.answer(ch.sent[k][0], welcome)
    t.join(5)
    assert out == [[]] and len(ch.sent) == 5
