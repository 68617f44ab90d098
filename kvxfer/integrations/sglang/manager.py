"""``KvxferKVManager``: one per SGLang scheduler rank, the kvxfer endpoint behind SGLang's contract.

SGLang makes it in ``PrefillBootstrapQueue._init_kv_manager`` / ``DecodePreallocQueue.
_init_kv_manager`` as ``Manager(kv_args, mode, server_args, is_mla_backend)``. It describes the
rank's pools over SGLang's memory (``kvxfer.integrations.sglang.pools``: the pool objects the
plugin's hook handed over, else ``KVArgs``), wraps SGLang's ``MetadataBuffers`` as aux rows
(``AuxRows`` over ``kv_args.aux_data_ptrs``, cleared to 0 so SGLang's metadata gate reads "not
landed" until kvxfer wrote the row), and opens a ``PrefillEndpoint`` (registered with the prefill
instance's bootstrap server, ``KvxferKVBootstrapServer``) or a ``DecodeEndpoint``.

What SGLang's schedulers call on it, besides constructing it (``decode.py``, ``prefill.py``):
    decode   ``prefill_info_table`` / ``try_ensure_parallel_info(addr)`` (the prefill instance's DP
             size, read once from its registry), ``is_abort_release_safe(room, acks)`` and
             ``clear_deferred_abort_state(room)`` (deferred release of an aborted request's pages:
             safe once kvxfer released the grant: no write of it can land any more),
             ``enable_deferred_decode_kv_release``, ``supports_host_destination`` (False),
             ``kv_args``
    prefill  ``kv_args``, ``register_to_bootstrap()`` (done at construction)
    both     ``teardown()`` (role switch: not supported), ``close()`` (tests, shutdown)
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Any, NamedTuple

from sglang.srt.disaggregation.base.conn import BaseKVManager

from ...control.client import BootstrapClient
from ...endpoint import DecodeEndpoint, PrefillEndpoint
from ...errors import ConfigError, ConnectError
from ...ranks import RankSpec
from .config import BackendConfig, bootstrap_url, client_host, instance_name, rank_topology
from .pools import current_context, describe, metadata_rows

log = logging.getLogger("kvxfer.sglang")


class PrefillInfo(NamedTuple):
    """What decode's scheduler reads of a prefill instance (``prefill_info_table[addr]``)."""
    dp_size: int
    follow_bootstrap_room: bool = True


class KvxferKVManager(BaseKVManager):
    """See the module docstring. ``config``: kvxfer's settings (default: ``BackendConfig.from_env``)."""
    supports_deferred_decode_kv_release = True
    supports_host_destination = False
    supports_role_switch = False

    def __init__(self, args, disaggregation_mode, server_args, is_mla_backend: bool | None = False,
                 config: BackendConfig | None = None, **_backend_kwargs: Any):
        mode = getattr(disaggregation_mode, "value", disaggregation_mode)
        if mode not in ("prefill", "decode"):
            raise ConfigError(f"the kvxfer backend serves prefill or decode, not disaggregation mode {mode!r}")
        self.kv_args, self.server_args, self.is_mla_backend = args, server_args, bool(is_mla_backend)
        self.disaggregation_mode, self.role = disaggregation_mode, mode
        self.config = config or BackendConfig.from_env()
        self.enable_deferred_decode_kv_release = True
        self.topology = rank_topology(args, server_args)
        if mode == "decode" and self.topology.pp_size != 1:
            raise ConfigError("the kvxfer backend needs decode ranks that hold every layer (--pp-size 1 on decode)")
        ctx = current_context()
        self.description = describe(args, ctx, self.topology.tp_size, self.is_mla_backend)
        d = self.description
        kv = d.kv.pool(swa_map=d.swa_map, window=d.window) if d.swa_map is not None else d.kv.pool()
        state = d.state.pool() if d.state is not None else None
        self.kv_pool, self.state_pool = kv, state
        self.metadata = metadata_rows(args)
        layers = {p.layer for p in kv.layout.parts} | ({p.layer for p in state.layout.parts} if state else set())
        num_layers = (ctx.num_layers if ctx is not None and ctx.num_layers else None) or max(layers) + 1
        heads = 1 if self.is_mla_backend else int(getattr(args, "total_kv_head_num", None) or
                                                    (ctx.num_kv_heads if ctx is not None else None) or
                                                    max(p.heads for p in kv.layout.parts) * self.topology.tp_size)
        host = client_host(str(getattr(server_args, "host", "127.0.0.1")))
        self.bootstrap_port = int(getattr(server_args, "disaggregation_bootstrap_port", 8998))
        name_port = self.bootstrap_port if mode == "prefill" else int(getattr(server_args, "port", 0) or 0)
        t = self.topology
        self.spec = RankSpec(role=mode, num_kv_heads=heads, num_layers=num_layers,
                             instance=instance_name(mode[0], host, name_port), tp_size=t.tp_size, tp_rank=t.tp_rank,
                             pp_size=t.pp_size, pp_rank=t.pp_rank, dp_size=t.dp_size, dp_rank=t.dp_rank,
                             replicated=self.is_mla_backend)
        bind_host = str(getattr(server_args, "host", "127.0.0.1") or "127.0.0.1")
        options = {"endpoint": f"tcp://{bind_host}:0"} if self.config.transport == "zmq" else {}
        common: dict[str, Any] = dict(state=state, aux=self.metadata, transport=self.config.transport,
                                      transport_options=options, timeouts=self.config.timeouts,
                                      secret=self.config.secret,
                                      **({} if self.metadata is not None else {"aux_bytes": 0}))
        self.prefill_info_table: dict[str, PrefillInfo] = {}
        self._receivers: dict[int, Any] = {}     # decode: room -> its receiver until kvxfer released it
        self._lock = threading.Lock()
        self.endpoint: Any   # a PrefillEndpoint or a DecodeEndpoint, by the mode
        if mode == "prefill":
            self.endpoint = PrefillEndpoint(self.spec, kv, bind=f"tcp://{bind_host}:0", **common)
            self.register_to_bootstrap()
        else:
            self.endpoint = DecodeEndpoint(self.spec, kv, **common)

    # -- prefill ---------------------------------------------------------------------------
    def bootstrap_address(self) -> str:
        """``host:port`` of this prefill instance's bootstrap server (SGLang's rule: the
        ``--dist-init-addr`` host on several nodes, else the server's host)."""
        dist = getattr(self.server_args, "dist_init_addr", None)
        host = str(dist).rpartition(":")[0].strip("[]") if dist else client_host(str(self.server_args.host))
        return f"[{host}]:{self.bootstrap_port}" if ":" in host else f"{host}:{self.bootstrap_port}"

    def register_to_bootstrap(self) -> None:
        """Prefill: register with the instance's bootstrap server, retrying while it starts
        (``BackendConfig.register_timeout``); heartbeats keep the registration afterwards."""
        url = bootstrap_url(self.bootstrap_address())
        deadline = time.monotonic() + self.config.register_timeout
        while True:
            try:
                self.endpoint.register(url)
                return
            except ConnectError as e:
                if time.monotonic() > deadline:
                    raise ConnectError(f"prefill rank {self.spec.key} could not register at {url} within "
                                       f"{self.config.register_timeout}s: {e}") from None
                time.sleep(0.2)

    # -- decode ------------------------------------------------------------------------------
    def try_ensure_parallel_info(self, bootstrap_addr: str) -> bool:
        """Decode scheduler, per prefill address until True: read the instance's DP size from its
        registry once (at most 2 s); False while nothing is registered there."""
        if bootstrap_addr in self.prefill_info_table:
            return True
        try:
            ranks = BootstrapClient(bootstrap_url(bootstrap_addr), self.config.secret, timeout=2.0).topology()[1]
        except ConnectError as e:
            log.info("prefill at %s not reachable yet: %s", bootstrap_addr, e)
            return False
        ranks = [r for r in ranks if r.spec.role == "prefill"]
        if not ranks:
            return False
        self.prefill_info_table[bootstrap_addr] = PrefillInfo(dp_size=ranks[0].spec.dp_size)
        return True

    @property
    def tracking(self) -> int:
        """Decode: the receivers kvxfer has not released yet (bounded by the requests running)."""
        with self._lock:
            return len(self._receivers)

    def track(self, room: int, receiver) -> None:
        with self._lock:
            self._receivers[room] = receiver

    def forget(self, room: int, receiver) -> None:
        with self._lock:
            if self._receivers.get(room) is receiver:
                del self._receivers[room]

    def is_abort_release_safe(self, bootstrap_room: int, required_acks: int = 0) -> bool:
        """Decode scheduler, for a request held after a failure: True once no write of it can land
        (kvxfer released the grant); kvxfer's release needs no acknowledgement count."""
        with self._lock:
            r = self._receivers.get(bootstrap_room)
        return r is None or r.is_abort_release_safe()

    def clear_deferred_abort_state(self, bootstrap_room: int) -> None:
        with self._lock:
            self._receivers.pop(bootstrap_room, None)

    def submit_prefill_recompute(self, receiver, payload) -> None:
        """SGLang's PD retraction "rebootstrap" (prefill recomputes a retracted request's KV)."""
        raise NotImplementedError("the kvxfer backend does not support PD retraction rebootstrap (prefill "
                                  "recomputing a retracted request) yet: keep a decode-side backup with "
                                  "--disaggregation-decode-retraction-backup cpu_tensor or host_pool")

    # -- both ----------------------------------------------------------------------------------
    def teardown(self) -> None:
        raise NotImplementedError("the kvxfer backend does not support PD role switching")

    def close(self) -> None:
        """Close the endpoint (fails what runs, stops kvxfer's threads); the pools are SGLang's."""
        self.endpoint.close()


__all__ = ["KvxferKVManager", "PrefillInfo"]
