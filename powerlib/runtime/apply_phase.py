"""The session's apply phase: one stage of a frequency plan, handed to the controller.

:class:`ApplyPhase` is what runs in the instruction hooks once a plan has arrived:

- ``begin`` hands the planned clock of the instruction to the
  :class:`~powerlib.runtime.controller.FrequencyController` and returns (a repeat of the last
  request costs nothing);
- the first iteration is checked against the plan's instruction order: a mismatch (another
  instruction, or another count at ``step``) resets the clocks, reports once through
  ``on_stop`` (a :class:`~powerlib.runtime.phases.RankFailure` marked ``off_order``) and leaves
  training alone;
- after that first iteration, ``end`` asks for the next instruction's clock at once
  (``prefetch``), so the switch overlaps the wait for the next instruction's input;
- with a lead (``lead_s``, the clock-change latency the session measured), a switch to a
  *higher* clock is requested ahead: ``begin`` of the instruction before it asks for it,
  delayed to ``lead_s`` before that instruction's predicted end, so the faster clock lands by
  the time the next one starts (its tail runs fast: a little energy, no time). A switch down stays
  at ``end`` (the next one's head runs at the faster old clock: energy, no time). The first
  instruction's predecessor is the previous iteration's last (docs/runtime.md "Requesting
  clocks ahead");
- a change the controller reports failed (``AppliedChange.ok`` False: the control session
  reset the GPU to its baseline and recorded why, docs/real-gpu.md §2) stops the phase at the
  next iteration boundary (:meth:`ApplyPhase.check_changes`) and reports once through
  ``on_stop``; the session makes the stop job-wide at the next collective the ranks share
  (the closed loop's exchange, docs/real-gpu.md §3).

The session drives it on a real device; ``powerlib simulate`` drives the same object on the
emulator (:func:`powerlib.emulator.demo.simulate_plan`), so what the emulator reports is what
this code does.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Protocol

from powerlib.errors import InvalidArgumentError
from powerlib.planning.pipeline import InstructionKey
from powerlib.planning.plan import FrequencyPlan
from powerlib.runtime.controller import FrequencyController
from powerlib.runtime.phases import RankFailure, SessionPhase
from powerlib.runtime.session_config import ApplyConfig

__all__ = ["ApplyPhase", "plan_lead_s"]


def _ignore(failure: RankFailure) -> None:
    """Nobody to tell (the emulator's ``powerlib simulate``)."""


class _Latency(Protocol):
    """What measured the clock-change latency (the profile phase)."""

    @property
    def latency_s(self) -> float | None:
        """The latency to plan for (the 90th percentile of the warm-up's probes)."""
        ...


def _fmt(key: InstructionKey) -> str:
    _, chunk, mb, kind = key
    return f"{kind} mb{mb}" + (f" chunk{chunk}" if chunk else "")


class ApplyPhase:
    """Applies one stage of a plan through a frequency controller.

    Args:
        plan: The plan (checked against the device's clocks by the caller).
        stage: The stage this object applies.
        controller: Takes the clock requests.
        prefetch: See :class:`~powerlib.runtime.session_config.ApplyConfig`.
        check_order: Check the first iteration against the plan's order (and prefetch only
            after it); ``False`` when the caller runs the plan's own order (the emulator).
        on_stop: Called once, after the clocks were reset, with the reason the phase stopped:
            the loop does not run the plan's order (``off_order``), or a clock change failed.
        lead_s: Request a switch up this long before the previous instruction's predicted
            end: its begin + ``max(0, predicted_time_s - lead_s)`` (``planned_time_s`` when
            the plan records no prediction; neither: not ahead). ``None``: off. Like
            ``prefetch``, only after the order check.

    Raises:
        InvalidArgumentError: ``lead_s`` is negative or not finite.
    """

    def __init__(
        self,
        plan: FrequencyPlan,
        stage: int,
        controller: FrequencyController,
        *,
        prefetch: bool = True,
        check_order: bool = True,
        on_stop: Callable[[RankFailure], None] = _ignore,
        lead_s: float | None = None,
    ) -> None:
        if lead_s is not None and not (math.isfinite(lead_s) and lead_s >= 0):
            raise InvalidArgumentError(f"lead_s must be a finite number >= 0, not {lead_s}")
        stage_plan = plan.stage(stage)
        self.lead_s = lead_s
        self.durations: dict[InstructionKey, float | None] = {
            p.key: p.planned_time_s if p.predicted_time_s is None else p.predicted_time_s
            for p in stage_plan
        }
        """Each instruction's predicted time (what request ahead times a switch by)."""
        self.stage = stage
        self.expected: list[InstructionKey] = [p.key for p in stage_plan]
        self.freqs: dict[InstructionKey, float] = dict(
            zip(self.expected, (p.freq_mhz for p in stage_plan))
        )
        self.controller = controller
        self.prefetch = prefetch
        self._on_stop = on_stop
        self._seen = len(controller.applied)  # the controller's changes checked so far
        self.phase = SessionPhase.APPLY
        """``APPLY``, or ``DONE`` once a mismatch or a failure stopped it (:attr:`active`)."""
        self.stopped_reason: str | None = None
        """Why a failure stopped the phase (:meth:`stop`); ``None`` otherwise."""
        self.checking = check_order
        """The current iteration is the first one, checked against the plan's order."""
        self.first_requests: list[tuple[InstructionKey, float]] = []
        """Every clock the checked iteration asked for, in order."""
        self.position = 0
        """Instructions begun in this iteration."""

    wants_start = False

    @classmethod
    def for_session(
        cls,
        plan: FrequencyPlan,
        stage: int,
        controller: FrequencyController,
        config: ApplyConfig,
        profiling: _Latency | None,
        *,
        on_stop: Callable[[RankFailure], None],
    ) -> ApplyPhase:
        """A session's apply phase: ``config``'s prefetch and request ahead.

        The lead is the one the plan was made for (``workload.request_ahead_s``: rank 0 planned
        with the slowest rank's measured latency, and every rank must apply what it planned,
        docs/perseus.md §2.8); none in a plan without one, or with ``config.request_ahead``
        off. ``profiling`` is not read (kept for the callers' signature).
        """
        lead_s = plan_lead_s(plan) if config.request_ahead else None
        return cls(
            plan, stage, controller, prefetch=config.prefetch, on_stop=on_stop, lead_s=lead_s
        )

    @property
    def active(self) -> bool:
        """The plan is applied (no mismatch or failure stopped it)."""
        return self.phase is SessionPhase.APPLY

    def begin(self, kind: str, microbatch: int = 0, chunk: int = 0) -> None:
        """An instruction starts: check it (first iteration), then request its clock."""
        if not self.active:
            return
        key = InstructionKey(self.stage, chunk, microbatch, kind)
        if self.checking:
            self._check(key)
            if not self.active:
                return
        freq = self.freqs.get(key)
        if freq is not None:
            self.request(freq)
            if self.lead_s is not None and not self.checking:
                self._request_ahead(key, freq)
        self.position += 1

    def _request_ahead(self, key: InstructionKey, freq_mhz: float) -> None:
        """Ask now for the next instruction's clock, if higher: to land by its start."""
        expected, pos = self.expected, self.position + 1
        nxt = self.freqs[expected[pos] if pos < len(expected) else expected[0]]
        duration = self.durations.get(key)
        if nxt <= freq_mhz or duration is None or self.lead_s is None:
            return
        marker = self.controller.marker
        self.controller.request(
            nxt,
            after=None if marker is None else marker.record(),
            delay_s=max(0.0, duration - self.lead_s),
        )

    def end(self) -> None:
        """An instruction ends: ask for the next one's clock now (``prefetch``)."""
        if not self.active or not self.prefetch or self.checking:
            return
        # The switch (milliseconds on real drivers) overlaps the wait for the next input.
        expected = self.expected
        nxt = expected[self.position] if self.position < len(expected) else expected[0]
        self.request(self.freqs[nxt])

    def step(self) -> None:
        """The iteration ended: the checked one must have run every planned instruction."""
        self.check_changes()
        if self.active and self.checking:
            if self.position != len(self.expected):
                self._mismatch(
                    f"the iteration ran {self.position} instruction(s), "
                    f"the plan has {len(self.expected)}"
                )
            self.checking = False
        self.position = 0

    def start_iteration(self) -> None:
        """Nothing to agree on: the plan is fixed."""

    def request(self, freq_mhz: float) -> None:
        """Hand a clock to the controller; a repeat of the last request costs nothing.

        A clock still delayed (requested ahead) is handed again: the controller applies it now.
        """
        ctl = self.controller
        if freq_mhz != ctl.last_requested or freq_mhz == ctl.delayed_mhz:
            # On a GPU the host runs ahead: a marker on the stream holds the change until the
            # device reaches this point, on the controller's thread (no synchronize here).
            marker = ctl.marker
            ctl.request(freq_mhz, after=None if marker is None else marker.record())

    def check_changes(self) -> None:
        """Stop, and report once, if a change the controller made since the last call failed."""
        applied = self.controller.applied
        seen, self._seen = self._seen, len(applied)
        if self.stopped_reason is not None or seen == self._seen:
            return
        failed = next((a for a in applied[seen : self._seen] if not a.ok), None)
        if failed is not None:
            self.fail(f"stage {self.stage}: {failed.failure()}")

    def fail(self, reason: str) -> None:
        """A failure this phase found: :meth:`stop`, then report it once (``on_stop``)."""
        if self.stopped_reason is None:
            self.stop(reason)
            self._on_stop(RankFailure(reason))

    def stop(self, reason: str) -> None:
        """Stop applying (this rank failed): clocks reset, nothing more is requested.

        Idempotent: the first reason is kept.
        """
        if self.stopped_reason is not None:
            return
        self.stopped_reason = reason
        self.phase = SessionPhase.DONE
        self.checking = False
        self.controller.reset()

    def _check(self, key: InstructionKey) -> None:
        pos = self.position
        if pos >= len(self.expected):
            self._mismatch(
                f"instruction {pos} {_fmt(key)} is beyond the plan's {len(self.expected)}"
            )
        elif key != self.expected[pos]:
            self._mismatch(
                f"instruction {pos} is {_fmt(key)}, the plan expects {_fmt(self.expected[pos])}"
            )
        else:
            self.first_requests.append((key, self.freqs[key]))

    def _mismatch(self, detail: str) -> None:
        self.phase = SessionPhase.DONE
        self.checking = False
        self.controller.reset()
        self._on_stop(
            RankFailure(
                f"stage {self.stage}: the training loop does not run the plan's instruction "
                f"order ({detail}); clocks reset, training continues unmanaged",
                off_order=True,
            )
        )


def plan_lead_s(plan: FrequencyPlan) -> float | None:
    """How far ahead ``plan`` was made to have its switches up requested (``None``: not)."""
    value = plan.workload.get("request_ahead_s")
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    lead = float(value)
    return lead if math.isfinite(lead) and lead >= 0 else None
