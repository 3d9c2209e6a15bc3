"""A TCP port on 127.0.0.1 for a server a test starts in another process (moto's S3 server, a
torch.distributed rendezvous).

Why not ``bind(("127.0.0.1", 0))``: that port comes from the kernel's ephemeral range
(``/proc/sys/net/ipv4/ip_local_port_range``, 32768-60999 by default), the range every outgoing
connection's local port is drawn from too. Between closing the probe socket and the server's own
bind (a second or more: the server is an interpreter that imports first), a connection of a
concurrent test (gloo's pairs between ranks, an HTTP client) may take it, and the server dies of
"Address already in use" (seen once under ``pytest -n 2``, 2026-11-29). A port below that range
is never handed out implicitly; it is probed free, and only another explicit bind could race it.
"""

from __future__ import annotations

import random
import socket

#: where to look: above the well-known and common service ports, below the ephemeral range
_LOW = 20000


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def server_port() -> int:
    """A port on 127.0.0.1 free now and outside the ephemeral range (when the range leaves room
    below it; else any free port)."""
    high = _ephemeral_low()
    candidates = random.sample(range(_LOW, high), min(200, high - _LOW)) if high - _LOW > 100 else []
    for port in candidates:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
