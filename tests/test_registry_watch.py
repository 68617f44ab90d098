"""A decode endpoint's view of a registry (``RegistryWatch``) says how current it is: while the
registry does not answer, the view is current only as of the failed call, not as of now.

Why it matters (issue 35, the first request after a prefill restart): a vLLM prefill engine hosts
its instance's registry, so a restarted engine takes the registry down with it. The decode
endpoint's recovery handshakes the record its view holds and, when that fails, fails the requests
that waited since before the view's time. With the view claiming to be current while the watch
could not reach the registry, a request that came after the restart was failed by a handshake to
the old record (CI, ``test_vllm_e2e.py``'s restart case, 2 of 4 fresh-clone runs: "a new
handshake with <the old port> failed", 1.3 s after the new rank had registered).
"""
from __future__ import annotations

import time

import pytest
from waiting import until

from kvxfer.control.bootstrap import BootstrapConfig, BootstrapServer
from kvxfer.control.client import BootstrapClient
from kvxfer.control.watch import LAG, RegistryWatch


@pytest.mark.slow   # a registry stopped and restarted, a second of waiting (the full tier)
def test_a_view_is_current_only_while_the_registry_answers():
    server = BootstrapServer(BootstrapConfig()).start()
    port = server.port
    watch = RegistryWatch(BootstrapClient(server.url, timeout=2.0), lambda: None, wait=0.2)
    try:
        watch.follow({"prefill-instance"})
        assert until(lambda: watch.healthy, 10.0), "the watch never had an answer"
        _, as_of = watch.view()
        assert as_of > time.monotonic() - LAG - 1.0, "an answered watch is current"
        server.stop()
        down = time.monotonic()
        assert until(lambda: not watch.healthy, 10.0), "the watch did not see the registry go"
        time.sleep(1.0)
        _, as_of = watch.view()
        assert as_of <= down + 0.5, f"the view claims to be current {as_of - down:.1f}s after the registry went"
        server = BootstrapServer(BootstrapConfig(port=port)).start()
        assert until(lambda: watch.healthy, 15.0), "the watch did not come back with the registry"
        _, as_of = watch.view()
        assert as_of > time.monotonic() - LAG - 1.0, "current again once answered"
    finally:
        watch.stop()
        server.stop()
