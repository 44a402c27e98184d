"""Energy measurement: ``powerlib.measure`` windows, commands, results and their JSON schema.

See :mod:`powerlib.measurement.measure` for the API, :mod:`powerlib.measurement.reader` for the
sampler thread, :mod:`powerlib.measurement.timeline` for how energy is attributed to windows,
:mod:`powerlib.measurement.command` for ``powerlib measure -- CMD`` (:func:`run_command`),
:mod:`powerlib.measurement.exporter` for the Prometheus exporter (the ``prometheus`` extra,
imported only from there), and ``docs/measurement.md`` for the accuracy and overhead figures.
"""

from __future__ import annotations

from powerlib.measurement.command import CommandMeasurement, run_command
from powerlib.measurement.events import EVENTS_ENV, read_events
from powerlib.measurement.markers import StreamMarker
from powerlib.measurement.measure import (
    Measurement,
    Window,
    active_measurements,
    measure,
)
from powerlib.measurement.plot import plot_power
from powerlib.measurement.reader import LOCAL
from powerlib.measurement.result import (
    SCHEMA,
    DeviceEnergy,
    MeasurementResult,
    WindowEnergy,
    finite_json,
    reduce_results,
)

__all__ = [
    "EVENTS_ENV",
    "LOCAL",
    "SCHEMA",
    "CommandMeasurement",
    "DeviceEnergy",
    "Measurement",
    "MeasurementResult",
    "StreamMarker",
    "Window",
    "WindowEnergy",
    "active_measurements",
    "finite_json",
    "measure",
    "plot_power",
    "read_events",
    "reduce_results",
    "run_command",
]
