"""Virtual-time pipeline emulation on table-driven emulated GPUs (demo, benchmarks, tests)."""

from powerlib.emulator.device import EmulatedBackend, EmulatedDevice, VirtualTime
from powerlib.emulator.engine import (
    IDEAL_MODEL,
    NVML_LIKE_MODEL,
    Emulator,
    ExecutedInstruction,
    IterationResult,
    NvmlLikeModel,
    tables_from_profile,
)

__all__ = [
    "IDEAL_MODEL",
    "NVML_LIKE_MODEL",
    "EmulatedBackend",
    "EmulatedDevice",
    "Emulator",
    "ExecutedInstruction",
    "IterationResult",
    "NvmlLikeModel",
    "VirtualTime",
    "tables_from_profile",
]
