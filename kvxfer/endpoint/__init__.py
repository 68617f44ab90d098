"""Per-request KV transfer: ``PrefillEndpoint`` / ``KVSender`` (``prefill``), ``DecodeEndpoint`` /
``KVReceiver`` (``decode``), what both share (``request``: ``KVPoll``, ``Outcome``, the request base;
``base``: ``Timeouts``, the endpoint base), TP-group agreement (``group``: ``reduce_poll``,
``LocalGroup``) and the aux records (``aux``). The request life cycle and who calls what is in
``base``'s docstring.
"""
from .aux import AUX_BYTES, AuxBuffer, AuxRecord, AuxRows
from .base import Timeouts
from .decode import DecodeEndpoint, KVReceiver
from .group import LocalGroup, reduce_poll
from .prefill import KVSender, PrefillEndpoint
from .request import KVPoll, Outcome

__all__ = ["KVPoll", "Outcome", "Timeouts", "reduce_poll", "LocalGroup", "AuxRecord", "AuxBuffer", "AuxRows",
           "AUX_BYTES", "PrefillEndpoint", "KVSender", "DecodeEndpoint", "KVReceiver"]
