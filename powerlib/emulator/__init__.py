"""Virtual-time pipeline emulation on table-driven emulated GPUs (demo, benchmarks, tests)."""

from powerlib.emulator.device import EmulatedBackend, EmulatedDevice, VirtualTime
from powerlib.emulator.engine import (
    Emulator,
    ExecutedInstruction,
    IterationResult,
    tables_from_profile,
)

__all__ = [
    "EmulatedBackend",
    "EmulatedDevice",
    "Emulator",
    "ExecutedInstruction",
    "IterationResult",
    "VirtualTime",
    "tables_from_profile",
]
