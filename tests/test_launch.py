"""The demos' launcher (``kvxfer.cli.launch``): the rendezvous its rank processes meet in is
held by the launcher from before they start, so no other process can take its port between
picking it and rank 0 binding it (a free port picked and closed early lost that race once, in
a full suite run: EADDRINUSE in torch's store)."""
from __future__ import annotations

import errno
import gc
import socket
from datetime import timedelta

import pytest
import torch.distributed as dist

from kvxfer.cli.launch import rendezvous


def _bind(port: int) -> None:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)   # past TIME_WAIT, never past a listener
        s.bind(("127.0.0.1", port))


def test_rendezvous_holds_its_port_until_dropped():
    store = rendezvous()
    port = store.port
    with pytest.raises(OSError) as e:
        _bind(port)                      # no one else can take it while the ranks start
    assert e.value.errno == errno.EADDRINUSE
    client = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))
    dist.PrefixStore("prefill", client).set("k", "p")
    dist.PrefixStore("decode", client).set("k", "d")
    assert store.get("prefill/k") == b"p" and store.get("decode/k") == b"d"   # two groups, one store
    del client, store
    gc.collect()
    _bind(port)                          # dropped (stop_ranks): the port is free again
