"""What a frontier is solved over: per (stage, kind), a profile's or Kareus's candidate options.

:func:`~powerlib.planning.perseus.frontier.compute_frontier` takes either a measured
:class:`~powerlib.planning.profile.Profile` or, from Kareus, per ``(stage, kind)`` candidate
execution options (several per clock); :class:`OptionSource` answers the three questions the
frontier asks of either: the options of one ``(stage, kind)``, the ``(time, energy)`` its savings
are measured against, and the fastest option at each clock (what a plan is replayed on).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from powerlib.errors import PlanError
from powerlib.planning.pipeline import PipelineDAG
from powerlib.planning.profile import Profile

__all__ = ["OptionSource"]

Key = tuple[int, str]


@dataclass(frozen=True, slots=True)
class OptionSource:
    """A measured profile or Kareus's candidates, and the optional savings reference.

    Attributes:
        profile: Measured (stage, instruction, frequency, time, energy) rows; ``None`` with
            ``candidates``.
        candidates: Instead of ``profile``: per ``(stage, kind)``, the execution options
            ``(freq_mhz, time_s, energy_j, knob)``, several per clock allowed.
        reference: Per ``(stage, kind)``, the ``(time_s, energy_j)`` of the baseline the
            savings are measured against. Default: each pair's fastest candidate, or the
            profile's option at its maximum clock.
    """

    profile: Profile | None
    candidates: Mapping[Key, Sequence[tuple[Any, ...]]] | None
    reference: Mapping[Key, tuple[float, float]] | None

    def check(self, used: set[Key], num_stages: int) -> None:
        """Refuse a source that does not cover the pipeline.

        Args:
            used: The ``(stage, kind)`` pairs the pipeline runs.
            num_stages: Its number of stages.

        Raises:
            PlanError: Neither a profile nor candidates, a profile that does not cover the
                stages, or a used pair without candidates.
        """
        if self.candidates is None:
            if self.profile is None:
                raise PlanError("compute_frontier needs a profile or per-instruction candidates")
            self.profile.validate_for(num_stages, ())
            return
        missing = sorted(used - set(self.candidates))
        if missing:
            raise PlanError(f"no execution options for (stage, kind) {missing[0]}")

    def points(self, stage: int, kind: str) -> Sequence[tuple[Any, ...]]:
        """One pair's execution options ``(freq_mhz, time_s, energy_j, ...)``."""
        if self.candidates is not None:
            return self.candidates[(stage, kind)]
        assert self.profile is not None  # check() refused neither
        return self.profile.options(stage, kind)

    def reference_of(self, stage: int, kind: str) -> tuple[float, float]:
        """The ``(time_s, energy_j)`` one pair's savings are measured against."""
        if self.reference is not None:
            return self.reference[(stage, kind)]
        if self.candidates is not None:
            _, ref_t, ref_e, *_ = min(self.candidates[(stage, kind)], key=lambda o: o[1])
            return ref_t, ref_e
        assert self.profile is not None  # check() refused neither
        _, ref_t, ref_e = max(self.profile.options(stage, kind), key=lambda o: o[0])
        return ref_t, ref_e

    def reference_times(self) -> dict[Key, float] | None:
        """Per pair, the reference's time; ``None`` without an explicit reference."""
        if self.reference is None:
            return None
        return {key: tr for key, (tr, _) in self.reference.items()}

    def baseline_busy(self, dag: PipelineDAG) -> dict[int, tuple[float, float]]:
        """Per stage, the busy ``(time_s, energy_j)`` of its instructions at their reference."""
        busy: dict[int, tuple[float, float]] = {}
        for stage in range(dag.num_stages):
            t = e = 0.0
            for i in dag.stage_order(stage):
                ins = dag.instructions[i]
                ref_t, ref_e = self.reference_of(ins.stage, ins.kind)
                t += ref_t
                e += ref_e
            busy[stage] = (t, e)
        return busy

    def fastest_per_clock(self, used: set[Key]) -> dict[Key, dict[float, tuple[float, float]]]:
        """Per used pair, per clock, the ``(time_s, energy_j)`` of its fastest option."""
        measured: dict[Key, dict[float, tuple[float, float]]] = {}
        for stage, kind in sorted(used):
            at: dict[float, tuple[float, float]] = {}
            for f, t, e, *_ in self.points(stage, kind):
                if f not in at or t < at[f][0]:
                    at[f] = (t, e)
            measured[(stage, kind)] = at
        return measured
