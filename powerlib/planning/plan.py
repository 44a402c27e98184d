"""The frequency plan a session applies: JSON (schema ``powerlib.plan.v1``) in, validated, out.

A plan says, for every pipeline stage, the instructions of one iteration in execution order and
the SM frequency each one runs at::

    {"schema": "powerlib.plan.v1",
     "workload": {"num_stages": 2, "num_microbatches": 2, "schedule": "1f1b", ...},
     "policy": "fastest", "time_s": 0.41, "energy_j": 512.0, ...,
     "stages": [{"stage": 0, "instructions": [
         {"kind": "forward", "microbatch": 0, "chunk": 0, "freq_mhz": 1410.0}, ...]}, ...]}

:meth:`Frontier.plan_json <powerlib.planning.perseus.frontier.Frontier.plan_json>` writes it.
Reading never evaluates anything; every validation error is one :class:`PlanError` line that
names the file and the offending entry. This module is pure (standard library only).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from powerlib.errors import PlanError
from powerlib.planning.pipeline import KINDS, Instruction

__all__ = ["PLAN_SCHEMA", "FrequencyPlan", "PlannedInstruction"]

PLAN_SCHEMA = "powerlib.plan.v1"


@dataclass(frozen=True, slots=True)
class PlannedInstruction:
    """One instruction of a stage's plan and its frequency."""

    instruction: Instruction
    freq_mhz: float

    @property
    def key(self) -> tuple[int, int, int, str]:
        """``(stage, chunk, microbatch, kind)``: how a session looks the instruction up."""
        ins = self.instruction
        return (ins.stage, ins.chunk, ins.microbatch, ins.kind)


@dataclass(frozen=True, slots=True)
class FrequencyPlan:
    """A validated plan: per stage, the instructions in execution order with their frequency.

    Attributes:
        stages: ``stages[s]`` is stage ``s``'s instructions in execution order.
        workload: The workload metadata (stages, microbatches, schedule, P_block, ...).
        summary: The remaining top-level fields (policy, predicted time and energy, ...).
        source: Where it was read from, for error messages.
    """

    stages: tuple[tuple[PlannedInstruction, ...], ...]
    workload: Mapping[str, Any] = field(default_factory=dict)
    summary: Mapping[str, Any] = field(default_factory=dict)
    source: str = "<plan>"

    @property
    def num_stages(self) -> int:
        """Number of pipeline stages."""
        return len(self.stages)

    def stage(self, stage: int) -> tuple[PlannedInstruction, ...]:
        """One stage's instructions in execution order.

        Raises:
            PlanError: The plan has no such stage.
        """
        if (
            isinstance(stage, bool)
            or not isinstance(stage, int)
            or not 0 <= stage < len(self.stages)
        ):
            raise PlanError(
                f"{self.source}: the plan has {len(self.stages)} stage(s); there is no stage {stage!r}"
            )
        return self.stages[stage]

    def frequencies(self, stage: int) -> list[float]:
        """One stage's frequencies in execution order."""
        return [p.freq_mhz for p in self.stage(stage)]

    def check_frequencies(self, supported_mhz: Sequence[float], stage: int | None = None) -> None:
        """Every planned frequency (of ``stage``, or all) must be one the device can lock.

        Raises:
            PlanError: Naming the first unsupported frequency and the supported range.
        """
        if not supported_mhz:
            raise PlanError(f"{self.source}: the device cannot lock its SM clock")
        allowed = set(supported_mhz)
        stages = range(len(self.stages)) if stage is None else [stage]
        for s in stages:
            for p in self.stage(s):
                if p.freq_mhz not in allowed:
                    raise PlanError(
                        f"{self.source}: stage {s} {p.instruction} asks for {p.freq_mhz:g} MHz, "
                        f"which the device does not support ({min(allowed):g}-{max(allowed):g} MHz)"
                    )

    @classmethod
    def read(cls, path: str | Path) -> FrequencyPlan:
        """Read and validate a plan file.

        Raises:
            PlanError: Unreadable file, malformed JSON, or an invalid plan.
        """
        source = str(path)
        try:
            text = Path(path).read_text(encoding="utf-8")
        except OSError as err:
            raise PlanError(f"{source}: cannot read the plan: {err.strerror or err}") from err
        try:
            data = json.loads(text)
        except ValueError as err:
            raise PlanError(f"{source}: not valid JSON: {err}") from err
        return cls.from_json(data, source=source)

    @classmethod
    def from_json(cls, data: Any, *, source: str = "<plan>") -> FrequencyPlan:
        """Validate a decoded plan.

        Raises:
            PlanError: One line naming the first problem.
        """
        if not isinstance(data, dict):
            raise PlanError(f"{source}: a plan is a JSON object, got {type(data).__name__}")
        if data.get("schema") != PLAN_SCHEMA:
            raise PlanError(f"{source}: schema is {data.get('schema')!r}, expected {PLAN_SCHEMA!r}")
        workload = data.get("workload", {})
        if not isinstance(workload, dict):
            raise PlanError(f"{source}: 'workload' must be an object")
        stages_raw = data.get("stages")
        if not isinstance(stages_raw, list) or not stages_raw:
            raise PlanError(f"{source}: 'stages' must be a non-empty list")
        stages: list[tuple[PlannedInstruction, ...]] = []
        for s, entry in enumerate(stages_raw):
            where = f"{source}: stages[{s}]"
            if not isinstance(entry, dict):
                raise PlanError(f"{where} must be an object")
            if entry.get("stage", s) != s:
                raise PlanError(
                    f"{where} says stage {entry.get('stage')!r}; stages must be in order"
                )
            items = entry.get("instructions")
            if not isinstance(items, list) or not items:
                raise PlanError(f"{where}.instructions must be a non-empty list")
            planned = []
            seen: set[tuple[int, int, int, str]] = set()
            for i, item in enumerate(items):
                p = _instruction(item, s, f"{where}.instructions[{i}]")
                if p.key in seen:
                    raise PlanError(f"{where}.instructions[{i}]: {p.instruction} appears twice")
                seen.add(p.key)
                planned.append(p)
            stages.append(tuple(planned))
        expected = workload.get("num_stages")
        if expected is not None and expected != len(stages):
            raise PlanError(
                f"{source}: workload.num_stages is {expected!r} but the plan has {len(stages)} stage(s)"
            )
        summary = {k: v for k, v in data.items() if k not in ("schema", "workload", "stages")}
        return cls(stages=tuple(stages), workload=dict(workload), summary=summary, source=source)

    def to_json(self) -> dict[str, Any]:
        """The plan as JSON data (round-trips through :meth:`from_json`)."""
        return {
            "schema": PLAN_SCHEMA,
            "workload": dict(self.workload),
            **dict(self.summary),
            "stages": [
                {
                    "stage": s,
                    "instructions": [
                        {
                            "kind": p.instruction.kind,
                            "microbatch": p.instruction.microbatch,
                            "chunk": p.instruction.chunk,
                            "freq_mhz": p.freq_mhz,
                        }
                        for p in planned
                    ],
                }
                for s, planned in enumerate(self.stages)
            ],
        }


def _instruction(item: Any, stage: int, where: str) -> PlannedInstruction:
    if not isinstance(item, dict):
        raise PlanError(f"{where} must be an object")
    kind = item.get("kind")
    if kind not in KINDS:
        raise PlanError(f"{where}: kind must be one of {', '.join(KINDS)}, got {kind!r}")
    freq = item.get("freq_mhz")
    if (
        isinstance(freq, bool)
        or not isinstance(freq, int | float)
        or not math.isfinite(freq)
        or freq <= 0
    ):
        raise PlanError(f"{where}: freq_mhz must be a positive number, got {freq!r}")
    try:
        ins = Instruction(
            stage=stage,
            microbatch=item.get("microbatch"),
            kind=kind,
            chunk=item.get("chunk", 0),
        )
    except PlanError as err:
        raise PlanError(f"{where}: {err}") from err
    return PlannedInstruction(ins, float(freq))
