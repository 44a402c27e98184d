"""Torch blocks whose compute time follows the simulated clock (shared by the integration workers).

The simulated GPU does not run torch, so each block sleeps ``BASE_S * f_max / f`` for the clock
locked on ``Delay.device`` in its forward and in its backward; profiles then trade time for
energy the way a GPU does. ``BASE_S`` stays well above a simulated clock change (~1 ms), so no
request is superseded by the next one before it lands.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import powerlib

BASE_S = 0.02
FREQS = [1410.0, 1200.0, 1005.0]


class Delay(torch.autograd.Function):
    """Identity that sleeps for the clock in force, in forward and in backward."""

    device: powerlib.Device

    @staticmethod
    def sleep() -> None:
        locked = Delay.device.read_state().locked_sm_freqs_mhz
        f_max = Delay.device.info.max_sm_freq_mhz
        time.sleep(BASE_S * f_max / (locked[1] if locked else f_max))

    @staticmethod
    def forward(ctx, x):  # noqa: ANN001, ANN205
        Delay.sleep()
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        Delay.sleep()
        return grad


class WeightDelay(torch.autograd.Function):
    """Free in forward; in backward it delays the weight gradient (the W of a split backward)."""

    @staticmethod
    def forward(ctx, w):  # noqa: ANN001, ANN205
        return w.view_as(w)

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        Delay.sleep()
        return grad


class Block(torch.nn.Module):
    """``tanh(delay(linear(x)))``; with ``delay_weight_grad`` the weight gradient is delayed too.

    The delay sits after the linear layer, so its backward runs even where ``x`` needs no
    gradient. Zero-bubble schedules compute the weight gradient apart (W): the weight's own delay
    makes W as clock-dependent as I.
    """

    def __init__(self, hidden: int = 16, *, delay_weight_grad: bool = False) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(hidden, hidden)
        self.delay_weight_grad = delay_weight_grad

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.lin.weight
        if self.delay_weight_grad:
            weight = WeightDelay.apply(weight)
        return torch.tanh(Delay.apply(torch.nn.functional.linear(x, weight, self.lin.bias)))


SWEEP = {
    "freqs_mhz": FREQS,
    "warmup_iterations": 1,
    "settle_iterations": 0,
    "iterations_per_freq": 1,
    # One sample per clock on a shared CPU: the profile's noise can leave the guarded fastest
    # plan a few 1e-4 past all-max (a noisy top clock is dropped as dominated), and the session
    # then rightly refuses it. These tests are about applying the plan and catching a wrong
    # order, so they allow 10 % (a loaded CI machine once showed +4.6 % on DeepSpeed ZeRO); the guard itself is tested in tests/runtime.
    "max_slowdown": 0.1,
}
"""Session options of the workers' auto runs: one warm-up, one iteration per clock."""

ITERATIONS = 1 + len(FREQS) + 2
"""Warm-up, one per clock, then two applied iterations."""


def drive(session: Any, iteration: Callable[[int], None]) -> list[int]:
    """Run :data:`ITERATIONS` iterations; returns the controller's log length before each one."""
    marks = []
    for i in range(ITERATIONS):
        marks.append(len(session.controller.applied))
        iteration(i)
        session.controller.wait_idle()  # for the record only
    marks.append(len(session.controller.applied))
    return marks


def plan_rows(session: Any) -> dict[str, Any]:
    """This stage's plan and the first applied iteration's requests, as ``[kind, mb, chunk, f]``."""
    plan = session.plan
    return {
        "plan": [
            [p.instruction.kind, p.instruction.microbatch, p.instruction.chunk, p.freq_mhz]
            for p in plan.stage(session.stage)
        ]
        if plan
        else None,
        "requested": [[k[3], k[2], k[1], f] for k, f in session.first_apply_requests],
    }


def record(session: Any, marks: list[int]) -> dict[str, Any]:
    """What the tests check of an auto run: the plan of this stage against what was asked/applied."""
    plan = session.plan
    first = session.apply_started_iteration
    applied = [c.freq_mhz for c in session.controller.applied]
    return {
        "phase": session.phase,
        "iterations": session.iteration,
        "applied_from": first,
        **plan_rows(session),
        "applied_first_iteration": applied[marks[first] : marks[first + 1]] if plan else None,
        "order_source": plan.workload.get("order_source") if plan else None,
        "placement": plan.workload.get("placement") if plan else None,
        "profiled_freqs_mhz": session.report()["profiled_freqs_mhz"],
    }


def tampered_plan(plan_path: Path, out: Path, rank: int) -> Path:
    """``plan_path`` with stage 1's last two instructions swapped, written by rank 0 to ``out``.

    Collective: every rank waits at a barrier until the file exists.
    """
    import torch.distributed as dist  # noqa: PLC0415

    if rank == 0:
        data = json.loads(plan_path.read_text())
        ins = data["stages"][1]["instructions"]
        ins[-1], ins[-2] = ins[-2], ins[-1]
        out.write_text(json.dumps(data))
    dist.barrier()
    return out
