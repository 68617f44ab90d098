"""A hostile UCX peer for the hostile suite: a UCX worker of its own, with UCX settings of its own,
that speaks the UCX transport's control format as read from ``transports/ucx/protocol.py``
(never importing it or any kvxfer encoder): raw ``ucxx`` (context, worker, endpoints, tagged
sends and probes) and msgpack.

Run as a program (``python tests/hostile_ucx_wire.py``) it reads one JSON command per line and
answers one JSON line each (``xfer_peer.PeerProcess(..., script=__file__)`` drives it), so an
attacker whose own UCX misbehaves (a shared-memory FIFO of another size) dies alone, never the
test process. Commands (bytes travel as base64)::

    init     config (UCX settings, names without UCX_), rma -> address (hex), pid
    connect  address (hex) -> ep (an index)
    send     ep, tag, data (b64) -> sent (bool: completed within 2 s)
    recv     wait_s -> batches [[sender, secret b64, [message, ...]], ...] (messages as JSON-safe lists)
    spray    ep, sender, secret (b64), count -> completed: ``count`` batches of one empty ANNOUNCE
             each (each answered), each waited for at most 0.1 s
    join     front (hex), sender, shm, token (b64), identity -> joined, ep, tag, secret (b64): ``Attacker.join``
             (``identity``: the HELLO names this process, ``identity()``)
    hellos   ep, count, shm -> sent: ``count`` front HELLOs (control tag 0) under fresh sender ids
    post     ep, tag, count, size, turns -> posted: ``count`` messages of ``size`` bytes on tags ``tag | k``
             posted, then ``turns`` progress calls, never waited for (a sender that goes silent
             with its frames half sent: over TCP their rendezvous needs our progress to finish)
    blast    ep, tag, count, size -> completed: ``count`` messages of ``size`` random bytes on ``tag``, all
             in flight at once, then waited for (10 s at most)
    frames   ep, dtags [lo, hi), frames, size, byte -> sent: data frames ``DATA_BIT | d << 24 | k`` of
             ``size`` bytes of ``byte`` for every d in [lo, hi) and k < frames (frame injection)
    fuzz     ep, seed, count, sender, secret (b64), tag -> sent, completed
    close

Formats (the UCX transport, as read):

    control batch   msgpack [sender id, channel secret (16 bytes), [message, ...]], tag
                    CTRL_TAG (1 << 63) | control tag; a HELLO to a transport's descriptor address
                    goes with control tag 0, everything else with the tag its WELCOME named.
    HELLO           [0, address, secret, epoch, host, pid, start, err, eager, token, shm, ctag(, drained)]
                    (full form; older forms stop after the secret, the start time, err or eager).
                    shm: [SYSV_FIFO_SIZE, SYSV_SEG_SIZE, POSIX_FIFO_SIZE, POSIX_SEG_SIZE] as strings
                    ("" for UCX's default); ctag: the control tag our messages to the peer carry.
    ANNOUNCE        [1, xid, rid, timeout, notify, runs, nput, frame_bytes, inline, cap, staged, eager]
                    runs: int64 LE rows (regions, offsets, lengths)
    GO [2, xid, dtag]  DONE [3, xid]  ACK [4, xid]  FAIL [5, xid, why]  ABORT [6, xid, why]
    PING [7]  BYE [8]  PREGRANT [9, [rid], [ranges]]  FENCE [10, [rid]]  FENCED [11, [rid], all]
    WELCOME         [12, address, ctag]: the peer's data address and the control tag to use on it
    data frame      tag DATA_BIT (1 << 62) | dtag << 24 | frame index, the frame's bytes, no header
"""
from __future__ import annotations

import base64
import json
import os
import random
import struct
import sys
import time

import msgpack
import numpy as np

CTRL_TAG, DATA_BIT, KIND_MASK = 1 << 63, 1 << 62, 3 << 62
FRAME_BITS = 24
HELLO, ANNOUNCE, GO, DONE, ACK, FAIL, ABORT, PING, BYE, PREGRANT, FENCE, FENCED, WELCOME = range(13)
UCX_DEFAULT_FIFO = {"SYSV_FIFO_SIZE": "256"}   # UCX's own default (kvxfer sets 4096)


def batch(sender: str, secret: bytes, msgs: list) -> bytes:
    return msgpack.packb([sender, secret, msgs], use_bin_type=True)


def runs_field(*triples) -> bytes:
    """(region, offset, nbytes) triples as an ANNOUNCE's int64 LE rows (regions, offsets, lengths)."""
    cols = list(zip(*triples)) if triples else [(), (), ()]
    return struct.pack(f"<{3 * len(triples)}q", *cols[0], *cols[1], *cols[2])


def hello(address: bytes, secret: bytes, *, epoch: int = 0, host: str = "", pid: int = 0, start: int = 0,
          err: int = 0, eager: int = 0, token: bytes = b"", shm=("4096", "", "", ""), ctag: int = 1) -> list:
    """The full HELLO; ``shm`` as the peer would read it (kvxfer's own settings by default)."""
    return [HELLO, address, secret, epoch, host, pid, start, err, eager, token, list(shm), ctag]


def identity() -> dict:
    """This process as a HELLO names it: host (boot id / PID namespace / network namespace, as
    inode numbers), pid and start time (clock ticks since boot), so a receiver on this kernel can
    tell when it is gone."""
    with open("/proc/sys/kernel/random/boot_id") as f:
        boot = f.read().strip()
    with open("/proc/self/stat", "rb") as f:
        stat = f.read()
    return {"host": f"{boot}/{os.stat('/proc/self/ns/pid').st_ino}/{os.stat('/proc/self/ns/net').st_ino}",
            "pid": os.getpid(), "start": int(stat[stat.rindex(b")") + 2:].split()[19])}


def hello_forms(address: bytes, secret: bytes, **kw) -> list[list]:
    """Every HELLO shape an attacker may try: the older forms (3, 7, 8, 9 fields), the full one,
    and the full one with a ``drained`` epoch (a re-handshake on a new endpoint): below its
    epoch, equal, past it (malformed), negative, not an int, and one field more."""
    full = hello(address, secret, **kw)
    epoch = full[3]
    drained = [full + [d] for d in (max(epoch - 1, 0), epoch, epoch + 1, -1, "0", 1 << 63)]
    return [full[:3], full[:7], full[:8], full[:9], full, *drained, full + [epoch, 0]]


def announce(xid: int, rid: str, runs: bytes, nput: int, *, frame: int = 4096, inline: bytes = b"",
             cap: bytes = b"", timeout: float = 10.0, notify: bytes = b"") -> list:
    return [ANNOUNCE, xid, rid, timeout, notify, runs, nput, frame, inline, cap]


def _rand_value(rng: random.Random, depth: int = 0):
    """A random msgpack value: what a fuzzer puts in a message's fields."""
    k = rng.randrange(9 if depth < 2 else 7)
    return [lambda: rng.randrange(-2, 1 << rng.choice((3, 16, 40, 63))), lambda: rng.random() * 1e6,
            lambda: rng.randbytes(rng.choice((0, 1, 16, 24, 100))), lambda: "x" * rng.choice((0, 8, 40)),
            lambda: None, lambda: rng.random() < 0.5, lambda: -rng.randrange(1 << 20),
            lambda: [_rand_value(rng, depth + 1) for _ in range(rng.randrange(4))],
            lambda: {str(i): _rand_value(rng, depth + 1) for i in range(rng.randrange(3))}][k]()


def fuzz_message(rng: random.Random, address: bytes, secret: bytes) -> list:
    """A random control message: a known kind with random fields (or a valid-looking one)."""
    kind = rng.randrange(14)
    if kind == HELLO and rng.random() < 0.5:
        form = rng.choice(hello_forms(address, secret, ctag=rng.randrange(1 << 62), token=rng.randbytes(32)))
        return list(form)
    if kind == ANNOUNCE and rng.random() < 0.5:
        n = rng.randrange(1, 5)
        runs = runs_field(*[(rng.randrange(2), rng.randrange(1 << 20), rng.choice((1, 512, 8192, 1 << 16)))
                            for _ in range(n)])
        return announce(rng.randrange(1 << 40), rng.choice(("granted.1", "nobody", "x" * 40)), runs,
                        rng.randrange(n + 1), frame=rng.choice((1, 4096, 1 << 20)),
                        inline=rng.randbytes(rng.randrange(64)))
    return [kind] + [_rand_value(rng) for _ in range(rng.randrange(13))]


class Attacker:
    """A UCX context and worker with ``config`` (UCX settings; UCX's own defaults for the rest)."""

    def __init__(self, config: dict | None = None, rma: bool = False):
        from ucxx._lib import libucxx as ucx_api
        from ucxx._lib.arr import Array
        self.api, self.Array = ucx_api, Array
        feats = (ucx_api.Feature.TAG, ucx_api.Feature.RMA) if rma else (ucx_api.Feature.TAG,)
        self.ctx = ucx_api.UCXContext(dict(config or {}), feature_flags=feats)
        self.worker = ucx_api.UCXWorker(self.ctx)
        self.address = self.worker.address.tobytes()
        self.eps: list = []
        self.keep: list = []
        self.pending: list = []   # batches received, not yet handed out (``next_batch``)

    def connect(self, address: bytes) -> int:
        self.eps.append(self.worker.create_endpoint_from_worker_address(
            self.api.UCXAddress.create_from_buffer(address), False))
        return len(self.eps) - 1

    def send(self, ep: int, tag: int, data: bytes, wait_s: float = 2.0) -> bool:
        buf = np.frombuffer(data, np.uint8) if data else np.zeros(1, np.uint8)
        req = self.eps[ep].tag_send(self.Array(buf), self.api.UCXXTag(tag))
        end = time.monotonic() + wait_s
        while not req.completed and time.monotonic() < end:
            self.worker.progress()
        self.keep = [k for k in self.keep if not k[0].completed]
        self.keep.append((req, buf))
        return bool(req.completed)

    def recv(self, wait_s: float = 1.0) -> list:
        """Control batches sent to us (any control tag), decoded; undecodable ones as None."""
        out, end = [], time.monotonic() + wait_s
        while time.monotonic() < end:
            self.worker.progress()
            res = self.worker.tag_probe(self.api.UCXXTag(CTRL_TAG), self.api.UCXXTagMask(1 << 63), remove=True)
            if not res.matched:
                if out:
                    break
                time.sleep(0.001)
                continue
            buf = np.empty(max(res.length, 1), np.uint8)
            req = self.worker.tag_recv_with_handle(self.Array(buf), res)
            while not req.completed:
                self.worker.progress()
            try:
                out.append(msgpack.unpackb(buf[:res.length].tobytes(), raw=False))
            except Exception:
                out.append(None)
        return out

    def join(self, front_hex: str, sender: str, *, token: bytes = b"", shm=("4096", "", "", ""), eager: bool = False,
             wait_s: float = 3.0, who: dict | None = None) -> "Channel | None":
        """Join a transport as its senders do: HELLO to its front worker (the descriptor's address),
        then, on its WELCOME, an endpoint to the data address it names and HELLO again there under
        the control tag it gave. None when no WELCOME came (refused)."""
        secret, ctag = os.urandom(16), random.randrange(1, 1 << 62)
        front = self.connect(bytes.fromhex(front_hex))
        msg = hello(self.address, secret, eager=int(eager), token=token, shm=shm, ctag=ctag, **(who or {}))
        self.send(front, CTRL_TAG, batch(sender, secret, [msg]))
        welcome = self.wait_for(WELCOME, wait_s)
        if welcome is None:
            return None
        ch = Channel(self, self.connect(welcome[1]), sender, secret, welcome[2], ctag)
        ch.send([msg])
        return ch if self.wait_for(WELCOME, wait_s) is not None else None

    def next_batch(self, wait_s: float = 2.0) -> list | None:
        """The next batch sent to us (None on timeout); one at a time, none lost."""
        if not self.pending:
            self.pending = self.recv(wait_s)
        return self.pending.pop(0) if self.pending else None

    def wait_for(self, kind: int, wait_s: float = 3.0) -> list | None:
        """The first message of ``kind`` in the batches sent to us within ``wait_s`` (the batches
        before it are consumed)."""
        end = time.monotonic() + wait_s
        while (left := end - time.monotonic()) > 0:
            b = self.next_batch(left)
            for m in (b[-1] if isinstance(b, list) and b and isinstance(b[-1], list) else []):
                if isinstance(m, list) and m and m[0] == kind:
                    return m
        return None

    def blast(self, ep: int, tag: int, count: int, size: int, wait_s: float = 10.0) -> int:
        """``count`` messages of ``size`` random bytes on ``tag``, all posted before any is waited for."""
        bufs = [np.frombuffer(os.urandom(size), np.uint8) for _ in range(count)]
        reqs = [self.eps[ep].tag_send(self.Array(b), self.api.UCXXTag(tag)) for b in bufs]
        end = time.monotonic() + wait_s
        while not all(r.completed for r in reqs) and time.monotonic() < end:
            self.worker.progress()
        self.keep.extend(zip(reqs, bufs))
        return sum(r.completed for r in reqs)

    def close(self) -> None:
        """Close our endpoints (bounded: a peer that is gone does not take their flush)."""
        for ep in self.eps:
            try:
                ep.close()
            except Exception:
                pass
        end = time.monotonic() + 0.1
        while time.monotonic() < end:
            self.worker.progress()
        self.eps = []

    def fuzz(self, ep: int, seed: int, count: int, sender: str, secret: bytes, tag: int = 0) -> tuple[int, int]:
        """``count`` random messages: control batches of random messages under ``sender`` (some
        under other ids and secrets; control tag ``tag``, 0 or a random one), raw bytes on random
        tags of every kind, sizes up to 256 KiB (past UCX's eager limit: rendezvous). Returns
        (sent, completed within 0.1 s each)."""
        rng, done, ctag = random.Random(seed), 0, tag
        for _ in range(count):
            r = rng.random()
            if r < 0.55:
                msgs = [fuzz_message(rng, self.address, secret) for _ in range(rng.randrange(1, 4))]
                who = sender if rng.random() < 0.8 else rng.choice(("mallory", "x" * 64, ""))
                data = batch(who, secret if rng.random() < 0.9 else rng.randbytes(16), msgs)
                tag = CTRL_TAG | rng.choice((ctag, ctag, 0, rng.randrange(1 << 62)))
            else:
                data = rng.randbytes(rng.choice((0, 1, 100, 8192, 65536, 262144)))
                tag = rng.choice((CTRL_TAG, DATA_BIT, 0, KIND_MASK)) | rng.randrange(1 << 62)
                if rng.random() < 0.5:   # a small data tag, as sequential ones were
                    tag = DATA_BIT | rng.randrange(1, 64) << FRAME_BITS | rng.randrange(4)
            done += self.send(ep, tag, data, 0.1)
        return count, done


class Channel:
    """A joined channel: our data endpoint to the peer, our sender id and secret, the control tag
    it gave us (``tag``) and the one we gave it (``mine``)."""

    def __init__(self, att: Attacker, ep: int, sender: str, secret: bytes, tag: int, mine: int):
        self.att, self.ep, self.sender, self.secret, self.tag, self.mine = att, ep, sender, secret, tag, mine

    def send(self, msgs: list, *, sender: str | None = None, secret: bytes | None = None,
             tag: int | None = None) -> bool:
        """A batch of ``msgs`` on the data path (another ``sender``, ``secret`` or ``tag`` if given)."""
        data = batch(self.sender if sender is None else sender, self.secret if secret is None else secret, msgs)
        return self.att.send(self.ep, CTRL_TAG | (self.tag if tag is None else tag), data)

    def wait_for(self, kind: int, wait_s: float = 3.0) -> list | None:
        return self.att.wait_for(kind, wait_s)


class UcxClient:
    """The older hostile client's interface (``hostile_wire.UcxClient``: send batches under any
    sender id, read what comes back) over the joined protocol: the first batch that holds a HELLO
    joins (front HELLO, then the data worker the WELCOME names); every batch goes over the data
    path under the tag it gave, a HELLO in it completed to the full form. Before a join, a batch
    goes to the front worker (control tag 0), as a peer that never said HELLO would send it."""

    def __init__(self, victim_address_hex: str):
        # the victim's shared-memory FIFO size must match ours: it shares this process
        self.att = Attacker({} if "UCX_SYSV_FIFO_SIZE" in os.environ else {"SYSV_FIFO_SIZE": "4096"})
        self.front_hex, self.address, self.secret = victim_address_hex, self.att.address, os.urandom(16)
        self.front = self.att.connect(bytes.fromhex(victim_address_hex))
        self.ch: Channel | None = None
        self.ctag = random.randrange(1, 1 << 62)

    def hello(self, eager: bool = False) -> list:
        return hello(self.address, self.secret, eager=int(eager), ctag=self.ctag)

    def _full(self, m) -> list:
        """A HELLO of any older form as the full one (its own fields kept), our control tag in it."""
        if not (isinstance(m, list) and m and m[0] == HELLO and 3 <= len(m) < 12):
            return m
        full = hello(m[1], m[2], ctag=self.ctag)
        return m + full[len(m):]

    def send(self, sender: str, msgs: list, timeout: float = 5.0, secret: bytes | None = None) -> None:
        secret = self.secret if secret is None else secret
        msgs = [self._full(m) for m in msgs]
        if self.ch is None and any(isinstance(m, list) and m and m[0] == HELLO for m in msgs):
            h = next(m for m in msgs if isinstance(m, list) and m and m[0] == HELLO)
            self.att.send(self.front, CTRL_TAG, batch(sender, secret, [h]), timeout)
            welcome = self.att.wait_for(WELCOME, timeout)
            if welcome is not None:
                self.ch = Channel(self.att, self.att.connect(welcome[1]), sender, secret, welcome[2], self.ctag)
        if self.ch is None:
            self.att.send(self.front, CTRL_TAG, batch(sender, secret, msgs), timeout)
        else:
            self.att.send(self.ch.ep, CTRL_TAG | self.ch.tag, batch(sender, secret, msgs), timeout)

    def recv(self, timeout: float = 2.0) -> list | None:
        return self.att.next_batch(timeout)

    def wait_for(self, kind: int, timeout: float = 3.0) -> list | None:
        return self.att.wait_for(kind, timeout)

    def close(self) -> None:
        self.att.close()


def main() -> None:
    sys.stdout = os.fdopen(os.dup(1), "w")   # replies only: what UCX prints goes to stderr
    os.dup2(2, 1)
    att: Attacker | None = None
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd.pop("op")
        try:
            if op == "init":
                att = Attacker(cmd.get("config"), bool(cmd.get("rma")))
                reply = {"address": att.address.hex(), "pid": os.getpid()}
            elif op == "connect":
                reply = {"ep": att.connect(bytes.fromhex(cmd["address"]))}
            elif op == "send":
                reply = {"sent": att.send(cmd["ep"], cmd["tag"], base64.b64decode(cmd["data"]))}
            elif op == "recv":
                got = att.recv(cmd.get("wait_s", 1.0))
                reply = {"batches": [None if b is None else json.loads(json.dumps(
                    b, default=lambda v: base64.b64encode(v).decode() if isinstance(v, bytes) else str(v)))
                    for b in got]}
            elif op == "spray":
                secret = base64.b64decode(cmd["secret"])
                reply = {"completed": sum(att.send(cmd["ep"], CTRL_TAG, batch(cmd["sender"], secret, [
                    announce(k + 1, "nobody", b"", 0)]), 0.1) for k in range(cmd["count"]))}
            elif op == "join":
                ch = att.join(cmd["front"], cmd["sender"], shm=tuple(cmd.get("shm", ("4096", "", "", ""))),
                              token=base64.b64decode(cmd.get("token", "")),
                              who=identity() if cmd.get("identity") else None)
                reply = {"joined": False} if ch is None else {
                    "joined": True, "ep": ch.ep, "tag": ch.tag, "secret": base64.b64encode(ch.secret).decode()}
            elif op == "post":
                bufs = [np.zeros(cmd["size"], np.uint8) for _ in range(cmd["count"])]
                reqs = [att.eps[cmd["ep"]].tag_send(att.Array(b), att.api.UCXXTag(cmd["tag"] | k))
                        for k, b in enumerate(bufs)]
                for _ in range(cmd["turns"]):
                    att.worker.progress()
                att.keep.extend(zip(reqs, bufs))
                reply = {"posted": len(reqs)}
            elif op == "blast":
                reply = {"completed": att.blast(cmd["ep"], cmd["tag"], cmd["count"], cmd["size"])}
            elif op == "hellos":
                reply = {"sent": sum(att.send(cmd["ep"], CTRL_TAG, batch(f"fresh-{k}", sec, [hello(
                    att.address, sec, shm=tuple(cmd["shm"]), ctag=k + 1)]), 0.05)
                    for k in range(cmd["count"]) for sec in (os.urandom(16),))}
            elif op == "frames":
                data, (lo, hi) = bytes([cmd["byte"]]) * cmd["size"], cmd["dtags"]
                reply = {"sent": sum(att.send(cmd["ep"], DATA_BIT | d << FRAME_BITS | k, data, 0.05)
                                     for d in range(lo, hi) for k in range(cmd["frames"]))}
            elif op == "fuzz":
                sent, done = att.fuzz(cmd["ep"], cmd["seed"], cmd["count"], cmd["sender"],
                                      base64.b64decode(cmd["secret"]), cmd.get("tag", 0))
                reply = {"sent": sent, "completed": done}
            elif op == "close":
                print(json.dumps({}), flush=True)
                break
            else:
                reply = {"error": f"unknown op {op}"}
        except Exception as e:
            reply = {"error": f"{type(e).__name__}: {e}"}
        print(json.dumps(reply), flush=True)


if __name__ == "__main__":
    main()
