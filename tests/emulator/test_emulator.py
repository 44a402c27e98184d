"""The emulator is the ground truth: it must agree with the planner where the model says so."""

from __future__ import annotations

import pytest
from runtime_helpers import make_emulator, toy_profile

from powerlib.emulator.demo import default_profile
from powerlib.emulator.device import EmulatedDevice, VirtualTime
from powerlib.emulator.engine import Emulator
from powerlib.planning.perseus.frontier import FrontierSettings, compute_frontier
from powerlib.planning.pipeline import Instruction
from powerlib.planning.profile import Profile
from powerlib.planning.profile_rows import ProfileRow
from powerlib.planning.schedules import build_schedule


def _frontier(profile, stages: int, mb: int, p_block_w: float, tau: float = 1e-3):
    return compute_frontier(
        profile,
        build_schedule("1f1b", stages, mb),
        settings=FrontierSettings(unit_time_s=tau, p_block_w=p_block_w),
        schedule_name="1f1b",
        num_microbatches=mb,
    )


class _Prefetch:
    """Applies a plan the way the session does: next clock requested when an instruction ends."""

    phase = "apply"

    def __init__(self, device: EmulatedDevice, freqs: list[float]) -> None:
        self.device, self.freqs, self.pos = device, freqs, 0

    def begin(self, kind: str, microbatch: int, chunk: int) -> None:
        if self.device.read_state().locked_sm_freqs_mhz != (self.freqs[self.pos],) * 2:
            self.device.lock_sm_clocks(self.freqs[self.pos])
        self.pos += 1

    def end(self) -> None:
        self.device.lock_sm_clocks(self.freqs[self.pos % len(self.freqs)])

    def step(self) -> None:
        self.pos = 0

    def start_iteration(self) -> None:
        return None


@pytest.mark.parametrize("mb", [1, 3, 6])
def test_all_max_baseline_equals_the_planners(mb: int) -> None:
    profile = toy_profile()
    frontier = _frontier(profile, 4, mb, 80.0)
    result = make_emulator(profile, mb).run_iteration()
    base = frontier.baseline()
    assert result.time_s == pytest.approx(base.time_s, rel=1e-12)
    assert result.energy_j == pytest.approx(base.energy_j, rel=1e-12)


def test_every_frontier_plan_realizes_what_the_planner_replays() -> None:
    profile = toy_profile()
    frontier = _frontier(profile, 4, 4, 80.0)
    emulator = make_emulator(profile, 4)
    for point in frontier.points[:: max(1, len(frontier.points) // 12)]:
        options = frontier.planned_options(point)
        got = emulator.run_frequencies([o.freq_mhz for o in options])
        want = frontier.realized(options)
        assert got.time_s == pytest.approx(want.time_s, rel=1e-12)
        assert got.energy_j == pytest.approx(want.energy_j, rel=1e-12)


def test_switch_latency_model_matches_the_emulator_on_gpt3() -> None:
    profile = default_profile()
    frontier = _frontier(profile, 8, 12, 83.64)
    options = frontier.within_slowdown(frontier.fastest, 0.001, switch_latency_s=0.005)
    emulator = Emulator(
        profile, build_schedule("1f1b", 8, 12), p_block_w=83.64, switch_latency_s=0.005
    )
    base = emulator.run_iteration()
    freqs = [o.freq_mhz for o in options]
    hooks = [
        _Prefetch(emulator.devices[s], [freqs[i] for i in frontier.dag.stage_order(s)])
        for s in range(8)
    ]
    runs = [emulator.run_iteration(hooks) for _ in range(3)]
    model = frontier.realized(options, switch_latency_s=0.005)
    for run in runs[1:]:  # the first managed iteration starts from the unlocked clock
        assert run.time_s == pytest.approx(model.time_s, rel=1e-9)
        assert run.energy_j == pytest.approx(model.energy_j, rel=1e-9)
    assert runs[-1].time_s / base.time_s - 1 <= 0.001
    # without the latency-aware guard the same latency costs more than 0.1 %
    naive = frontier.within_slowdown(frontier.fastest, 0.001)
    assert frontier.realized(naive, switch_latency_s=0.005).time_s / base.time_s - 1 > 0.001


def test_a_clock_change_lands_after_the_latency_and_mid_instruction() -> None:
    clock = VirtualTime()
    table = {"forward": {1000.0: (1.0, 100.0), 500.0: (2.0, 120.0)}}
    dev = EmulatedDevice(index=0, table=table, clock=clock, p_block_w=10.0, switch_latency_s=0.5)
    dev.lock_sm_clocks(500.0)  # requested at t=0, lands at 0.5
    end, energy, segments = dev.execute("forward", 0.0)
    # 0.5 s at 1000 MHz does half the work; the other half takes 1 s at 500 MHz
    assert end == pytest.approx(1.5)
    assert energy == pytest.approx(0.5 * 100.0 + 0.5 * 120.0)
    assert segments == [(0.0, 0.5, 1000.0), (0.5, 1.5, 500.0)]


def test_energy_counter_moves_in_steps_and_blocking_power_fills_gaps() -> None:
    clock = VirtualTime()
    table = {"forward": {1000.0: (0.25, 100.0)}}
    dev = EmulatedDevice(index=0, table=table, clock=clock, p_block_w=20.0, counter_period_s=0.1)
    dev.execute("forward", 0.0)  # 400 W for 0.25 s
    clock.now_s = 0.29
    assert dev.read_state().energy_j == pytest.approx(0.2 * 400.0)  # the counter shows t = 0.2
    assert dev.energy_at(0.29) == pytest.approx(100.0 + 0.04 * 20.0)
    clock.now_s = 1.0
    assert dev.read_state().energy_j == pytest.approx(100.0 + 0.75 * 20.0)


def test_a_straggler_holds_the_iteration_and_every_stage_blocks() -> None:
    profile = toy_profile()
    emulator = make_emulator(profile, 4)
    alone = emulator.run_iteration()
    emulator.straggler_time_s = 1.3 * alone.time_s
    held = emulator.run_iteration()
    assert held.time_s == pytest.approx(1.3 * alone.time_s)
    assert held.makespan_s == pytest.approx(alone.time_s)
    extra = held.energy_j - alone.energy_j
    assert extra == pytest.approx(4 * 80.0 * 0.3 * alone.time_s)


def test_noise_is_seeded_and_perturbs_times() -> None:
    profile = toy_profile()
    a = make_emulator(profile, 4, noise=0.02, seed=7).run_iteration()
    b = make_emulator(profile, 4, noise=0.02, seed=7).run_iteration()
    c = make_emulator(profile, 4).run_iteration()
    assert a.time_s == b.time_s and a.energy_j == b.energy_j
    assert a.time_s != c.time_s


def test_instructions_with_one_useful_clock_are_fixed_and_still_planned() -> None:
    from powerlib.planning.profile import Profile
    from powerlib.planning.profile_rows import ProfileRow

    base = toy_profile()
    rows = []
    for r in base.rows:
        if r.stage == 0 and r.freq_mhz < 1410.0:  # lower clocks: slower *and* costlier
            r = ProfileRow(
                stage=0,
                instruction=r.instruction,
                freq_mhz=r.freq_mhz,
                time_s=r.time_s,
                energy_j=1e3,
            )
        rows.append(r)
    profile = Profile(rows)
    frontier = _frontier(profile, 4, 4, 80.0)
    assert len(frontier.points) > 1
    for ins, freq in zip(frontier.dag.instructions, frontier.frequencies(frontier.fastest)):
        if ins.stage == 0:
            assert freq == 1410.0
    emulator = make_emulator(profile, 4)
    options = frontier.planned_options(frontier.min_energy)
    got = emulator.run_frequencies([o.freq_mhz for o in options])
    assert got.energy_j == pytest.approx(frontier.realized(options).energy_j, rel=1e-12)


def test_a_profile_where_only_the_top_clock_is_useful_gives_one_plan() -> None:
    from powerlib.planning.profile import Profile
    from powerlib.planning.profile_rows import ProfileRow

    rows = [
        ProfileRow(
            stage=s, instruction=k, freq_mhz=f, time_s=0.02 * 1410 / f, energy_j=5.0 * 1410 / f
        )
        for s in range(2)
        for k in ("forward", "backward")
        for f in (1410.0, 1200.0)
    ]
    frontier = _frontier(Profile(rows), 2, 2, 50.0)
    assert len(frontier.points) == 1
    assert set(frontier.frequencies(frontier.fastest)) == {1410.0}
    assert frontier.fastest.time_s == pytest.approx(frontier.baseline_time_s, abs=1e-3)


# torch 2.13 ScheduleZBVZeroBubble, 2 ranks, 4 microbatches, as the integration test recorded it
ZBV_ORDERS = [
    "F0 F1 F2 F0c1 I0c1 W0c1 F1c1 I1c1 W1c1 F3 I0 W0 F2c1 I2c1 W2c1 I1 W1 F3c1 I3c1 W3c1 I2 W2 I3 W3",
    "F0 F0c1 F1 F1c1 I0c1 W0c1 F2 I0 W0 F2c1 I1c1 W1c1 F3 I1 W1 F3c1 I2c1 W2c1 I2 I3c1 I3 W2 W3c1 W3",
]


def _split_profile() -> Profile:
    """toy_profile with each backward split into I (60 %) and W (40 %)."""
    rows = []
    for row in toy_profile(2).rows:
        if row.instruction == "forward":
            rows.append(row)
            continue
        for kind, share in (("backward_input", 0.6), ("backward_weight", 0.4)):
            rows.append(
                ProfileRow(
                    stage=row.stage,
                    instruction=kind,
                    freq_mhz=row.freq_mhz,
                    time_s=row.time_s * share,
                    energy_j=row.energy_j * share,
                )
            )
    return Profile(rows, source="toy-split")


def test_a_zero_bubble_v_schedule_realizes_what_the_planner_replays() -> None:
    kinds = {"F": "forward", "I": "backward_input", "W": "backward_weight"}
    schedule = []
    for stage, text in enumerate(ZBV_ORDERS):
        order = []
        for token in text.split():
            mb, _, chunk = token[1:].partition("c")
            order.append(
                Instruction(
                    stage=stage, microbatch=int(mb), kind=kinds[token[0]], chunk=int(chunk or 0)
                )
            )
        schedule.append(order)
    profile = _split_profile()
    frontier = compute_frontier(
        profile,
        schedule,
        settings=FrontierSettings(unit_time_s=1e-3, p_block_w=80.0),
        schedule_name="recorded",
        num_microbatches=4,
        num_chunks=2,
        placement="v",
    )
    emulator = Emulator(profile, schedule, placement="v", p_block_w=80.0)
    base = emulator.run_iteration()
    assert base.time_s == pytest.approx(frontier.baseline().time_s, rel=1e-12)
    for point in frontier.points[:: max(1, len(frontier.points) // 8)]:
        options = frontier.planned_options(point)
        got = emulator.run_frequencies([o.freq_mhz for o in options])
        want = frontier.realized(options)
        assert got.time_s == pytest.approx(want.time_s, rel=1e-12)
        assert got.energy_j == pytest.approx(want.energy_j, rel=1e-12)
    guarded = frontier.within_slowdown(frontier.fastest, 0.001)
    run = emulator.run_frequencies([o.freq_mhz for o in guarded])
    assert run.time_s <= base.time_s * 1.001
    assert run.energy_j < base.energy_j  # the V schedule's bubbles leave something to save
