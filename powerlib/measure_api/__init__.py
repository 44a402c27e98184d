"""The ``powerlib.measure`` API: energy per step, token and window, and of a whole command.

:mod:`powerlib.measure_api.measure` is ``powerlib.measure`` (:class:`Measurement`),
:mod:`powerlib.measure_api.command` is ``powerlib measure -- CMD`` (:func:`run_command`; a
child's own steps reach it through :mod:`powerlib.measure_api.events`),
:mod:`powerlib.measure_api.result` is what a measurement found and its JSON form
(``result.schema.json``), and :mod:`powerlib.measure_api.plot` draws power over time. The
devices are read and energy is attributed by the engine, :mod:`powerlib.measurement`;
``docs/measurement.md`` has the accuracy and overhead figures.
"""

from __future__ import annotations

from powerlib.measure_api.command import CommandMeasurement, run_command
from powerlib.measure_api.events import read_events
from powerlib.measure_api.measure import (
    Measurement,
    Window,
    active_measurements,
    measure,
)
from powerlib.measure_api.plot import plot_power
from powerlib.measure_api.result import (
    SCHEMA,
    DeviceEnergy,
    MeasurementResult,
    WindowEnergy,
    finite_json,
    reduce_results,
)
from powerlib.measurement.markers import StreamMarker
from powerlib.measurement.reader import LOCAL

__all__ = [
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
