"""Keep UCX's listeners on the worker's own interface.

UCX (under NIXL) opens its connection-establishment listeners on every network device it finds
unless `UCX_NET_DEVICES` names some; a worker started with `--host 127.0.0.1` would still accept
NIXL connections on its public interface. `confine_ucx(host)` sets `UCX_NET_DEVICES` to the
interface that carries `host` before the first agent initialises UCX (UCX reads it once per
process). An operator's own `UCX_NET_DEVICES` wins; a wildcard host (0.0.0.0, ::, "") leaves UCX
on every device, as the gRPC listener is then on every interface too.
"""

from __future__ import annotations

import fcntl
import ipaddress
import logging
import os
import socket
import struct

log = logging.getLogger(__name__)

_SIOCGIFADDR = 0x8915  # Linux ioctl: an interface's (primary) IPv4 address


def interface_of(host: str) -> str | None:
    """Name of the network interface whose IPv4 address is `host` (a name is resolved first);
    "lo" for any loopback address; None when no interface carries it (or not Linux)."""
    try:
        addr = ipaddress.ip_address(socket.gethostbyname(host))
    except (OSError, ValueError):
        return None
    if addr.is_loopback:
        return "lo"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                raw = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:  # no IPv4 address on this interface
                continue
            if ipaddress.ip_address(raw[20:24]) == addr:
                return name
    return None


def confine_ucx(host: str) -> str | None:
    """Set UCX_NET_DEVICES for `host` (see the module doc); returns the value in force."""
    if "UCX_NET_DEVICES" in os.environ:
        return os.environ["UCX_NET_DEVICES"]
    if host in ("", "0.0.0.0", "::", "[::]"):
        return None
    name = interface_of(host)
    if name is None:
        log.warning("no network interface carries %s: UCX (NIXL) listens on every interface; set "
                    "UCX_NET_DEVICES to confine it", host)
        return None
    os.environ["UCX_NET_DEVICES"] = name
    return name
