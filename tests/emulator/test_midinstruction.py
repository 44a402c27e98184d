"""A clock change that lands while an instruction runs re-times it (issue 45, point 5).

The emulator used to decide a whole instruction at its start; a change requested later (the
apply phase's request ahead, from a timer) must reach it: the part before the landing stands,
the rest runs at the new clock, and its end, energy and the stage's schedule move with it.
"""

from __future__ import annotations

import pytest
from runtime_helpers import make_emulator, toy_profile

from powerlib.emulator.device import EmulatedDevice, VirtualTime
from powerlib.emulator.engine import Emulator

LO, HI = 1000.0, 2000.0
TABLE = {"forward": {LO: (0.1, 10.0), HI: (0.05, 12.0)}}  # 100 W at LO, 240 W at HI
P_BLOCK_W = 50.0


def _flat(segments) -> list[float]:
    """Segments as one flat list (``pytest.approx`` takes no nesting)."""
    return [x for segment in segments for x in segment]


def _device(clock: VirtualTime, switch_latency_s: float = 0.0, **noise: float) -> EmulatedDevice:
    dev = EmulatedDevice(index=0, table=TABLE, clock=clock, p_block_w=P_BLOCK_W, **noise)  # type: ignore[arg-type]
    dev.lock_sm_clocks(LO)  # no latency yet: in force from 0
    dev.switch_latency_s = switch_latency_s
    return dev


def test_virtual_time_one_shot_timers() -> None:
    clock = VirtualTime()
    fired: list[tuple[str, float]] = []
    clock.at(0.3, lambda: fired.append(("b", clock.now_s)))
    clock.at(0.1, lambda: fired.append(("a", clock.now_s)))
    cancel = clock.at(0.2, lambda: fired.append(("never", clock.now_s)))
    assert clock.next_due_s() == 0.1
    cancel()
    clock.advance_to(0.15)
    assert fired == [("a", 0.1)]
    assert clock.next_due_s() == 0.3  # the cancelled one is gone
    clock.advance_to(1.0)
    assert fired == [("a", 0.1), ("b", 0.3)]  # once each
    assert clock.next_due_s() is None
    clock.at(0.5, lambda: fired.append(("late", clock.now_s)))  # already past: at the next advance
    clock.advance_to(1.0)
    assert fired[-1] == ("late", 1.0)
    with pytest.raises(ValueError, match="finite"):
        clock.at(float("nan"), lambda: None)


def test_a_faster_clock_landing_mid_instruction_runs_the_rest_fast() -> None:
    clock = VirtualTime()
    dev = _device(clock, switch_latency_s=0.01)
    end, energy, segments = dev.execute("forward", 0.0)
    assert (end, energy) == (pytest.approx(0.1), pytest.approx(10.0))
    clock.advance_to(0.04)
    dev.lock_sm_clocks(HI)  # lands at 0.05: half the work done at LO
    end, energy, segments = dev.execution  # type: ignore[misc]
    assert _flat(segments) == pytest.approx(_flat(((0.0, 0.05, LO), (0.05, 0.075, HI))))
    assert end == pytest.approx(0.05 + 0.5 * 0.05)
    assert energy == pytest.approx(0.5 * 10.0 + 0.5 * 12.0)
    # the energy breakpoints were rewritten: the counter sees the new split, then blocking power
    assert dev.energy_at(0.05) == pytest.approx(5.0)
    assert dev.energy_at(0.075) == pytest.approx(11.0)
    assert dev.energy_at(0.1) == pytest.approx(11.0 + P_BLOCK_W * 0.025)
    assert dev.retimed == 1


def test_a_slower_clock_landing_mid_instruction_keeps_its_noise() -> None:
    clocks = VirtualTime(), VirtualTime()
    noisy = {"noise": 0.05, "seed": 7}
    dev, twin = _device(clocks[0], **noisy), _device(clocks[1], **noisy)
    dev.reset_sm_clocks()
    twin.reset_sm_clocks()  # both unlocked: HI from 0
    end0, energy0, _ = dev.execute("forward", 0.0)
    twin.execute("forward", 0.0)
    t_factor = end0 / 0.05  # the noise's time factor at HI
    landing = 0.25 * end0  # a quarter of the work done
    clocks[0].advance_to(landing)
    dev.lock_sm_clocks(LO)  # no latency: lands now
    end, energy, segments = dev.execution  # type: ignore[misc]
    rest_s = 0.75 * 0.1 * t_factor  # the rest of the work at LO, with the same time factor
    assert _flat(segments) == pytest.approx(
        _flat(((0.0, landing, HI), (landing, landing + rest_s, LO)))
    )
    assert end == pytest.approx(landing + rest_s)
    e_factor = energy0 / 12.0  # the noise's energy factor
    assert energy == pytest.approx(0.25 * energy0 + 0.75 * 10.0 * e_factor)
    # the noise stream was not drawn again: the next instruction matches the twin's
    clocks[0].advance_to(1.0)
    clocks[1].advance_to(1.0)
    twin.lock_sm_clocks(LO)
    assert dev.execute("forward", 1.0) == twin.execute("forward", 1.0)


def test_a_change_landing_after_the_instruction_does_not_touch_it() -> None:
    clock = VirtualTime()
    dev = _device(clock, switch_latency_s=0.01)
    before = dev.execute("forward", 0.0)
    clock.advance_to(0.095)
    dev.lock_sm_clocks(HI)  # lands at 0.105, after the end at 0.1
    end, energy, segments = dev.execution  # type: ignore[misc]
    assert (end, energy, list(segments)) == before
    assert dev.energy_at(0.2) == pytest.approx(10.0 + P_BLOCK_W * 0.1)
    assert dev.retimed == 0


class _Low:
    """Locks the lowest clock at every begin; optionally, during the ``boost``-th instruction,
    a timer locks the highest one ``at_share`` of the way through it."""

    phase = "test"

    def __init__(self, emulator: Emulator, stage: int, boost: int = -1, at_share: float = 0.0):
        self.clock, self.dev = emulator.clock, emulator.devices[stage]
        freqs = self.dev.info.supported_sm_freqs_mhz
        self.lo, self.hi = freqs[0], freqs[-1]
        self.boost, self.at_share, self.n, self.ends = boost, at_share, 0, 0
        self.timed: tuple[float, float] = (0.0, 0.0)  # (when the timer fires, duration at lo)

    def begin(self, kind: str, microbatch: int, chunk: int) -> None:
        self.dev.lock_sm_clocks(self.lo)  # no latency in this emulator: lands now
        if self.n == self.boost:
            duration = self.dev._table[kind][self.lo][0]
            fire = self.clock.now_s + self.at_share * duration
            self.clock.at(fire, lambda: self.dev.lock_sm_clocks(self.hi))
            self.timed = fire, duration
        self.n += 1

    def end(self) -> None:
        self.ends += 1

    def step(self) -> None:
        return None

    def start_iteration(self) -> None:
        return None


def _run(boost: int = -1, at_share: float = 0.3):
    """2 stages x 4 microbatches at the lowest clock; stage 1's ``boost``-th instruction sped up."""
    emulator = make_emulator(toy_profile(2), 4)
    hooks = [_Low(emulator, 0), _Low(emulator, 1, boost, at_share)]
    return emulator, hooks, emulator.run_iteration(hooks)


def _find(result, stage: int, kind: str, microbatch: int):
    return next(
        e
        for e in result.executed
        if (e.instruction.stage, e.instruction.kind, e.instruction.microbatch)
        == (stage, kind, microbatch)
    )


def test_the_event_loop_moves_a_re_timed_end_and_what_waits_for_it() -> None:
    _, _, plain = _run()
    emulator, hooks, boosted = _run(boost=1)  # stage 1's second instruction: B mb0
    ex = _find(boosted, 1, "backward", 0)
    fire, duration = hooks[1].timed
    lo, hi = hooks[1].lo, hooks[1].hi
    table = emulator.devices[1]._table["backward"]
    assert fire == pytest.approx(ex.start_s + 0.3 * duration)
    assert _flat(ex.segments) == pytest.approx(
        _flat(((ex.start_s, fire, lo), (fire, fire + 0.7 * table[hi][0], hi)))
    )
    assert ex.end_s == pytest.approx(fire + 0.7 * table[hi][0])
    assert ex.energy_j == pytest.approx(0.3 * table[lo][1] + 0.7 * table[hi][1])
    # what waited for it starts at its new end: stage 0's B mb0 (its input), stage 1's F mb1
    assert _find(boosted, 0, "backward", 0).start_s == ex.end_s
    assert _find(boosted, 1, "forward", 1).start_s == ex.end_s
    assert ex.end_s < _find(plain, 1, "backward", 0).end_s
    # the stale end was dropped: every instruction ended once, and the energy adds up
    stage1 = [e for e in boosted.executed if e.instruction.stage == 1]
    assert hooks[1].ends == len(stage1) == len(emulator._order[1])
    busy = sum(e.end_s - e.start_s for e in stage1)
    dev, start, end = emulator.devices[1], boosted.start_s, boosted.start_s + boosted.time_s
    assert dev.energy_at(end) - dev.energy_at(start) == pytest.approx(
        sum(e.energy_j for e in stage1) + emulator.p_block_w * (boosted.time_s - busy)
    )
    assert boosted.time_s < plain.time_s


def test_a_timer_whose_change_lands_between_instructions_changes_nothing() -> None:
    _, _, plain = _run()
    _, hooks, late = _run(boost=1, at_share=1.0)  # the boost lands as the instruction ends
    assert hooks[1].timed[0] == _find(late, 1, "backward", 0).end_s
    assert late.executed == plain.executed
    assert late.energy_j == plain.energy_j
