"""The Prometheus exporter: ``powerlib exporter``, or an :class:`Exporter` inside a training process.

:mod:`powerlib.exporter.service` is the :class:`Exporter` (its metric names and labels are
listed there), :mod:`powerlib.exporter.metrics` the reading cache and the metric families
(devices, this process's ``powerlib.measure`` blocks and optimizing sessions, pulled at each
scrape), :mod:`powerlib.exporter.server` the bounded HTTP server. ``prometheus-client`` (the
``prometheus`` extra) is imported only when an exporter starts; docs/measurement.md §7.
"""

from __future__ import annotations

from powerlib.exporter.service import (
    DEFAULT_ADDR,
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_PORT,
    DEFAULT_TIMEOUT_S,
    DEFAULT_WORKERS,
    Exporter,
)

__all__ = [
    "DEFAULT_ADDR",
    "DEFAULT_MAX_CONNECTIONS",
    "DEFAULT_PORT",
    "DEFAULT_TIMEOUT_S",
    "DEFAULT_WORKERS",
    "Exporter",
]
