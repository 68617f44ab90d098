"""Per-request KV transfer: ``PrefillEndpoint`` / ``KVSender`` (``prefill``), ``DecodeEndpoint`` /
``KVReceiver`` (``decode``), what both share (``base``: ``KVPoll``, ``Timeouts``, ``reduce_poll``) and
the aux records (``aux``). The request life cycle and who calls what is in ``base``'s docstring.
"""
from .aux import AUX_BYTES, AuxBuffer, AuxRecord
from .base import KVPoll, Timeouts, reduce_poll
from .decode import DecodeEndpoint, KVReceiver
from .prefill import KVSender, PrefillEndpoint

__all__ = ["KVPoll", "Timeouts", "reduce_poll", "AuxRecord", "AuxBuffer", "AUX_BYTES",
           "PrefillEndpoint", "KVSender", "DecodeEndpoint", "KVReceiver"]
