"""From partition measurements to per-instruction options, and from those to one frontier.

Composition (docs/kareus.md §2.2, Alg. 2): an instruction (the forward or backward of one microbatch on
one stage) runs at **one clock**, and every partition type in it runs **one configuration** across
all its layers and both nanobatches. For each clock ``f``:

1. Take each partition type's measured configurations at ``f`` and keep their Pareto set in
   (time, dynamic energy).
2. Add them up over the types the instruction runs, each counted ``per_layer × layers`` times
   (a backward with activation checkpointing also re-runs the forward types). Sums of Pareto sets
   are pruned after every type, which is exact: a dominated partial sum stays dominated whatever
   is added to it. The artifact enumerates the full cartesian product instead.
3. Multiply by ``correction`` (the artifact hard-codes 1.15 for the gap between isolated and
   in-situ partitions; here it is a parameter, calibrated by :func:`calibrate_correction`, and
   1.0 on the simulator where partitions compose exactly).
4. Add the non-partition work of the stage (embedding; output layer and loss).
5. Add two more candidates per clock: **sequential** execution of the whole microbatch
   (execution-model switching, docs/kareus.md §4.5) and the **stock** nanobatched configuration
   (collective launched as soon as possible with the library's default SM count: plain
   nanobatching). Both are measured, so the composed set can only be better than either.

The options then go into the same Phillips–Dessouky solver as Perseus
(:func:`~powerlib.planning.perseus.frontier.compute_frontier` with ``candidates=``): each option's
knob is its execution mode plus the configuration of every partition type (:class:`Knob`), and
its cost is dynamic energy, static energy being charged once as ``stages · P_static · T``.

Pure: measurements in, options and frontiers out.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypedDict

from powerlib.errors import PlanError
from powerlib.kareus.evaluator import Evaluator, Measurement
from powerlib.kareus.partition import PartitionWorkload
from powerlib.kareus.partition_types import BLOCK_SIZE, Config, PartitionType
from powerlib.planning.perseus.frontier import Frontier, FrontierSettings, compute_frontier
from powerlib.planning.perseus.points import FrontierPoint
from powerlib.planning.perseus.work import DEFAULT_MAX_WORK
from powerlib.planning.pipeline import BACKWARD, FORWARD, Schedule

__all__ = [
    "METHODS",
    "STOCK_SM_COUNT",
    "Components",
    "Knob",
    "ComposedOptions",
    "KnobFields",
    "SettingFields",
    "calibrate_correction",
    "compose_options",
    "measure_components",
    "method_frontier",
    "pareto_indices",
    "sample_frontier",
]

STOCK_SM_COUNT = 24
"""SMs a stock collective (NCCL choosing its own channels) occupies: the sequential and plain
nanobatching baselines use it. [assumption] NCCL on NVSwitch A100 commonly runs 16-32 channels."""

METHODS = ("kareus", "perseus", "nanobatch")
"""``kareus``: composed options + sequential + stock; ``perseus``: sequential only (Megatron-LM +
Perseus, "M+P"); ``nanobatch``: stock nanobatching only ("N+P")."""

_KINDS = (FORWARD, BACKWARD)


class SettingFields(TypedDict):
    """One partition type's setting in a plan (:class:`~powerlib.planning.plan.PartitionSetting`)."""

    slot: str | None
    sm_count: int
    block_size: int


class KnobFields(TypedDict):
    """The plan fields of a Kareus option: what the planner writes into its instruction."""

    execution: str
    overlap: dict[str, SettingFields]
    option_source: str


@dataclass(frozen=True, slots=True)
class Knob:
    """What an instruction option sets besides its clock.

    Attributes:
        execution: ``sequential`` or ``nanobatch``.
        configs: Per partition type key, its configuration (nanobatch only).
        source: ``search`` (composed from measured configurations), ``stock`` or ``sequential``.
    """

    execution: str
    configs: tuple[tuple[str, Config], ...] = ()
    source: str = "search"

    def to_plan(self) -> KnobFields:
        """Plan fields: ``execution`` and ``overlap`` (slot, SM count, block size per type)."""
        return {
            "execution": self.execution,
            "overlap": {
                key: {"slot": c.slot, "sm_count": c.sm_count, "block_size": BLOCK_SIZE}
                for key, c in self.configs
            },
            "option_source": self.source,
        }


ComposedOptions = dict[tuple[int, str], list[tuple[float, float, float, Knob]]]
"""Per ``(stage, kind)``, an instruction's options ``(freq_mhz, time_s, energy_j, knob)``."""


@dataclass(frozen=True, slots=True)
class Components:
    """Everything measured besides the searched partitions, per clock.

    Attributes:
        p_static_w: Static power the dynamic energies were computed with.
        sequential: ``(phase, freq) ->`` one layer without nanobatching, microbatch-sized.
        extras: ``(stage, kind, freq) ->`` the stage's non-partition work.
        stock: ``(partition key, freq) ->`` the stock configuration of that partition type.
        stock_sm_count: SM count of the stock collective.
    """

    p_static_w: float
    sequential: Mapping[tuple[str, float], Measurement]
    extras: Mapping[tuple[int, str, float], Measurement]
    stock: Mapping[tuple[str, float], Measurement]
    stock_sm_count: int = STOCK_SM_COUNT
    freqs_mhz: tuple[float, ...] = field(default=())


def _stock_config(ptype: PartitionType, freq_mhz: float, sm_count: int) -> Config:
    """Plain nanobatching: launch as soon as possible (first slot), stock SM count."""
    return Config(freq_mhz=freq_mhz, sm_count=sm_count, slot=ptype.slots[0])


def measure_components(
    workload: PartitionWorkload,
    evaluator: Evaluator,
    freqs_mhz: Sequence[float],
    *,
    stock_sm_count: int = STOCK_SM_COUNT,
    progress: Callable[[int, int, str], None] | None = None,
) -> Components:
    """Measure the sequential layers, the non-partition work and the stock configurations.

    Args:
        workload: The model, parallelism and stages.
        evaluator: What measures (simulator or GPUs).
        freqs_mhz: Clocks (those the partitions were searched at).
        stock_sm_count: SMs of a stock collective.
        progress: ``(done, total, what)`` callback.
    """
    freqs = sorted({float(f) for f in freqs_mhz})
    if not freqs:
        raise PlanError("measure_components needs at least one clock")
    jobs: list[tuple[str, Any]] = []
    for f in freqs:
        for phase in ("fwd", "bwd"):
            jobs.append(("sequential", (phase, f)))
        for st in workload.stages:
            for kind, ops in ((FORWARD, st.extra_forward), (BACKWARD, st.extra_backward)):
                if ops:
                    jobs.append(("extra", (st.stage, kind, f, ops)))
        for p in workload.partitions:
            jobs.append(("stock", (p, f)))
    sequential: dict[tuple[str, float], Measurement] = {}
    extras: dict[tuple[int, str, float], Measurement] = {}
    stock: dict[tuple[str, float], Measurement] = {}
    for n, (what, arg) in enumerate(jobs, 1):
        if what == "sequential":
            phase, f = arg
            sequential[(phase, f)] = evaluator.evaluate_sequential(
                workload.sequential[phase], f, stock_sm_count
            )
        elif what == "extra":
            stage, kind, f, ops = arg
            extras[(stage, kind, f)] = evaluator.evaluate_compute(ops, f)
        else:
            p, f = arg
            stock[(p.key, f)] = evaluator.evaluate(p, _stock_config(p, f, stock_sm_count))
        if progress is not None:
            progress(n, len(jobs), what)
    return Components(
        p_static_w=evaluator.p_static_w,
        sequential=sequential,
        extras=extras,
        stock=stock,
        stock_sm_count=stock_sm_count,
        freqs_mhz=tuple(freqs),
    )


def pareto_indices(times: Sequence[float], costs: Sequence[float]) -> list[int]:
    """Indices of the non-dominated ``(time, cost)`` points, fastest first (ties: cheapest).

    A point is dropped if another is no slower and no costlier and differs in one of them;
    of exact duplicates the first is kept.
    """
    order = sorted(range(len(times)), key=lambda i: (times[i], costs[i], i))
    keep: list[int] = []
    best = math.inf
    for i in order:
        if costs[i] < best:
            keep.append(i)
            best = costs[i]
    return keep


_Partial = tuple[float, float, tuple[tuple[str, Config], ...]]
_Fronts = dict[str, dict[float, list[_Partial]]]
"""Per partition type key, per clock: the Pareto set of its measured configurations."""


def _pareto(items: list[_Partial]) -> list[_Partial]:
    idx = pareto_indices([t for t, _, _ in items], [e for _, e, _ in items])
    return [items[i] for i in idx]


def _types_of(
    workload: PartitionWorkload, kind: str, layers: int
) -> list[tuple[str, PartitionType, int]]:
    """(plan key, partition type, multiplicity) of one instruction.

    The forward types a backward recomputes get the plan key ``recompute_<key>``.
    """
    out = []
    for ptype, per_layer in workload.instruction_types(kind):
        key = ptype.key
        if kind == BACKWARD and ptype.phase == "fwd":
            key = f"recompute_{key}"
        out.append((key, ptype, per_layer * layers))
    return out


def compose_options(
    workload: PartitionWorkload,
    records: Mapping[str, Iterable[tuple[Config, float, float]]],
    components: Components,
    *,
    method: str = "kareus",
    correction: float = 1.0,
) -> ComposedOptions:
    """Per ``(stage, kind)``, the instruction options ``(freq_mhz, time_s, energy_j, knob)``.

    Args:
        workload: The model, parallelism and stages.
        records: Per partition type key, every measured ``(config, time_s, dynamic_energy_j)``
            (the whole evaluation log, not only its Pareto set; docs/kareus.md §2.1). Needed for
            ``method="kareus"`` only.
        components: Sequential, extra and stock measurements (:func:`measure_components`).
        method: One of :data:`METHODS`.
        correction: Factor on composed partition sums (time and dynamic energy).

    Returns:
        Options whose energy is total energy (dynamic + ``P_static · time``), Pareto-pruned in
        (time, dynamic energy) per ``(stage, kind)``.

    Raises:
        PlanError: Unknown method, a non-positive correction, or a clock some partition type
            was not measured at.
    """
    if method not in METHODS:
        raise PlanError(f"method must be one of {', '.join(METHODS)}, got {method!r}")
    if not (math.isfinite(correction) and correction > 0):
        raise PlanError(f"correction must be a positive number, got {correction!r}")
    p_s = components.p_static_w
    freqs = list(components.freqs_mhz)
    by_type: _Fronts = {}
    if method == "kareus":
        by_type, freqs = _searched_fronts(workload, records, freqs)
    out: ComposedOptions = {}
    for st in workload.stages:
        for kind in _KINDS:
            types = _types_of(workload, kind, st.layers)
            cands: list[tuple[float, float, float, Knob]] = []  # (f, t, dyn, knob)
            for f in freqs:
                ext = components.extras.get((st.stage, kind, f))
                ext_t = ext.time_s if ext else 0.0
                ext_d = ext.dynamic_energy_j if ext else 0.0
                if method in ("kareus", "perseus"):
                    t, d = _sequential_sum(workload, components, kind, f, st.layers)
                    cands.append((f, t + ext_t, d + ext_d, Knob("sequential", (), "sequential")))
                nanobatched: list[tuple[float, float, Knob]] = []
                if method in ("kareus", "nanobatch"):
                    nanobatched.append(_stock_sum(components, types, f))
                if method == "kareus":
                    nanobatched += _searched_sums(by_type, types, f)
                for t, d, knob in nanobatched:
                    cands.append((f, correction * t + ext_t, correction * d + ext_d, knob))
            keep = pareto_indices([c[1] for c in cands], [c[2] for c in cands])
            out[(st.stage, kind)] = [
                (cands[i][0], cands[i][1], cands[i][2] + p_s * cands[i][1], cands[i][3])
                for i in sorted(keep, key=lambda i: (cands[i][1], cands[i][0]))
            ]
    return out


def _searched_fronts(
    workload: PartitionWorkload,
    records: Mapping[str, Iterable[tuple[Config, float, float]]],
    freqs: list[float],
) -> tuple[_Fronts, list[float]]:
    """Each partition type's fronts per clock, and the clocks of ``freqs`` every type has.

    Raises:
        PlanError: A partition type without records, or no clock common to all.
    """
    by_type: _Fronts = {}
    for p in workload.partitions:
        got = records.get(p.key)
        if got is None:
            raise PlanError(f"no search results for partition type {p.key!r}")
        per_f: dict[float, list[_Partial]] = {}
        for config, time_s, dyn_j in got:
            per_f.setdefault(float(config.freq_mhz), []).append(
                (float(time_s), float(dyn_j), ((p.key, config),))
            )
        by_type[p.key] = {f: _pareto(items) for f, items in per_f.items()}
    common = set(freqs)
    for per_f in by_type.values():
        common &= set(per_f)
    if not common:
        raise PlanError("the partition types were not measured at any common clock")
    return by_type, sorted(common)


def _sequential_sum(
    workload: PartitionWorkload, components: Components, kind: str, f: float, layers: int
) -> tuple[float, float]:
    """``(time_s, dynamic_energy_j)`` of an instruction's layers run sequentially at ``f``."""
    phases = workload.phases(kind)
    t = sum(components.sequential[(ph, f)].time_s for ph in phases) * layers
    d = sum(components.sequential[(ph, f)].dynamic_energy_j for ph in phases)
    return t, d * layers


def _stock_sum(
    components: Components, types: list[tuple[str, PartitionType, int]], f: float
) -> tuple[float, float, Knob]:
    """An instruction's partitions in their stock configuration at ``f``: time, energy, knob."""
    t = d = 0.0
    stock_configs: list[tuple[str, Config]] = []
    for key, ptype, mult in types:
        m = components.stock[(ptype.key, f)]
        t += mult * m.time_s
        d += mult * m.dynamic_energy_j
        stock_configs.append((key, _stock_config(ptype, f, components.stock_sm_count)))
    return t, d, Knob("nanobatch", tuple(stock_configs), "stock")


def _searched_sums(
    by_type: _Fronts, types: list[tuple[str, PartitionType, int]], f: float
) -> list[tuple[float, float, Knob]]:
    """The Pareto set of an instruction's sums of searched configurations at ``f`` (Alg. 2).

    Pruned after every type, which is exact: a dominated partial sum stays dominated.
    """
    acc: list[_Partial] = [(0.0, 0.0, ())]
    for key, ptype, mult in types:
        opts = by_type[ptype.key][f]
        acc = _pareto(
            [
                (ta + mult * tb, ea + mult * eb, ca + ((key, cb[0][1]),))
                for ta, ea, ca in acc
                for tb, eb, cb in opts
            ]
        )
    return [(t, d, Knob("nanobatch", configs, "search")) for t, d, configs in acc]


def calibrate_correction(pairs: Iterable[tuple[float, float]]) -> float:
    """The composition correction from ``(composed_time_s, measured_in_situ_time_s)`` pairs.

    Least squares through the origin: ``Σ composed·measured / Σ composed²``. The artifact's
    1.15 is such a ratio for its testbed; on the simulator, where partitions compose exactly,
    it comes out at 1.

    Raises:
        PlanError: With no pairs or non-positive times.
    """
    num = den = 0.0
    n = 0
    for composed, measured in pairs:
        if not (composed > 0 and measured > 0):
            raise PlanError(f"calibration times must be positive, got {(composed, measured)}")
        num += composed * measured
        den += composed * composed
        n += 1
    if n == 0:
        raise PlanError("calibrate_correction needs at least one (composed, measured) pair")
    return num / den


def reference_options(
    workload: PartitionWorkload, components: Components
) -> dict[tuple[int, str], tuple[float, float]]:
    """Megatron-LM's point per ``(stage, kind)``: sequential at the highest clock."""
    seq = compose_options(workload, {}, components, method="perseus")
    return {key: max(opts, key=lambda o: o[0])[1:3] for key, opts in seq.items()}


def method_frontier(
    workload: PartitionWorkload,
    options: Mapping[tuple[int, str], Sequence[tuple[float, float, float, Knob]]],
    components: Components,
    schedule: Schedule,
    *,
    schedule_name: str,
    num_microbatches: int,
    unit_time_s: float = 1e-3,
    cost_model: str = "convex",
    progress: Callable[[int, int], None] | None = None,
    max_work: int | None = DEFAULT_MAX_WORK,
) -> Frontier:
    """The iteration frontier of one method's options on the Perseus solver.

    Savings are against Megatron-LM (sequential at the highest clock). ``cost_model="convex"``
    (the lower convex hull of each instruction's options) makes frontiers of nested option sets
    nest too: more options can only lower the hull, so Kareus's frontier weakly dominates the
    baselines' at every time.
    """
    return compute_frontier(
        None,
        schedule,
        settings=FrontierSettings(
            unit_time_s=unit_time_s,
            p_block_w=components.p_static_w,
            order="subtract-then-filter",
            cost_model=cost_model,
            max_work=max_work,
        ),
        schedule_name=schedule_name,
        num_microbatches=num_microbatches,
        progress=progress,
        candidates=options,
        reference=reference_options(workload, components),
    )


def sample_frontier(points: Sequence[FrontierPoint], n: int = 10) -> list[FrontierPoint]:
    """``n`` plans along the solver trajectory, denser toward the fast end (docs/kareus.md §2.3).

    The artifact takes 15 strided samples and drops positions 0, 2, 4, 6 and 8; this does the
    same for ``n = 10`` and keeps the fastest point last.
    """
    if not points:
        return []
    m = n + n // 2
    picks = sorted({round(i * (len(points) - 1) / (m - 1)) for i in range(m)})
    drop = set(range(0, 2 * (m - n), 2))
    sampled = [points[j] for k, j in enumerate(picks) if k not in drop] or list(points)
    if sampled[-1] is not points[-1]:
        sampled.append(points[-1])
    return sampled
