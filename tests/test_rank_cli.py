"""``kvxfer rank`` (``kvxfer/cli/rank.py``): ranks started from the command line, their pool
described by flags, smoke-tested with the pattern self-test.

Fast tier: flag checking (errors name the flag and the fix) and the pattern itself.
Slow tier: real processes on 127.0.0.1 (bootstrap, prefill, decode: a byte-exact self-test, a
``--check`` of an incompatible pair, SIGTERM deregisters), and, where network namespaces can
be made (``tests/hosts.py``), the README's three-host run: bootstrap on A, prefill TP 2
page-major on B, decode TP 4 token-major on C.
"""
from __future__ import annotations

import json
import queue
import signal
import subprocess
import sys
import threading
import time
import urllib.request

import numpy as np
import pytest
from hosts import hosts_fixture, hosts_skip_reason
from support.ports import free_port

from kvxfer.cli import pattern
from kvxfer.cli import rank as cli
from kvxfer.cli import rank_serve as serve

pytestmark = pytest.mark.slow   # processes, waits of seconds (the full tier)

RANK = [sys.executable, "-m", "kvxfer.cli.rank"]
BOOTSTRAP = [sys.executable, "-m", "kvxfer.cli", "bootstrap"]
SMALL = ["--layers", "2", "--kv-heads", "8", "--head-dim", "64", "--pages", "64", "--log-level", "WARNING"]


# ------------------------------------------------------------------------------------
# Fast: flags and the pattern
# ------------------------------------------------------------------------------------
def config(*flags: str, env: dict | None = None) -> cli.RankConfig:
    return cli.resolve(cli.parser().parse_args(["--bootstrap", "http://127.0.0.1:8998", *flags]), env or {})


@pytest.mark.parametrize("flags, env, words", [
    (["--role", "prefill", "--selftest", "2"], {}, "--selftest runs on decode ranks"),
    (["--role", "decode", "--kv-heads", "6", "--tp-size", "4"], {}, "--kv-heads 6 and --tp-size 4"),
    (["--role", "decode", "--tp-size", "2", "--tp-rank", "2"], {}, "--tp-rank 2 is outside 0..1"),
    (["--role", "decode", "--pp-size", "2"], {}, "use --pp-size 1"),
    (["--role", "decode", "--layout", "mla", "--head-dim", "64"], {}, "--kv-lora-rank + --rope-dim"),
    (["--role", "decode", "--secret", "a", "--secret-file", "f"], {}, "pass one"),
    (["--role", "decode", "--check", "--selftest", "1"], {}, "drop --selftest"),
    (["--role", "decode", "--advertise", "0.0.0.0"], {}, "wildcard"),
    (["--role", "decode", "--tp-size", "2"], {"WORLD_SIZE": "4", "RANK": "3"}, "drop --tp-size"),
    (["--role", "decode", "--selftest", "4", "--tokens", "512", "--pages", "64"], {}, "raise --pages"),
    (["--role", "decode", "--ucx-tls", "tcp"], {}, "--transport ucx"),
    (["--role", "decode", "--ucx-eager-writes"], {}, "decode ranks started with --transport ucx"),
    (["--role", "prefill", "--transport", "ucx", "--ucx-eager-writes"], {}, "pass it to decode ranks"),
    (["--role", "prefill", "--transport", "ucx", "--no-ucx-eager-writes"], {}, "--no-ucx-eager-writes given"),
])
def test_bad_flags_are_named_with_the_fix(flags, env, words):
    with pytest.raises(cli.UsageError, match=words.replace("+", r"\+").replace(".", r"\.")):
        config(*flags, env=env)


def test_ucx_eager_writes_reach_the_decode_transport():
    """--[no-]ucx-eager-writes becomes the decode transport's ``eager_writes``; without either, the
    transport's default (eager) holds."""
    from kvxfer_transports.ucx.options import UCXOptions
    hb = serve.timeouts_of((30.0, 300.0, 30.0, 30.0), (1.0, 5.0)).heartbeat
    on = config("--role", "decode", "--transport", "ucx", "--ucx-eager-writes")
    no = config("--role", "decode", "--transport", "ucx", "--no-ucx-eager-writes")
    default = config("--role", "decode", "--transport", "ucx")
    assert serve.transport_options_of(on, hb) == {**serve.transport_options_of(default, hb), "eager_writes": True}
    assert serve.transport_options_of(no, hb) == {**serve.transport_options_of(default, hb), "eager_writes": False}
    assert "eager_writes" not in serve.transport_options_of(default, hb) and UCXOptions().eager_writes
    assert "eager_writes" not in serve.transport_options_of(config("--role", "prefill", "--transport", "ucx"), hb)


def test_main_says_what_is_wrong(capsys):
    assert cli.main(["--role", "decode", "--bootstrap", "http://127.0.0.1:1", "--tp-size", "3", "--kv-heads", "8"]) == 2
    err = capsys.readouterr().err
    assert "--kv-heads 8 and --tp-size 3" in err and "1, 2, 4, 8, 16" in err, err


def test_loopback_is_not_advertised_to_another_host():
    with pytest.raises(cli.UsageError, match="--advertise 127.0.0.1 gives loopback.*another host"):
        cli.addresses(None, "127.0.0.1", "http://10.213.250.1:8998")
    assert cli.addresses(None, None, "http://127.0.0.1:8998") == ("127.0.0.1", "127.0.0.1")
    assert cli.addresses("0.0.0.0", "127.0.0.1", "http://127.0.0.1:8998") == ("0.0.0.0", "127.0.0.1")
    assert cli.addresses("lo", None, "http://127.0.0.1:8998") == ("127.0.0.1", "127.0.0.1")   # an interface


def test_a_rank_binds_every_interface_and_publishes_the_advertised_address():
    """The endpoint's own bind/advertise (no rewrite of the record): the control ROUTER binds the
    wildcard, the record says the advertised address for control and zmq data alike."""
    rank = serve.Rank(config("--role", "prefill", "--bind", "0.0.0.0", "--advertise", "127.0.0.1", *SMALL))
    try:
        info = rank.info()
        assert rank.ep.channel.bound.startswith("tcp://0.0.0.0:")
        assert info["control"].startswith("tcp://127.0.0.1:") and info["data"]["zmq"]["endpoint"].startswith(
            "tcp://127.0.0.1:"), info
        assert rank.ep.info.control == info["control"]
    finally:
        rank.close()


def test_place_from_torchrun():
    c = config("--role", "prefill", "--pp-size", "2", env={"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "3"})
    assert (c.tp_size, c.tp_rank, c.pp_size, c.pp_rank, c.local_rank) == (2, 1, 2, 1, 3)


def test_pattern_is_logical():
    """The bytes of a (layer, kind, head, position) do not depend on which heads or tokens are asked."""
    whole = pattern.pattern(1, 5, 0, "k", [0, 1, 2, 3], np.arange(40), 16)
    part = pattern.pattern(1, 5, 0, "k", [2, 3], np.arange(8, 24), 16)
    assert np.array_equal(whole[8:24, 2:4], part)
    assert not np.array_equal(whole, pattern.pattern(1, 6, 0, "k", [0, 1, 2, 3], np.arange(40), 16))
    assert not np.array_equal(whole, pattern.pattern(1, 5, 0, "v", [0, 1, 2, 3], np.arange(40), 16))
    assert len(np.unique(whole)) > 200


def test_fill_then_verify_across_layouts():
    from kvxfer.pools import MHAPool
    p = MHAPool(layers=2, heads=4, head_dim=8, dtype="bfloat16", num_pages=8, page_size=4, layout="page_major")
    d = MHAPool(layers=2, heads=2, head_dim=8, dtype="bfloat16", num_pages=8, page_size=4)
    pattern.fill(p, 0, 9, [0, 1, 2, 3], np.arange(4, 14))
    assert pattern.verify(p, 0, 9, [0, 1, 2, 3], np.arange(4, 14)) == (0, "")
    for layer in (0, 1):   # heads 2..3 of p into d's slots 20..29
        d.set_kv_buffer(layer, np.arange(20, 30), *(t[:, 2:4] for t in p.get_kv_buffer(layer, np.arange(4, 14))))
    assert pattern.verify(d, 0, 9, [2, 3], np.arange(20, 30)) == (0, "")
    bad, first = pattern.verify(d, 0, 9, [0, 1], np.arange(20, 30))
    assert bad and first.startswith("layer 0 k head 0 token 0")


def test_head_map_flag_is_the_rank_specs():
    c = config("--role", "decode", "--kv-heads", "4", "--tp-size", "2", "--head-map", "3,1;0,2")
    assert c.head_map == ((3, 1), (0, 2))
    assert config("--role", "decode", "--kv-heads", "4", "--tp-size", "2", "--head-map", "0,1;2,3").head_map is None
    for bad, words in (("0,1;1,2", "head 1 is held by 2"), ("0,1", "list of 2 lists"), ("a,b;c,d", "--head-map")):
        with pytest.raises(cli.UsageError, match=words):
            config("--role", "decode", "--kv-heads", "4", "--tp-size", "2", "--head-map", bad)
    with pytest.raises(cli.UsageError, match="drop --head-map"):
        config("--role", "decode", "--layout", "mla", "--head-map", "0")


def test_a_rank_with_a_head_map_moves_the_heads_it_names():
    """In process: prefill TP 2 (contiguous) -> decode rank 0 of TP 2 holding heads 2, 3 (the
    other block: --head-map '2,3;0,1'); its self-test verifies each head's pattern byte for byte."""
    from kvxfer.control.bootstrap import BootstrapConfig, BootstrapServer
    server = BootstrapServer(BootstrapConfig(host="127.0.0.1", port=0)).start()
    flags = ["--bootstrap", server.url, "--kv-heads", "4", "--head-dim", "16", "--layers", "2", "--pages", "32",
             "--page-size", "4", "--tp-size", "2", "--seed", "6"]
    ranks = []
    try:
        for r in (0, 1):
            p = serve.Rank(cli.resolve(cli.parser().parse_args([*flags, "--role", "prefill", "--tp-rank", str(r),
                                                                "--layout", "page_major"]), {}))
            ranks.append(p)
            p.start()
        d = serve.Rank(cli.resolve(cli.parser().parse_args([*flags, "--role", "decode", "--tp-rank", "0",
                                                            "--head-map", "2,3;0,1"]), {}))
        ranks.append(d)
        assert d.heads == [2, 3]
        d.start()
        res = d.selftest(2, 10, 5, 20)
        assert res["ok"] and all(v["verified"] for v in res["requests"].values()), res
        assert res["nbytes"] == 2 * 10 * 2 * 2 * 2 * 16 * 2   # requests x tokens x layers x K,V x heads x dim x bf16
    finally:
        for rk in reversed(ranks):
            rk.close()
        server.stop()


# ------------------------------------------------------------------------------------
# Slow: real processes
# ------------------------------------------------------------------------------------
class Proc:
    """A process whose stdout lines are read into a queue (``line(timeout)``)."""

    def __init__(self, argv, popen=subprocess.Popen, stdin=None):
        self.p = popen(argv, stdin=stdin, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, bufsize=1)
        self.lines: queue.Queue = queue.Queue()
        self.err: list[str] = []
        threading.Thread(target=self._pump, args=(self.p.stdout, self.lines.put), daemon=True).start()
        threading.Thread(target=self._pump, args=(self.p.stderr, self.err.append), daemon=True).start()

    @staticmethod
    def _pump(f, put):
        for line in f:
            put(line.rstrip("\n"))

    def line(self, timeout: float = 60.0) -> str:
        try:
            return self.lines.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"no output within {timeout}s; stderr: {self.err[-10:]}") from None

    def line_with(self, text: str, timeout: float = 60.0) -> str:
        """The next stdout line containing ``text`` (UCX prints its warnings on stdout)."""
        end = time.monotonic() + timeout
        while True:
            line = self.line(max(0.1, end - time.monotonic()))
            if text in line:
                return line

    def call(self, cmd: dict, timeout: float = 60.0) -> dict:
        self.p.stdin.write(json.dumps(cmd) + "\n")
        self.p.stdin.flush()
        return json.loads(self.line(timeout))

    def end(self, timeout: float = 30.0) -> int:
        rc = self.p.wait(timeout)
        return rc

    def rest(self, timeout: float = 5.0) -> list[str]:
        """The stdout lines not read yet, once the process has ended (why a self-test failed)."""
        self.p.wait(timeout)
        out = []
        while True:
            try:
                out.append(self.lines.get(timeout=0.5))
            except queue.Empty:
                return out

    def kill(self) -> None:
        if self.p.poll() is None:
            self.p.kill()
            self.p.wait(10)


def start_bootstrap(host: str = "127.0.0.1", port: int = 0, popen=subprocess.Popen) -> tuple[Proc, str]:
    b = Proc([*BOOTSTRAP, "--host", host, "--port", str(port)], popen=popen)
    line = b.line()
    assert "advertised as " in line, line
    return b, line.split("advertised as ")[1].split()[0]


def registered(url: str) -> int:
    with urllib.request.urlopen(url + "/topology", timeout=5) as r:
        return len(json.loads(r.read())["ranks"])


@pytest.fixture
def procs():
    started: list[Proc] = []
    yield started
    for p in reversed(started):
        p.kill()


def unix_call(path: str, cmd: dict) -> dict:
    import socket
    with socket.socket(socket.AF_UNIX) as s:
        s.connect(path)
        f = s.makefile("rw")
        f.write(json.dumps(cmd) + "\n")
        f.flush()
        return json.loads(f.readline())


@pytest.mark.slow
def test_selftest_prefill_to_decode_byte_exact_then_sigterm_deregisters(procs, tmp_path):
    b, url = start_bootstrap()
    procs.append(b)
    sock, metrics = str(tmp_path / "p.sock"), free_port()
    p = Proc([*RANK, "--role", "prefill", "--bootstrap", url, "--layout", "page_major", "--seed", "4",
              "--serve", f"unix:{sock}", "--metrics-port", str(metrics), *SMALL])
    procs.append(p)
    assert "ready" in p.line_with("ready"), p.err
    d = Proc([*RANK, "--role", "decode", "--bootstrap", url, "--seed", "4", "--serve", *SMALL], stdin=subprocess.PIPE)
    procs.append(d)
    hello = json.loads(d.line())
    assert hello["ready"] and hello["heads"] == list(range(8))
    res = d.call({"op": "selftest", "requests": 3, "tokens": 100, "room": 11})
    assert res["ok"], res
    assert all(v["verified"] and v["tokens"] == 100 for v in res["requests"].values())
    assert res["nbytes"] == 3 * 100 * 2 * 2 * 8 * 64 * 2   # tokens x layers x K,V x heads x dim x bf16
    assert d.call({"op": "stats"})["free_pages"] == 63     # every slot came back
    assert d.call({"op": "exit"}) == {"ok": True}
    assert d.end() == 0
    end = time.monotonic() + 20   # prefill releases each request's KV once decode confirmed it
    while (st := unix_call(sock, {"op": "stats"}))["requests"].get("success", 0) < 3 and time.monotonic() < end:
        time.sleep(0.1)
    assert st["requests"] == {"success": 3} and st["free_pages"] == 63, st
    assert "error" in unix_call(sock, {"op": "selftest"})   # a decode command, refused in words
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics}/metrics", timeout=5) as r:
        assert 'kvxfer_requests_total{reason="",role="prefill",state="success"} 3.0' in r.read().decode()
    assert registered(url) == 1
    p.p.send_signal(signal.SIGTERM)
    assert p.end() == 0, p.err
    assert registered(url) == 0, "SIGTERM did not deregister the prefill rank"
    assert not (tmp_path / "p.sock").exists()


@pytest.mark.slow
@pytest.mark.parametrize("eager", [[], ["--no-ucx-eager-writes"]], ids=["eager (default)", "announced"])
def test_selftest_over_ucx_is_byte_exact(procs, eager):
    """Decode ranks pregrant their requests by default, or announce them (--no-ucx-eager-writes);
    either way the self-test's KV lands byte-exact and every slot comes back."""
    from kvxfer.transport.registry import available_transports
    if "ucx" not in available_transports():
        pytest.skip("ucx is not installed (KVXFER_NO_UCX)")
    b, url = start_bootstrap()
    procs.append(b)
    p = Proc([*RANK, "--role", "prefill", "--bootstrap", url, "--transport", "ucx", "--seed", "5", *SMALL])
    procs.append(p)
    assert "ready" in p.line_with("ready"), p.err
    d = Proc([*RANK, "--role", "decode", "--bootstrap", url, "--transport", "ucx", *eager, "--seed", "5",
              "--serve", *SMALL], stdin=subprocess.PIPE)
    procs.append(d)
    assert json.loads(d.line())["ready"]
    res = d.call({"op": "selftest", "requests": 3, "tokens": 100, "room": 21})
    assert res["ok"] and all(v["verified"] and v["tokens"] == 100 for v in res["requests"].values()), res
    end = time.monotonic() + 10   # a forgotten request's slots wait for the prefill rank's FENCED
    while (st := d.call({"op": "stats"}))["free_pages"] != 63 and time.monotonic() < end:
        time.sleep(0.1)
    assert st["free_pages"] == 63, st
    assert d.call({"op": "exit"}) == {"ok": True}
    assert d.end() == 0


@pytest.mark.slow
def test_check_says_an_incompatible_pair_cannot_talk(procs):
    b, url = start_bootstrap()
    procs.append(b)
    p = Proc([*RANK, "--role", "prefill", "--bootstrap", url, "--page-size", "16", *SMALL])
    procs.append(p)
    assert "ready" in p.line(), p.err
    bad = subprocess.run([*RANK, "--role", "decode", "--bootstrap", url, "--page-size", "24", "--check", *SMALL],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 1, bad.stderr
    assert "cannot talk" in bad.stdout and "P page_size 16 vs D page_size 24" in bad.stdout, bad.stdout
    good = subprocess.run([*RANK, "--role", "decode", "--bootstrap", url, "--page-size", "32", "--check", *SMALL],
                          capture_output=True, text=True, timeout=120)
    assert good.returncode == 0 and "compatible" in good.stdout, (good.stdout, good.stderr)
    clash = subprocess.run([*RANK, "--role", "prefill", "--bootstrap", url, "--tp-size", "2", "--tp-rank", "1",
                            "--check", *SMALL], capture_output=True, text=True, timeout=120)
    assert clash.returncode == 1, clash.stderr
    assert "registered with tp/pp/dp sizes 1/1/1 but this rank has 2/1/1" in clash.stdout, clash.stdout


# ------------------------------------------------------------------------------------
# Slow, multihost: the README's three-host run
# ------------------------------------------------------------------------------------
three = hosts_fixture(3)


def _transports():
    import importlib.util
    no_ucx = importlib.util.find_spec("ucxx") is None
    return ["zmq", pytest.param("ucx", marks=pytest.mark.skipif(no_ucx, reason="ucxx does not import"))]


@pytest.mark.slow
@pytest.mark.multihost
@pytest.mark.skipif(bool(hosts_skip_reason()), reason=str(hosts_skip_reason()))
@pytest.mark.parametrize("transport", _transports())
def test_three_hosts_tp2_page_major_to_tp4_token_major(three, procs, transport):
    a, b, c = three
    net = ["--transport", transport] + (["--ucx-tls", "tcp"] if transport == "ucx" else [])   # namespaces share IPC
    boot, url = start_bootstrap(a.addr, 8998, popen=lambda argv, **kw: a.popen(argv, **kw))
    procs.append(boot)
    assert url == f"http://{a.addr}:8998"
    # rank 0: no address flags (it advertises the address that reaches the bootstrap);
    # rank 1: binds every interface and advertises its interface by name
    where = [[], ["--bind", "0.0.0.0", "--advertise", "veth0"]]
    ps = []
    for r in range(2):
        p = Proc([*RANK, "--role", "prefill", "--bootstrap", url, "--tp-size", "2", "--tp-rank", str(r),
                  "--layout", "page_major", *net, *where[r], *SMALL], popen=lambda argv, **kw: b.popen(argv, **kw))
        procs.append(p)
        ps.append(p)
        ready = p.line_with("ready", 120)
        if transport == "zmq":
            assert ready.count(f"tcp://{b.addr}:") == 2 and "0.0.0.0" not in ready, ready
    refused = c.run([*RANK, "--role", "decode", "--bootstrap", url, "--advertise", "127.0.0.1", *SMALL])
    assert refused.returncode == 2 and "--advertise 127.0.0.1 gives loopback" in refused.stderr, refused.stderr
    ds = [Proc([*RANK, "--role", "decode", "--bootstrap", url, "--tp-size", "4", "--tp-rank", str(r),
                "--layout", "token_major", "--selftest", "3", "--tokens", "90", *net, *SMALL],
               popen=lambda argv, **kw: c.popen(argv, **kw)) for r in range(4)]
    procs.extend(ds)
    for r, d in enumerate(ds):
        out = d.line_with("kvxfer rank --selftest", 180)
        rc = d.end(60)
        prefill_err = [line for i, p in enumerate(ps) for line in [f"prefill tp{i} stderr:", *p.err[-10:]]]
        assert rc == 0, "\n".join([out, *d.rest(), "stderr:", *d.err[-20:], *prefill_err])
        assert f"3/3 requests byte-exact on default/dp0/pp0/tp{r}" in out
