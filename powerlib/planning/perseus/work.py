"""How much work a plan solve is, estimated before it starts, and the limit it is held to.

The walk (:func:`~powerlib.planning.perseus.frontier.compute_frontier`) takes one max-flow step
per time quantum over every instruction; the direct solve (docs/perseus.md §2.6) is one linear
program with a column per instruction and per unit segment of its cost. Both are held to one
limit in *work units* of about 10 µs each on one core: for the walk a unit is one
instruction-step; for the direct solve the units grow with the square of the program's columns
under HiGHS and with their 1.5th power under the compiled min-cost flow (measured, below). :func:`estimate_pipeline_work` predicts either from the options alone (no
DAG), and :class:`WorkEstimate` refuses a solve past the limit.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from powerlib.errors import PlanError
from powerlib.planning.pipeline import KINDS

__all__ = [
    "DEFAULT_MAX_WORK",
    "DIRECT_SOLVERS",
    "WORK_HINT",
    "WorkEstimate",
    "check_quantum",
    "direct_kind",
    "estimate_pipeline_work",
]

#: The frontier walk's work limit, in instruction-steps (instructions x time quanta between the
#: slowest and the fastest plan). Measured cost here: about 1e-5 s and 10 bytes per unit (GPT-3
#: 175B, 8 stages, M = 96: 5.4e6 units, 54 s, 49 MB; benchmarks/planner.py), so the default
#: admits about 8 minutes and 0.5 GB. ``--max-work`` / ``max_work=`` raises it.
DEFAULT_MAX_WORK = 50_000_000
_SECONDS_PER_UNIT = 1e-5
_BYTES_PER_UNIT = 10.0
#: The direct solve's measured cost on this project's 2-core CI-class machine (GPT-3 175B
#: repeated to N stages, 1F1B, τ = 1 ms; benchmarks/planner_scale.py): HiGHS dual simplex took
#: 2.1 s at 72k columns (16 x 128), 7.3 s at 144k (16 x 256) and 35 s at 288k (32 x 256),
#: about the square of the columns (4e-10 s per column²), and about 1.4 kB of memory per column.
_DIRECT_SECONDS_PER_COLUMN_SQ = 4e-10
_DIRECT_BYTES_PER_COLUMN = 1400.0
#: The compiled min-cost flow (issue 34), whole ``powerlib plan`` processes on the same machine
#: and workload (T_max - 1, T_min, T* and the guard's exact solves on two threads, the guard's
#: replays): 2.7 s at 141k columns (16 x 256), 19 s at 562k (32 x 512), 164 s at 2.25M
#: (64 x 1024), about columns^1.5 (5e-8 s per column^1.5), and about 450 bytes per column.
_FLOW_SECONDS_PER_COLUMN_POW = 5e-8
_FLOW_EXPONENT = 1.5
_FLOW_BYTES_PER_COLUMN = 450.0
SOLVER_KINDS = ("walk", "direct", "flow")


@dataclass(frozen=True, slots=True)
class WorkEstimate:
    """How much work a solve is: the walk's max-flow steps or the direct solve's program.

    Attributes:
        num_instructions: Nodes of the instruction DAG.
        time_steps: Time quanta between the slowest plan's makespan and the fastest one's.
        unit_segments: Unit segments of every instruction's cost (τ each between its fastest
            and its slowest useful duration): the direct solve's columns besides one per node.
        solver: ``walk``, ``direct`` (HiGHS) or ``flow`` (the compiled min-cost flow, which
            also solves direct points): which solve the estimate is for.
    """

    num_instructions: int
    time_steps: int
    unit_segments: int = 0
    solver: str = "walk"

    def __post_init__(self) -> None:
        if self.solver not in SOLVER_KINDS:
            raise PlanError(f"unknown solver {self.solver!r}; choose one of walk, direct, flow")

    @property
    def lp_columns(self) -> int:
        """The direct solve's columns: one finish time per node, the makespan, the segments."""
        return self.num_instructions + 1 + self.unit_segments

    @property
    def work(self) -> int:
        """Work units (about 10 µs each): what the limit is expressed in."""
        if self.solver == "direct":
            units = _DIRECT_SECONDS_PER_COLUMN_SQ * float(self.lp_columns) ** 2 / _SECONDS_PER_UNIT
            return max(1, math.ceil(min(units, 1e18)))
        if self.solver == "flow":
            seconds = _FLOW_SECONDS_PER_COLUMN_POW * math.pow(self.lp_columns, _FLOW_EXPONENT)
            return max(1, math.ceil(min(seconds / _SECONDS_PER_UNIT, 1e18)))
        return self.num_instructions * max(self.time_steps, 1)

    @property
    def time_s(self) -> float:
        """Expected solve time on one core (measured rates, see the module's constants)."""
        return self.work * _SECONDS_PER_UNIT

    @property
    def memory_bytes(self) -> float:
        """Expected memory of the frontier's points (walk) or the linear program (direct)."""
        if self.solver == "direct":
            return self.lp_columns * _DIRECT_BYTES_PER_COLUMN
        if self.solver == "flow":
            return self.lp_columns * _FLOW_BYTES_PER_COLUMN
        return self.work * _BYTES_PER_UNIT

    def describe(self) -> str:
        """One phrase: the counts, the product and the expected time and memory."""
        if self.solver in ("direct", "flow"):
            return (
                f"{self.num_instructions:,} instructions + {self.unit_segments:,} unit segments "
                f"= {self.lp_columns:,} columns = {self.work:.3g} work units (about "
                f"{_duration(self.time_s)} and {_size(self.memory_bytes)})"
            )
        return (
            f"{self.num_instructions:,} instructions x {self.time_steps:,} time steps = "
            f"{self.work:.3g} instruction-steps (about {_duration(self.time_s)} and "
            f"{_size(self.memory_bytes)})"
        )

    def check(self, max_work: int | None, *, hint: str) -> None:
        """Refuse work past ``max_work`` (``None``: no limit).

        Raises:
            PlanError: With the estimate, the limit and ``hint`` (how to raise the limit or
                shrink the problem).
        """
        if max_work is not None and self.work > max_work:
            what = {
                "direct": "the plan's linear program",
                "flow": "the plan's min-cost flow",
            }.get(self.solver, "the frontier")
            raise PlanError(
                f"{what} is too much work: {self.describe()}, over the limit of "
                f"{max_work:.3g}; {hint}"
            )


def _duration(time_s: float) -> str:
    for unit, size in (("h", 3600.0), ("min", 60.0)):
        if time_s >= size:
            return f"{time_s / size:.3g} {unit}"
    return f"{time_s:.2g} s"


def _size(n_bytes: float) -> str:
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6)):
        if n_bytes >= size:
            return f"{n_bytes / size:.3g} {unit}"
    return f"{n_bytes / 1e3:.3g} kB"


#: How to get past the limit, in the words of the CLI (the library names ``max_work=``).
WORK_HINT = (
    "raise --max-work (max_work= from Python), or plan with a larger --unit-time-s or fewer "
    "microbatches"
)


def check_quantum(unit_time_s: float, p_block_w: float = 0.0) -> None:
    """Refuse a time quantum or blocking power the solver cannot use.

    Raises:
        PlanError: ``unit_time_s`` is not a positive number or ``p_block_w`` is negative.
    """
    if not (unit_time_s > 0 and math.isfinite(unit_time_s)):
        raise PlanError(f"--unit-time-s must be a positive number of seconds, got {unit_time_s}")
    if not (p_block_w >= 0 and math.isfinite(p_block_w)):
        raise PlanError(f"--p-block-w must be a non-negative number of watts, got {p_block_w}")


def estimate_pipeline_work(
    option_points: Mapping[tuple[int, str], Sequence[tuple[float, float]]],
    *,
    num_stages: int,
    num_microbatches: int,
    num_chunks: int = 1,
    unit_time_s: float,
    solver: str = "walk",
    direct_solver: str = "auto",
) -> WorkEstimate:
    """Estimate the walk or the direct solve before any schedule is built (cheap: no DAG).

    The walk runs from every instruction at its slowest useful option (the one with the least
    energy: slower ones are dominated) to every one at its fastest. Each stage runs
    ``num_microbatches`` forward+backward pairs per chunk, and an iteration lasts about
    ``M + N - 1`` times the slowest stage's per-microbatch work (exact for balanced 1F1B and
    GPipe). :func:`compute_frontier` checks the exact figure on the DAG afterwards.

    Args:
        option_points: Per ``(stage, kind)``, its options as ``(time_s, energy_j)`` (a profile's
            :meth:`~powerlib.planning.profile.Profile.option_points`, or Kareus's composed
            options).
        num_stages: Pipeline stages N.
        num_microbatches: Microbatches M.
        num_chunks: Model chunks per stage.
        unit_time_s: The time quantum τ.
        solver: ``walk`` or ``direct`` (estimated as ``flow`` where the compiled min-cost flow
            solves the direct points, see :func:`direct_kind`), or ``flow``.
        direct_solver: What solves direct points: ``auto`` or ``highs`` (:func:`direct_kind`).

    Raises:
        PlanError: ``unit_time_s`` is not a positive number.
    """
    check_quantum(unit_time_s)
    if solver == "direct":
        solver = direct_kind(direct_solver)
    fast_s: list[float] = [0.0]
    slow_s: list[float] = [0.0]
    per_mb = 2
    for stage in range(num_stages):
        present = [k for k in KINDS if option_points.get((stage, k))]
        # A full backward where there is one, else its input and weight parts.
        if "backward" in present:
            present = [k for k in present if k in ("forward", "backward")]
        per_mb = max(per_mb, len(present))
        points = [option_points[stage, k] for k in present]
        fast_s.append(num_chunks * math.fsum(min(t for t, _ in p) for p in points))
        slow_s.append(num_chunks * math.fsum(min(p, key=lambda o: (o[1], o[0]))[0] for p in points))
    steps = (num_microbatches + num_stages - 1) * (max(slow_s) - max(fast_s)) / unit_time_s
    # Each instruction's unit segments: τ each between its fastest and slowest useful duration.
    segments = num_microbatches * math.fsum(s - f for s, f in zip(slow_s, fast_s)) / unit_time_s
    instructions = num_stages * num_microbatches * num_chunks * per_mb
    return WorkEstimate(
        num_instructions=instructions,
        time_steps=int(min(max(steps, 0), 1e18)),
        unit_segments=int(min(max(segments, 0), 1e18)),
        solver=solver,
    )


DIRECT_SOLVERS = ("auto", "highs")
"""What may solve direct points: ``auto`` (the compiled flow where it is built, else HiGHS) or
``highs`` (HiGHS even where the flow is built: benchmarks compare both; the caller passes
:func:`powerlib.config.direct_solver`, ``POWERLIB_DIRECT_SOLVER``)."""


def direct_kind(direct_solver: str = "auto") -> str:
    """What solves direct points here: ``flow`` (the compiled extension) or ``direct`` (HiGHS).

    Args:
        direct_solver: One of :data:`DIRECT_SOLVERS`.
    """
    from powerlib.planning.perseus import mincost  # noqa: PLC0415 - keep this module light

    if direct_solver not in DIRECT_SOLVERS:
        raise PlanError(
            f"direct_solver must be one of {', '.join(DIRECT_SOLVERS)}, got {direct_solver!r}"
        )
    if mincost.available() and direct_solver != "highs":
        return "flow"
    return "direct"
