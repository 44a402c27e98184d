"""Clocks requested ahead so that a switch up lands when the instruction starts (issue 45, 5).

The controller takes delayed requests (inline on the emulator's timers; threaded ones are in
test_controller.py); the apply phase requests a switch up ``lead_s`` before the previous
instruction's planned end, and leaves a switch down at that instruction's end.
"""

from __future__ import annotations

import contextlib
import dataclasses
import statistics

import pytest
from runtime_helpers import emulated_sessions, make_emulator, toy_profile

from powerlib.control import ControlSession
from powerlib.emulator.device import EmulatedBackend, EmulatedDevice, VirtualTime
from powerlib.emulator.engine import Emulator, IterationResult
from powerlib.errors import InvalidArgumentError
from powerlib.planning.plan import FrequencyPlan, PlannedInstruction
from powerlib.planning.schedules import build_schedule
from powerlib.runtime.apply_phase import ApplyPhase, plan_lead_s
from powerlib.runtime.controller import FrequencyController
from powerlib.runtime.session_config import ApplyConfig

TABLE = {"forward": {f: (0.01, 1.0) for f in (900.0, 1000.0, 1100.0, 1200.0)}}


@pytest.fixture
def inline():
    clock = VirtualTime()
    dev = EmulatedDevice(index=0, table=TABLE, clock=clock, p_block_w=50.0)
    with ControlSession(EmulatedBackend([dev]), handle_signals=False) as control:
        yield clock, FrequencyController(control, dev, threaded=False, clock=clock)


def _applied(ctl: FrequencyController) -> list[tuple[float | None, float]]:
    return [(c.freq_mhz, c.time_s) for c in ctl.applied]


def test_inline_delayed_request_waits_for_its_time(inline) -> None:
    clock, ctl = inline
    ctl.request(900.0)  # immediate: now
    ctl.request(1100.0, delay_s=0.05)  # beside it, not instead
    assert ctl.delayed_mhz == 1100.0 and ctl.last_requested == 1100.0
    clock.advance_to(0.04)
    assert _applied(ctl) == [(900.0, 0.0)]
    clock.advance_to(0.2)
    assert _applied(ctl) == [(900.0, 0.0), (1100.0, 0.05)]
    assert ctl.delayed_mhz is None


def test_inline_immediate_request_for_the_delayed_clock_applies_it_now(inline) -> None:
    clock, ctl = inline
    ctl.request(1000.0, delay_s=0.05)
    clock.advance_to(0.01)
    ctl.request(1000.0)
    clock.advance_to(0.2)
    assert _applied(ctl) == [(1000.0, 0.01)]  # now, and once


def test_inline_another_clock_or_a_reset_drops_the_delayed_request(inline) -> None:
    clock, ctl = inline
    ctl.request(1000.0, delay_s=0.05)
    ctl.request(900.0)
    ctl.request(1100.0, delay_s=0.05)
    ctl.reset()
    clock.advance_to(0.2)
    assert _applied(ctl) == [(900.0, 0.0), (None, 0.0)]
    ctl.request(1000.0, delay_s=0.01)
    ctl.stop()  # stopped: dropped, and nothing more
    ctl.request(1100.0, delay_s=0.01)
    clock.advance_to(0.3)
    assert [c.freq_mhz for c in ctl.applied] == [900.0, None, None]


def test_inline_without_a_timer_a_delayed_request_applies_at_once() -> None:
    clock = VirtualTime()
    dev = EmulatedDevice(index=0, table=TABLE, clock=clock, p_block_w=50.0)
    with ControlSession(EmulatedBackend([dev]), handle_signals=False) as control:
        ctl = FrequencyController(control, dev, threaded=False, clock=lambda: 0.0)
        ctl.request(1000.0, delay_s=0.05)
        assert [c.freq_mhz for c in ctl.applied] == [1000.0]
        with pytest.raises(InvalidArgumentError, match="delay_s"):
            ctl.request(900.0, delay_s=-1.0)


# -- the apply phase, on the emulator -----------------------------------------------------------

STAGES, MICROBATCHES = 3, 4
LATENCY_S, SPREAD = 0.004, 0.5


def _zigzag_plan(emulator: Emulator) -> FrequencyPlan:
    """Each stage runs high, low, low, high, ...: switches up and down everywhere.

    Two lows in a row: the one before a switch up starts clean (a late switch down runs the
    first low's head fast, so it ends early, and a switch up requested by its planned end
    would land after the next one began).
    """
    freqs = emulator.devices[0].info.supported_sm_freqs_mhz
    schedule = build_schedule("1f1b", STAGES, MICROBATCHES)
    stages = []
    for s, order in enumerate(schedule):
        table = emulator.devices[s]._table
        clocks = [freqs[-1] if i % 4 in (0, 3) else freqs[0] for i in range(len(order))]
        stages.append(
            tuple(
                PlannedInstruction(ins, f, predicted_time_s=table[ins.kind][f][0])
                for ins, f in zip(order, clocks)
            )
        )
    return FrequencyPlan(stages=tuple(stages), workload={"schedule": "1f1b"})


def _apply(lead_s: float | None) -> tuple[FrequencyPlan, list, list[IterationResult]]:
    emulator = make_emulator(
        toy_profile(STAGES), MICROBATCHES, switch_latency_s=LATENCY_S, latency_spread=SPREAD
    )
    plan = _zigzag_plan(emulator)
    with ControlSession(emulator.backend, handle_signals=False) as control:
        phases = [
            ApplyPhase(
                plan,
                s,
                FrequencyController(control, dev, threaded=False, clock=emulator.clock),
                check_order=False,
                lead_s=lead_s,
            )
            for s, dev in enumerate(emulator.devices)
        ]
        runs = [emulator.run_iteration(phases) for _ in range(3)]
    return plan, phases, runs


def _pairs(plan: FrequencyPlan, runs: list[IterationResult], stage: int):
    """``(u, v, f_u, f_v)``: consecutive instructions of ``stage`` from the second iteration on
    (the first of an iteration follows the previous iteration's last)."""
    freqs = plan.frequencies(stage)
    ran = [ex for run in runs for ex in run.executed if ex.instruction.stage == stage]
    n = len(freqs)
    return [(ran[i - 1], ran[i], freqs[(i - 1) % n], freqs[i % n]) for i in range(n, len(ran))]


def test_with_a_lead_a_switch_up_lands_before_the_instruction_begins() -> None:
    lead_s = LATENCY_S * (1 + SPREAD)  # the latest landing
    plan, phases, runs = _apply(lead_s)
    _, _, plain = _apply(None)
    ups = late_before = 0
    for s in range(STAGES):
        for u, v, f_u, f_v in _pairs(plan, runs, s):
            if f_v > f_u:
                ups += 1
                assert {f for _, _, f in v.segments} == {f_v}, (s, v)  # landed by its start
                assert u.segments[-1][2] in (f_u, f_v)  # u's tail may run fast
        for _, v, f_u, f_v in _pairs(plan, plain, s):
            late_before += f_v > f_u and v.segments[0][2] != f_v
    assert ups >= 2 * STAGES and late_before > 0  # without the lead some landed late
    # the request was made lead_s before u's planned end: delayed from u's begin
    changes = [(c.freq_mhz, c.time_s) for c in phases[0].controller.applied]
    for u, _, f_u, f_v in _pairs(plan, runs, 0):
        if f_v > f_u:
            want = u.start_s + max(0.0, phases[0].durations[u.instruction.key] - lead_s)
            assert (f_v, pytest.approx(want)) in changes
    assert sum(r.time_s for r in runs[1:]) < sum(r.time_s for r in plain[1:])


def test_a_switch_down_is_still_requested_at_the_end_of_the_one_before() -> None:
    plan, phases, runs = _apply(LATENCY_S * (1 + SPREAD))
    for s in range(STAGES):
        changes = [(c.freq_mhz, c.time_s) for c in phases[s].controller.applied]
        downs = [(f_v, u.end_s) for u, _, f_u, f_v in _pairs(plan, runs, s) if f_v < f_u]
        assert downs and all(down in changes for down in downs)


# -- the apply phase's requests, and the session's wiring ----------------------------------------


class _Ctl:
    """A controller stand-in that records requests."""

    marker = None
    delayed_mhz = None

    def __init__(self) -> None:
        self.last_requested: float | None = None
        self.applied: list = []
        self.requests: list[tuple[float, float]] = []

    def request(self, freq_mhz: float, *, after: object = None, delay_s: float = 0.0) -> None:
        self.last_requested = freq_mhz
        self.requests.append((freq_mhz, delay_s))

    def reset(self) -> None:
        self.last_requested = None


def _plan(
    freqs: list[float], times: list[float | None], planned_s: float | None = 1.0
) -> FrequencyPlan:
    """One stage; ``times`` predicted, each planned (quantized) ``planned_s``."""
    order = build_schedule("1f1b", 1, len(freqs) // 2)[0]
    return FrequencyPlan(
        stages=(
            tuple(
                PlannedInstruction(ins, f, planned_time_s=planned_s, predicted_time_s=t)
                for ins, f, t in zip(order, freqs, times)
            ),
        )
    )


def _requests(phase: ApplyPhase, ctl: _Ctl, n: int) -> list[tuple[float, float]]:
    for ins in phase.expected[:n]:
        phase.begin(ins.kind, ins.microbatch, ins.chunk)
        phase.end()
    return ctl.requests


def test_the_apply_phase_requests_ahead_only_switches_up() -> None:
    ctl = _Ctl()
    freqs = [1100.0, 900.0, 1200.0, 1000.0, 1100.0, 1000.0, 1200.0, 900.0]
    plan = _plan(freqs, [0.05, 0.05, 0.01, 0.01, 0.05, None, 0.05, 0.04])
    phase = ApplyPhase(plan, 0, ctl, check_order=False, lead_s=0.03)  # type: ignore[arg-type]
    assert _requests(phase, ctl, 8) == [
        (1100.0, 0.0),
        (900.0, 0.0),  # down: at the end of the one before
        (1200.0, pytest.approx(0.02)),  # up: 0.03 s before the 0.05 s one ends
        (1000.0, 0.0),
        (1100.0, 0.0),  # up after a 0.01 s one: at once
        (1000.0, 0.0),
        (1200.0, pytest.approx(0.97)),  # no prediction: by its planned time (1 s)
        (900.0, 0.0),
        (1100.0, pytest.approx(0.01)),  # the next iteration's first one: ahead too
    ]
    phase.step()
    assert _requests(phase, ctl, 2)[9:] == [(900.0, 0.0), (1200.0, pytest.approx(0.02))]
    ctl = _Ctl()  # neither time: not ahead, at the end as before
    plan = _plan(freqs, [None] * 8, None)
    phase = ApplyPhase(plan, 0, ctl, check_order=False, lead_s=0.03)  # type: ignore[arg-type]
    assert all(delay == 0.0 for _, delay in _requests(phase, ctl, 8))
    assert (1200.0, 0.0) in ctl.requests


def test_the_apply_phase_does_not_request_ahead_while_checking_or_without_a_lead() -> None:
    plan = _plan([900.0, 1200.0], [0.05, 0.05])
    for lead, check in ((None, False), (0.03, True)):
        ctl = _Ctl()
        phase = ApplyPhase(plan, 0, ctl, check_order=check, lead_s=lead)  # type: ignore[arg-type]
        assert all(delay == 0.0 for _, delay in _requests(phase, ctl, 2))
    with pytest.raises(InvalidArgumentError, match="lead_s"):
        ApplyPhase(plan, 0, _Ctl(), lead_s=-0.01)  # type: ignore[arg-type]


@dataclasses.dataclass
class _Profiled:
    latency_s: float | None


def _with_lead(plan: FrequencyPlan, lead: object) -> FrequencyPlan:
    """``plan`` as rank 0 recorded it: ``workload.request_ahead_s`` (absent for ``...``)."""
    workload = dict(plan.workload)
    workload.pop("request_ahead_s", None)
    if lead is not ...:
        workload["request_ahead_s"] = lead
    return dataclasses.replace(plan, workload=workload)


@pytest.mark.parametrize(
    ("ahead", "recorded", "profiling", "lead"),
    [
        (True, 0.021, _Profiled(0.03), 0.021),  # the plan's lead, not this rank's measurement
        (True, 0.021, None, 0.021),  # a rank that did not profile applies it too
        (True, 0.0, _Profiled(0.03), 0.0),
        (False, 0.021, _Profiled(0.03), None),  # request_ahead off: no lead
        (True, ..., _Profiled(0.03), None),  # the plan records none (an older plan)
        (True, None, _Profiled(0.03), None),  # rank 0 planned without one
        (True, -0.01, _Profiled(0.03), None),  # a bad value is no lead
        (True, float("nan"), _Profiled(0.03), None),
        (True, True, _Profiled(0.03), None),
        (True, "0.02", _Profiled(0.03), None),
    ],
)
def test_the_session_applies_the_lead_its_plan_records(
    ahead: bool, recorded: object, profiling: _Profiled | None, lead: float | None
) -> None:
    """Rank 0 plans with one lead (the guard replays switches requested that far ahead), so
    every rank must apply that one, whatever latency it measured itself (issue 45)."""
    assert ApplyConfig().request_ahead is True
    config = ApplyConfig(request_ahead=ahead, prefetch=False)
    plan = _with_lead(_plan([900.0, 1200.0], [0.05, 0.05]), recorded)
    assert plan_lead_s(plan) == (None if recorded is ... else lead if ahead else recorded)
    phase = ApplyPhase.for_session(plan, 0, _Ctl(), config, profiling, on_stop=print)  # type: ignore[arg-type]
    assert phase.lead_s == lead and phase.prefetch is False


@pytest.mark.parametrize("ahead", [True, False])
def test_every_rank_leads_by_the_median_latency_rank_0_planned_with(ahead: bool) -> None:
    """End to end: the ranks measure different landings; rank 0 records the median of all of
    them in the plan (``apply.request_ahead`` on) and every rank applies exactly that."""
    emulator = make_emulator(
        toy_profile(STAGES), MICROBATCHES, switch_latency_s=0.02, latency_spread=SPREAD, seed=2
    )
    sessions = emulated_sessions(emulator, None, settle_iterations=0, request_ahead=ahead)
    with contextlib.ExitStack() as stack:
        for s in sessions:
            stack.enter_context(s)
        for _ in range(60):
            emulator.run_iteration(sessions)
            if all(s.phase in ("apply", "done") for s in sessions):
                break
        assert all(s.phase == "apply" for s in sessions), [s.phase for s in sessions]
        leads = [s._flow.applying.lead_s for s in sessions]
    own = [s.profiling.landing_s for s in sessions]
    assert len(set(own)) > 1  # each rank measured its own landing
    pooled = [x for s in sessions for x in s.profiling.latency_samples_s]
    plan = sessions[0]._flow.plan
    if ahead:
        assert plan_lead_s(plan) == pytest.approx(statistics.median(pooled))
        assert leads == [plan_lead_s(plan)] * STAGES
    else:
        assert plan_lead_s(plan) is None and leads == [None] * STAGES


def test_closing_the_controller_drops_a_delayed_request(inline) -> None:
    clock, ctl = inline
    ctl.request(1000.0, delay_s=0.05)
    ctl.close()  # the session ends: no clock lands after it
    clock.advance_to(0.2)
    assert ctl.applied == [] and ctl.delayed_mhz is None
