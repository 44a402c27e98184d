"""Per-instruction time and energy measurement and frequency sweeps (the session's profile phase)."""

from powerlib.profiling.meter import EnergyMeter
from powerlib.profiling.sweep import (
    FrequencySweep,
    ProfileRecorder,
    SweepConfig,
    aggregate_stage_rows,
)

__all__ = [
    "EnergyMeter",
    "FrequencySweep",
    "ProfileRecorder",
    "SweepConfig",
    "aggregate_stage_rows",
]
