"""The UCX transport's options as data (issue 32): one frozen ``UCXOptions``, checked in one place.

A bad value or an unknown key is a ``ConfigError`` (a ValueError of kvxfer's tree) that names the
option, the value and what is allowed, raised before any UCX object or thread exists; UCX's own
refusal of a setting is mapped into the tree where the transport starts."""
from __future__ import annotations

import dataclasses
import threading

import pytest

pytest.importorskip("ucxx")

from kvxfer.errors import ConfigError, KVXferError  # noqa: E402
from kvxfer.transport.registry import get_transport  # noqa: E402
from kvxfer_transports.ucx import UCXOptions, UCXTransport  # noqa: E402

BAD = [
    ({"nonsense": 1}, ["unknown ucx option", "'nonsense'", "frame_bytes"]),   # names the key and the known ones
    ({"frame_bytes": 1024}, ["frame_bytes=1024", "4096..2**32-1"]),
    ({"frame_bytes": 1 << 32}, ["frame_bytes=4294967296"]),
    ({"frame_bytes": 4096.0}, ["frame_bytes=4096.0", "give int, not float"]),
    ({"staging_frames": 0}, ["staging_frames=0", "1..4096"]),
    ({"staging_frames": True}, ["staging_frames=True", "not bool"]),
    ({"stage_host": "sometimes"}, ["stage_host='sometimes'", "network, always, never"]),
    ({"admission": "yes"}, ["admission='yes'", "bool or None"]),
    ({"eager_writes": 1}, ["eager_writes=1", "give bool"]),
    ({"heartbeat": 5.0, "peer_timeout": 1.0}, ["heartbeat=5.0", "peer_timeout=1.0", "below the peer timeout"]),
    ({"heartbeat": 0}, ["heartbeat=0", "above 0"]),
    ({"connect_timeout": 0}, ["connect_timeout=0", "(0, 600]"]),
    ({"max_peers": 0}, ["max_peers=0", "at least 1"]),
    ({"max_incoming_per_peer": -1}, ["max_incoming_per_peer=-1", "at least 1"]),
    ({"max_control_bytes": 100}, ["max_control_bytes=100", "at least 4096"]),
    ({"put_below": -1}, ["put_below=-1", "at least 0"]),
    ({"few_runs": "many"}, ["few_runs='many'", "give int"]),
    ({"fence_grace": -0.5}, ["fence_grace=-0.5", "at least 0"]),
    ({"quarantine_timeout": 0}, ["quarantine_timeout=0", "None or above 0"]),
    ({"tls": 5}, ["tls=5", "str or None"]),
    ({"pregrant_window_bytes": -1}, ["pregrant_window_bytes=-1", "at least 0"]),
    ({"pregrant_window_requests": 2.5}, ["pregrant_window_requests=2.5", "give int"]),
    ({"ucx_config": {"RNDV_THRESH": 8192}}, ["ucx_config=", "string values"]),
    ({"tcp_rto_max": 0.5}, ["tcp_rto_max=0.5", "None or in [1, 120] seconds"]),
    ({"tcp_rto_max": 121}, ["tcp_rto_max=121", "None or in [1, 120] seconds"]),
    ({"tcp_rto_max": "2"}, ["tcp_rto_max='2'", "give int or float or None"]),
]


@pytest.mark.parametrize("bad, words", BAD, ids=[",".join(f"{k}={v!r}" for k, v in bad.items()) for bad, _ in BAD])
def test_a_bad_option_is_a_config_error_naming_it_before_anything_starts(bad, words):
    def io_threads() -> set:
        return {th for th in threading.enumerate() if th.name.startswith("kvxfer-ucx")}
    before = io_threads()
    with pytest.raises(ConfigError) as e:
        get_transport("ucx", **bad)
    for w in words:
        assert w in str(e.value), (w, str(e.value))
    assert isinstance(e.value, KVXferError) and isinstance(e.value, ValueError)
    assert not io_threads() - before, "an I/O thread was started for options that were refused"


def test_options_are_one_frozen_value_given_either_way():
    opts = UCXOptions(frame_bytes=1 << 20, heartbeat=0.2, peer_timeout=2, ucx_config={"RNDV_THRESH": "8192"})
    assert UCXOptions.of({"frame_bytes": 1 << 20, "heartbeat": 0.2, "peer_timeout": 2,
                          "ucx_config": {"RNDV_THRESH": "8192"}}) == opts
    with pytest.raises(dataclasses.FrozenInstanceError):
        opts.frame_bytes = 4096   # type: ignore[misc]
    given = {"RNDV_THRESH": "4096"}
    kept = UCXOptions(ucx_config=given)
    given["RNDV_THRESH"] = "1"
    assert kept.ucx_config == {"RNDV_THRESH": "4096"}, "the options share a mapping the caller still changes"
    with pytest.raises(ConfigError, match="not both"):
        UCXTransport(opts, frame_bytes=4096)
    t = UCXTransport(options=opts)
    try:
        assert t.options is opts and t.options.stage_host == "network" and t.options.admission is None
    finally:
        t.close()


def test_every_option_is_documented():
    """Each field carries a docstring in ``options.py`` (read from the source: the one place the
    options are described)."""
    import ast
    import inspect

    from kvxfer_transports.ucx import options
    tree = ast.parse(inspect.getsource(options))
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "UCXOptions")
    documented = {a.target.id for a, doc in zip(cls.body, cls.body[1:])
                  if isinstance(a, ast.AnnAssign) and isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant)}
    assert documented == {f.name for f in dataclasses.fields(UCXOptions)}
