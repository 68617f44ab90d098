"""Addresses, in one place: their syntax (``split_address``, ``check_address``), where a socket
listens (``bind``, which may be a wildcard such as ``0.0.0.0``: every interface) and what peers are
told to reach (``advertise``: never a wildcard, and never loopback for a peer on another host).

Who calls what: every layer that takes an address checks it here: ``RankInfo`` and
``ControlChannel.connect`` (``check_address``), the transports' data endpoints and the bootstrap
API (``split_address``); ``ControlChannel`` (after binding, with its ``advertise`` setting) and
``BootstrapServer`` (its ``url``) call ``advertise_address``; the registry calls ``is_loopback``
on every record registered from another host; the endpoints call ``check_reachable`` at start-up
and ``kvxfer rank`` calls ``rank_addresses``. Everything raises ``ConfigError`` (a ValueError)
naming the address tried and the setting to change.
"""
from __future__ import annotations

import fcntl
import ipaddress
import re
import socket
import struct
import urllib.parse
from collections.abc import Mapping

from .errors import ConfigError, short

_HOST = re.compile(r"[A-Za-z0-9_.\-]{1,253}")
WILDCARDS = frozenset({"*", "0.0.0.0", "::", "[::]"})


# ------------------------------------------------------------------------------------
# Syntax: what an address is, and one a peer can connect to
# ------------------------------------------------------------------------------------
def split_address(address: str) -> tuple[str, str, int]:
    """``tcp://host:port`` -> ("tcp", host, port); ``ipc://path`` -> ("ipc", path, 0); port 0 or
    ``*`` (bind: any free port) -> 0. ValueError
    naming the address when it is not one (an IPv6 host is written ``[::1]``)."""
    if not isinstance(address, str) or len(address) > 256:
        raise ConfigError(f"an address must be a string of at most 256 characters, got {short(address)}")
    if address.startswith("ipc://"):
        path = address[6:]
        if not path or "\0" in path or not path.isprintable():
            raise ConfigError(f"address {address!r}: ipc:// needs a printable path")
        return "ipc", path, 0
    if not address.startswith("tcp://"):
        raise ConfigError(f"address {short(address)} must be tcp://host:port or ipc://path")
    host, sep, port = address[6:].rpartition(":")
    if not sep or not (port == "*" or port.isdigit() and port.isascii() and int(port) <= 65535):
        raise ConfigError(f"address {address!r} needs a port in 1..65535 (tcp://host:port)")
    if host.startswith("[") and host.endswith("]"):
        try:
            ipaddress.IPv6Address(host[1:-1])
        except ValueError:
            raise ConfigError(f"address {address!r}: {host} is not an IPv6 address") from None
    elif host != "*" and not _HOST.fullmatch(host):
        raise ConfigError(f"address {address!r}: host {host!r} is not an IP address, interface or host name")
    return "tcp", host, 0 if port == "*" else int(port)


def check_address(address: str, *, advertised: bool = True) -> str:
    """``address`` if a peer can connect to it; ``advertised=True`` also refuses a wildcard host
    (``0.0.0.0``, ``*``, ``::``), which binds every interface but reaches none."""
    kind, host, port = split_address(address)
    if kind == "tcp" and port == 0:
        raise ConfigError(f"address {address!r} needs a port in 1..65535 (tcp://host:port)")
    if advertised and kind == "tcp" and host in WILDCARDS:
        raise ConfigError(f"address {address!r} is a wildcard: bind it, but advertise a routable address "
                         f"(see kvxfer.addresses.advertise_address)")
    return address


_SIOCGIFADDR = 0x8915


def interface_address(name: str) -> str | None:
    """The IPv4 address of network interface ``name`` (e.g. ``eth0``), or None (Linux only)."""
    if not isinstance(name, str) or not 0 < len(name) < 16 or not name.isprintable():
        return None
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            raw = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()))
        except OSError:
            return None
    return socket.inet_ntoa(raw[20:24])


def interfaces() -> dict[str, str]:
    """Interface name -> IPv4 address, for every interface that has one."""
    out: dict[str, str] = {}
    try:
        names = [n for _, n in socket.if_nameindex()]
    except OSError:
        return out
    for n in names:
        a = interface_address(n)
        if a is not None:
            out[n] = a
    return out


def is_loopback(host: str, resolve: bool = True) -> bool:
    """True for 127.0.0.0/8, ::1, ``localhost`` and (``resolve``) any name that resolves only to
    loopback. ``resolve=False`` never blocks on DNS (the registry's event loop uses it)."""
    host = host.strip("[]")
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    if host.lower() in ("localhost", "localhost.localdomain", "ip6-localhost") or host.lower().endswith(".localhost"):
        return True
    if not resolve:
        return False
    try:
        addrs = {str(ai[4][0]) for ai in socket.getaddrinfo(host, None)}
    except OSError:
        return False
    return bool(addrs) and all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addrs)


def routable_address() -> str | None:
    """An IPv4 address of this host that another host can reach (not loopback, not link-local)."""
    for _name, a in sorted(interfaces().items()):
        ip = ipaddress.ip_address(a)
        if not (ip.is_loopback or ip.is_link_local or ip.is_unspecified):
            return a
    return None


def advertise_host(bind_host: str, advertise: str | None = None, *, remote: bool = False,
                   setting: str = "advertise") -> str:
    """The host to advertise for a socket bound on ``bind_host``.

    ``advertise``: an IP address, a host name or an interface name (``eth0``); None: the bind
    host, or for a wildcard bind a routable interface address (loopback when there is none and
    ``remote`` is False). ``remote=True``: a peer on another host will use it, so loopback or a
    wildcard is refused. ``setting`` names the option to change in the error."""
    tried = advertise if advertise else bind_host
    if advertise:
        host = interface_address(advertise) or advertise
    elif bind_host in WILDCARDS or bind_host == "":
        host = routable_address() or ("127.0.0.1" if not remote else "")
        if not host:
            raise ConfigError(f"bound {bind_host!r} (every interface) but found no routable interface address to "
                             f"advertise: set {setting}= to an address or interface name peers can reach")
    else:
        host = bind_host
    if host in WILDCARDS:
        raise ConfigError(f"cannot advertise the wildcard {tried!r}: it binds every interface but reaches none; "
                         f"set {setting}= to an address or interface name peers can reach")
    if remote and is_loopback(host):
        raise ConfigError(f"cannot advertise loopback {tried!r} (-> {host}) to a peer on another host: set "
                         f"{setting}= to a routable address or interface name")
    return host


def advertise_address(bind: str, advertise: str | None = None, *, remote: bool = False,
                      setting: str = "advertise") -> str:
    """``advertise_host`` for a whole endpoint: ``tcp://0.0.0.0:5555`` -> ``tcp://10.1.2.3:5555``.
    ``ipc://`` endpoints are returned unchanged (same host only)."""
    kind, host, port = split_address(bind)
    if kind == "ipc":
        if remote:
            raise ConfigError(f"cannot advertise {bind!r} to a peer on another host: ipc:// reaches only this host; "
                             f"bind tcp:// and set {setting}=")
        return bind
    h = advertise_host(host, advertise, remote=remote, setting=setting)
    if ":" in h and not h.startswith("["):
        h = f"[{h}]"
    return f"tcp://{h}:{port}"


# ------------------------------------------------------------------------------------
# Addresses that reach (start-up checks of the endpoints)
# ------------------------------------------------------------------------------------
def on_another_host(host: str) -> bool:
    """True when ``host`` (a bootstrap URL's host) is not this host: not loopback and none of this
    host's interface addresses. Resolves names (start-up only: it may block on DNS)."""
    if is_loopback(host) or host in WILDCARDS:   # a client reaches a wildcard on its own host
        return False
    try:
        addrs = {ai[4][0] for ai in socket.getaddrinfo(host.strip("[]"), None)}
    except OSError:
        return True
    return not addrs & (set(interfaces().values()) | {"127.0.0.1", "::1"})


def check_reachable(role: str, control: str, data: Mapping, bootstrap: str, *, advertise: str | None = None,
                    bound: str = "") -> None:
    """Start-up (``PrefillEndpoint.register``, ``DecodeEndpoint.connect``): ValueError, naming the
    setting to change, when the bootstrap at ``bootstrap`` is on another host and a rank (its
    ``RankInfo``'s ``role``, ``control`` address and ``data`` descriptors) advertises an address
    its peers there cannot reach: loopback or a wildcard, for the control address
    (``advertise=``) or a transport's data ``endpoint`` (``transport_options``)."""
    host = urllib.parse.urlsplit(bootstrap).hostname
    if not host or not on_another_host(host):
        return
    checks = [(control, f"PrefillEndpoint(advertise=) (now {advertise!r}; bound {bound or '?'}; "
                             f"kvxfer rank --advertise)")] if control else []
    for name, d in data.items():
        ep = d.get("endpoint") if isinstance(d, dict) else None
        if isinstance(ep, str) and ep.startswith("tcp://"):
            checks.append((ep, f"transport_options['endpoint'] of the {name} transport (kvxfer rank --bind / "
                               f"--advertise)"))
    for address, setting in checks:
        try:
            _, h, _ = split_address(address)
        except ValueError:
            continue
        if h in WILDCARDS or is_loopback(h):
            raise ConfigError(f"this {role} rank would advertise {address} to the bootstrap {bootstrap} on "
                             f"another host, which only {'no host' if h in WILDCARDS else 'this host'} can reach: "
                             f"set {setting} to an address or interface name peers can reach")


# ------------------------------------------------------------------------------------
# A rank's bind and advertise addresses (``kvxfer rank --bind / --advertise``)
# ------------------------------------------------------------------------------------
def to_ip(value: str, flag: str) -> str:
    """An address, an interface name or a hostname -> an IPv4 address (wildcards kept); ValueError
    naming ``flag`` otherwise."""
    if value in ("*", "0.0.0.0"):
        return "0.0.0.0"
    try:
        return str(ipaddress.ip_address(value))
    except ValueError:
        pass
    ip = interface_address(value)
    if ip is not None:
        return ip
    try:
        return socket.gethostbyname(value)
    except OSError:
        raise ConfigError(f"{flag} {value}: not an address, an interface with an IPv4 address, or a hostname "
                         f"that resolves") from None


def route_to(host: str, port: int) -> str:
    """The local address this host uses to reach ``host`` (no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((host, port or 9))
            return s.getsockname()[0]
        except OSError as e:
            raise ConfigError(f"no route to the bootstrap host {host} ({e.strerror}): pass --advertise with this "
                             f"host's address or interface") from None


def rank_addresses(bind: str | None, advertise: str | None, bootstrap: str) -> tuple[str, str]:
    """(bind, advertise) addresses of a rank registering at ``bootstrap``: ``advertise`` (an address,
    interface or host name), else the bind address, else the address this host reaches the bootstrap
    from. ValueError, naming the flag, when peers could not reach what would be advertised (a
    wildcard, or loopback to a bootstrap on another host)."""
    scheme = urllib.parse.urlsplit(bootstrap).scheme
    url = urllib.parse.urlsplit("//" + urllib.parse.urlsplit(bootstrap).netloc.split(",")[0])   # etcd: the first host
    if scheme not in ("http", "https", "etcd") or not url.hostname:
        raise ConfigError(f"--bootstrap {bootstrap}: use http://HOST:PORT (what `kvxfer bootstrap` prints) or "
                         f"etcd://HOST:2379[,HOST2:2379...]")
    try:
        boot_ip = socket.gethostbyname(url.hostname)
    except OSError:
        raise ConfigError(f"--bootstrap {bootstrap}: host {url.hostname} does not resolve") from None
    boot_local = ipaddress.ip_address(boot_ip).is_loopback
    b = to_ip(bind, "--bind") if bind else None
    if advertise:
        adv = to_ip(advertise, "--advertise")
    elif b and b != "0.0.0.0":
        adv = b
    else:
        adv = route_to(boot_ip, url.port or 80)
    a = ipaddress.ip_address(adv)
    if a.is_unspecified:
        raise ConfigError(f"--advertise {advertise}: a wildcard address reaches nobody; advertise this host's "
                         f"address or interface (bind the wildcard with --bind 0.0.0.0)")
    if a.is_loopback and not boot_local:
        which = f"--advertise {advertise}" if advertise else (f"--bind {bind}" if bind else "the default")
        raise ConfigError(f"{which} gives loopback {adv}, but the bootstrap {bootstrap} is on another host: its "
                         f"peers could never reach this rank; pass --advertise with this host's address or "
                         f"interface name (e.g. eth0)")
    return (b or adv), adv
