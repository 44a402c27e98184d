"""The paired counterfactual: what a measured iteration would have cost at the baseline clocks.

The closed loop (:mod:`powerlib.runtime.closed_loop`, docs/measurement.md §9) cannot run an
iteration twice. It can, from one iteration's instruction spans and the clocks each instruction
ran at, back out every instruction's noise factor and replay the iteration's DAG at the
baseline clocks on the same factors. The baseline is what the job runs without powerlib: the
default clocks, which under load are the maximum clock (the profile's top row).

For instruction ``i`` of stage ``s`` and kind ``k`` that ran for ``d_i`` seconds over clock
segments ``(len_j, f_j)`` (a change lands part-way through: the segments split the span at the
landing), its factor is the share of its work each segment did at the profile's pace,

    φ_i = Σ_j len_j / t(s, k, f_j),

so that ``φ_i · t(s, k, f)`` is what the same work with the same noise takes at clock ``f``.
The iteration's baseline time is its measured time with the critical path swapped:

    T_base = T − R(d) + R(φ · t_max),

where ``R`` is the critical path through the iteration's DAG (:func:`critical_path_s`). What
the replay does not model (communication, the optimizer step, the host) stays as measured, in
both terms. Its baseline energy is the profile's model on the same factors,

    E_base = Σ_s [ Σ_i φ_i · e(s, k_i, f_max) + P_block · (T_base − Σ_i φ_i · t(s, k_i, f_max)) ],

which the loop calibrates against the interleaved baseline iterations it measures (the same
formula on their own spans, against their counter energy). Pure: no device, no clock.
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from powerlib.planning.perseus.replay import Layout, ReplayModel, layout_of
from powerlib.planning.perseus.sources import OptionSource
from powerlib.planning.pipeline import InstructionKey, build_dag
from powerlib.planning.plan import FrequencyPlan
from powerlib.planning.profile import Profile

__all__ = ["Counterfactual", "IterationRecord", "Replayer", "replay_model"]

Span = tuple[int, int, str, float, float]
"""One instruction: ``(chunk, microbatch, kind, start_s, end_s)``."""


@dataclass(frozen=True, slots=True, kw_only=True)
class IterationRecord:
    """One stage's record of one measured iteration.

    Attributes:
        stage: The stage.
        start_s: When the iteration began on this stage.
        end_s: When it ended (its ``step``).
        spans: Its instructions, in the order they ran.
        clocks: ``(time_s, freq_mhz)`` from which time on the device ran at which clock, in
            time order; ``None`` is the baseline (clocks unlocked). The first entry is at or
            before ``start_s``.
        energy_j: The stage's device energy over the iteration, when measured.
    """

    stage: int
    start_s: float
    end_s: float
    spans: tuple[Span, ...]
    clocks: tuple[tuple[float, float | None], ...]
    energy_j: float | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class Counterfactual:
    """One iteration as measured and as it would have run at the baseline clocks.

    Attributes:
        time_s: The iteration's measured time (the slowest stage's).
        baseline_time_s: Its time at the baseline clocks on the same noise.
        energy_j: Its measured energy, every stage (``None``: a stage's was not measured).
        baseline_energy_j: The profile's model of its energy at the baseline clocks
            (uncalibrated).
        model_energy_j: The profile's model of its energy as it ran (uncalibrated).
        pipeline_s: The critical path of its instructions at the baseline clocks alone (no
            gaps, nothing holding the iteration): what a straggler's time is compared with.
    """

    time_s: float
    baseline_time_s: float
    energy_j: float | None
    baseline_energy_j: float
    model_energy_j: float
    pipeline_s: float = 0.0


def _pace(rows: Mapping[float, tuple[float, float]], freq_mhz: float) -> tuple[float, float]:
    """``(time_s, energy_j)`` of one instruction at ``freq_mhz``: the row, or interpolated.

    Between profiled clocks linearly; outside them the nearest row.
    """
    got = rows.get(freq_mhz)
    if got is not None:
        return got
    freqs = sorted(rows)
    k = bisect.bisect_left(freqs, freq_mhz)
    if k == 0:
        return rows[freqs[0]]
    if k == len(freqs):
        return rows[freqs[-1]]
    lo, hi = freqs[k - 1], freqs[k]
    w = (freq_mhz - lo) / (hi - lo)
    (t0, e0), (t1, e1) = rows[lo], rows[hi]
    return t0 + w * (t1 - t0), e0 + w * (e1 - e0)


def _segments(
    clocks: Sequence[tuple[float, float | None]], start_s: float, end_s: float
) -> list[tuple[float, float | None]]:
    """``(length_s, clock)`` of each clock segment of ``[start_s, end_s]``."""
    times = [t for t, _ in clocks]
    k = max(bisect.bisect_right(times, start_s) - 1, 0)
    out: list[tuple[float, float | None]] = []
    t = start_s
    while t < end_s:
        until = times[k + 1] if k + 1 < len(times) else end_s
        until = min(max(until, t), end_s)
        if until > t:
            out.append((until - t, clocks[k][1]))
        t = until
        if k + 1 >= len(times):
            break
        k += 1
    return out or [(0.0, clocks[k][1] if clocks else None)]


class Replayer:
    """Replays measured iterations of one workload at the baseline clocks.

    Args:
        model: The planned workload (``Frontier.model``): its DAG, its measured rows, P_block.

    Raises:
        KeyError: Never on construction; :meth:`replay` returns ``None`` for a record that does
            not fit the DAG.
    """

    def __init__(self, model: ReplayModel) -> None:
        self._model = model
        self._layout: Layout = layout_of(model.dag)
        self._index = {ins.key: i for i, ins in enumerate(model.dag.instructions)}
        self._top: dict[tuple[int, str], tuple[float, float, float]] = {}
        for key, rows in model.measured.items():
            top = max(rows)
            self._top[key] = (top, *rows[top])

    def _critical_path_s(self, times_s: Sequence[float]) -> float:
        layout = self._layout
        finish = [0.0] * len(times_s)
        for v in layout.topo:
            start = max((finish[u] for u in layout.preds[v]), default=0.0)
            finish[v] = start + times_s[v]
        return max(finish, default=0.0)

    def replay(
        self,
        records: Sequence[IterationRecord],
        *,
        held_s: float | None = None,
        held_ratio: float | None = None,
    ) -> Counterfactual | None:
        """One iteration (every stage's record) at the baseline clocks.

        Args:
            records: Every stage's record of the iteration.
            held_s: Something outside the pipeline (a straggler's data-parallel peer) holds
                the baseline iteration to at least this long; its stages draw the blocking
                power meanwhile.
            held_ratio: Instead of ``held_s``: held to this many times the baseline
                pipeline's own critical path (:attr:`Counterfactual.pipeline_s`).

        Returns:
            ``None`` when the records do not cover the DAG exactly (a stage missing, an
            instruction the plan does not have, a span without a time).
        """
        model = self._model
        n = len(model.dag.instructions)
        actual = [-1.0] * n
        base = [0.0] * n
        stage_base_busy: dict[int, tuple[float, float]] = {}  # stage -> (Σ φ t_max, Σ φ e_max)
        stage_model_energy: dict[int, float] = {}
        for rec in records:
            busy_t = busy_e = energy_now = 0.0
            for chunk, mb, kind, start_s, end_s in rec.spans:
                i = self._index.get(InstructionKey(rec.stage, chunk, mb, kind))
                rows = model.measured.get((rec.stage, kind))
                if i is None or rows is None or not end_s >= start_s or actual[i] >= 0.0:
                    return None
                _, t_max, e_max = self._top[(rec.stage, kind)]
                phi = 0.0
                for length_s, clock in _segments(rec.clocks, start_s, end_s):
                    t_f, e_f = _pace(
                        rows, self._top[(rec.stage, kind)][0] if clock is None else clock
                    )
                    phi += length_s / t_f
                    energy_now += e_f * (length_s / t_f)
                actual[i] = end_s - start_s
                base[i] = phi * t_max
                busy_t += phi * t_max
                busy_e += phi * e_max
            stage_base_busy[rec.stage] = (busy_t, busy_e)
            stage_model_energy[rec.stage] = energy_now - model.p_block_w * sum(
                end - start for *_, start, end in rec.spans
            )
        if min(actual, default=-1.0) < 0.0 or len(stage_base_busy) != model.dag.num_stages:
            return None
        time_s = max(rec.end_s - rec.start_s for rec in records)
        pipeline_s = self._critical_path_s(base)
        baseline_time_s = time_s - self._critical_path_s(actual) + pipeline_s
        if held_ratio is not None:
            held_s = held_ratio * pipeline_s
        if held_s is not None:
            baseline_time_s = max(baseline_time_s, held_s)
        p_block = model.p_block_w
        baseline_energy_j = sum(
            busy_e + p_block * (baseline_time_s - busy_t)
            for busy_t, busy_e in stage_base_busy.values()
        )
        model_energy_j = sum(e + p_block * time_s for e in stage_model_energy.values())
        energies = [rec.energy_j for rec in records]
        return Counterfactual(
            time_s=time_s,
            baseline_time_s=baseline_time_s,
            energy_j=None
            if any(e is None for e in energies)
            else float(sum(e for e in energies if e is not None)),
            baseline_energy_j=baseline_energy_j,
            model_energy_j=model_energy_j,
            pipeline_s=pipeline_s,
        )


def replay_model(plan: FrequencyPlan, profile: Profile, p_block_w: float) -> ReplayModel:
    """What the counterfactual needs of a saved plan and the profile it was made from.

    The DAG of the plan's own instruction order and the profile's measured rows: a session that
    applies a saved plan with its profile (``profile_path``) measures it paired too.

    Raises:
        PlanError: The plan's order is not a valid pipeline schedule.
    """
    order = [[p.instruction for p in plan.stage(s)] for s in range(plan.num_stages)]
    dag = build_dag(order)
    used = {(ins.stage, ins.kind) for ins in dag.instructions}
    # the table a frontier planned on this profile replays on (Frontier.model's ``measured``)
    measured = OptionSource(profile, None, None).fastest_per_clock(used)
    return ReplayModel(
        dag=dag,
        options={},
        measured=measured,
        unit_time_s=profile.unit_time_s or 1e-3,
        p_block_w=p_block_w,
    )
