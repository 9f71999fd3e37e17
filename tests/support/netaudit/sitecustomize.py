"""Records every attempt of this process (and its children, which inherit PYTHONPATH) to reach
a non-loopback host: TCP connects and name lookups, through Python's audit hooks.

Put this directory first on PYTHONPATH and set NETAUDIT_LOG to a file: each attempt appends
``pid event address``. UDP connects are left out: they send nothing (Dask's get_ip() uses one
to read the outward address).
"""

import os
import socket
import sys

_LOG = os.environ.get("NETAUDIT_LOG")
_LOOPBACK_NAMES = {"localhost", "localhost.localdomain", "ip6-localhost", ""}


def _is_loopback(host):
    if not isinstance(host, str):
        return True
    return host in _LOOPBACK_NAMES or host.startswith("127.") or host in ("::1", "0.0.0.0", "::")


def _record(event, address):
    with open(_LOG, "a", encoding="utf-8") as f:
        f.write(f"{os.getpid()} {event} {address!r}\n")


def _hook(event, args):
    if event == "socket.connect":
        sock, address = args
        if sock.family in (socket.AF_INET, socket.AF_INET6) and sock.type == socket.SOCK_STREAM \
                and not _is_loopback(address[0]):
            _record(event, address)
    elif event == "socket.getaddrinfo" and not _is_loopback(args[0]):
        _record(event, args[0])


if _LOG:
    sys.addaudithook(_hook)
