"""The frequency plan a session applies: JSON (schema ``powerlib.plan.v1``) in, validated, out.

A plan says, for every pipeline stage, the instructions of one iteration in execution order and
the SM frequency each one runs at::

    {"schema": "powerlib.plan.v1",
     "workload": {"num_stages": 2, "num_microbatches": 2, "schedule": "1f1b", ...},
     "policy": "fastest", "time_s": 0.41, "energy_j": 512.0, ...,
     "stages": [{"stage": 0, "instructions": [
         {"kind": "forward", "microbatch": 0, "chunk": 0, "freq_mhz": 1410.0}, ...]}, ...]}

:meth:`Frontier.plan <powerlib.planning.perseus.frontier.Frontier.plan>` builds one;
:meth:`FrequencyPlan.write` and :meth:`FrequencyPlan.read` are the only writer and reader of the
file format, and :meth:`FrequencyPlan.grid` draws a plan as text. Reading never evaluates anything; every validation error is one :class:`PlanError` line that
names the file and the offending entry. This module is pure (standard library only).
"""

from __future__ import annotations

import json
import math
import textwrap
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from powerlib.errors import PlanError
from powerlib.inputs import load_json_file
from powerlib.planning.pipeline import KIND_LETTERS, KINDS, Instruction, InstructionKey, build_dag

__all__ = ["EXECUTIONS", "PLAN_SCHEMA", "FrequencyPlan", "PartitionSetting", "PlannedInstruction"]

PLAN_SCHEMA = "powerlib.plan.v1"

EXECUTIONS = ("sequential", "nanobatch")
"""How an instruction of an overlap plan runs: whole microbatch, or two overlapped nanobatches."""


@dataclass(frozen=True, slots=True)
class PartitionSetting:
    """How one partition type runs inside an instruction (Kareus overlap plans).

    Attributes:
        slot: The launch slot whose first kernel the collective starts with (``rope_0``), or
            ``None``: after the compute (no overlap).
        sm_count: CTAs (one per SM) of the communication kernel; on NCCL, the communicator's
            CTA limit.
        block_size: Threads per CTA.
    """

    slot: str | None
    sm_count: int
    block_size: int = 1024

    def to_json(self) -> dict[str, object]:
        """``{"slot", "sm_count", "block_size"}``."""
        return {"slot": self.slot, "sm_count": self.sm_count, "block_size": self.block_size}


@dataclass(frozen=True, slots=True)
class PlannedInstruction:
    """One instruction of a stage's plan and its frequency.

    Attributes:
        instruction: Which instruction.
        freq_mhz: Its locked SM clock.
        execution: ``sequential`` (a Perseus plan, or an overlap plan's whole-microbatch option)
            or ``nanobatch`` (two overlapped nanobatches, configured by ``overlap``).
        overlap: Per partition type (``fwd_attn``, ...), its setting; empty unless nanobatched.
        planned_time_s: The duration the planner gave it (a multiple of the time quantum), when
            the plan records one.
        predicted_time_s: The planner's time for it, when the plan records one.
        predicted_energy_j: The planner's energy for it, when the plan records one.
        option_source: Where an overlap plan's option came from (``search``, ``stock`` or
            ``sequential``), when the plan records it.
    """

    instruction: Instruction
    freq_mhz: float
    execution: str = "sequential"
    overlap: Mapping[str, PartitionSetting] = field(default_factory=dict)
    planned_time_s: float | None = None
    predicted_time_s: float | None = None
    predicted_energy_j: float | None = None
    option_source: str | None = None

    @property
    def key(self) -> InstructionKey:
        """``(stage, chunk, microbatch, kind)``: how a session looks the instruction up."""
        return self.instruction.key


@dataclass(frozen=True, slots=True)
class FrequencyPlan:
    """A validated plan: per stage, the instructions in execution order with their frequency.

    Attributes:
        stages: ``stages[s]`` is stage ``s``'s instructions in execution order.
        workload: The workload metadata (stages, microbatches, schedule, P_block, ...).
        summary: The remaining top-level fields (policy, predicted time and energy, ...).
        source: Where it was read from, for error messages.
        power_limits_w: Per stage, the power limit its GPUs run under (the ``power-budget``
            policy, docs/perseus.md §7; JSON: the stage's ``power_limit_w``); a stage not in
            it keeps the limit it has.
    """

    stages: tuple[tuple[PlannedInstruction, ...], ...]
    workload: Mapping[str, Any] = field(default_factory=dict)
    summary: Mapping[str, Any] = field(default_factory=dict)
    source: str = "<plan>"
    power_limits_w: Mapping[int, float] = field(default_factory=dict)

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

    def power_limit_w(self, stage: int) -> float | None:
        """The power limit the plan sets on ``stage``'s GPUs (W), or ``None``: it sets none."""
        limit_w = self.power_limits_w.get(stage)
        return None if limit_w is None else float(limit_w)

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

    def check_workload(
        self,
        *,
        num_stages: int | None = None,
        num_microbatches: int | None = None,
        schedule: str | None = None,
        num_chunks: int | None = None,
        placement: str | None = None,
        against: str = "the session",
    ) -> None:
        """Refuse a plan made for another workload than the one it is applied to.

        The plan's workload is what its ``workload`` metadata says, and where that is silent,
        what its instructions show (microbatches and chunks: one more than the largest index);
        metadata that contradicts the instructions is refused too. Only the arguments given are
        compared. A schedule named ``recorded`` on either side, or a plan planned on the order
        its hooks recorded (``workload.order_source == "recorded"``), leaves the order to the
        session's check of the first iteration.

        Args:
            num_stages: Pipeline stages of the session or profile.
            num_microbatches: Microbatches per iteration.
            schedule: The schedule's name.
            num_chunks: Model chunks per stage.
            placement: ``looped`` or ``v``.
            against: What the plan is compared with, for the message (``the session``, ``the
                profile x.csv``).

        Raises:
            PlanError: One line naming the plan, both values and what they count, e.g.
                ``plan.json: the plan has 4 stages, the session has 8``.
        """
        instructions = [p.instruction for stage in self.stages for p in stage]
        shown = {
            "num_microbatches": 1 + max(ins.microbatch for ins in instructions),
            "num_chunks": 1 + max(ins.chunk for ins in instructions),
        }
        for name, value in shown.items():
            said = self.workload.get(name)
            if said is not None and said != value:
                raise PlanError(
                    f"{self.source}: workload.{name} is {repr(said)[:40]} but the plan's "
                    f"instructions have {value}"
                )
        if num_stages is not None and self.num_stages != num_stages:
            raise PlanError(
                f"{self.source}: the plan has {_count(self.num_stages, 'stage')}, {against} has "
                f"{num_stages}"
            )
        if num_microbatches is not None and shown["num_microbatches"] != num_microbatches:
            raise PlanError(
                f"{self.source}: the plan is for "
                f"{_count(shown['num_microbatches'], 'microbatch', 'microbatches')}, {against} "
                f"has {num_microbatches}"
            )
        if num_chunks is not None and shown["num_chunks"] != num_chunks:
            raise PlanError(
                f"{self.source}: the plan has {_count(shown['num_chunks'], 'chunk')} per stage, "
                f"{against} has {num_chunks}"
            )
        planned = self.workload.get("schedule")
        if (
            schedule is not None
            and planned is not None
            and planned != schedule
            and RECORDED not in (planned, schedule)
            and self.workload.get("order_source") != RECORDED
        ):
            raise PlanError(
                f"{self.source}: the plan is for the {planned} schedule, {against} runs {schedule}"
            )
        planned = self.workload.get("placement")
        if placement is not None and planned is not None and planned != placement:
            raise PlanError(
                f"{self.source}: the plan is for the {planned} placement, {against} uses "
                f"{placement}"
            )

    @classmethod
    def read(cls, path: str | Path) -> FrequencyPlan:
        """Read and validate a plan file.

        Raises:
            PlanError: Unreadable file, malformed JSON, or an invalid plan.
        """
        data = load_json_file(path, what="plan", error=PlanError)
        return cls.from_json(data, source=str(path))

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
        limits_w: dict[int, float] = {}
        for s, entry in enumerate(stages_raw):
            where = f"{source}: stages[{s}]"
            if not isinstance(entry, dict):
                raise PlanError(f"{where} must be an object")
            limit_w = _number(entry, "power_limit_w", where)
            if limit_w is not None and limit_w <= 0:
                raise PlanError(f"{where}: power_limit_w must be > 0 W, got {limit_w:g}")
            if limit_w is not None:
                limits_w[s] = limit_w
            if entry.get("stage", s) != s:
                raise PlanError(
                    f"{where} says stage {entry.get('stage')!r}; stages must be in order"
                )
            items = entry.get("instructions")
            if not isinstance(items, list) or not items:
                raise PlanError(f"{where}.instructions must be a non-empty list")
            planned = []
            seen: set[InstructionKey] = set()
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
        return cls(
            stages=tuple(stages),
            workload=dict(workload),
            summary=summary,
            source=source,
            power_limits_w=limits_w,
        )

    def write(self, path: str | Path) -> None:
        """Write the plan file (one JSON document, schema ``powerlib.plan.v1``)."""
        Path(path).write_text(json.dumps(self.to_json(), indent=1) + "\n", encoding="utf-8")

    def grid(self, width: int = 100) -> str:
        """The plan drawn as text: one row per stage, time running left to right.

        Each of a row's ``width`` cells shows what the stage runs at the middle of the cell: the
        instruction's kind letter (F forward, B backward, I backward input, W backward weight),
        or ``.`` while the stage is idle. A second block draws the same rows with each
        instruction's SM clock as a symbol that the last line resolves to MHz (``0`` is the
        highest clock). Start times follow from the plan's own order and durations through the
        pipeline DAG (:func:`~powerlib.planning.pipeline.build_dag` with the plan's placement):
        an instruction starts when its stage's previous one and the one it depends on have
        ended. An instruction lasts its ``planned_time_s``, else its ``predicted_time_s``; when
        some instruction records neither (or all durations are zero), every instruction lasts
        one unit and the header says so. Pure: the plan is not changed.

        Args:
            width: Cells per row, at least 1.

        Returns:
            The header, the instruction rows, the clock rows and the clock legend, one per line
            (no trailing newline).

        Raises:
            PlanError: ``width`` is below 1, or the instructions do not form a pipeline
                schedule.
        """
        if isinstance(width, bool) or not isinstance(width, int) or width < 1:
            raise PlanError(f"a plan grid is at least 1 cell wide, got {width!r}")
        schedule = [[p.instruction for p in stage] for stage in self.stages]
        dag = build_dag(schedule, str(self.workload.get("placement", "looped")))
        planned = [p for stage in self.stages for p in stage]  # the DAG's node order
        times, missing = _grid_durations(planned)
        starts = dag.start_times(times)
        total = max(start + t for start, t in zip(starts, times))
        symbols, legend = _clock_symbols(sorted({p.freq_mhz for p in planned}, reverse=True))
        label = len(f"S{self.num_stages - 1}")
        kinds, clocks = [], []
        node = 0
        for s, stage in enumerate(self.stages):
            spans = [(starts[node + i], times[node + i], p) for i, p in enumerate(stage)]
            node += len(stage)
            prefix = f"S{s}".ljust(label)
            letters = _cells(spans, width, total, lambda p: KIND_LETTERS[p.instruction.kind])
            kinds.append(f"{prefix} |{letters}|")
            clocks.append(
                f"{prefix} |{_cells(spans, width, total, lambda p: symbols[p.freq_mhz])}|"
            )
        what = self._grid_title(1 + max(p.instruction.microbatch for p in planned))
        when = _grid_scale(total, width, missing, len(planned))
        return "\n".join(
            [
                f"{what}: {when}",
                "instructions (F forward, B backward, I backward input, W backward weight, . idle):",
                *kinds,
                "SM clock of each instruction (. idle):",
                *clocks,
                *textwrap.wrap(
                    "clock: " + ", ".join(legend),
                    width=max(label + width + 3, 60),
                    subsequent_indent="       ",
                ),
            ]
        )

    def _grid_title(self, microbatches: int) -> str:
        """What :meth:`grid` draws: the policy, the pipeline's size and its schedule."""
        what = f"{self.policy} plan" if self.policy else "plan"
        what += (
            f", {_count(self.num_stages, 'stage')} x "
            f"{_count(microbatches, 'microbatch', 'microbatches')}"
        )
        if self.workload.get("schedule"):
            what += f" ({self.workload['schedule']})"
        return what

    @property
    def policy(self) -> str:
        """The policy that chose the plan (``""`` when the file does not say)."""
        return str(self.summary.get("policy", ""))

    def to_json(self) -> dict[str, object]:
        """The plan as JSON data (round-trips through :meth:`from_json`)."""
        return {
            "schema": PLAN_SCHEMA,
            "workload": dict(self.workload),
            **dict(self.summary),
            "stages": [
                {
                    "stage": s,
                    **({"power_limit_w": limit_w} if (limit_w := self.power_limit_w(s)) else {}),
                    "instructions": [_instruction_json(p) for p in planned],
                }
                for s, planned in enumerate(self.stages)
            ],
        }


RECORDED = "recorded"
"""The schedule name of an order that only the training loop's hooks know."""


def _count(n: int, singular: str, plural: str | None = None) -> str:
    return f"{n} {singular if n == 1 else plural or singular + 's'}"


_CLOCK_SYMBOLS = "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"


def _clock_symbols(freqs_mhz: Sequence[float]) -> tuple[dict[float, str], list[str]]:
    """A symbol per clock (highest first) and the legend's entries.

    Beyond the alphabet, neighbouring clocks share a symbol and its entry names their range.
    """
    n = len(_CLOCK_SYMBOLS)
    step = max(1, -(-len(freqs_mhz) // n))  # clocks per symbol
    symbols = {f: _CLOCK_SYMBOLS[i // step] for i, f in enumerate(freqs_mhz)}
    legend = []
    for symbol in dict.fromkeys(symbols.values()):
        shared = [f for f in freqs_mhz if symbols[f] == symbol]
        span = f"{shared[0]:g}" if len(shared) == 1 else f"{shared[-1]:g}-{shared[0]:g}"
        legend.append(f"{symbol} = {span} MHz")
    return symbols, legend


def _grid_durations(planned: Sequence[PlannedInstruction]) -> tuple[list[float], int]:
    """Each instruction's drawn duration (its ``planned_time_s``, else ``predicted_time_s``).

    Returns ``(durations, missing)``: ``missing`` counts the instructions that record neither
    (all of them when every duration is zero); when it is not zero, every instruction is
    drawn one unit long.
    """
    recorded = [
        p.predicted_time_s if p.planned_time_s is None else p.planned_time_s for p in planned
    ]
    missing = recorded.count(None)
    times = [1.0 if t is None else t for t in recorded]
    if missing == 0 and max(times) <= 0:
        missing = len(times)
    if missing:
        times = [1.0] * len(planned)
    return times, missing


def _grid_scale(total: float, width: int, missing: int, count: int) -> str:
    """The grid header's time scale, or why every instruction is drawn one unit long."""
    if not missing:
        return f"iteration {total:.4g} s, {width} columns of {total / width:.3g} s"
    which = "any" if missing == count else f"{missing} of {count}"
    return (
        f"the plan records no duration for {which} instructions, so each instruction is "
        f"drawn one unit long: iteration {total:g} units, {width} columns of "
        f"{total / width:.3g} units"
    )


def _cells(
    spans: Sequence[tuple[float, float, PlannedInstruction]],
    width: int,
    total: float,
    symbol: Callable[[PlannedInstruction], str],
) -> str:
    """One row: per cell, the symbol of the instruction running at the cell's middle, or ``.``.

    Args:
        spans: ``(start, duration, instruction)`` in order, not overlapping.
        width: Cells.
        total: The time the row covers.
        symbol: What a cell shows of an instruction.
    """
    out = []
    k = 0
    for c in range(width):
        t = (c + 0.5) * total / width
        while k < len(spans) and spans[k][0] + spans[k][1] <= t:
            k += 1
        out.append(symbol(spans[k][2]) if k < len(spans) and spans[k][0] <= t else ".")
    return "".join(out)


def _instruction_json(p: PlannedInstruction) -> dict[str, object]:
    out: dict[str, object] = {
        "kind": p.instruction.kind,
        "microbatch": p.instruction.microbatch,
        "chunk": p.instruction.chunk,
        "freq_mhz": p.freq_mhz,
    }
    if p.planned_time_s is not None:
        out["planned_time_s"] = p.planned_time_s
    if p.predicted_time_s is not None:
        out["predicted_time_s"] = p.predicted_time_s
    if p.predicted_energy_j is not None:
        out["predicted_energy_j"] = p.predicted_energy_j
    if p.execution != "sequential" or p.overlap or p.option_source is not None:
        out["execution"] = p.execution
        out["overlap"] = {key: setting.to_json() for key, setting in p.overlap.items()}
    if p.option_source is not None:
        out["option_source"] = p.option_source
    return out


def _number(item: dict[str, object], name: str, where: str) -> float | None:
    value = item.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise PlanError(f"{where}: {name} must be a finite number, got {value!r}")
    return float(value)


def _overlap(item: dict[str, object], where: str) -> tuple[str, dict[str, PartitionSetting]]:
    execution = item.get("execution", "sequential")
    if execution not in EXECUTIONS:
        raise PlanError(
            f"{where}: execution must be one of {', '.join(EXECUTIONS)}, got {execution!r}"
        )
    raw = item.get("overlap", {})
    if not isinstance(raw, dict):
        raise PlanError(f"{where}: overlap must be an object of partition settings")
    if execution == "sequential" and raw:
        raise PlanError(f"{where}: a sequential instruction has no partition settings")
    if execution == "nanobatch" and not raw:
        raise PlanError(f"{where}: a nanobatch instruction needs its partition settings")
    settings: dict[str, PartitionSetting] = {}
    for key, entry in raw.items():
        at = f"{where}.overlap.{key}"
        if not isinstance(entry, dict):
            raise PlanError(f"{at} must be an object with slot, sm_count and block_size")
        slot = entry.get("slot")
        if slot is not None and (not isinstance(slot, str) or not slot):
            raise PlanError(f"{at}: slot must be a slot name or null, got {slot!r}")
        sm = entry.get("sm_count")
        if isinstance(sm, bool) or not isinstance(sm, int) or sm < 1:
            raise PlanError(f"{at}: sm_count must be a positive integer, got {sm!r}")
        block = entry.get("block_size", 1024)
        if isinstance(block, bool) or not isinstance(block, int) or block < 1:
            raise PlanError(f"{at}: block_size must be a positive integer, got {block!r}")
        settings[str(key)] = PartitionSetting(slot=slot, sm_count=sm, block_size=block)
    return execution, settings


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
    microbatch: Any = item.get("microbatch")  # unchecked JSON: Instruction validates it
    try:
        ins = Instruction(
            stage=stage,
            microbatch=microbatch,
            kind=kind,
            chunk=item.get("chunk", 0),
        )
    except PlanError as err:
        raise PlanError(f"{where}: {err}") from err
    execution, overlap = _overlap(item, where)
    source = item.get("option_source")
    if source is not None and (not isinstance(source, str) or not source):
        raise PlanError(f"{where}: option_source must be a name, got {source!r}")
    return PlannedInstruction(
        ins,
        float(freq),
        execution=execution,
        overlap=overlap,
        planned_time_s=_number(item, "planned_time_s", where),
        predicted_time_s=_number(item, "predicted_time_s", where),
        predicted_energy_j=_number(item, "predicted_energy_j", where),
        option_source=source,
    )
