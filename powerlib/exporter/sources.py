"""Who an exporter connection counts against, and which connection makes room first.

A full :class:`~powerlib.exporter.server.MetricsServer` closes a connection for each new one.
The choice is :class:`Sources`': a connection whose request is whole and being rendered is
never chosen; one still waiting for its request (nothing, or part of it) is chosen first, one
whose answer is ready but not taken after; within a tier, the oldest connection of the source
that holds the most connections. A source is the peer's address (IPv6: its /64). A scrape
sends its request as it connects, and the server reads it as it accepts the connection: a
user who opens connections, sends part of a request or nothing and closes them, over and
over, so closes only its own connections, never a scrape (docs/measurement.md §7).
"""

from __future__ import annotations

import ipaddress
from collections import OrderedDict
from typing import Any, Protocol

__all__ = ["ANSWERED", "IDLE", "Sources", "address_source"]

IDLE, ANSWERED = 0, 1  # the tiers, in the order their connections make room


def address_source(addr: Any) -> object:
    """A peer's source: its address; IPv6 its /64 (a host may use any address of it).

    An IPv4-mapped address is that IPv4 address.
    """
    host = addr[0] if isinstance(addr, tuple) and addr else addr
    if not isinstance(host, str) or ":" not in host:
        return host
    try:
        ip = ipaddress.IPv6Address(host.split("%", 1)[0])
    except ValueError:
        return host
    if ip.ipv4_mapped is not None:
        return str(ip.ipv4_mapped)
    return int(ip) >> 64


class _Conn(Protocol):
    source: object


class Sources:
    """Connections that may be closed to make room, by tier, busiest source first.

    A source's count is every connection it holds, whatever its state; per tier, the sources
    with a connection in that tier sit in buckets by that count, so the busiest is found
    without a scan.
    """

    def __init__(self) -> None:
        self._count: dict[object, int] = {}
        self._conns: tuple[dict[object, OrderedDict[Any, None]], ...] = ({}, {})
        self._buckets: tuple[dict[int, dict[object, None]], ...] = ({}, {})
        self._top = [0, 0]  # per tier: no bucket above this is non-empty

    def add(self, conn: _Conn) -> None:
        """``conn`` is open: its source holds one more."""
        self._recount(conn.source, +1)

    def remove(self, conn: _Conn) -> None:
        """``conn`` is closed (and in no tier): its source holds one fewer."""
        self._recount(conn.source, -1)

    def enter(self, conn: _Conn, tier: int) -> None:
        """``conn`` may now be closed to make room, in ``tier``."""
        mine = self._conns[tier].setdefault(conn.source, OrderedDict())
        mine[conn] = None
        if len(mine) == 1:
            self._bucket(tier, self._count[conn.source])[conn.source] = None

    def leave(self, conn: _Conn, tier: int) -> None:
        """``conn`` is no longer in ``tier``."""
        mine = self._conns[tier][conn.source]
        del mine[conn]
        if not mine:
            del self._conns[tier][conn.source]
            del self._buckets[tier][self._count[conn.source]][conn.source]

    def victim(self, tier: int) -> Any:
        """The oldest connection in ``tier`` of the source holding the most (``None``: none)."""
        buckets = self._buckets[tier]
        while self._top[tier] > 0 and not buckets.get(self._top[tier]):
            buckets.pop(self._top[tier], None)
            self._top[tier] -= 1
        if self._top[tier] == 0:
            return None
        source = next(iter(buckets[self._top[tier]]))
        return next(iter(self._conns[tier][source]))

    def _bucket(self, tier: int, count: int) -> dict[object, None]:
        self._top[tier] = max(self._top[tier], count)
        return self._buckets[tier].setdefault(count, {})

    def _recount(self, source: object, step: int) -> None:
        old = self._count.get(source, 0)
        new = old + step
        if new:
            self._count[source] = new
        else:
            del self._count[source]
        for tier in (IDLE, ANSWERED):
            if source in self._conns[tier]:
                del self._buckets[tier][old][source]
                self._bucket(tier, new)[source] = None
