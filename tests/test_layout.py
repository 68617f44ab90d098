"""Layouts as data: every constructor tiles its regions exactly, round-trips as plain
data, and refuses bad descriptions with a LayoutError that names the field and values."""
from __future__ import annotations

import json

import numpy as np
import pytest

from kvxfer.errors import LayoutError
from kvxfer.layout import (
    DTYPE_SIZES,
    Layout,
    Part,
    Region,
    Space,
    hnd_layout,
    host_layout,
    hybrid_swa_layout,
    mla_layout,
    page_major_layout,
    state_layout,
    token_major_layout,
)

MHA = dict(layers=[0, 2, 5], heads=3, head_dim=8, v_head_dim=4, dtype="bfloat16")


def all_layouts() -> dict[str, Layout]:
    """One small instance of every layout the constructors build (page size 4)."""
    tm = token_major_layout(num_slots=24, page_size=4, **MHA)
    out = {
        "token_major": tm,
        "token_major_fp8_scales": token_major_layout(num_slots=24, page_size=4, scale_block=4,
                                                     **{**MHA, "dtype": "fp8_e4m3"}),
        "hnd": hnd_layout(num_pages=6, page_size=4, **MHA),
        "page_major": page_major_layout(num_pages=6, page_size=4, **MHA),
        "page_major_fp8_scales": page_major_layout(num_pages=6, page_size=4, scale_block=2,
                                                   **{**MHA, "dtype": "fp8_e4m3"}),
        "mla": mla_layout(layers=3, kv_lora_rank=16, rope_dim=4, dtype="bfloat16", num_slots=32, page_size=8),
        "state": state_layout(layers=[1, 3], conv_blocks=[4, 2, 2], conv_width=3, temporal_heads=2,
                              temporal_head_shape=[2, 3], num_slots=5),
        "hybrid_swa": hybrid_swa_layout(token_major_layout(layers=[0, 2], heads=2, head_dim=4, dtype="float16",
                                                           num_slots=32, page_size=4),
                                        page_major_layout(layers=[1, 3], heads=2, head_dim=4, dtype="float16",
                                                          num_pages=3, page_size=4)),
    }
    for style in ("layer_first", "page_first"):
        out[f"host_{style}"] = host_layout(tm, style, 40)
        out[f"host_{style}_hybrid"] = host_layout(out["hybrid_swa"], style, {"token": 16, "swa": 8})
    return out


LAYOUTS = all_layouts()


def cell_owners(lay: Layout) -> list[np.ndarray]:
    """Per region, how many (part, slot, head) cells claim each byte, walking every cell."""
    owners = [np.zeros(r.nbytes, np.int64) for r in lay.regions]
    for p in lay.parts:
        sp = lay.space(p.space)
        for s in range(sp.num_slots):
            for h in range(p.heads):
                o = p.base + (s // sp.page_size) * p.page_stride + (s % sp.page_size) * p.token_stride \
                    + h * p.head_stride
                owners[p.region][o: o + p.head_bytes] += 1
    return owners


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_every_byte_belongs_to_exactly_one_cell(name: str) -> None:
    """No two cells overlap (a write to one slot never lands in another) and no region
    has bytes nothing addresses (a region is exactly as big as its parts)."""
    lay = LAYOUTS[name]
    for region, owners in zip(lay.regions, cell_owners(lay)):
        assert owners.max() == 1, f"{name}: cells overlap in region {region.name}"
        assert owners.min() == 1, f"{name}: region {region.name} has {int((owners == 0).sum())} unaddressed bytes"


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_plain_data_round_trip(name: str) -> None:
    lay = LAYOUTS[name]
    again = Layout.from_dict(json.loads(json.dumps(lay.to_dict())))
    assert again == lay and again.signature == lay.signature
    assert [again.part(*p.key) for p in lay.parts] == list(lay.parts)


def test_to_dict_is_plain_fresh_data_of_every_field() -> None:
    """``to_dict`` reads each field (not ``dataclasses.asdict``): every field of every item, and a
    new dict each call, so a caller that changes it changes nothing else."""
    import dataclasses
    lay = LAYOUTS["page_major_fp8_scales"]
    d = lay.to_dict()
    assert d == {"kind": lay.kind, "spaces": [dataclasses.asdict(s) for s in lay.spaces],
                 "regions": [dataclasses.asdict(r) for r in lay.regions],
                 "parts": [dataclasses.asdict(p) for p in lay.parts]}
    d["parts"][0]["heads"] = 99
    d["spaces"].clear()
    assert lay.to_dict()["parts"][0]["heads"] == lay.parts[0].heads and lay.to_dict()["spaces"]


def test_a_description_read_before_gives_back_the_same_layout() -> None:
    """``from_dict`` keeps what it parsed by the description's exact bytes: an equal description
    (a HELLO's, a registry record's) gives the same frozen object without parsing again; one that
    differs anywhere, even only in a value's type, is parsed on its own, and a refused one is
    refused every time (failures are not kept)."""
    lay = LAYOUTS["hnd"]
    d = json.loads(json.dumps(lay.to_dict()))
    first = Layout.from_dict(d)
    assert first == lay and Layout.from_dict(json.loads(json.dumps(lay.to_dict()))) is first
    changed = json.loads(json.dumps(lay.to_dict()))
    changed["parts"][-1]["base"] += 0   # the same: still the same object
    assert Layout.from_dict(changed) is first
    changed["regions"][0]["nbytes"] += 64
    other = Layout.from_dict(changed)
    assert other is not first and other.regions[0].nbytes == lay.regions[0].nbytes + 64
    typed = json.loads(json.dumps(lay.to_dict()))
    typed["parts"][0]["heads"] = True   # a bool is not the int 1: never the cached layout of heads=1
    one = json.loads(json.dumps(lay.to_dict()))
    one["parts"][0]["heads"] = 1
    assert Layout.from_dict(typed) is not Layout.from_dict(one)
    bad = json.loads(json.dumps(lay.to_dict()))
    bad["parts"][0]["base"] = lay.regions[0].nbytes   # reaches past its region
    for _ in range(2):
        with pytest.raises(LayoutError, match="reaches byte"):
            Layout.from_dict(bad)
    odd = {"kind": lay.kind, "spaces": [{1: 2}], "regions": [], "parts": []}   # a key that is no name
    with pytest.raises(LayoutError, match="not a layout description"):
        Layout.from_dict(odd)
    huge = json.loads(json.dumps(lay.to_dict()))
    huge["regions"][0]["nbytes"] = 1 << 70   # no msgpack key: parsed as it is, and still checked
    assert Layout.from_dict(huge).regions[0].nbytes == 1 << 70


def test_signature_changes_with_any_field() -> None:
    a = token_major_layout(num_slots=24, page_size=4, **MHA)
    sigs = {a.signature}
    for change in (dict(num_slots=28), dict(page_size=2), dict(heads=6), dict(head_dim=16), dict(dtype="float16"),
                   dict(v_head_dim=8), dict(layers=[0, 2, 6])):
        sigs.add(token_major_layout(**{**dict(num_slots=24, page_size=4, **MHA), **change}).signature)
    assert len(sigs) == 8


def test_shapes_match_the_documented_layouts() -> None:
    """Spot-check strides against the shapes written in the constructors' docstrings."""
    hb = 8 * 2
    tm = token_major_layout(num_slots=24, page_size=4, **MHA).part(2, "k")
    assert (tm.token_stride, tm.head_stride, tm.page_stride) == (3 * hb, hb, 4 * 3 * hb)   # [slots, heads, dim]
    hnd = hnd_layout(num_pages=6, page_size=4, **MHA).part(2, "k")
    assert (hnd.token_stride, hnd.head_stride, hnd.page_stride) == (hb, 4 * hb, 3 * 4 * hb)  # [pages, heads, ps, dim]
    pm = page_major_layout(num_pages=6, page_size=4, **MHA)
    k_block, v_block = 4 * 3 * hb, 4 * 3 * 4 * 2
    assert pm.part(0, "v").base == k_block and pm.part(2, "k").base == k_block + v_block
    assert pm.part(5, "v").page_stride == 3 * (k_block + v_block)
    st = LAYOUTS["state"]
    c1 = st.part(3, "conv1")   # channels 4..5 of layer index 1: [layers, slots, 8 channels, width 3]
    assert (c1.heads, c1.head_bytes, c1.base) == (2, 3 * 2, 1 * 5 * 8 * 3 * 2 + 4 * 3 * 2)
    assert st.part(1, "temporal").head_bytes == 6 * 4 and st.part(1, "temporal").dtype == "float32"


def test_host_layout_mirrors_every_device_part() -> None:
    dev = LAYOUTS["hybrid_swa"]
    for style in ("layer_first", "page_first"):
        host = LAYOUTS[f"host_{style}_hybrid"]
        assert {p.key for p in host.parts} == {p.key for p in dev.parts}
        for p in dev.parts:
            h = host.part(*p.key)
            assert (h.heads, h.head_bytes, h.dtype, h.space) == (p.heads, p.head_bytes, p.dtype, p.space)
        assert [s.page_size for s in host.spaces] == [s.page_size for s in dev.spaces]
        assert [s.num_slots for s in host.spaces] == [16, 8]


def test_check_slots_names_the_first_bad_value() -> None:
    lay = token_major_layout(num_slots=24, page_size=4, **MHA)
    assert lay.check_slots("token", [4, 23]).dtype == np.int64
    for slots, words in (([4, 24], ["[1] = 24", "out of range", "4..23"]), ([5, 3], ["[1] = 3", "padding page"]),
                         ([[4, 5]], ["1-D", "(1, 2)"]), ([4.5], ["integers"])):
        with pytest.raises(LayoutError) as e:
            lay.check_slots("token", slots)
        assert all(w in str(e.value) for w in words), str(e.value)
    with pytest.raises(LayoutError, match="no space 'swa'"):
        lay.check_slots("swa", [4])


@pytest.mark.parametrize("num_slots", [24, 4096])   # few slots of a big space (sort) and many (count)
def test_check_slots_refuses_a_slot_named_twice(num_slots: int) -> None:
    lay = token_major_layout(num_slots=num_slots, page_size=4, **MHA)
    assert list(lay.check_slots("token", [4, 9, 5], distinct=True)) == [4, 9, 5]
    assert list(lay.check_slots("token", [4, 4])) == [4, 4]        # only asked for where it matters
    for slots, first in (([4, 9, 5, 9], "[3] = 9"), ([7, 7, 8, 8], "[1] = 7")):
        with pytest.raises(LayoutError, match="named twice") as e:
            lay.check_slots("token", slots, distinct=True)
        assert first in str(e.value), str(e.value)


@pytest.mark.parametrize("build, words", [
    (lambda: token_major_layout(num_slots=100, page_size=16, **MHA), ["num_slots 100", "page_size 16"]),
    (lambda: token_major_layout(num_slots=16, page_size=16, **MHA), ["num_slots 16", "padding page"]),
    (lambda: hnd_layout(num_pages=4, page_size=0, **MHA), ["page_size must be >= 1", "got 0"]),
    (lambda: token_major_layout(num_slots=24, page_size=4, **{**MHA, "dtype": "int4"}), ["'int4'", "float32"]),
    (lambda: token_major_layout(num_slots=24, page_size=4, scale_block=3, **{**MHA, "dtype": "fp8_e4m3"}),
     ["head dim 8", "scale_block 3"]),
    (lambda: token_major_layout(num_slots=24, page_size=4, **{**MHA, "layers": [1, 1]}), ["duplicates", "[1, 1]"]),
    (lambda: hybrid_swa_layout(token_major_layout(num_slots=24, page_size=4, **MHA),
                               token_major_layout(num_slots=24, page_size=4, **{**MHA, "layers": [2, 3]})),
     ["overlap", "[2]"]),
    (lambda: host_layout(LAYOUTS["token_major"], "page_last", 40), ["'page_last'", "layer_first"]),
    (lambda: host_layout(LAYOUTS["hybrid_swa"], "layer_first", {"token": 16}), ["num_slots", "'swa'"]),
    (lambda: host_layout(LAYOUTS["token_major"], "page_first", 42), ["num_slots 42", "page_size 4"]),
])
def test_bad_descriptions_raise_layout_error(build, words) -> None:
    with pytest.raises(LayoutError) as e:
        build()
    assert isinstance(e.value, ValueError)
    assert all(w in str(e.value) for w in words), str(e.value)


def _part(**kw) -> Part:
    base = dict(layer=0, kind="k", space="token", region=0, base=0, page_stride=64, token_stride=16, heads=2,
                head_stride=8, head_bytes=8, dtype="float32")
    return Part(**{**base, **kw})


def test_hand_written_layouts_are_checked() -> None:
    sp = Space(name="token", num_slots=16, page_size=4)
    ok = Layout(kind="custom", spaces=(sp,), regions=(Region(name="r", nbytes=256),), parts=(_part(),))
    assert ok.part(0, "k").head_dim == 2
    with pytest.raises(LayoutError, match=r"reaches byte 264 but region 'r' has 256"):
        Layout(kind="custom", spaces=(sp,), regions=(Region(name="r", nbytes=256),), parts=(_part(base=8),))
    with pytest.raises(LayoutError, match="appears twice"):
        Layout(kind="custom", spaces=(sp,), regions=(Region(name="r", nbytes=256),), parts=(_part(), _part()))
    with pytest.raises(LayoutError, match="space 'swa' is not one of"):
        Layout(kind="custom", spaces=(sp,), regions=(Region(name="r", nbytes=256),), parts=(_part(space="swa"),))
    with pytest.raises(LayoutError, match="region 1 outside 0..0"):
        Layout(kind="custom", spaces=(sp,), regions=(Region(name="r", nbytes=256),), parts=(_part(region=1),))
    with pytest.raises(LayoutError, match="head_stride must be >= 0, got -8"):
        _part(head_stride=-8)
    with pytest.raises(LayoutError, match="no part"):
        ok.part(1, "k")
    with pytest.raises(LayoutError, match="not a layout description"):
        Layout.from_dict({"kind": "x", "spaces": []})


def test_dtype_sizes_match_torch() -> None:
    """The byte sizes kvxfer plans with are the element sizes of the tensors pools hold."""
    import torch

    from kvxfer.pools import torch_dtype
    for name, size in DTYPE_SIZES.items():
        assert torch.empty(0, dtype=torch_dtype(name)).element_size() == size, name


def test_fp8_formats_are_distinct_in_layouts_and_plans() -> None:
    """e4m3 and e5m2 are one byte each but different numbers: two layouts that differ only in
    the format have different signatures and a plan between them is refused."""
    import torch

    from kvxfer.errors import PlanError
    from kvxfer.plan import plan_transfer
    from kvxfer.pools import torch_dtype
    a, b = (token_major_layout(layers=1, heads=2, head_dim=8, dtype=d, num_slots=32, page_size=4)
            for d in ("fp8_e4m3", "fp8_e5m2"))
    assert a.signature != b.signature
    assert torch_dtype("fp8_e4m3") == torch.float8_e4m3fn and torch_dtype("fp8_e5m2") == torch.float8_e5m2
    with pytest.raises(PlanError, match="dtype src fp8_e4m3 vs dst fp8_e5m2"):
        plan_transfer(a, np.arange(4, 8), b, np.arange(4, 8))
