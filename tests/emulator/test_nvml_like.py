"""The emulator behaves like NVML (issue 32, point 1): a discrete-event clock with timers, a
counter that publishes at a phase and may sample part-time, reads that cost the training
thread, clock latency drawn from a distribution, paired noise and thermal drift."""

from __future__ import annotations

import json
import math

import pytest
from runtime_helpers import make_emulator, toy_profile

from powerlib.emulator.device import EmulatedDevice, VirtualTime
from powerlib.emulator.engine import IDEAL_MODEL, NVML_LIKE_MODEL, Emulator, NvmlLikeModel
from powerlib.emulator.noise_model import FIXED_LENGTH
from powerlib.planning.schedules import build_schedule

FAST, SLOW = 1000.0, 500.0


class _Recorder:
    """Hooks that log (virtual time, stage, event) and make ``reads`` driver reads per hook."""

    phase = "record"

    def __init__(
        self, emulator: Emulator, stage: int, log: list, begin_reads: int = 0, end_reads: int = 0
    ) -> None:
        self.emulator, self.stage, self.log = emulator, stage, log
        self.begin_reads, self.end_reads = begin_reads, end_reads

    def _event(self, name: str, reads: int) -> None:
        self.log.append((self.emulator.clock(), self.stage, name))
        for _ in range(reads):
            self.emulator.devices[self.stage].read_state()

    def begin(self, kind: str, microbatch: int, chunk: int) -> None:
        self._event("begin", self.begin_reads)

    def end(self) -> None:
        self._event("end", self.end_reads)

    def step(self) -> None:
        self._event("step", 0)

    def start_iteration(self) -> None:
        return None


def _device(clock: VirtualTime, table: dict | None = None, **kwargs: object) -> EmulatedDevice:
    table = table or {"forward": {FAST: (0.075, 30.0), SLOW: (0.15, 40.0)}}  # 400 W at FAST
    return EmulatedDevice(index=0, table=table, clock=clock, p_block_w=20.0, **kwargs)  # type: ignore[arg-type]


def _landing_s(dev: EmulatedDevice, t0: float, freq: float) -> float:
    """When ``freq`` takes effect after a request at ``t0`` (bisection on the clock timeline)."""
    lo, hi = t0, t0 + 10.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if dev.freq_at(mid) == freq else (mid, hi)
    return hi - t0


def test_hooks_run_in_time_order_and_time_never_goes_back() -> None:
    emulator = make_emulator(toy_profile(), 4)
    log: list = []
    hooks = [_Recorder(emulator, s, log) for s in range(4)]
    for _ in range(2):
        result = emulator.run_iteration(hooks)
    times = [t for t, _, _ in log]
    assert times == sorted(times)
    # each end hook runs exactly when its instruction ends, each begin when it starts
    ends = sorted((t, s) for t, s, event in log[len(log) // 2 :] if event == "end")
    assert ends == sorted((e.end_s, e.instruction.stage) for e in result.executed)
    begins = sorted((t, s) for t, s, event in log[len(log) // 2 :] if event == "begin")
    assert begins == sorted((e.start_s, e.instruction.stage) for e in result.executed)
    with pytest.raises(ValueError, match="only moves forward"):
        emulator.clock.advance_to(emulator.clock() - 1e-9)


def test_timers_tick_at_their_virtual_times_and_can_be_cancelled() -> None:
    clock = VirtualTime()
    ticks: list[float] = []
    cancel = clock.every(0.1, lambda: ticks.append(clock()), phase_s=0.05)
    clock.advance_to(0.32)
    assert ticks == pytest.approx([0.05, 0.15, 0.25]) and clock() == 0.32
    late: list[float] = []
    clock.every(0.25, lambda: late.append(clock()))  # from now on: 0.5, 0.75, ...
    clock.advance_to(0.8)
    assert ticks == pytest.approx([0.05, 0.15, 0.25, 0.35, 0.45, 0.55, 0.65, 0.75])
    assert late == pytest.approx([0.5, 0.75])
    cancel()
    clock.advance_to(1.0)
    assert len(ticks) == 8 and late == pytest.approx([0.5, 0.75, 1.0])
    with pytest.raises(ValueError, match="positive"):
        clock.every(0.0, lambda: None)


def test_a_sampler_timer_reads_the_devices_in_virtual_time_for_free() -> None:
    base = make_emulator(toy_profile(2), 3, read_cost_s=0.003).run_iteration()
    emulator = make_emulator(toy_profile(2), 3, read_cost_s=0.003)
    device = emulator.devices[1]
    samples = []
    emulator.clock.every(0.0037, lambda: samples.append(device.read_state()), phase_s=0.0011)
    result = emulator.run_iteration()
    assert len(samples) == math.floor((result.time_s - 0.0011) / 0.0037) + 1
    for k, state in enumerate(samples):
        assert state.timestamp_s == pytest.approx(0.0011 + k * 0.0037)
        running = [
            e
            for e in result.executed
            if e.instruction.stage == 1 and e.start_s <= state.timestamp_s < e.end_s
        ]
        want = running[0].energy_j / (running[0].end_s - running[0].start_s) if running else 80.0
        assert state.power_w == pytest.approx(want)
    # the sampler's reads cost the training thread nothing
    assert device.reads == len(samples) and result.stall_s == 0.0 and device.stall_s == 0.0
    assert result.time_s == base.time_s and result.energy_j == base.energy_j


def test_a_read_returns_the_last_value_published_at_the_counters_phase() -> None:
    clock = VirtualTime()
    dev = _device(clock, counter_period_s=0.1, counter_phase_s=0.03)
    dev.execute("forward", 0.0)
    expected = {0.02: 0.0, 0.125: dev.energy_at(0.03), 0.135: dev.energy_at(0.13)}
    expected[0.29] = dev.energy_at(0.23)
    for t, energy in expected.items():
        clock.advance_to(t)
        assert dev.read_state().energy_j == pytest.approx(energy, abs=1e-12)
    with pytest.raises(ValueError, match="counter_phase_s"):
        _device(clock, counter_period_s=0.1, counter_phase_s=0.1)


def test_part_time_sampling_publishes_the_window_energy_over_the_duty() -> None:
    clock = VirtualTime()
    part = _device(clock, counter_period_s=0.1, duty=0.25)
    full = _device(clock, counter_period_s=0.1)
    for dev in (part, full):
        dev.execute("forward", 0.0)  # 400 W over [0, 0.075): outside the sampled [0.075, 0.1)
        dev.execute("forward", 0.325)  # 400 W over [0.325, 0.4): the window [0.375, 0.4) sees it
    clock.advance_to(0.15)
    assert part.read_state().energy_j == pytest.approx(20.0 * 0.025 / 0.25)  # 2 J, truth 30.5 J
    assert full.read_state().energy_j == pytest.approx(part.energy_at(0.1)) == 30.5
    clock.advance_to(0.45)
    assert part.read_state().energy_j == pytest.approx(3 * 2.0 + 400.0 * 0.025 / 0.25)  # 46 J
    assert full.read_state().energy_j == pytest.approx(part.energy_at(0.4)) == 65.0
    assert part.counter_at(0.15) == pytest.approx(2.0)  # a read back in time folds again


def test_hook_reads_delay_the_instruction_and_are_reported_as_stall() -> None:
    cost = 0.003
    profile = toy_profile(1)
    base = make_emulator(profile, 2).run_iteration()
    emulator = make_emulator(profile, 2, read_cost_s=cost)
    hooks = [_Recorder(emulator, 0, [], begin_reads=2, end_reads=1)]
    result = emulator.run_iteration(hooks)
    runs = result.executed
    assert runs[0].start_s == pytest.approx(2 * cost)
    for before, after in zip(runs, runs[1:]):
        assert after.start_s - before.end_s == pytest.approx(3 * cost)
    for ideal, got in zip(base.executed, runs):
        assert got.end_s - got.start_s == pytest.approx(ideal.end_s - ideal.start_s)
    assert result.stall_s == pytest.approx(4 * 3 * cost) == emulator.devices[0].stall_s
    assert result.time_s == pytest.approx(base.time_s + 4 * 3 * cost)


def test_clock_changes_land_after_delays_drawn_within_the_spread() -> None:
    table = {"forward": {FAST: (0.075, 30.0), SLOW: (0.15, 40.0)}}
    clock = VirtualTime()
    spread = _device(clock, table, switch_latency_s=0.1, latency_spread=0.5, noise=0.05, seed=3)
    fixed = _device(clock, table, switch_latency_s=0.1, noise=0.05, seed=3)
    delays, runs = [], []
    for i in range(20):
        clock.advance_to(float(i))
        target = SLOW if i % 2 == 0 else FAST
        for dev in (spread, fixed):
            dev.lock_sm_clocks(target)
        delays.append(_landing_s(spread, float(i), target))
        assert _landing_s(fixed, float(i), target) == pytest.approx(0.1)
        # executions after both changes landed: the latency draws leave the noise draws alone
        runs.append([dev.execute("forward", i + 0.5) for dev in (spread, fixed)])
    assert all(0.05 - 1e-9 <= d <= 0.15 + 1e-9 for d in delays)
    assert len({round(d, 6) for d in delays}) == len(delays)
    assert all(a == b for a, b in runs)


def test_a_noise_key_pairs_iterations_instruction_by_instruction() -> None:
    emulator = make_emulator(toy_profile(), 4, noise=0.05, seed=1)

    def shape(result) -> list[float]:  # every instruction's offsets and energy, flat
        return [
            x
            for e in result.executed
            for x in (e.start_s - result.start_s, e.end_s - result.start_s, e.energy_j)
        ]

    a = emulator.run_iteration(noise_key=5)
    b = emulator.run_iteration(noise_key=5)
    c = emulator.run_iteration(noise_key=6)
    assert shape(a) == pytest.approx(shape(b), rel=1e-9) and b.time_s == pytest.approx(a.time_s)
    assert c.time_s != pytest.approx(a.time_s, rel=1e-9)
    d, e = emulator.run_iteration(), emulator.run_iteration()  # no key: one stream, as before
    assert d.time_s != pytest.approx(e.time_s, rel=1e-9)


def test_thermal_drift_raises_power_over_time_and_reads_a_temperature() -> None:
    clock = VirtualTime()
    table = {"forward": {FAST: (1.0, 100.0)}}
    dev = _device(clock, table, drift=0.1, drift_tau_s=10.0)
    assert dev.info.capabilities.has_temperature
    assert _device(clock, table).read_state().temperature_c is None
    first = dev.execute("forward", 0.0)
    later = dev.execute("forward", 50.0)
    factor = 1 + 0.1 * (1 - math.exp(-5.0))
    assert first[:2] == (1.0, pytest.approx(100.0)) and later[0] == 51.0  # time does not drift
    assert later[1] == pytest.approx(100.0 * factor)
    clock.advance_to(50.5)
    state = dev.read_state()
    assert state.power_w == pytest.approx(100.0 * factor)
    assert state.temperature_c == pytest.approx(35 + 40 * (1 - math.exp(-5.05)))
    emulator = make_emulator(toy_profile(), 4, drift=0.05, drift_tau_s=1.0)
    runs = [emulator.run_iteration() for _ in range(5)]
    assert all(r.time_s == pytest.approx(runs[0].time_s) for r in runs)
    assert runs[0].energy_j < runs[1].energy_j < runs[-1].energy_j


def test_the_nvml_like_model_configures_every_device() -> None:
    assert NVML_LIKE_MODEL.describe() == (  # issue 45: hierarchical noise by default
        "NVML-like: 100 ms counter, 3 ms reads, 20 ms ± 50 % clock latency, fixed-length noise "
        "(1 % per iteration + 0.5 % drift, 0.4 % independent, GPU offsets 0.5 % time / 3 % "
        "power, fail-slows 0.02/1000 GPU-iterations), 2 % thermal drift"
    )
    assert IDEAL_MODEL.describe().startswith("ideal: 1 ms counter, free reads, 5 ms clock latency")
    assert json.loads(json.dumps(NVML_LIKE_MODEL.to_json()))["counter_phase"] == "random"
    schedule = build_schedule("1f1b", 4, 4)
    emulator = Emulator(toy_profile(), schedule, p_block_w=80.0, model=NVML_LIKE_MODEL, seed=2)
    again = Emulator(toy_profile(), schedule, p_block_w=80.0, model=NVML_LIKE_MODEL, seed=2)
    phases = [d.counter_phase_s for d in emulator.devices]
    assert phases == [d.counter_phase_s for d in again.devices]
    assert len(set(phases)) == 4 and all(0 <= p < 0.1 for p in phases)
    dev = emulator.devices[3]
    assert (dev.read_cost_s, dev.switch_latency_s, dev.latency_spread) == (0.003, 0.02, 0.5)
    assert (dev.counter_period_s, dev.noise, dev.drift) == (0.1, 0.004, 0.02)  # 0.4 % own
    assert dev.noise_draws is emulator.noise_draws and dev.gpu_power_factor != 1.0
    assert emulator.model is NVML_LIKE_MODEL
    with pytest.raises(ValueError, match="either model= or"):
        Emulator(toy_profile(), schedule, p_block_w=80.0, model=IDEAL_MODEL, noise=0.01)
    with pytest.raises(ValueError, match="either model= or"):
        Emulator(toy_profile(), schedule, p_block_w=80.0, model=IDEAL_MODEL, noise_model=FIXED_LENGTH)
    with pytest.raises(ValueError, match="duty must be in"):
        NvmlLikeModel(duty=0.0)
