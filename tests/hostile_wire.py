"""A hostile peer that speaks kvxfer's wire formats, written from reading the code and
independent of kvxfer's own encoders (raw zmq, msgpack, hmac/hashlib, urllib, ucxx).

Formats (as of the commit this file was written against):

control channel  (kvxfer/control/wire.py seal/open_frames, kvxfer/control/channel.py, PROTOCOL 2)
    frames [mac, head, body]; head = msgpack [1, sender, recipient, nonce (16 bytes per sending
    connection), seq (from 1)]; body = msgpack map with "t" (one of kvxfer/control/messages.py, exact
    types, no unknown field); mac = HMAC-SHA256(secret, len(head) u32 LE || head || body) or b"".
    The ROUTER requires the signed sender == routing identity and admits each (nonce, seq) once.
    With a secret the ROUTER is a ZMTP CURVE server (kvxfer/control/zmtp.py): its secret key is the
    z85 of HMAC-SHA256(secret, "kvxfer control channel: CURVE server key"), a client's of
    HMAC-SHA256(secret, "kvxfer control channel: CURVE client key"); only that client key is let in.
    Prefill binds a ROUTER; decode connects a DEALER whose identity is its peer name.
    A HELLO is {"t": "hello", "i": call id, "info": RankInfo dict, "nonce": 8..64 bytes};
    the answer is {"t": "welcome" | "refuse", "re": call id, ...}.
bootstrap HTTP   (kvxfer/control/auth.py sign_http/check_http, kvxfer/control/bootstrap.py)
    X-KVXfer-Auth: "<unix time>:<32 hex nonce>:<hex HMAC-SHA256(secret,
    '<t>\\n<nonce>\\n<METHOD>\\n<path>\\n' + body)>"; each nonce is accepted once. Writes carry
    "owner" (16-64 of [A-Za-z0-9_-]): another owner's PUT is 409, DELETE 403.
zmq data plane   (transports/zmq.py)
    DEALER -> receiver ROUTER: [hdr, part...]; hdr msgpack {"t": "d", "r": request id, "x": xid,
    "dl": seconds, "runs": int64 LE [regions*k, offsets*k, nbytes*k]}; the last message adds
    "nruns", "nbytes", "notify". {"t": "p", "n": int} is answered with a pong after every reply
    to what came before it. Replies: {"t": "a", "x": [xids]}, {"t": "n", "x", "why"}, {"t": "p"}.
    notify (kvxfer/control/wire.py ChunkMeta) = msgpack [room, gen, [tp, pp], chunk, total, nbytes, aux].
ucx control      (transports/ucx/protocol.py): see hostile_ucx_wire.py, which speaks it.
"""
from __future__ import annotations

import hashlib
import hmac
import itertools
import json
import os
import struct
import time
import urllib.error
import urllib.request

import msgpack
import zmq

_ids = itertools.count(1 << 40)


# ------------------------------------------------------------------------------------
# Control channel
# ------------------------------------------------------------------------------------
HEAD_VERSION = 1


def ctl_head(sender: str, recipient: str, nonce: bytes, seq: int) -> bytes:
    """The signed head: msgpack [1, sender, recipient, 16-byte connection nonce, seq >= 1]."""
    return msgpack.packb([HEAD_VERSION, sender, recipient, nonce, seq], use_bin_type=True)


def ctl_frames(msg, secret: bytes | None = None, body: bytes | None = None, *, sender: str = "",
               recipient: str = "", nonce: bytes | None = None, seq: int = 1,
               head: bytes | None = None) -> list[bytes]:
    """[mac, head, body] for ``msg`` (or a raw ``body``/``head``); mac = HMAC-SHA256(secret,
    len(head) as 4 bytes LE || head || body) when ``secret`` is given, else empty."""
    body = msgpack.packb(msg, use_bin_type=True) if body is None else body
    if head is None:
        head = ctl_head(sender, recipient, os.urandom(16) if nonce is None else nonce, seq)
    tag = hmac.new(secret, len(head).to_bytes(4, "little") + head + body, hashlib.sha256).digest() if secret else b""
    return [tag, head, body]


def curve_dial(sock: zmq.Socket, secret: bytes) -> None:
    """Make ``sock`` (before ``connect``) a CURVE client that a ROUTER with ``secret`` lets in: the keys
    a secret holder derives (an insider: the MAC, replay and schema checks are what is tested)."""
    from zmq.utils import z85

    def pair(label: bytes) -> tuple[bytes, bytes]:
        sk = z85.encode(hmac.new(secret, label, hashlib.sha256).digest())
        return zmq.curve_public(sk), sk
    server_public, _ = pair(b"kvxfer control channel: CURVE server key")
    client_public, client_secret = pair(b"kvxfer control channel: CURVE client key")
    sock.curve_serverkey, sock.curve_publickey, sock.curve_secretkey = server_public, client_public, client_secret


def bad_hello(i: int) -> dict:
    """A HELLO whose rank record is invalid: a live prefill answers it with REFUSE, so it
    doubles as a probe that the control thread is alive and has handled what came before."""
    return {"t": "hello", "i": i, "info": {}, "nonce": os.urandom(16)}


class CtlClient:
    """A raw DEALER on a prefill rank's control ROUTER, under an identity of our choice. It signs
    (when it has the secret) with its own identity as sender, the ROUTER's address as recipient, a
    per-connection nonce and a growing seq, as an honest decode rank does."""

    def __init__(self, address: str, secret: bytes | None = None, identity: str | None = None):
        self.secret, self.address = secret, address
        self.identity = identity or f"hostile/{os.urandom(6).hex()}"
        self.nonce, self.seq = os.urandom(16), 0
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.linger = 0
        self.sock.setsockopt(zmq.IDENTITY, self.identity.encode())
        if secret is not None:
            curve_dial(self.sock, secret)
        self.sock.connect(address)

    def frames(self, msg=None, *, body: bytes | None = None) -> list[bytes]:
        """The next message of this connection, sealed (seq advances)."""
        self.seq += 1
        return ctl_frames(msg, self.secret, body, sender=self.identity, recipient=self.address,
                          nonce=self.nonce, seq=self.seq)

    def send(self, msg=None, *, body: bytes | None = None, frames: list[bytes] | None = None) -> None:
        self.sock.send_multipart(frames if frames is not None else self.frames(msg, body=body))

    def legacy(self, msg) -> list[bytes]:
        """``msg`` in the envelope of protocol 1, [mac, body] (mac = HMAC-SHA256(secret, body) or b""):
        the same input reaches the parser of either version."""
        body = msgpack.packb(msg, use_bin_type=True)
        return [hmac.new(self.secret, body, hashlib.sha256).digest() if self.secret else b"", body]

    def send_both(self, msg) -> None:
        """``msg`` in the old envelope, then in the current one."""
        self.sock.send_multipart(self.legacy(msg))
        self.send(msg)

    def recv_frames(self, timeout: float = 2.0) -> list[bytes] | None:
        if not self.sock.poll(int(timeout * 1000)):
            return None
        return self.sock.recv_multipart()

    def recv(self, timeout: float = 2.0) -> dict | None:
        """The next message's body, decoded (None on timeout)."""
        frames = self.recv_frames(timeout)
        return None if frames is None else msgpack.unpackb(frames[-1], raw=False)

    def replies(self, wait: float = 1.0, until: str | None = None) -> list:
        """Every reply within ``wait`` seconds (or up to the first of type ``until``)."""
        out, end = [], time.monotonic() + wait
        while (m := self.recv(max(0.0, end - time.monotonic()))) is not None:
            out.append(m)
            if until is not None and isinstance(m, dict) and m.get("t") == until:
                break
        return out

    def alive(self, timeout: float = 2.0) -> bool:
        """True when the ROUTER's thread answers a probe HELLO (so it handled all before it)."""
        i = next(_ids)
        self.send(bad_hello(i))
        end = time.monotonic() + timeout
        while (left := end - time.monotonic()) > 0:
            m = self.recv(left)
            if m is None:
                return False
            if m.get("t") == "refuse" and m.get("re") == i:
                return True
        return False

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()


# ------------------------------------------------------------------------------------
# Bootstrap HTTP
# ------------------------------------------------------------------------------------
def sign(secret: bytes, method: str, path: str, body: bytes, now: float | None = None,
         nonce: str | None = None) -> str:
    """X-KVXfer-Auth: "<unix time>:<32 hex nonce>:<hex HMAC-SHA256(secret,
    '<t>\\n<nonce>\\n<METHOD>\\n<path>\\n' + body)>"."""
    t = str(int(time.time() if now is None else now))
    n = nonce or os.urandom(16).hex()
    digest = hmac.new(secret, f"{t}\n{n}\n{method}\n{path}\n".encode() + body, hashlib.sha256).hexdigest()
    return f"{t}:{n}:{digest}"


def http(url: str, method: str, path: str, body=None, *, secret: bytes | None = None,
         header: str | None = None, raw: bytes | None = None, timeout: float = 5.0) -> tuple[int, bytes, str]:
    """(status, body bytes, the auth header sent). ``header`` replays a captured signature."""
    data = raw if raw is not None else (b"" if body is None else json.dumps(body).encode())
    req = urllib.request.Request(url.rstrip("/") + path, data=data if (body is not None or raw is not None) else None,
                                 method=method, headers={"Content-Type": "application/json"})
    auth = header if header is not None else (sign(secret, method, path.split("?")[0], data) if secret else "")
    if auth:
        req.add_header("X-KVXfer-Auth", auth)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read(), auth
    except urllib.error.HTTPError as e:
        return e.code, e.read(), auth


# ------------------------------------------------------------------------------------
# ZMQ data plane
# ------------------------------------------------------------------------------------
def chunk_meta(room: int, gen: int, source=(0, 0), chunk: int = 0, total: int = 1, nbytes: int = 0,
               aux: bytes | None = None) -> bytes:
    return msgpack.packb([room, gen, list(source), chunk, total, nbytes, aux], use_bin_type=True)


def runs_field(*triples) -> bytes:
    """(region, offset, nbytes) triples as the header's int64 LE field (regions, offsets, lengths)."""
    cols = list(zip(*triples)) if triples else [(), (), ()]
    return struct.pack(f"<{3 * len(triples)}q", *cols[0], *cols[1], *cols[2])


def data_header(rid: str, xid: int, runs: bytes = b"", dl: float = 10.0, end: tuple | None = None,
                notify: bytes = b"", cap: bytes | None = None) -> bytes:
    """``cap``: the grant capability field "c" (bytes; absent when None)."""
    h = {"t": "d", "r": rid, "x": xid, "dl": dl, "runs": runs}
    if cap is not None:
        h["c"] = cap
    if end is not None:
        h.update(nruns=end[0], nbytes=end[1], notify=notify)
    return msgpack.packb(h, use_bin_type=True)


class DataClient:
    """A raw DEALER on a zmq transport's ROUTER (its descriptor's "endpoint")."""

    def __init__(self, endpoint: str, user: str | None = None, token: bytes = b""):
        """``user``/``token``: a sender id the receiver admitted and its admission token (ZMQ PLAIN:
        what a receiver with ``admission="required"`` checks at the handshake); None: NULL."""
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.linger = 0
        if user is not None:
            self.sock.plain_username, self.sock.plain_password = user.encode(), token
        self.sock.connect(endpoint)

    def exchange(self, parts: list[bytes], timeout: float = 5.0) -> list[dict] | None:
        """Send a message, then a ping: the replies that came before its pong (None: no pong)."""
        n = next(_ids)
        self.sock.send_multipart(parts)
        self.sock.send(msgpack.packb({"t": "p", "n": n}))
        out, end = [], time.monotonic() + timeout
        while self.sock.poll(max(0, int((end - time.monotonic()) * 1000))):
            h = msgpack.unpackb(self.sock.recv(), raw=False)
            if h.get("t") == "p":
                if h.get("n") == n:
                    return out
            else:
                out.append(h)
        return None

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()


# ------------------------------------------------------------------------------------
# UCX control (raw ucxx: a worker of our own, never kvxfer's transport)
# ------------------------------------------------------------------------------------
CTRL_TAG, KIND_MASK = 1 << 63, 3 << 62
HELLO, ANNOUNCE, GO, DONE, ACK, FAIL, ABORT, PING, BYE, PREGRANT, FENCE, FENCED = range(12)


# The client moved to hostile_ucx_wire (the UCX transport's join protocol, issue 34); its
# interface is the same.
from hostile_ucx_wire import UcxClient  # noqa: E402, F401


class CtlServer:
    """A fake prefill control ROUTER: answers every HELLO with ``reply(msg)`` (a hostile reply)."""

    def __init__(self, reply, secret: bytes | None = None):
        import threading
        self.reply, self.secret, self._stop = reply, secret, False
        self._nonce, self._seq = os.urandom(16), 0
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.linger = 0
        self.sock.bind("tcp://127.0.0.1:*")
        self.address = self.sock.last_endpoint.decode()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop:
            if not self.sock.poll(20):
                continue
            ident, *frames = self.sock.recv_multipart()
            try:
                msg = msgpack.unpackb(frames[-1], raw=False)
                sender = msgpack.unpackb(frames[-2], raw=False)[1]   # head [1, sender, recipient, nonce, seq]
            except Exception:
                continue
            if isinstance(msg, dict) and msg.get("t") == "hello":
                self._seq += 1    # signed for the decode rank that asked, as a real prefill would
                self.sock.send_multipart([ident] + ctl_frames(self.reply(msg), self.secret, sender=self.address,
                                                              recipient=sender, nonce=self._nonce, seq=self._seq))

    def close(self) -> None:
        self._stop = True
        self._thread.join(2)
        self.sock.close(0)
        self.ctx.term()
