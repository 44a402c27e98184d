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
from powerlib.emulator.noise_model import NOISE_MODELS, NoiseModel

__all__ = [
    "IDEAL_MODEL",
    "NOISE_MODELS",
    "NVML_LIKE_MODEL",
    "EmulatedBackend",
    "EmulatedDevice",
    "Emulator",
    "ExecutedInstruction",
    "IterationResult",
    "NoiseModel",
    "NvmlLikeModel",
    "VirtualTime",
    "tables_from_profile",
]
