"""The connector's settings: ``kv_connector_extra_config`` checked into a frozen ``Settings`` (an
unknown key or a bad value is refused, naming it), and what each side reads from vLLM's config
(``from_vllm``: plain attribute reads, no vLLM import here).

Keys of ``kv_connector_extra_config`` (all optional):
    instance          prefill: this engine's instance name (default ``vllm-<registry host>:<port>``, so a
                      restarted prefill engine keeps its name); DP rank ``d`` > 0 adds ``-dp<d>``.
                      A decode engine's ranks are named ``<instance>-decode`` when it is given, else
                      ``vllm-decode-<engine id>``: one name per engine (two live decode processes
                      with one rank name would be refused by prefill as one rank)
    bootstrap_url     prefill: register at this kvxfer registry (``kvxfer bootstrap``) instead of the
                      one the prefill scheduler starts
    bootstrap_host    prefill: where the registry the scheduler starts listens and what decode is told
                      (default 127.0.0.1; give the host's address across hosts)
    bootstrap_port    prefill: its port (default 8998; DP rank ``d`` adds ``d``)
    host              the address every rank binds and advertises its kvxfer sockets on (default:
                      ``bootstrap_host``)
    transport         "zmq" (default) or "ucx"; ``transport_options``: its keyword options
    secret            HMAC key of the control plane and the registry (both sides the same)
    timeouts          ``kvxfer.endpoint.Timeouts`` fields in seconds, e.g. {"bootstrap": 30, "transfer": 30}
    kv_layout         "auto" (default), "paged", "flash", "flashinfer", "cpu" or "mla" (see ``layouts``)
    register_timeout  seconds a prefill worker keeps trying to register (the registry starts with the
                      scheduler, after the workers; default 120)
"""
from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields

from ...endpoint.base import Timeouts
from ...errors import ConfigError

KV_LAYOUTS = ("auto", "paged", "flash", "flashinfer", "cpu", "mla")
DEFAULT_PORT = 8998


@dataclass(frozen=True, kw_only=True)
class Settings:
    """What one engine's connector needs; ``producer`` / ``consumer`` from ``kv_role``."""
    producer: bool
    consumer: bool
    instance: str
    decode_instance: str               # the name this engine's decode ranks go by
    bootstrap_url: str                 # where prefill ranks register (and decode is told)
    serve_registry: bool               # the prefill scheduler starts the registry at bootstrap_host:port
    bootstrap_host: str
    bootstrap_port: int
    host: str
    transport: str = "zmq"
    transport_options: Mapping = field(default_factory=dict)
    secret: str | None = None
    timeouts: Timeouts = field(default_factory=Timeouts)
    kv_layout: str = "auto"
    register_timeout: float = 120.0


def _text(extra: Mapping, key: str, default: str) -> str:
    v = extra.get(key, default)
    if not isinstance(v, str) or not v or len(v) > 256 or not v.isprintable():
        raise ConfigError(f"kv_connector_extra_config[{key!r}] must be a printable string of 1..256 characters, "
                         f"got {v!r}")
    return v


def _timeouts(given: Mapping) -> Timeouts:
    try:
        seconds: dict = {k: float(v) for k, v in given.items()}
        return dataclasses.replace(Timeouts(), **seconds)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"kv_connector_extra_config['timeouts']: {e}") from None


def parse(extra: Mapping | None, role: str, dp_rank: int = 0, engine_id: str = "") -> Settings:
    """``kv_connector_extra_config`` and ``kv_role`` -> Settings; ConfigError naming a bad key."""
    extra = dict(extra or {})
    known = {"instance", "bootstrap_url", "bootstrap_host", "bootstrap_port", "host", "transport",
             "transport_options", "secret", "timeouts", "kv_layout", "register_timeout"}
    unknown = sorted(set(extra) - known)
    if unknown:
        raise ConfigError(f"kv_connector_extra_config has unknown key(s) {unknown}; known: {sorted(known)}")
    if role not in ("kv_producer", "kv_consumer", "kv_both"):
        raise ConfigError(f"kv_role must be kv_producer, kv_consumer or kv_both, got {role!r}")
    host = _text(extra, "bootstrap_host", "127.0.0.1")
    port = extra.get("bootstrap_port", DEFAULT_PORT)
    if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port + dp_rank <= 65535:
        raise ConfigError(f"kv_connector_extra_config['bootstrap_port'] must be a port in 1..65535, got {port!r}")
    port += dp_rank
    external = "bootstrap_url" in extra
    url = _text(extra, "bootstrap_url", "") if external else f"http://{host}:{port}"
    if not url.startswith(("http://", "https://")):
        raise ConfigError(f"kv_connector_extra_config['bootstrap_url'] must be an http(s) URL, got {url!r}")
    instance = _text(extra, "instance", f"vllm-{host}:{port}")
    if dp_rank and "instance" in extra:
        instance = f"{instance}-dp{dp_rank}"
    # vLLM gives every engine its own engine_id, the same in its scheduler and all its workers
    own = re.sub(r"[^A-Za-z0-9_.:\-]", "", engine_id)[:64] or "default"
    decode_instance = f"{instance}-decode" if "instance" in extra else f"vllm-decode-{own}"
    timeouts = extra.get("timeouts", {})
    names = {f.name for f in fields(Timeouts)} - {"heartbeat"}
    if not isinstance(timeouts, Mapping) or set(timeouts) - names:
        raise ConfigError(f"kv_connector_extra_config['timeouts'] must map some of {sorted(names)} to seconds, "
                         f"got {timeouts!r}")
    layout = extra.get("kv_layout", "auto")
    if layout not in KV_LAYOUTS:
        raise ConfigError(f"kv_connector_extra_config['kv_layout'] must be one of {KV_LAYOUTS}, got {layout!r}")
    options = extra.get("transport_options", {})
    if not isinstance(options, Mapping):
        raise ConfigError(f"kv_connector_extra_config['transport_options'] must be a dict, got {options!r}")
    secret = extra.get("secret")
    if secret is not None and (not isinstance(secret, str) or not secret):
        raise ConfigError("kv_connector_extra_config['secret'] must be a non-empty string")
    wait = extra.get("register_timeout", 120.0)
    if isinstance(wait, bool) or not isinstance(wait, (int, float)) or wait <= 0:
        raise ConfigError(f"kv_connector_extra_config['register_timeout'] must be > 0 seconds, got {wait!r}")
    return Settings(producer=role in ("kv_producer", "kv_both"), consumer=role in ("kv_consumer", "kv_both"),
                    instance=instance, decode_instance=decode_instance, bootstrap_url=url,
                    serve_registry=not external, bootstrap_host=host,
                    bootstrap_port=port, host=_text(extra, "host", host),
                    transport=_text(extra, "transport", "zmq"), transport_options=dict(options), secret=secret,
                    timeouts=_timeouts(timeouts), kv_layout=layout,
                    register_timeout=float(wait))


@dataclass(frozen=True, kw_only=True)
class ModelShape:
    """What a worker reads from vLLM's config: the model's global KV heads and layers, head sizes,
    block size, this worker's TP rank and size."""
    num_kv_heads: int
    num_layers: int
    head_size: int
    block_size: int
    tp_rank: int
    tp_size: int
    dp_rank: int = 0
    use_mla: bool = False


def from_vllm(vllm_config) -> Settings:
    """Settings from a ``VllmConfig`` (its ``kv_transfer_config`` and DP rank)."""
    ktc = vllm_config.kv_transfer_config
    dp = int(getattr(vllm_config.parallel_config, "data_parallel_rank", 0) or 0)
    return parse(ktc.kv_connector_extra_config, ktc.kv_role, dp, str(getattr(ktc, "engine_id", "") or ""))


def shape_from_vllm(vllm_config, tp_rank: int) -> ModelShape:
    """The model shape a worker needs (``tp_rank``: this worker's rank in its TP group)."""
    mc, pc = vllm_config.model_config, vllm_config.parallel_config
    return ModelShape(num_kv_heads=int(mc.get_total_num_kv_heads()), num_layers=int(mc.hf_config.num_hidden_layers),
                      head_size=int(mc.get_head_size()), block_size=int(vllm_config.cache_config.block_size),
                      tp_rank=int(tp_rank), tp_size=int(pc.tensor_parallel_size),
                      dp_rank=int(getattr(pc, "data_parallel_rank", 0) or 0), use_mla=bool(mc.use_mla))


__all__ = ["Settings", "ModelShape", "parse", "from_vllm", "shape_from_vllm", "KV_LAYOUTS", "DEFAULT_PORT"]
