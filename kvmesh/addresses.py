"""Network addresses as settings give them: ``host:port``, ``[v6]:port`` or a bare host, checked before anything
binds or dials them (getaddrinfo and gRPC keep a port's low 16 bits: port 99999 served on 34463)."""

from __future__ import annotations

import ipaddress


def split_host_port(address: str) -> tuple[str, int | None]:
    """``"host:port"``, ``"[v6]:port"`` or a bare host (port None); ValueError when it is none of them."""
    if address.startswith("["):
        host, close, rest = address[1:].partition("]")
        if not close or (rest and not rest.startswith(":")):
            raise ValueError("an IPv6 host goes in brackets: [v6] or [v6]:port")
        return host, _port(rest[1:]) if rest else None
    if address.count(":") > 1:
        try:  # a bare IPv6 address: a host without a port
            ipaddress.IPv6Address(address.partition("%")[0])
        except ValueError:
            raise ValueError("an IPv6 host goes in brackets: [v6]:port") from None
        return address, None
    host, colon, port = address.partition(":")
    return host, _port(port) if colon else None


def _port(text: str) -> int:
    if not text.isdigit() or int(text) > 65535:
        raise ValueError(f"the port must be a number from 0 to 65535, got {text!r}")
    return int(text)


def problem(address: str, *, port: str = "required") -> str | None:
    """What is wrong with ``address`` (None: nothing); ``port``: "required" (1-65535), "any" (0: any free port,
    for a listen address) or "optional" (a bare host too)."""
    try:
        host, number = split_host_port(address)
    except ValueError as exc:
        return str(exc)
    if not host:
        return "it names no host"
    if number is None and port != "optional":
        return "it needs a port: host:port"
    if number == 0 and port != "any":
        return "port 0 is not an address others can reach"
    return None


def check_address(setting: str, address: str, *, port: str = "required") -> str:
    """``address`` if it is usable for ``setting`` (:func:`problem`); ValueError naming the setting otherwise."""
    found = problem(address, port=port)
    if found is not None:
        raise ValueError(f"{setting} {address!r}: {found}")
    return address
