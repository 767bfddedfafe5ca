"""Ports checked before anything loads: a taken one ends the command with one line that names it.

A server binds its ports only once it starts, and `raincheck serve` starts its decode worker (the model)
before the HTTP API, so a taken port used to surface minutes later, as a bare "Address already in use".
The check binds each port the command will listen on, as the servers would (SO_REUSEADDR: a socket in
TIME_WAIT does not count), and lets it go again. A port taken in between still fails at the server's
own bind, with the same kind of message.
"""

from __future__ import annotations

import socket


def port_taken(host: str, port: int) -> str | None:
    """Why `host:port` cannot be listened on now, or None (port 0: any free port, never taken)."""
    if port == 0:
        return None
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        return f"cannot resolve {host}: {e.strerror}"
    family, _, _, _, address = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(address)
        except OSError as e:
            return e.strerror or str(e)
    return None


def check_ports(ports: list[tuple[str, str, int | None]]) -> None:
    """Each (flag, host, port) the command listens on (None: off) can be bound; else ValueError naming
    the first that cannot."""
    for flag, host, port in ports:
        if port is None:
            continue
        why = port_taken(host, port)
        if why is not None:
            raise ValueError(f"{flag} {port}: cannot listen on {host}:{port} ({why}); choose another port")
