"""Settings of the SGLang backend, and where a rank sits in SGLang's parallel layout.

SGLang gives a transfer backend no option of its own on the command line, so the few settings
kvxfer needs beyond ``ServerArgs`` are read once, at manager start-up, from the environment:

    KVXFER_TRANSPORT     "zmq" (default) or "ucx": kvxfer's data plane between the ranks
    KVXFER_SECRET_FILE   a file holding the shared secret of the control plane and registry
                         (default: none, for a trusted network)
    SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT, SGLANG_DISAGGREGATION_WAITING_TIMEOUT
                         SGLang's own phase deadlines (seconds, default 300 each), used as
                         kvxfer's ``Timeouts.bootstrap`` / ``Timeouts.waiting``

Who calls what: ``KvxferKVManager`` calls ``BackendConfig.from_env()`` and ``rank_topology``
once; tests pass a ``BackendConfig`` of their own (``KvxferKVManager(..., config=)``).
"""
from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass, field
from typing import NamedTuple

from ...endpoint.base import Timeouts
from ...errors import ConfigError, ConnectError

TRANSPORTS = ("zmq", "ucx")
_NAME_CHARS = re.compile(r"[^A-Za-z0-9_.:\-]")


@dataclass(frozen=True, slots=True, kw_only=True)
class BackendConfig:
    transport: str = "zmq"
    timeouts: Timeouts = field(default_factory=Timeouts)
    secret: bytes | None = None
    register_timeout: float = 60.0   # seconds a prefill rank retries its registration (bootstrap not up yet)

    def __post_init__(self):
        if self.transport not in TRANSPORTS:
            raise ConfigError(f"KVXFER_TRANSPORT={self.transport!r}: choose one of {TRANSPORTS}")
        if not self.register_timeout > 0:
            raise ConfigError(f"register_timeout must be > 0 seconds, got {self.register_timeout}")

    @classmethod
    def from_env(cls, env=None) -> "BackendConfig":
        env = os.environ if env is None else env
        secret = None
        path = env.get("KVXFER_SECRET_FILE")
        if path:
            try:
                with open(path, "rb") as f:
                    secret = f.read().strip()
            except OSError as e:
                raise ConfigError(f"KVXFER_SECRET_FILE={path!r} cannot be read: {e}") from None
        timeouts = dataclasses.replace(Timeouts(), bootstrap=_seconds(env, "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT"),
                                       waiting=_seconds(env, "SGLANG_DISAGGREGATION_WAITING_TIMEOUT"))
        return cls(transport=env.get("KVXFER_TRANSPORT", "zmq"), timeouts=timeouts, secret=secret)


def _seconds(env, name: str, default: float = 300.0) -> float:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not a number of seconds") from None
    if not value > 0:
        raise ConfigError(f"{name}={raw!r} must be > 0 seconds")
    return value


class RankTopology(NamedTuple):
    """A rank's place in kvxfer's terms: its attention-TP group, DP group and PP stage."""
    tp_size: int
    tp_rank: int
    dp_size: int
    dp_rank: int
    pp_size: int
    pp_rank: int


def rank_topology(kv_args, server_args) -> RankTopology:
    """From ``ServerArgs`` (tp/dp/pp sizes, DP attention) and ``KVArgs`` (``engine_rank``: the TP rank
    on prefill, the attention-TP rank on decode; ``pp_rank``; ``system_dp_rank``, which both sides'
    ``_init_kv_manager`` set). Context parallelism is refused in words."""
    tp, dp, pp = int(server_args.tp_size), int(server_args.dp_size or 1), int(server_args.pp_size or 1)
    if int(getattr(server_args, "attn_cp_size", 1) or 1) > 1:
        raise ConfigError("the kvxfer backend does not split a request's KV over context-parallel ranks "
                         "(--attn-cp-size > 1)")
    dp_attention = bool(getattr(server_args, "enable_dp_attention", False)) and dp > 1
    attn_tp = tp // dp if dp_attention else tp
    rank = int(kv_args.engine_rank)   # prefill: the TP rank; decode: already the attention-TP rank
    system_dp = getattr(kv_args, "system_dp_rank", None)
    dp_rank = int(system_dp) if system_dp is not None else rank // attn_tp
    return RankTopology(attn_tp, rank % attn_tp, dp, dp_rank, pp, int(getattr(kv_args, "pp_rank", 0) or 0))


def host_port(addr: str) -> tuple[str, int]:
    """``host:port`` (SGLang's bootstrap address; ``[v6]:port`` too) -> (host, port)."""
    host, sep, port = str(addr).rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536 or not host:
        raise ConnectError(f"bootstrap address {addr!r} is not host:port")
    return host.strip("[]"), int(port)


def bootstrap_url(addr: str) -> str:
    """kvxfer's registry URL for SGLang's bootstrap address ``host:port``."""
    host, port = host_port(addr)
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def instance_name(role: str, host: str, port: int) -> str:
    """A kvxfer instance name for an SGLang server (unique per host and port)."""
    return _NAME_CHARS.sub("_", f"sglang-{role}-{host}-{port}")[:128]


def client_host(host: str) -> str:
    """A wildcard bind address as a client reaches it on this host."""
    return {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)


__all__ = ["BackendConfig", "RankTopology", "rank_topology", "host_port", "bootstrap_url", "instance_name",
           "client_host", "TRANSPORTS"]
