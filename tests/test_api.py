"""The public surface: ``kvxfer.__all__`` is pinned, ``import kvxfer`` stays light, and
``kvxfer compat`` computes its table from the code (and can say no)."""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest

import kvxfer
from kvxfer.cli import compat
from kvxfer.errors import KVXferError, LayoutError, PlanError

PUBLIC = [
    # errors
    "KVXferError", "LayoutError", "PlanError", "CompatibilityError", "TransportError", "ConnectError",
    "TransferTimeout", "PeerError", "RejectedWrite", "RequestError", "ConfigError", "ProtocolError",
    # layouts
    "Layout", "Part", "Region", "Space", "token_major_layout", "hnd_layout", "page_major_layout",
    "mla_layout", "state_layout", "hybrid_swa_layout", "host_layout",
    # planning
    "HeadSlice", "WHOLE", "Planner", "plan_transfer", "TransferPlan", "ByteRanges", "execute_plan",
    # pools
    "KVPool", "MHAPool", "MLAPool", "StatePool", "HybridSWAPool", "PageAllocator", "EnginePool", "RawMemory",
    # transports
    "Transport", "TransferHandle", "Arrival", "get_transport", "available_transports",
    # control plane and offload, loaded lazily
    "heads_held", "sources_for_decode_rank", "targets_for_prefill_rank",
    "RankSpec", "RankInfo", "BootstrapConfig", "BootstrapServer", "BootstrapClient",
    "KVPoll", "Timeouts", "AuxRecord", "AuxBuffer", "AuxRows",
    "PrefillEndpoint", "DecodeEndpoint", "KVSender", "KVReceiver", "reduce_poll", "Outcome", "LocalGroup",
    "HostPool", "DecodeOffloadManager",
]


def test_all_is_pinned() -> None:
    """Adding or removing a public name is a decision: update this list with it."""
    assert kvxfer.__all__ == PUBLIC
    for name in PUBLIC:
        value = getattr(kvxfer, name)
        # Each name is kvxfer's own object of that name (a class or function defined in kvxfer,
        # or an instance of a kvxfer class), not a stand-in or a re-exported foreign object.
        if isinstance(value, type) or callable(value) and hasattr(value, "__qualname__"):
            assert value.__name__ == name and value.__module__.startswith("kvxfer."), (name, value)
        else:
            assert type(value).__module__.startswith("kvxfer."), (name, value)


def test_errors_for_bad_input_are_value_errors() -> None:
    assert issubclass(LayoutError, ValueError) and issubclass(LayoutError, KVXferError)
    assert issubclass(PlanError, ValueError) and issubclass(PlanError, KVXferError)


def test_a_transport_class_is_found_once_and_an_unknown_name_every_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """Reading the entry points scans every installed distribution (tens of ms), once per endpoint
    before: a transport's class is now kept by name; a name not installed is looked for each time
    (a transport installed since is found), and still fails by name."""
    from kvxfer.errors import ConnectError
    from kvxfer.transport import registry
    scans = []
    real = registry.entry_points
    monkeypatch.setattr(registry, "entry_points", lambda **kw: scans.append(kw) or real(**kw))
    for _ in range(3):
        registry.get_transport("local").close()
    assert len(scans) <= 1
    scans.clear()
    for _ in range(2):
        with pytest.raises(ConnectError, match="unknown transport 'no-such'; installed: .*local"):
            registry.get_transport("no-such")
    assert len(scans) == 2


@pytest.mark.slow   # a subprocess
def test_import_kvxfer_loads_no_transport() -> None:
    """In a fresh interpreter (this one may have loaded transports for other tests)."""
    code = ("import sys, json, kvxfer\n"
            "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in ('ucxx', 'zmq', 'transports'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []


# ------------------------------------------------------------------------------------
# kvxfer compat
# ------------------------------------------------------------------------------------
OFFLOAD_IMPORTS = importlib.util.find_spec("kvxfer.offload") is not None


@pytest.fixture(scope="module")
def table() -> dict[str, dict[str, str]]:
    return compat.compute_table()


def test_compat_table_shape(table: dict[str, dict[str, str]]) -> None:
    assert list(table) == ["MHA token_major", "MHA hnd", "MHA page_major", "MLA", "state", "hybrid SWA",
                           "host layer_first", "host page_first"]
    assert all(list(cells) == ["transfer", "CPU copy", "prefix-valid write", "head slicing", "offload"]
               for cells in table.values())


def test_every_compat_cell_is_yes(table: dict[str, dict[str, str]]) -> None:
    columns = compat.COLUMNS if OFFLOAD_IMPORTS else tuple(c for c in compat.COLUMNS if c != "offload")
    bad = {(r, c): table[r][c] for r in table for c in columns if table[r][c] != "yes"}
    assert not bad, bad
    if not OFFLOAD_IMPORTS:
        assert all(cells["offload"] == compat.OFFLOAD_MISSING for cells in table.values())


def test_compat_cli(capsys: pytest.CaptureFixture) -> None:
    from kvxfer.cli import main
    assert main(["compat", "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert set(printed) == {r.name for r in compat.ROWS}


def test_compat_reports_wrong_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    """The cells are real checks: a transfer that moves nothing, a host reload that also
    scribbles one byte elsewhere, a prefix write that ignores commit lengths and a missing
    offload module all print "no"."""
    row = compat.ROWS[2]  # MHA page_major
    monkeypatch.setattr(compat, "execute_plan", lambda plan, src, dst: None)
    assert compat.cell(row, "transfer").startswith("no (part ")
    monkeypatch.undo()

    real_load = kvxfer.KVPool.load_cpu_copy

    def load_and_scribble(self, copy, slots):
        real_load(self, copy, slots)
        self.buffers[0][0] ^= 0xFF  # in the padding page: never one of the request's cells
    monkeypatch.setattr(kvxfer.KVPool, "load_cpu_copy", load_and_scribble)
    assert compat.cell(row, "CPU copy") == "no (1 bytes outside the request changed in region pages)"
    monkeypatch.undo()

    real_prefix = kvxfer.KVPool.set_kv_buffer_prefix_valid

    def ignore_commit_lens(self, layer, slots_2d, commit_lens, *tensors, **extra):
        every_column = [len(row) for row in slots_2d]
        real_prefix(self, layer, slots_2d, every_column, *tensors, **extra)
    monkeypatch.setattr(kvxfer.KVPool, "set_kv_buffer_prefix_valid", ignore_commit_lens)
    assert "outside the request changed" in compat.cell(row, "prefix-valid write")
    monkeypatch.undo()

    monkeypatch.setitem(sys.modules, "kvxfer.offload", None)  # makes the import fail
    assert compat.cell(row, "offload") == compat.OFFLOAD_MISSING


def test_compat_head_slicing_catches_a_wrong_slice(monkeypatch: pytest.MonkeyPatch) -> None:
    """Sending the wrong half of the heads (the classic GQA mapping bug) is a "no"."""
    from kvxfer.plan import HeadSlice
    real = compat.plan_transfer

    def wrong_half(*args, src_heads=HeadSlice(), dst_heads=HeadSlice(), **kw):
        if src_heads.count == 2:
            src_heads = HeadSlice(1 - src_heads.index, 2)
        return real(*args, src_heads=src_heads, dst_heads=dst_heads, **kw)
    monkeypatch.setattr(compat, "plan_transfer", wrong_half)
    assert compat.cell(compat.ROWS[0], "head slicing").startswith("no (part ")
    assert compat.cell(compat.ROWS[3], "head slicing") == "yes"  # MLA is replicated, never sliced
