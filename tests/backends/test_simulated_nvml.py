"""The simulated GPU behaves like NVML: clock-change latency, read cost, run-to-run noise.

Issue 32 point 1: a clock change lands after ``switch_latency_s * U(1 - spread, 1 + spread)``
(the setting changes at once, the running clock at the landing), a driver read takes
``POWERLIB_SIM_READ_COST_S``, and each work unit's duration and energy carry seeded noise. All
on a :class:`VirtualClock`: deterministic, nothing sleeps.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest
from click.testing import CliRunner

from powerlib import ConfigError, Settings
from powerlib.backends.simulated import SimulatedBackend, SimulatedDevice, VirtualClock
from powerlib.backends.simulated_model import GPU_MODELS, WorkUnit
from powerlib.cli import cli

A100 = GPU_MODELS["a100"]
STEP_S = 1e-4  # how finely the tests poll the virtual clock
LOW_S = A100.switch_latency_s * (1 - A100.latency_spread)  # 10 ms
HIGH_S = A100.switch_latency_s * (1 + A100.latency_spread)  # 30 ms


def _devices(
    settings: Settings, clock: VirtualClock, *, persist: bool = False, gpus: int = 2
) -> list[SimulatedDevice]:
    backend = SimulatedBackend(settings.replace(sim_gpus=gpus), clock=clock, persist=persist)
    return list(backend.devices())


def _landing_s(dev: SimulatedDevice, clock: VirtualClock, idle_mhz: float) -> float:
    """Poll the running clock until it shows ``idle_mhz``; the time that took."""
    start_s = clock.now()
    while dev.read_state().sm_freq_mhz != idle_mhz:
        assert clock.now() - start_s < 1.0, "the clock change never landed"
        clock.advance(STEP_S)
    return clock.now() - start_s


def test_model_defaults_are_20_ms_spread_by_half() -> None:
    for model in GPU_MODELS.values():
        assert model.switch_latency_s == 0.02 and model.latency_spread == 0.5


def test_a_clock_change_lands_within_the_latency_bounds(settings: Settings) -> None:
    clock = VirtualClock()
    dev = _devices(settings, clock)[0]
    latencies = []
    for mhz in (900.0, 1200.0, 600.0, 1005.0) * 5:
        dev.lock_sm_clocks(mhz)
        st = dev.read_state()
        assert st.locked_sm_freqs_mhz == (mhz, mhz)  # the setting changes at once
        assert st.sm_freq_mhz != mhz  # the running clock does not
        latencies.append(_landing_s(dev, clock, mhz))
    dev.reset_sm_clocks()
    assert dev.read_state().locked_sm_freqs_mhz is None
    assert dev.read_state().sm_freq_mhz == 1005.0  # a reset lands late too
    latencies.append(_landing_s(dev, clock, A100.min_freq_mhz))
    assert all(LOW_S <= t <= HIGH_S + STEP_S for t in latencies), latencies
    assert max(latencies) - min(latencies) > 0.005  # drawn, not constant


def test_latency_draws_are_seeded(settings: Settings) -> None:
    def landings(seed: int) -> list[float]:
        clock = VirtualClock()
        dev = _devices(settings.replace(sim_seed=seed), clock)[1]
        out = []
        for mhz in (900.0, 1200.0, 600.0):
            dev.lock_sm_clocks(mhz)
            out.append(_landing_s(dev, clock, mhz))
        return out

    assert landings(3) == landings(3)
    assert landings(3) != landings(4)


def test_a_newer_request_overrides_one_still_in_flight(settings: Settings) -> None:
    clock = VirtualClock()
    dev = _devices(settings, clock)[0]
    dev.lock_sm_clocks(900.0)
    dev.lock_sm_clocks(1200.0)
    seen = []
    while clock.now() < 2 * HIGH_S:
        seen.append(dev.read_state().sm_freq_mhz)
        clock.advance(STEP_S)
    assert seen[0] == A100.min_freq_mhz  # the old clock runs meanwhile
    assert seen[-1] == 1200.0
    assert 900.0 not in seen[seen.index(1200.0) :]  # the older change never lands after it


def test_work_runs_at_the_old_clock_until_the_change_lands(settings: Settings) -> None:
    clock = VirtualClock()
    dev = _devices(settings, clock)[0]
    work = WorkUnit(time_at_max_s=1.0, compute_fraction=1.0, sm_activity=0.5)
    dev.lock_sm_clocks(705.0)  # half the 1410 MHz the unlocked clock runs work at
    r = dev.run(work)
    # The first L seconds do L seconds of work at 1410 MHz, the rest takes twice as long:
    # t = L + 2 (1 - L) = 2 - L.
    latency_s = 2.0 - r.time_s
    assert LOW_S <= latency_s <= HIGH_S
    e_fast = A100.power_w(1410.0, work) * latency_s
    e_slow = A100.power_w(705.0, work) * (r.time_s - latency_s)
    assert r.energy_j == pytest.approx(e_fast + e_slow, rel=1e-9)
    mean_mhz = (1410.0 * latency_s + 705.0 * (r.time_s - latency_s)) / r.time_s
    assert r.freq_mhz == pytest.approx(mean_mhz)  # the time-weighted mean clock
    assert dev.run(work).time_s == pytest.approx(2.0)  # landed: all of it at 705 MHz


def test_a_change_in_flight_persists_across_processes(settings: Settings) -> None:
    clock = VirtualClock(start_s=100.0)
    _devices(settings, clock, persist=True)[0].lock_sm_clocks(900.0)
    other = _devices(settings, clock, persist=True)[0]  # another process's view of the GPU
    st = other.read_state()
    assert st.locked_sm_freqs_mhz == (900.0, 900.0) and st.sm_freq_mhz == A100.min_freq_mhz
    assert LOW_S <= _landing_s(other, clock, 900.0) <= HIGH_S + STEP_S
    path = settings.state_dir / "simulated" / "a100-0.json"
    assert json.loads(path.read_text())["switches"] == 1


def test_a_state_file_without_the_new_fields_still_loads(settings: Settings) -> None:
    clock = VirtualClock(start_s=100.0)
    _devices(settings, clock, persist=True)
    path = settings.state_dir / "simulated" / "a100-0.json"
    old = json.loads(path.read_text())
    for key in ("running_mhz", "pending", "switches"):
        del old[key]
    old["locked_mhz"] = [900.0, 900.0]
    path.write_text(json.dumps(old))
    st = _devices(settings, clock, persist=True)[0].read_state()
    assert st.locked_sm_freqs_mhz == (900.0, 900.0) and st.sm_freq_mhz == 900.0  # landed


def test_zero_latency_lands_at_once(settings: Settings) -> None:
    clock = VirtualClock()
    dev = _devices(settings.replace(sim_switch_latency_s=0.0), clock)[0]
    dev.lock_sm_clocks(900.0)
    assert dev.read_state().sm_freq_mhz == 900.0


def test_a_read_costs_its_cost_on_a_virtual_clock(settings: Settings) -> None:
    clock = VirtualClock()
    a, b = _devices(settings.replace(sim_read_cost_s=0.003), clock)
    for _ in range(10):
        a.read_state()
    assert clock.now() == pytest.approx(0.03)
    assert b.read_state().timestamp_s == pytest.approx(0.033)  # the state after the read
    a.exact_energy_j()  # the ground truth is not a driver read
    assert clock.now() == pytest.approx(0.033)
    free = VirtualClock()
    _devices(settings, free)[0].read_state()  # the default costs nothing
    assert free.now() == 0.0


def _noisy_runs(settings: Settings, noise: float, seed: int) -> list[tuple[float, float]]:
    clock = VirtualClock()
    dev = _devices(settings.replace(sim_noise=noise, sim_seed=seed), clock)[0]
    work = WorkUnit(time_at_max_s=0.5, sm_activity=0.5)
    return [(r.time_s, r.energy_j) for r in (dev.run(work) for _ in range(300))]


def test_noise_is_seeded_and_bounded(settings: Settings) -> None:
    work = WorkUnit(time_at_max_s=0.5, sm_activity=0.5)
    nominal_s, nominal_j = 0.5, 0.5 * A100.power_w(1410.0, work)
    quiet = _noisy_runs(settings, 0.0, 0)
    assert all(t == nominal_s and e == pytest.approx(nominal_j) for t, e in quiet)
    runs = _noisy_runs(settings, 0.05, 7)
    assert runs == _noisy_runs(settings, 0.05, 7)
    assert runs != _noisy_runs(settings, 0.05, 8)
    t_factors = [t / nominal_s for t, _ in runs]
    e_factors = [e / nominal_j for _, e in runs]
    for factors in (t_factors, e_factors):
        assert all(0.85 - 1e-9 <= f <= 1.15 + 1e-9 for f in factors)  # clipped to ±3 σ
        assert 0.035 <= statistics.stdev(factors) <= 0.065
        assert abs(statistics.fmean(factors) - 1.0) < 0.01
    assert abs(statistics.correlation(t_factors, e_factors)) < 0.2  # drawn independently


def test_the_knobs_come_from_the_environment(tmp_path: Path) -> None:
    env = {
        "POWERLIB_STATE_DIR": str(tmp_path),
        "POWERLIB_SIM_SWITCH_LATENCY_S": "0.05",
        "POWERLIB_SIM_LATENCY_SPREAD": "0",
        "POWERLIB_SIM_READ_COST_S": "0.003",
        "POWERLIB_SIM_NOISE": "0.02",
        "POWERLIB_SIM_SEED": "11",
    }
    settings = Settings.from_env(env)
    assert (settings.sim_read_cost_s, settings.sim_noise, settings.sim_seed) == (0.003, 0.02, 11)
    clock = VirtualClock()
    dev = SimulatedBackend(settings.replace(sim_read_cost_s=0.0), clock=clock).devices()[0]
    details = dev.details()
    assert (details["switch_latency_s"], details["latency_spread"]) == (0.05, 0.0)
    assert (details["read_cost_s"], details["noise"]) == (0.0, 0.02)
    dev.lock_sm_clocks(900.0)
    assert _landing_s(dev, clock, 900.0) == pytest.approx(0.05, abs=STEP_S)


@pytest.mark.parametrize(
    ("var", "raw"),
    [
        ("POWERLIB_SIM_SWITCH_LATENCY_S", "-0.01"),
        ("POWERLIB_SIM_SWITCH_LATENCY_S", "soon"),
        ("POWERLIB_SIM_SWITCH_LATENCY_S", "nan"),
        ("POWERLIB_SIM_SWITCH_LATENCY_S", "inf"),
        ("POWERLIB_SIM_LATENCY_SPREAD", "1.5"),
        ("POWERLIB_SIM_READ_COST_S", "-0.001"),
        ("POWERLIB_SIM_READ_COST_S", "3ms"),
        ("POWERLIB_SIM_NOISE", "0.3"),
        ("POWERLIB_SIM_NOISE", "0.1\nPOWERLIB_SIM_NOISE=0"),
        ("POWERLIB_SIM_SEED", "-1"),
        ("POWERLIB_SIM_SEED", "1.5"),
        ("POWERLIB_SIM_SEED", "9" * 5000),
    ],
)
def test_a_bad_value_is_one_clear_error_line(tmp_path: Path, var: str, raw: str) -> None:
    with pytest.raises(ConfigError, match=f"^{var} must be ") as err:
        Settings.from_env({var: raw})
    assert "\n" not in str(err.value)
    env = {"POWERLIB_BACKEND": "simulated", "POWERLIB_STATE_DIR": str(tmp_path), var: raw}
    result = CliRunner().invoke(cli, ["status"], env=env, catch_exceptions=False)
    assert result.exit_code != 0
    assert result.stdout == ""
    assert result.stderr.startswith(f"powerlib: error: {var} must be ")
    assert result.stderr.count("\n") == 1


def test_settings_built_directly_are_checked_too() -> None:
    with pytest.raises(ConfigError, match="^POWERLIB_SIM_NOISE must be "):
        Settings(sim_noise=-0.1)
    with pytest.raises(ConfigError, match="^POWERLIB_SIM_SWITCH_LATENCY_S must be "):
        Settings(sim_switch_latency_s=float("nan"))
