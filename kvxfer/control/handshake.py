"""The HELLO exchange: decode sends its ``RankInfo``, prefill checks the pair and answers
WELCOME (its own info) or REFUSE (every mismatch in words).

Who calls what: the decode endpoint sends its HELLOs from ``connect()`` (``start_hello`` for every
prefill rank at once, then ``welcomed`` for each answer; ``hello`` for one, blocking); the
prefill endpoint calls ``answer_hello`` on its channel thread for each HELLO
(never raises: a record that fails any check is a REFUSE with the reason).
"""
from __future__ import annotations

import collections
import heapq
import itertools
import logging
import math
import os
import queue
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future

from ..errors import CompatibilityError, ConnectError
from .channel import ControlChannel
from .compat import check_pair, head_map_mismatch
from .messages import MAX_WHY, MAX_WHYS, Hello, Message, Refuse, Welcome
from .peers import Call
from .records import RankInfo

log = logging.getLogger("kvxfer.control")

# A refusal that starts so says the data path is unreachable: ``hello`` raises ConnectError.
DATA_PATH = "data path unreachable"
# A refusal that starts so is for now only (the rank is busy, or an earlier process of this decode
# rank is still live there): ``hello`` raises ``Busy``, and the caller may try again.
BUSY = "busy:"


class Busy(ConnectError):
    """The prefill rank refused the HELLO for now; the same HELLO may succeed a moment later."""


def describe(descriptor) -> str:
    """A peer's transport descriptor in a few words for a message: its address, or the record."""
    if isinstance(descriptor, Mapping):
        for k in ("endpoint", "address", "addr"):
            if isinstance(descriptor.get(k), str):
                return descriptor[k][:256]
    r = repr(descriptor)
    return r if len(r) <= 200 else r[:197] + "..."


# ------------------------------------------------------------------------------------
# The two halves of the handshake
# ------------------------------------------------------------------------------------
def hello(channel: ControlChannel, peer: str, d_info: RankInfo, timeout: float,
          tokens: Mapping[str, bytes] | None = None) -> RankInfo:
    """Decode side: HELLO -> the prefill rank's RankInfo, or CompatibilityError / ConnectError.
    ``tokens``: per transport, what ``Transport.admit`` gave for this prefill rank."""
    with start_hello(channel, peer, d_info.to_dict(), tokens) as c:
        try:
            reply = c.result(timeout)
        except ConnectError as e:
            raise unanswered(channel, e) from None
    return welcome_info(peer, reply)


def start_hello(channel: ControlChannel, peer: str, info: dict,
                tokens: Mapping[str, bytes] | None = None) -> Call:
    """``hello`` without the wait: the HELLO (``info``: our ``RankInfo.to_dict()``) is sent; its
    ``Call`` gets the reply (read it with ``welcomed``; a call that timed out: ``unanswered``).
    The caller closes the call."""
    nonce, toks = os.urandom(16), dict(tokens) if tokens else None
    return channel.start_call(peer, lambda i: Hello(i=i, info=info, nonce=nonce, tokens=toks))


def unanswered(channel: ControlChannel, e: ConnectError) -> ConnectError:
    """A HELLO's ConnectError, saying why no answer may have come."""
    if channel.secret is None and "no answer" in str(e):   # a secured rank never answers one without it
        return ConnectError(f"{e} (if the prefill rank has a shared secret, this rank needs the same one: its "
                            f"control port takes no connection without it)")
    return e


def welcome_info(peer: str, reply: Message) -> RankInfo:
    """The answer to a HELLO -> the prefill rank's RankInfo (``welcomed``, then its record read)."""
    w = welcomed(peer, reply)
    try:
        return RankInfo.from_dict(w.info)
    except ValueError as e:
        raise ConnectError(f"prefill rank {peer} sent an invalid rank record: {e}") from None


def welcomed(peer: str, reply: Message) -> Welcome:
    """The answer to a HELLO, when it is a WELCOME; ``Busy`` (try again soon), ConnectError or
    CompatibilityError (every mismatch in words) otherwise."""
    if isinstance(reply, Refuse):
        why = [str(w)[:1024] for w in reply.why]
        if any(w.startswith(BUSY) for w in why):
            raise Busy(f"prefill rank {peer} refused the handshake for now: {'; '.join(why)}")
        if any(w.startswith(("authentication", "addressed to", "sender identity", "bad envelope", DATA_PATH))
               for w in why):
            raise ConnectError(f"prefill rank {peer} refused the handshake: {'; '.join(why)}")
        raise CompatibilityError(why)
    if not isinstance(reply, Welcome):
        raise ConnectError(f"prefill rank {peer} answered HELLO with {reply.T!r}")
    return reply


def hello_all(channel: ControlChannel, peers: Mapping[str, str], d_info: RankInfo, timeout: float,
              deadline: float, tokens: Callable[[str], Mapping[str, bytes]], fanout: int,
              busy_retry: float) -> list[Exception]:
    """Decode side, from one thread: HELLO every prefill rank of ``peers`` (key -> control address)
    at once, at most ``fanout`` in flight, each answer read as it comes (``hello`` for each, without
    a thread each). A rank that refuses for now (``Busy``) is asked again ``busy_retry`` s later,
    while ``deadline`` (``time.monotonic``) allows. ``tokens(key)`` gives the admission tokens of a
    HELLO (it may raise ConnectError). Returns the error of every rank that did not welcome us
    (a WELCOME's record is not read: the caller has each rank's record from its registry).
    O(log n) per answer: answers come through a queue, deadlines through a heap (a wait on every
    call in flight, after each answer, was O(fanout) each: ~65k steps for 1,024 ranks)."""
    todo, errors, info = collections.deque(peers), list[Exception](), d_info.to_dict()
    again: list[tuple[float, str]] = []                    # heap (when, key): busy, asked again then
    flying: dict[Future, tuple[str, Call, float]] = {}     # future -> (key, call, its timeout)
    ends: list[tuple[float, int, Future]] = []             # heap (ends at, n, future) of the calls in flight
    answered: queue.SimpleQueue[Future] = queue.SimpleQueue()   # futures as they complete (any thread)
    order, connected = itertools.count(), set[str]()
    try:
        while todo or again or flying:
            now = time.monotonic()
            while again and again[0][0] <= now:
                todo.append(heapq.heappop(again)[1])
            while todo and len(flying) < fanout:
                key = todo.popleft()
                left = deadline - now
                if left <= 0:
                    errors.append(ConnectError(f"connect timed out before the handshake with {key}"))
                    continue
                try:
                    if key not in connected:
                        channel.connect(key, peers[key])
                        connected.add(key)
                    c = start_hello(channel, key, info, tokens(key))
                except ConnectError as e:
                    errors.append(e)
                    continue
                flying[c.future] = (key, c, min(timeout, left))
                heapq.heappush(ends, (now + min(timeout, left), next(order), c.future))
                c.future.add_done_callback(answered.put)
            while ends and ends[0][2] not in flying:   # answered already
                heapq.heappop(ends)
            wake = min(ends[0][0] if ends else math.inf, again[0][0] if again else math.inf)
            ready = []
            if wake < math.inf:   # the first answer, the first call past its time, or a retry due
                try:
                    ready.append(answered.get(timeout=max(0.0, wake - time.monotonic())))
                except queue.Empty:
                    pass
            while not answered.empty():
                ready.append(answered.get_nowait())
            now = time.monotonic()
            while ends and ends[0][0] <= now:   # no answer in time
                ready.append(heapq.heappop(ends)[2])
            for fut in ready:
                item = flying.pop(fut, None)
                if item is None:   # handled already (answered after it timed out, or twice in ``ready``)
                    continue
                key, c, t = item
                c.close()
                try:
                    if not fut.done():
                        raise c.timed_out(t)
                    welcomed(key, fut.result())
                except Busy as e:
                    if deadline - now < busy_retry:
                        errors.append(e)
                    else:
                        log.info("%s", e)
                        heapq.heappush(again, (now + busy_retry, key))
                except ConnectError as e:
                    errors.append(unanswered(channel, e))
                except Exception as e:   # CompatibilityError: every mismatch in words
                    errors.append(e)
    finally:
        for _, c, _ in flying.values():
            c.close()
    return errors


def _refuse(i: int, why: list[str]) -> Refuse:
    return Refuse(re=i, why=[w[:MAX_WHY] for w in why[:MAX_WHYS]] or ["refused"])


def answer_hello(p_info: RankInfo, msg: Hello, transport: str,
                 group: Sequence[RankInfo] = ()) -> tuple[RankInfo | None, Message]:
    """Prefill side: (decode RankInfo or None, the reply to send). Never raises on peer input.
    ``group``: the decode ranks connected already; one of the peer's TP group that places the
    group's heads otherwise (``RankSpec.head_map``) is a refusal naming both."""
    try:
        d_info = RankInfo.from_dict(msg.info)
    except ValueError as e:
        return None, _refuse(msg.i, [f"invalid rank record: {e}"])
    if d_info.spec.role != "decode":
        return None, _refuse(msg.i, ["only decode ranks say HELLO"])
    try:
        why = check_pair(p_info, d_info, transport)
    except Exception as e:   # a record check_pair did not foresee: refuse it, never kill the thread
        log.warning("HELLO from %s: compatibility check failed on its record: %r", d_info.spec.key, e)
        why = [f"invalid rank record: {type(e).__name__}: {str(e)[:512]}"]
    for other in group if not why else ():   # a record check_pair passed: its heads split
        conflict = head_map_mismatch(other.spec, d_info.spec)
        if conflict and other.spec.tp_rank != d_info.spec.tp_rank:
            why.append(conflict)
            break
    if why:
        return None, _refuse(msg.i, why)
    return d_info, Welcome(re=msg.i, info=p_info.to_dict())
