"""The HELLO exchange: decode sends its ``RankInfo``, prefill checks the pair and answers
WELCOME (its own info) or REFUSE (every mismatch in words).
"""
from __future__ import annotations

import os
from collections.abc import Mapping

from ..errors import CompatibilityError, ConnectError
from ..ranks import RankInfo
from .channel import ControlChannel
from .compat import check_pair


# ------------------------------------------------------------------------------------
# The two halves of the handshake
# ------------------------------------------------------------------------------------
def hello(channel: ControlChannel, peer: str, d_info: RankInfo, timeout: float) -> RankInfo:
    """Decode side: HELLO -> the prefill rank's RankInfo, or CompatibilityError / ConnectError."""
    reply = channel.call(peer, {"t": "hello", "info": d_info.to_dict(), "nonce": os.urandom(16)}, timeout)
    if reply["t"] == "refuse":
        why = [str(w)[:1024] for w in reply["why"]]
        if any(w.startswith("authentication") for w in why):
            raise ConnectError(f"prefill rank {peer} refused the handshake: {'; '.join(why)}")
        raise CompatibilityError(why)
    if reply["t"] != "welcome":
        raise ConnectError(f"prefill rank {peer} answered HELLO with {reply['t']!r}")
    try:
        return RankInfo.from_dict(reply["info"])
    except ValueError as e:
        raise ConnectError(f"prefill rank {peer} sent an invalid rank record: {e}") from None


def answer_hello(p_info: RankInfo, msg: Mapping, transport: str) -> tuple[RankInfo | None, dict]:
    """Prefill side: (decode RankInfo or None, the reply to send)."""
    try:
        d_info = RankInfo.from_dict(msg["info"])
    except ValueError as e:
        return None, {"t": "refuse", "re": msg["i"], "why": [f"invalid rank record: {e}"]}
    if d_info.spec.role != "decode":
        return None, {"t": "refuse", "re": msg["i"], "why": ["only decode ranks say HELLO"]}
    why = check_pair(p_info, d_info, transport)
    if why:
        return None, {"t": "refuse", "re": msg["i"], "why": why}
    return d_info, {"t": "welcome", "re": msg["i"], "info": p_info.to_dict()}
