"""Energy measurement: ``powerlib.measure`` windows, results and their JSON schema.

See :mod:`powerlib.measurement.measure` for the API, :mod:`powerlib.measurement.timeline` for how
energy is attributed to windows, and ``docs/measurement.md`` for the accuracy and overhead figures.
"""

from __future__ import annotations

from powerlib.measurement.measure import (
    EVENTS_ENV,
    Measurement,
    StreamMarker,
    Window,
    active_measurements,
    measure,
    read_events,
)
from powerlib.measurement.result import (
    SCHEMA,
    DeviceEnergy,
    MeasurementResult,
    WindowEnergy,
    reduce_results,
)

__all__ = [
    "EVENTS_ENV",
    "SCHEMA",
    "DeviceEnergy",
    "Measurement",
    "MeasurementResult",
    "StreamMarker",
    "Window",
    "WindowEnergy",
    "active_measurements",
    "measure",
    "read_events",
    "reduce_results",
]
