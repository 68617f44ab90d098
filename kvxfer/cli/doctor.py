"""``kvxfer doctor``: what this machine gives kvxfer, and what it lacks.

Prints torch and CUDA versions and the devices; the UCX library in use (the ``libucx``
wheel that the ``ucx`` extra installs, or a system UCX), its version and build flags, its
memory domains with their memory types (host, cuda, ...) and its transports with their
devices (shared memory, cma, cuda_copy, cuda_ipc, tcp, RDMA verbs); whether RDMA (verbs,
rdmacm) is present; how to switch to a system UCX; and TCP's retransmission limit (how long
memory held for a partitioned cross-host peer may stay held after the link returns). UCX is
queried with its own ``ucx_info`` tool, so neither ucxx nor a GPU is needed.

    kvxfer doctor           the report
    kvxfer doctor --json    the same as JSON

Exit status 0 (a report, even when parts are missing).

Who calls it: a user, before the first cross-host run (the UCX wheel has no RDMA modules:
across hosts it falls back to TCP) and when filing a bug.
"""
from __future__ import annotations

import argparse
import ctypes.util
import importlib.util
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

PREFER_SYSTEM = "RAPIDS_LIBUCX_PREFER_SYSTEM_LIBRARY"
RDMA_TRANSPORTS = ("rc_verbs", "rc_mlx5", "ud_verbs", "ud_mlx5", "dc_mlx5", "rc", "ud", "dc")
SYSTEM_UCX_HINT = (f"to use a system UCX with RDMA (built --with-verbs --with-rdmacm, e.g. from MLNX_OFED or "
                   f"DOCA): put its lib/ on LD_LIBRARY_PATH and export {PREFER_SYSTEM}=true, then rerun "
                   f"`kvxfer doctor` and look for rc_mlx5 / rc_verbs below")

# ------------------------------------------------------------------------------------
# torch and CUDA
# ------------------------------------------------------------------------------------
def torch_report() -> dict:
    import torch
    devices: list[dict] = []
    out = {"torch": torch.__version__, "cuda_build": torch.version.cuda, "cuda_available": torch.cuda.is_available(),
           "devices": devices}
    if out["cuda_available"]:
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            devices.append({"index": i, "name": p.name, "capability": f"{p.major}.{p.minor}",
                                   "memory_gib": round(p.total_memory / 2**30, 1)})
        out["driver"] = _driver_version()
    return out


def _driver_version() -> str | None:
    try:
        import torch
        v = torch.cuda.driver_version() if hasattr(torch.cuda, "driver_version") else None
        return str(v) if v else None
    except Exception:
        return None


# ------------------------------------------------------------------------------------
# UCX
# ------------------------------------------------------------------------------------
def find_ucx_info() -> tuple[list[str], dict, str] | None:
    """(command, environment, source) to run ``ucx_info`` of the UCX that kvxfer would load:
    the system one when ``RAPIDS_LIBUCX_PREFER_SYSTEM_LIBRARY`` is true (as libucx does),
    else the wheel's; None when there is none."""
    env = dict(os.environ)
    system = shutil.which("ucx_info")
    prefer_system = os.environ.get(PREFER_SYSTEM, "false").lower() != "false"
    if prefer_system and system:
        return [system], env, "system"
    spec = importlib.util.find_spec("libucx")
    if spec is not None and spec.origin:
        root = Path(spec.origin).parent
        tool = root / "bin" / "ucx_info"
        if tool.exists():
            env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (str(root / "lib"), env.get("LD_LIBRARY_PATH")) if p)
            return [str(tool)], env, f"libucx wheel ({root})"
    if system:
        return [system], env, "system"
    return None


def parse_ucx_info(version_text: str, devices_text: str) -> dict:
    """``ucx_info -v`` and ``ucx_info -d`` as data: version, build flags, memory domains
    (with memory types) and transports (with devices)."""
    version = re.search(r"Library version:\s*(\S+)", version_text)
    path = re.search(r"Library path:\s*(\S+)", version_text)
    configured = re.search(r"Configured with:\s*(.*)", version_text)
    domains: dict[str, list[str]] = {}
    transports: dict[str, list[str]] = {}
    md = transport = None
    for line in devices_text.splitlines():
        line = line.strip().lstrip("#").strip()
        if line.startswith("Memory domain:"):
            md = line.split(":", 1)[1].strip()
            domains.setdefault(md, [])
        elif line.startswith("memory types:") and md is not None:
            domains[md] = [m.split("(")[0].strip() for m in re.findall(r"\w+ \([^)]*\)|\w+", line.split(":", 1)[1])
                           if m.strip()]
        elif line.startswith("Transport:"):
            transport = line.split(":", 1)[1].strip()
            transports.setdefault(transport, [])
        elif line.startswith("Device:") and transport is not None:
            dev = line.split(":", 1)[1].strip()
            if dev not in transports[transport]:
                transports[transport].append(dev)
    flags = configured.group(1) if configured else ""
    return {"version": version.group(1) if version else None, "library": path.group(1) if path else None,
            "configured": flags, "memory_domains": domains, "transports": transports,
            "built_without": sorted(set(re.findall(r"--without-(\w+)", flags)))}


def ucx_report(timeout: float = 60.0) -> dict:
    found = find_ucx_info()
    if found is None:
        return {"found": False, "why": "no UCX: install the ucx extra (pip install 'kvxfer[ucx]') or a system UCX"}
    cmd, env, source = found
    try:
        v = subprocess.run(cmd + ["-v"], env=env, capture_output=True, text=True, timeout=timeout)
        d = subprocess.run(cmd + ["-d"], env=env, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as e:
        return {"found": False, "source": source, "why": f"{cmd[0]} failed: {e}"}
    out = {"found": True, "source": source, "tool": cmd[0], **parse_ucx_info(v.stdout, d.stdout)}
    out["modules"] = ucx_modules(out["library"])
    out["ucxx"] = _installed("ucxx")
    return out


def _installed(name: str) -> bool:
    """Whether ``name`` can be imported, without importing it (ucxx starts UCX on import)."""
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):   # blocked (sys.modules[name] = None) or broken
        return False


def ucx_modules(library: str | None) -> list[str]:
    """Transport modules installed beside the library (``lib/ucx/libuct_*.so``): a module is
    listed by ``ucx_info -d`` only when it loads (cuda needs a driver, ib needs verbs)."""
    if not library:
        return []
    mods = Path(library).resolve().parent / "ucx"
    return sorted(p.name[len("libuct_"):-3] for p in mods.glob("libuct_*.so")) if mods.is_dir() else []


def rdma_report(ucx: dict) -> dict:
    """RDMA as UCX sees it (verbs transports) and as the machine has it (devices, libraries)."""
    ib = Path("/sys/class/infiniband")
    devices = sorted(p.name for p in ib.iterdir()) if ib.is_dir() else []
    ucx_rdma = sorted(t for t in ucx.get("transports", {}) if t in RDMA_TRANSPORTS)
    return {"ucx_transports": ucx_rdma, "ucx_built_without": [w for w in ucx.get("built_without", [])
                                                              if w in ("verbs", "rdmacm", "mlx5")],
            "devices": devices, "libibverbs": ctypes.util.find_library("ibverbs"),
            "librdmacm": ctypes.util.find_library("rdmacm")}


def tcp_report(root: Path = Path("/proc/sys/net/ipv4")) -> dict:
    """The kernel's TCP retransmission limits in this network namespace (None: not in this kernel)."""
    def read(name: str) -> int | None:
        try:
            return int((root / name).read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None
    return {"rto_max_ms": read("tcp_rto_max_ms"), "retries2": read("tcp_retries2")}


def gather() -> dict:
    ucx = ucx_report()
    return {"torch": torch_report(), "ucx": ucx, "rdma": rdma_report(ucx), "tcp": tcp_report(),
            "prefer_system_ucx": os.environ.get(PREFER_SYSTEM, "false")}


# ------------------------------------------------------------------------------------
# Output
# ------------------------------------------------------------------------------------
def render(r: dict) -> str:
    t, u, rd = r["torch"], r["ucx"], r["rdma"]
    lines = [f"torch         {t['torch']} (CUDA build {t['cuda_build'] or 'none'})",
             f"CUDA          {'available' if t['cuda_available'] else 'not available'}"
             + (f", driver {t['driver']}" if t.get("driver") else "")]
    for d in t["devices"]:
        lines.append(f"  cuda:{d['index']}      {d['name']} (sm {d['capability']}, {d['memory_gib']} GiB)")
    if not u.get("found"):
        lines.append(f"UCX           not found: {u.get('why')}")
    else:
        lines += [f"UCX           {u['version']} from the {u['source']}",
                  f"  library     {u['library']}",
                  f"  ucxx        {'installed' if u['ucxx'] else 'not installed (the ucx transport needs it)'}",
                  f"  built without: {', '.join(u['built_without']) or 'nothing'}",
                  f"  modules     {', '.join(u['modules']) or 'none'} (installed; loaded ones show below)",
                  "  memory domains (memory types):"]
        for md, types in u["memory_domains"].items():
            lines.append(f"    {md:14s} {', '.join(types) or '-'}")
        lines.append("  transports (devices):")
        for tr, devs in u["transports"].items():
            lines.append(f"    {tr:14s} {', '.join(devs)}")
        has = set(u["transports"])
        lines.append(f"  GPU memory:  cuda_copy {'yes' if 'cuda_copy' in has else 'no'}, "
                     f"cuda_ipc {'yes' if 'cuda_ipc' in has else 'no'} (GPU->GPU within a host)")
    lines.append(f"RDMA          UCX transports: {', '.join(rd['ucx_transports']) or 'none'}"
                 + (f" (this UCX was built without {', '.join(rd['ucx_built_without'])})"
                    if rd["ucx_built_without"] else ""))
    lines.append(f"  devices     {', '.join(rd['devices']) or 'none'} (/sys/class/infiniband); "
                 f"libibverbs {'found' if rd['libibverbs'] else 'not found'}, "
                 f"librdmacm {'found' if rd['librdmacm'] else 'not found'}")
    if not rd["ucx_transports"]:
        lines.append("  across hosts the ucx transport falls back to TCP")
    lines.append(f"  {PREFER_SYSTEM}={r['prefer_system_ucx']}: {SYSTEM_UCX_HINT}")
    rto = r.get("tcp", {}).get("rto_max_ms")
    if rto is None:
        lines.append("TCP           net.ipv4.tcp_rto_max_ms: not in this kernel (Linux >= 6.15), nor the per-socket "
                     "cap the ucx transport sets on its connections (tcp_rto_max): after a partition heals, what a "
                     "cross-host peer held comes back at TCP's next retransmission, up to 120 s later")
    else:
        lines.append(f"TCP           net.ipv4.tcp_rto_max_ms = {rto}; the ucx transport caps its own connections at "
                     "tcp_rto_max (2 s by default): after a partition heals, what a cross-host peer held comes back "
                     "within about that")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvxfer doctor", description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="print the report as JSON")
    args = ap.parse_args(argv)
    report = gather()
    print(json.dumps(report, indent=2) if args.json else render(report))
    return 0


__all__ = ["main", "gather", "render", "parse_ucx_info", "find_ucx_info", "ucx_report", "torch_report", "tcp_report"]
