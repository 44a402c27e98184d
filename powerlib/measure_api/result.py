"""What a measurement found: per device, per window, in total; its JSON form; the world reduction.

The JSON form is described by ``powerlib/measure_api/result.schema.json`` (JSON Schema draft
2020-12, ``"schema": "powerlib.measurement/1"``). The world reduction counts each physical
device once: a device is ``(hostname, device_id)``, and when several ranks measured it (eight
ranks that each see all eight GPUs of a node), the lowest rank's reading is kept.
:func:`finite_json` writes the documents: JSON has no ``NaN`` or ``Infinity``.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "SCHEMA",
    "DeviceEnergy",
    "MeasurementResult",
    "WindowEnergy",
    "finite_json",
    "reduce_results",
]

SCHEMA = "powerlib.measurement/1"


def _finite(value: Any) -> Any:
    """``value`` with every NaN and infinity, however deep, replaced by ``None``."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def finite_json(value: Any, **kwargs: Any) -> str:
    """``json.dumps`` of ``value`` with non-finite numbers as ``null``: never ``Infinity``/``NaN``.

    JSON has no such numbers (strict parsers, ``jq`` and the schema refuse them);
    ``allow_nan=False`` makes a missed one an error here rather than a broken document
    (docs/measurement.md §6).
    """
    return json.dumps(_finite(value), allow_nan=False, **kwargs)


def _r(value: float | None, digits: int = 9) -> float | None:
    return None if value is None else round(float(value), digits)


@dataclass(frozen=True, slots=True, kw_only=True)
class DeviceEnergy:
    """One device over the whole measurement.

    Attributes:
        device_id: Stable id (NVML UUID, ...).
        index: Index in its backend.
        name: Device name.
        backend: Backend it was read through.
        hostname: The node.
        rank: The ``torch.distributed`` rank that measured it (0 without one).
        energy_j: Energy from the measurement's start to its end.
        time_s: Length of the measurement.
        average_power_w: ``energy_j / time_s``.
        source: ``counter`` or ``integrated``.
        estimated: Not purely from a hardware counter (integrated power, a reset, no update).
        counter_resets: Counter resets detected.
        counter_wraps: Counter wraps detected.
        samples: Reads taken.
    """

    device_id: str
    index: int
    name: str
    backend: str
    hostname: str
    rank: int
    energy_j: float
    time_s: float
    average_power_w: float | None
    source: str
    estimated: bool
    counter_resets: int
    counter_wraps: int
    samples: int

    def to_json(self) -> dict[str, object]:
        """The schema's ``device`` object."""
        return {
            "device_id": self.device_id,
            "index": self.index,
            "name": self.name,
            "backend": self.backend,
            "hostname": self.hostname,
            "rank": self.rank,
            "energy_j": _r(self.energy_j, 6),
            "time_s": _r(self.time_s),
            "average_power_w": _r(self.average_power_w, 6),
            "source": self.source,
            "estimated": self.estimated,
            "counter_resets": self.counter_resets,
            "counter_wraps": self.counter_wraps,
            "samples": self.samples,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> DeviceEnergy:
        """Inverse of :meth:`to_json`."""
        return cls(**{k: data[k] for k in cls.__dataclass_fields__})


@dataclass(frozen=True, slots=True, kw_only=True)
class WindowEnergy:
    """One step or named window.

    Attributes:
        kind: ``step`` or ``window``.
        name: The window's name (steps: ``"step"``).
        index: Its number among windows of its kind and name on its rank, from 0.
        rank: The rank that recorded it.
        start_s: Start, seconds after the measurement began.
        time_s: Length.
        energy_j: Energy of every measured device over it.
        tokens: Tokens the caller said it processed, or ``None``.
        device_energy_j: Energy per device id.
    """

    kind: str
    name: str
    index: int
    rank: int
    start_s: float
    time_s: float
    energy_j: float
    tokens: float | None
    device_energy_j: Mapping[str, float] = field(default_factory=dict)

    @property
    def average_power_w(self) -> float | None:
        """``energy_j / time_s``."""
        return self.energy_j / self.time_s if self.time_s > 0 else None

    def to_json(self) -> dict[str, object]:
        """The schema's ``window`` object."""
        return {
            "kind": self.kind,
            "name": self.name,
            "index": self.index,
            "rank": self.rank,
            "start_s": _r(self.start_s),
            "time_s": _r(self.time_s),
            "energy_j": _r(self.energy_j, 6),
            "average_power_w": _r(self.average_power_w, 6),
            "tokens": self.tokens,
            "device_energy_j": {k: _r(v, 6) for k, v in self.device_energy_j.items()},
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> WindowEnergy:
        """Inverse of :meth:`to_json`."""
        return cls(
            kind=data["kind"],
            name=data["name"],
            index=data["index"],
            rank=data["rank"],
            start_s=data["start_s"],
            time_s=data["time_s"],
            energy_j=data["energy_j"],
            tokens=data["tokens"],
            device_energy_j=dict(data["device_energy_j"]),
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class MeasurementResult:
    """A measurement, per device, per window and in total.

    Attributes:
        reduce: ``local`` (this process) or ``world`` (every rank, each device once).
        ranks: Processes that contributed.
        start_unix_s: When the measurement began (Unix time).
        time_s: Its length (the longest rank's, for ``world``).
        devices: Each physical device once.
        windows: Steps and named windows, in start order (per rank for ``world``).
        tokens_reduce: How ``world`` combined ranks' tokens: ``sum`` or ``max``.
        provisional: Taken while the measurement was running: the last reads may not yet
            include the counter's next update, so the newest windows are extrapolated.
    """

    reduce: str
    ranks: int
    start_unix_s: float
    time_s: float
    devices: tuple[DeviceEnergy, ...]
    windows: tuple[WindowEnergy, ...]
    tokens_reduce: str = "sum"
    provisional: bool = False

    # -- totals ----------------------------------------------------------------------------------

    @property
    def energy_j(self) -> float:
        """Energy of every device over the whole measurement."""
        return math.fsum(d.energy_j for d in self.devices)

    @property
    def average_power_w(self) -> float | None:
        """``energy_j / time_s``."""
        return self.energy_j / self.time_s if self.time_s > 0 else None

    @property
    def estimated(self) -> bool:
        """Any device's energy is not purely from a hardware counter."""
        return any(d.estimated for d in self.devices)

    @property
    def steps(self) -> tuple[WindowEnergy, ...]:
        """The step windows (of every rank for ``world``)."""
        return tuple(w for w in self.windows if w.kind == "step")

    @property
    def num_steps(self) -> int:
        """Steps: on one rank, or the most any rank recorded for ``world`` (ranks step together)."""
        per_rank: dict[int, int] = {}
        for w in self.steps:
            per_rank[w.rank] = per_rank.get(w.rank, 0) + 1
        return max(per_rank.values(), default=0)

    @property
    def step_energy_j(self) -> list[float]:
        """Energy of each step across every device: step ``i`` of each device's owning rank."""
        per_index: dict[int, float] = {}
        for w in self.steps:
            per_index[w.index] = per_index.get(w.index, 0.0) + w.energy_j
        return [per_index[i] for i in sorted(per_index)]

    @property
    def step_time_s(self) -> list[float]:
        """Length of each step (the slowest rank's)."""
        per_index: dict[int, float] = {}
        for w in self.steps:
            per_index[w.index] = max(per_index.get(w.index, 0.0), w.time_s)
        return [per_index[i] for i in sorted(per_index)]

    @property
    def tokens(self) -> float | None:
        """Tokens over every step (``tokens_reduce`` across ranks), or ``None`` if none were given."""
        per_rank: dict[int, float] = {}
        for w in self.steps:
            if w.tokens is not None:
                per_rank[w.rank] = per_rank.get(w.rank, 0.0) + w.tokens
        if not per_rank:
            return None
        return max(per_rank.values()) if self.tokens_reduce == "max" else sum(per_rank.values())

    @property
    def energy_per_step_j(self) -> float | None:
        """Mean energy of a step, or ``None`` without steps."""
        energies = self.step_energy_j
        return math.fsum(energies) / len(energies) if energies else None

    @property
    def energy_per_token_j(self) -> float | None:
        """Energy of the steps divided by their tokens, or ``None``."""
        tokens = self.tokens
        if not tokens:
            return None
        return math.fsum(self.step_energy_j) / tokens

    def window(self, name: str) -> list[WindowEnergy]:
        """The named windows called ``name``."""
        return [w for w in self.windows if w.kind == "window" and w.name == name]

    # -- JSON ------------------------------------------------------------------------------------

    def summary(self) -> dict[str, object]:
        """The totals, without the per-window list."""
        energies = self.step_energy_j
        times = self.step_time_s
        return {
            "energy_j": _r(self.energy_j, 6),
            "time_s": _r(self.time_s),
            "average_power_w": _r(self.average_power_w, 6),
            "estimated": self.estimated,
            "steps": self.num_steps,
            "tokens": self.tokens,
            "energy_per_step_j": _r(self.energy_per_step_j, 6),
            "energy_per_token_j": _r(self.energy_per_token_j, 9),
            "step_energy_j_median": _r(statistics.median(energies), 6) if energies else None,
            "step_time_s_mean": _r(math.fsum(times) / len(times)) if times else None,
            "step_time_s_median": _r(statistics.median(times)) if times else None,
        }

    def to_json(self, *, windows: bool = True) -> dict[str, object]:
        """The result as the schema describes it (``windows=False`` leaves the list empty)."""
        return {
            "schema": SCHEMA,
            "reduce": self.reduce,
            "ranks": self.ranks,
            "tokens_reduce": self.tokens_reduce,
            "provisional": self.provisional,
            "start_unix_s": _r(self.start_unix_s, 6),
            **self.summary(),
            "devices": [d.to_json() for d in self.devices],
            "windows": [w.to_json() for w in self.windows] if windows else [],
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> MeasurementResult:
        """Inverse of :meth:`to_json` (the totals are recomputed).

        Raises:
            ValueError: Not a ``powerlib.measurement/1`` document.
        """
        if not isinstance(data, Mapping) or data.get("schema") != SCHEMA:
            raise ValueError(f"not a {SCHEMA} result")
        return cls(
            reduce=data["reduce"],
            ranks=data["ranks"],
            start_unix_s=data["start_unix_s"],
            time_s=data["time_s"],
            devices=tuple(DeviceEnergy.from_json(d) for d in data["devices"]),
            windows=tuple(WindowEnergy.from_json(w) for w in data["windows"]),
            tokens_reduce=data.get("tokens_reduce", "sum"),
            provisional=bool(data.get("provisional", False)),
        )


def reduce_results(
    results: Sequence[MeasurementResult], *, tokens_reduce: str = "sum"
) -> MeasurementResult:
    """Combine the ranks' local results, each physical device once.

    Args:
        results: One local result per rank, in rank order.
        tokens_reduce: ``sum`` (each rank passed the tokens it alone processed) or ``max``
            (every rank passed the same global count).

    A device is ``(hostname, device_id)``; the first rank (in order) that measured it owns it:
    its energy, and its share of each step's and window's energy, come from that rank only.
    """
    if tokens_reduce not in ("sum", "max"):
        raise ValueError(f"tokens_reduce must be 'sum' or 'max', got {tokens_reduce!r}")
    owner: dict[tuple[str, str], int] = {}
    devices: list[DeviceEnergy] = []
    for rank_i, res in enumerate(results):
        for dev in res.devices:
            key = (dev.hostname, dev.device_id)
            if key not in owner:
                owner[key] = rank_i
                devices.append(dev)
    windows: list[WindowEnergy] = []
    for rank_i, res in enumerate(results):
        hostname = {d.device_id: d.hostname for d in res.devices}
        for w in res.windows:
            owned = {
                dev_id: e
                for dev_id, e in w.device_energy_j.items()
                if owner.get((hostname.get(dev_id, ""), dev_id)) == rank_i
            }
            windows.append(
                WindowEnergy(
                    kind=w.kind,
                    name=w.name,
                    index=w.index,
                    rank=w.rank,
                    start_s=w.start_s,
                    time_s=w.time_s,
                    energy_j=math.fsum(owned.values()),
                    tokens=w.tokens,
                    device_energy_j=owned,
                )
            )
    return MeasurementResult(
        reduce="world",
        ranks=len(results),
        start_unix_s=min((r.start_unix_s for r in results), default=0.0),
        time_s=max((r.time_s for r in results), default=0.0),
        devices=tuple(devices),
        windows=tuple(windows),
        tokens_reduce=tokens_reduce,
        provisional=any(r.provisional for r in results),
    )
