"""``KvxferKVBootstrapServer``: the registry of one SGLang prefill instance.

SGLang starts one bootstrap server per prefill instance (``start_disagg_service``, in the
server's main process) as ``Server(host=, port=)`` at ``--disaggregation-bootstrap-port``; the
prefill ranks register there and decode ranks find them there by the request's bootstrap
address. This one is kvxfer's ``BootstrapServer`` (HTTP + JSON, bounded, optionally signed with
``KVXFER_SECRET_FILE``'s secret), serving from a background thread until ``close()``.
"""
from __future__ import annotations

from sglang.srt.disaggregation.base.conn import BaseKVBootstrapServer

from ...control.bootstrap import BootstrapConfig, BootstrapServer
from .config import BackendConfig


class KvxferKVBootstrapServer(BaseKVBootstrapServer):
    """See the module docstring. ``url``: where ranks reach it."""

    def __init__(self, host: str, port: int, config: BackendConfig | None = None):
        cfg = config or BackendConfig.from_env()
        self.host, self.port = host, int(port)
        self.server = BootstrapServer(BootstrapConfig(host=host or "127.0.0.1", port=int(port),
                                                      secret=cfg.secret)).start()
        self.url = self.server.url

    def run(self) -> None:
        """Serving already (started in the constructor, as SGLang's own servers are)."""

    def close(self) -> None:
        self.server.stop()


__all__ = ["KvxferKVBootstrapServer"]
