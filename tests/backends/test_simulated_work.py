"""The simulated GPU follows a session's job (issue 44; backends/_simulated_work.py).

Power follows the work (busy by kind while an instruction runs, blocked between, idle at the
end), unlocked under load equals all-max, and with time following the clock an instruction lasts
what its clocks make it. Most checks run on a manual clock (a wall-clock-like device whose time
moves only when told, the follower's sleep advancing it); two sleep a few real milliseconds.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path

import pytest

from powerlib import Settings
from powerlib.backends._simulated_work import (
    BLOCKED_WORK,
    KIND_WORK,
    LandingLog,
    SimulatedWorkFollower,
    stretched_end_s,
)
from powerlib.backends.simulated import SimulatedBackend, SimulatedDevice, VirtualClock
from powerlib.backends.simulated_model import GPU_MODELS, GpuModel, WorkUnit
from powerlib.emulator.device import EmulatedDevice, VirtualTime
from powerlib.errors import DeviceError
from powerlib.planning.pipeline import KINDS
from powerlib.registry import open_backend
from powerlib.runtime.claim import Job
from powerlib.runtime.coordination import SingleProcess
from powerlib.runtime.session import optimize

A100 = GPU_MODELS["a100"]
HALF_MHZ = 705.0  # half of the A100's 1410 MHz, a supported clock
FORWARD = KIND_WORK["forward"]


class ManualClock:
    """A wall-clock stand-in (not a VirtualClock, so the device follows work) moved by hand."""

    def __init__(self) -> None:
        self.now_s = 1000.0

    def now(self) -> float:
        return self.now_s

    def advance(self, duration_s: float) -> None:
        assert duration_s >= 0
        self.now_s += duration_s


def _device(
    clock: ManualClock, model: GpuModel = A100, *, latency_s: float = 0.0
) -> SimulatedDevice:
    model = dataclasses.replace(model, switch_latency_s=latency_s, latency_spread=0.0)
    return SimulatedDevice(index=0, model=model, clock=clock, state_path=None)


def _follower(dev: SimulatedDevice, clock: ManualClock) -> SimulatedWorkFollower:
    return SimulatedWorkFollower(dev, now=clock.now, time_follows_clock=True, sleep=clock.advance)


def test_the_follower_knows_every_kind_the_planner_knows() -> None:
    assert set(KIND_WORK) == set(KINDS)
    # compute_fraction < 1: a clock has a real energy minimum (time does not scale fully)
    assert all(0 < w.compute_fraction < 1 for w in KIND_WORK.values())


@pytest.mark.parametrize("model", sorted(GPU_MODELS))
def test_busy_power_by_kind_is_above_blocked_power_which_is_above_idle(model: str) -> None:
    m = GPU_MODELS[model]
    clock = ManualClock()
    dev = _device(clock, m)
    follower = _follower(dev, clock)
    idle_w = dev.read_state().power_w
    assert idle_w == pytest.approx(m.power_w(m.min_freq_mhz))  # no job yet: the lock floor
    for kind in KINDS:
        follower.instruction_began(kind)
        busy = dev.read_state()
        assert busy.sm_freq_mhz == m.max_freq_mhz  # unlocked under load: the maximum
        assert busy.power_w == pytest.approx(m.power_w(m.max_freq_mhz, KIND_WORK[kind]))
        assert busy.power_w < m.default_power_limit_w  # no kind throttles at its default cap
        follower.instruction_ended()
        blocked = dev.read_state()
        assert blocked.sm_freq_mhz == m.max_freq_mhz  # blocked keeps its clock
        assert blocked.power_w == pytest.approx(m.blocked_power_w)  # P_block, docs/perseus.md §1.4
        assert busy.power_w > blocked.power_w + 50 > idle_w + 50
    assert KIND_WORK["backward_weight"].compute_fraction > FORWARD.compute_fraction
    follower.close()
    assert dev.read_state().power_w == pytest.approx(idle_w)  # the job ended: idle again
    follower.instruction_began("forward")  # a closed follower does nothing
    assert dev.read_state().power_w == pytest.approx(idle_w)


def _run_job(dev: SimulatedDevice, clock: ManualClock, *, lock_each_at_max: bool) -> float:
    """A little job; returns the energy it took (its time is the clock's)."""
    follower = _follower(dev, clock)
    start_j = dev.exact_energy_j()
    for kind, work_s in (("forward", 0.04), ("forward", 0.05), ("backward", 0.09)):
        if lock_each_at_max:
            dev.lock_sm_clocks(A100.max_freq_mhz)
        follower.instruction_began(kind)
        clock.advance(work_s)
        follower.instruction_ended()
        clock.advance(0.013)  # blocked: waiting for the next stage
    energy_j = dev.exact_energy_j() - start_j
    follower.close()
    return energy_j


def test_a_lock_at_the_maximum_equals_the_unlocked_job_under_load() -> None:
    unlocked_clock, locked_clock = ManualClock(), ManualClock()
    unlocked = _device(unlocked_clock, latency_s=0.02)
    locked = _device(locked_clock, latency_s=0.02)
    unlocked_j = _run_job(unlocked, unlocked_clock, lock_each_at_max=False)
    locked_j = _run_job(locked, locked_clock, lock_each_at_max=True)
    assert locked.read_state().locked_sm_freqs_mhz == (1410.0, 1410.0)
    assert unlocked.read_state().locked_sm_freqs_mhz is None
    assert locked_j == pytest.approx(unlocked_j, rel=1e-12)  # power: exactly the same draw
    assert locked_clock.now_s == unlocked_clock.now_s == pytest.approx(1000.0 + 0.18 + 3 * 0.013)
    # and the job did draw busy power: more than blocked for its whole length
    assert unlocked_j > A100.blocked_power_w * (0.18 + 3 * 0.013) + 20


def test_time_follows_a_half_clock_on_a_manual_clock() -> None:
    clock = ManualClock()
    dev = _device(clock)
    dev.lock_sm_clocks(HALF_MHZ)  # no latency: it runs at once
    follower = _follower(dev, clock)
    start_s = clock.now_s
    follower.instruction_began("forward")
    assert dev.read_state().power_w == pytest.approx(A100.power_w(HALF_MHZ, FORWARD))
    clock.advance(0.040)  # what the host's work took: its time at the maximum clock
    follower.instruction_ended()
    a = FORWARD.compute_fraction
    assert clock.now_s - start_s == pytest.approx(0.040 * (a * 2 + 1 - a), rel=1e-9)
    assert dev.read_state().power_w == pytest.approx(A100.power_w(HALF_MHZ, BLOCKED_WORK))


def test_without_the_setting_time_does_not_follow_the_clock() -> None:
    clock = ManualClock()
    dev = _device(clock)
    dev.lock_sm_clocks(HALF_MHZ)
    follower = SimulatedWorkFollower(
        dev, now=clock.now, time_follows_clock=False, sleep=clock.advance
    )
    follower.instruction_began("backward")
    clock.advance(0.040)
    follower.instruction_ended()
    assert clock.now_s == pytest.approx(1000.040)
    assert dev.work_follower() is not None and not dev.time_follows_clock


def test_time_follows_the_clock_on_the_wall_clock(tmp_path: Path) -> None:
    settings = Settings(
        backend="simulated",
        sim_gpus=1,
        state_dir=tmp_path / "state",
        sim_switch_latency_s=0.0,
        sim_time_follows_clock=True,
    )
    with open_backend(settings=settings) as backend:
        dev = backend.device(0)
        assert isinstance(dev, SimulatedDevice)
        dev.lock_sm_clocks(HALF_MHZ)
        follower = dev.work_follower()
        assert isinstance(follower, SimulatedWorkFollower) and follower.time_follows_clock
        a = FORWARD.compute_fraction
        t0 = time.monotonic()
        follower.instruction_began("forward")
        time.sleep(0.010)
        t1 = time.monotonic()
        follower.instruction_ended()
        t2 = time.monotonic()
        follower.close()
    host_s, total_s = t1 - t0, t2 - t0
    assert total_s >= 0.9 * host_s * (2 * a + 1 - a)  # the stretch: 0.7 x more at half clock
    assert total_s <= host_s * (2 * a + 1 - a) + 0.05  # and not much more
    assert t2 - t1 >= 0.9 * 0.010 * a


def test_a_change_landing_mid_instruction_gives_the_mixed_duration() -> None:
    clock = ManualClock()
    dev = _device(clock, latency_s=0.02)
    dev.lock_sm_clocks(HALF_MHZ)
    clock.advance(0.05)  # landed
    follower = _follower(dev, clock)
    start_s = clock.now_s
    follower.instruction_began("forward")
    clock.advance(0.010)
    dev.lock_sm_clocks(A100.max_freq_mhz)  # lands 20 ms later: 30 ms into the instruction
    clock.advance(0.030)
    follower.instruction_ended()  # 40 ms of host time
    rate = 1 / (2 * FORWARD.compute_fraction + 1 - FORWARD.compute_fraction)  # work/s at half
    done_at_max_s = 0.030 * rate + 0.010  # by the end of the host's work
    expected_s = 0.040 + (0.040 - done_at_max_s)  # the rest at the maximum
    assert clock.now_s - start_s == pytest.approx(expected_s, rel=1e-9)
    assert 0.040 < expected_s < 0.040 / rate  # between all-max and all-half

    # a change that lands during the stretch shortens it from there
    clock.advance(0.1)
    dev.lock_sm_clocks(HALF_MHZ)
    clock.advance(0.05)
    start_s = clock.now_s
    follower.instruction_began("forward")
    clock.advance(0.035)
    dev.lock_sm_clocks(A100.max_freq_mhz)  # lands at 55 ms, after the host's 40 ms
    clock.advance(0.005)
    follower.instruction_ended()
    left_s = 0.040 - 0.040 * rate - 0.015 * rate  # after 55 ms at half
    assert clock.now_s - start_s == pytest.approx(0.055 + left_s, rel=1e-9)


def test_stretched_end_reads_the_clocks_in_order() -> None:
    work = WorkUnit(time_at_max_s=1.0, compute_fraction=1.0)
    clocks = [(0.0, 705.0), (1.0, 1410.0)]  # half speed for a second, then full
    assert stretched_end_s(A100, work, 0.0, clocks, 0.25) == pytest.approx(0.5)
    assert stretched_end_s(A100, work, 0.0, clocks, 1.0) == pytest.approx(1.5)
    assert stretched_end_s(A100, work, 0.5, clocks, 1.0) == pytest.approx(1.75)
    log = LandingLog()
    log.note(0.0, None)
    log.note(0.5, (705.0, 705.0))
    log.note(0.6, (705.0, 705.0))  # no change: not noted
    log.note(0.9, None)
    assert log.since(0.7) == [(0.7, (705.0, 705.0)), (0.9, None)]
    assert log.since(1.0) == [(1.0, None)]


def test_the_follower_swallows_a_device_error_once(caplog: pytest.LogCaptureFixture) -> None:
    clock = ManualClock()
    dev = _device(clock)
    follower = _follower(dev, clock)
    calls = []

    def broken(work: WorkUnit) -> float:
        calls.append(work)
        raise DeviceError("the state file vanished", device=dev.device_id)

    dev.begin_work = broken  # type: ignore[method-assign]
    with caplog.at_level(logging.WARNING):
        follower.instruction_began("forward")
        follower.instruction_ended()
        follower.instruction_began("backward")
        follower.close()
    warnings = [r for r in caplog.records if "stopped following" in r.getMessage()]
    assert len(warnings) == 1 and "the state file vanished" in warnings[0].getMessage()
    assert len(calls) == 1 and not follower.following


def test_the_session_job_swallows_a_broken_follower(caplog: pytest.LogCaptureFixture) -> None:
    class Broken:
        def instruction_began(self, kind: str) -> None:
            raise RuntimeError(f"no {kind}")

        def instruction_ended(self) -> None:
            raise AssertionError("never called once it failed")

        def close(self) -> None:
            raise RuntimeError("close")

    job = Job(
        coordinator=SingleProcess(),
        rank=0,
        stage=0,
        progress=None,  # type: ignore[arg-type]
        clock=time.perf_counter,
        settings=Settings(),
        work=Broken(),
    )
    with caplog.at_level(logging.WARNING):
        job.follow_work("forward")
        job.follow_work(None)
        job.close_work()
    assert job.work is None
    assert sum("stopped following" in r.getMessage() for r in caplog.records) == 1


def test_devices_on_a_virtual_clock_and_other_devices_have_no_follower(
    settings: Settings,
) -> None:
    backend = SimulatedBackend(settings.replace(sim_gpus=1), clock=VirtualClock())
    assert backend.devices()[0].work_follower() is None
    emulated = EmulatedDevice(
        index=0, table={"forward": {1410.0: (0.1, 20.0)}}, clock=VirtualTime(), p_block_w=80.0
    )
    assert emulated.work_follower() is None  # the Device default: a real device runs the work


@pytest.mark.parametrize("enabled", [False, True])
def test_a_session_lets_its_simulated_gpu_follow_the_work(tmp_path: Path, enabled: bool) -> None:
    settings = Settings(
        backend="simulated",
        sim_gpus=1,
        state_dir=tmp_path / "state",
        sim_switch_latency_s=0.0,
        sim_time_follows_clock=True,
    )
    with open_backend(settings=settings) as backend:
        # a disabled session changes no clock: loaded at 705 MHz, idle at 210 MHz
        backend.device(0).lock_sm_clocks(A100.min_freq_mhz, HALF_MHZ)
    session = optimize(
        num_stages=1,
        num_microbatches=1,
        mode="profile",
        enabled=enabled,
        settings=settings,
        device=0,
        coordinator=SingleProcess(),
        out_dir=None,
        progress=False,
        guardian=False,
    )
    with session:
        dev = session.device
        assert isinstance(dev, SimulatedDevice)
        session.begin("F")
        busy = dev.read_state()
        assert busy.power_w == pytest.approx(A100.power_w(busy.sm_freq_mhz, FORWARD))
        e0, t0 = dev.exact_energy_j(), time.time()
        time.sleep(0.005)
        e1, t1 = dev.exact_energy_j(), time.time()
        assert (e1 - e0) / (t1 - t0) == pytest.approx(busy.power_w, rel=0.05)
        before_end = time.monotonic()
        session.end()
        end_s = time.monotonic() - before_end
        blocked = dev.read_state()
        assert blocked.power_w == pytest.approx(A100.power_w(blocked.sm_freq_mhz, BLOCKED_WORK))
        assert blocked.power_w < busy.power_w
        if not enabled:  # at the half clock the disabled session left: end() stretched it
            assert busy.sm_freq_mhz == HALF_MHZ
            assert end_s >= 0.9 * 0.005 * FORWARD.compute_fraction
        session.step()
    idle = dev.read_state()
    assert idle.power_w == pytest.approx(A100.power_w(idle.sm_freq_mhz))  # idle after the job
    assert idle.power_w < blocked.power_w


def test_the_setting_comes_from_the_environment(tmp_path: Path) -> None:
    from powerlib.errors import ConfigError

    assert Settings.from_env({}).sim_time_follows_clock is True  # the default (issue 44)
    assert (
        Settings.from_env({"POWERLIB_SIM_TIME_FOLLOWS_CLOCK": "0"}).sim_time_follows_clock is False
    )
    on = Settings.from_env(
        {"POWERLIB_SIM_TIME_FOLLOWS_CLOCK": " 1 ", "POWERLIB_STATE_DIR": str(tmp_path / "state")}
    )
    assert on.sim_time_follows_clock is True
    with open_backend("simulated", on.replace(sim_gpus=2)) as backend:
        assert all(d.time_follows_clock for d in backend.devices())  # type: ignore[attr-defined]
    for bad in ("yes", "2", "true"):
        with pytest.raises(ConfigError, match="POWERLIB_SIM_TIME_FOLLOWS_CLOCK must be 0 or 1"):
            Settings.from_env({"POWERLIB_SIM_TIME_FOLLOWS_CLOCK": bad})
