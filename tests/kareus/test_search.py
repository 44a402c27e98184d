"""The per-partition multi-pass MBO (powerlib.planning.kareus.search) on a synthetic landscape.

The evaluator here is self-contained (no simulator): a partition's compute time comes from its
ops' FLOPs and bytes at the locked clock, the collective launched at a slot overlaps the compute
from that slot on, the collective's SMs slow that compute down while they speed the collective
up (an interior optimum in SM count that moves with the clock), and dynamic energy is mostly
the clock (∝ f^2.5 per unit of compute) plus a small per-SM communication term.
"""

from __future__ import annotations

import json
import math
import sys
import time
import zlib
from pathlib import Path

import numpy as np
import pytest

from powerlib.errors import PlanError
from powerlib.planning.kareus.evaluator import Measurement
from powerlib.planning.kareus.partition import (
    MODELS,
    Budget,
    Config,
    Parallelism,
    PartitionType,
    build_workload,
    config_space,
    search_budget,
)
from powerlib.planning.kareus.search import (
    LOG_SCHEMA,
    PASSES,
    SearchResult,
    hypervolume,
    relative_hypervolume,
    search_partition,
)

FREQS = range(900, 1411, 30)
F_MAX = 1410.0
SMS_TOTAL = 108  # A100


# --------------------------------------------------------------------------------------------
# Synthetic evaluator
# --------------------------------------------------------------------------------------------


class SyntheticEvaluator:
    """A structured, deterministic landscape with optional multiplicative noise.

    Args:
        noise: Relative standard deviation of time and total energy (per configuration,
            deterministic: a config always reads the same).
        flat: Time and energy depend on the clock only (SM count and slot do nothing).
        fail_after: Raise after this many evaluate() calls (an interrupted search).
    """

    p_static_w = 90.0
    freqs_mhz = tuple(float(f) for f in FREQS)

    def __init__(self, noise: float = 0.0, flat: bool = False,
                 fail_after: int | None = None) -> None:
        self.noise = noise
        self.flat = flat
        self.fail_after = fail_after
        self.calls: list[Config] = []

    def truth(self, ptype: PartitionType, c: Config) -> tuple[float, float]:
        """Noise-free (time_s, dynamic_energy_j)."""
        fr = c.freq_mhz / F_MAX
        op_t = [max(op.flops / (250e12 * fr), op.hbm_bytes / 1.5e12) for op in ptype.ops]
        comp = sum(op_t)
        if self.flat:
            t = comp * (1.0 + 0.3 * ptype.comm.group_size / 8)
            return t, 260.0 * fr**2.5 * comp
        bw = 40e9 * (1.0 - math.exp(-c.sm_count / 9.0)) * (0.85 + 0.15 * fr)
        comm = ptype.comm.wire_bytes / bw
        if c.slot is None:  # no overlap: compute, then the collective
            t = comp + comm
            busy = comp
        else:
            j = ptype.slot_ops[c.slot]
            pre, window = sum(op_t[:j]), sum(op_t[j:])
            slow = 1.0 / (1.0 - 2.5 * c.sm_count / SMS_TOTAL)
            if comm >= window * slow:
                after = comm
            else:
                after = comm + window - comm / slow
            t = pre + after
            busy = comp
        e_dyn = 260.0 * fr**2.5 * busy + 0.6 * c.sm_count * comm * (0.7 + 0.3 * fr)
        return t, e_dyn

    def truth_points(self, ptype: PartitionType, space: list[Config], plane: str = "total"
                     ) -> np.ndarray:
        rows = []
        for c in space:
            t, ed = self.truth(ptype, c)
            rows.append([t, ed + self.p_static_w * t if plane == "total" else ed])
        return np.array(rows)

    def evaluate(self, ptype: PartitionType, config: Config) -> Measurement:
        if self.fail_after is not None and len(self.calls) >= self.fail_after:
            raise RuntimeError("interrupted")
        self.calls.append(config)
        t, ed = self.truth(ptype, config)
        e = ed + self.p_static_w * t
        if self.noise:
            seed = zlib.crc32(f"{ptype.key}/{config.freq_mhz}/{config.sm_count}/{config.slot}".encode())
            z = np.random.default_rng(seed).standard_normal(2)
            t *= 1.0 + self.noise * z[0]
            e *= 1.0 + self.noise * z[1]
        return Measurement(time_s=t, energy_j=e, p_static_w=self.p_static_w, wall_s=13.0)

    def evaluate_sequential(self, segments, freq_mhz, sm_count):  # pragma: no cover
        raise NotImplementedError

    def evaluate_compute(self, ops, freq_mhz):  # pragma: no cover
        raise NotImplementedError


def _ptype(cp: int, key: str) -> PartitionType:
    par = (Parallelism(tp=8, micro_batch=8, seq_len=4096) if cp == 1
           else Parallelism(tp=4, cp=2, micro_batch=8, seq_len=4096))
    return build_workload(MODELS["llama3.2-3b"], par, [15, 13]).partition(key)


def found_relative_hv(ev: SyntheticEvaluator, ptype: PartitionType, space: list[Config],
                      result: SearchResult, plane: str = "total") -> float:
    """True (noise-free) relative HV of the configurations the search reports as Pareto."""
    chosen = [r.config for r in result.pareto(plane)]
    return relative_hypervolume(ev.truth_points(ptype, chosen, plane),
                                ev.truth_points(ptype, space, plane))
