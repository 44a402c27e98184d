"""The simulated GPU's physics and persistence.

These check the phenomena the planners rely on (clock-time scaling, the energy floor below the
voltage knee, power-cap throttling, a quantized energy counter) against the model's equations
(backends/simulated_model.py) and the reference numbers cited in powerlib/gpu_specs.py.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import pytest

from powerlib import ConfigError, NotSupportedError, Settings
from powerlib.backends.simulated import SimulatedBackend, SimulatedDevice, VirtualClock, WallClock
from powerlib.backends.simulated_model import GPU_MODELS, WorkUnit


def _backend(
    settings: Settings,
    model: str = "a100",
    gpus: int = 2,
    persist: bool = False,
    clock: VirtualClock | None = None,
) -> SimulatedBackend:
    return SimulatedBackend(
        settings.replace(sim_model=model, sim_gpus=gpus),
        clock=clock or VirtualClock(),
        persist=persist,
    )


@pytest.mark.parametrize(
    ("model", "count", "top"), [("a100", 81, 1410.0), ("h100", 119, 1980.0), ("a40", 103, 1740.0)]
)
def test_clock_lists_match_the_reference(model: str, count: int, top: float) -> None:
    freqs = GPU_MODELS[model].supported_freqs_mhz
    assert len(freqs) == count
    assert freqs[-1] == top and freqs[0] == 210.0
    assert {round(b - a, 6) for a, b in zip(freqs, freqs[1:])} == {15.0}


def test_a100_idle_and_blocked_power_match_published_figures() -> None:
    m = GPU_MODELS["a100"]
    assert 52.0 <= m.power_w(210.0) <= 68.0  # docs/peers.md: idle 52-68 W at 210 MHz
    assert m.power_w(1410.0) == pytest.approx(85.0)  # Kareus P2P-blocked power
    assert GPU_MODELS["a40"].power_w(1740.0) == pytest.approx(70.0)


def test_compute_bound_time_scales_inversely_with_clock_and_memory_bound_does_not() -> None:
    m = GPU_MODELS["a100"]
    compute = WorkUnit(time_at_max_s=1.0, compute_fraction=1.0)
    memory = WorkUnit(time_at_max_s=1.0, compute_fraction=0.0)
    assert m.duration_s(compute, 705.0) == pytest.approx(2.0)
    assert m.duration_s(memory, 705.0) == pytest.approx(1.0)
    mixed = WorkUnit(time_at_max_s=1.0, compute_fraction=0.6)
    assert m.duration_s(mixed, 705.0) == pytest.approx(0.6 * 2 + 0.4)


def test_power_rises_with_clock_and_voltage_is_floored_below_the_knee() -> None:
    m = GPU_MODELS["a100"]
    work = WorkUnit(time_at_max_s=1.0)
    powers = [m.power_w(f, work) for f in m.supported_freqs_mhz]
    assert all(b > a for a, b in zip(powers, powers[1:]))
    assert m.voltage_ratio(300.0) == m.voltage_ratio(900.0) == m.v_min_ratio
    assert m.voltage_ratio(1410.0) == 1.0
    # Below the knee dynamic power is linear in f (phi ∝ f); above it, superlinear.
    assert m.phi(450.0) * 2 == pytest.approx(m.phi(900.0))
    assert m.phi(1410.0) > 1410 / 900 * m.phi(900.0)


@pytest.mark.parametrize("model", sorted(GPU_MODELS))
def test_compute_bound_energy_has_its_minimum_at_the_voltage_knee(model: str) -> None:
    """Energy falls as the clock drops to the knee, then rises: the 'energy floor' (docs/kareus.md §5.3)."""
    m = GPU_MODELS[model]
    work = WorkUnit(time_at_max_s=1.0)
    energy = {f: m.duration_s(work, f) * m.power_w(f, work) for f in m.supported_freqs_mhz}
    best = min(energy, key=energy.__getitem__)
    assert abs(best - m.knee_freq_mhz) <= m.freq_step_mhz
    assert energy[m.max_freq_mhz] > energy[best] * 1.2  # a real saving exists
    assert energy[m.min_freq_mhz] > energy[best]  # and going lower wastes it again


def _wait_for_clock(dev: SimulatedDevice, clock: VirtualClock, idle_mhz: float) -> None:
    """Poll the running clock until a requested change lands, as a user would (with a deadline)."""
    m = dev.model
    deadline_s = clock.now() + m.switch_latency_s * (1 + m.latency_spread) + 1e-3
    while dev.read_state().sm_freq_mhz != idle_mhz:
        assert clock.now() < deadline_s, "the clock change did not land in time"
        clock.advance(1e-3)


def test_power_cap_throttles_full_load_on_a100(settings: Settings) -> None:
    clock = VirtualClock()
    b = _backend(settings, clock=clock)
    dev = b.devices()[0]
    heavy = WorkUnit(time_at_max_s=1.0, compute_fraction=0.8, sm_activity=1.0, memory_activity=1.0)
    assert GPU_MODELS["a100"].power_w(1410.0, heavy) > 400.0  # would exceed the 400 W TDP
    result = dev.run(heavy)
    assert result.freq_mhz < 1410.0
    assert result.power_w <= 400.0
    dev.set_power_limit(250.0)
    capped = dev.run(heavy)
    assert capped.freq_mhz < result.freq_mhz
    assert capped.power_w <= 250.0
    assert capped.time_s > result.time_s
    dev.lock_sm_clocks(600.0)  # below the throttle point the lock wins
    _wait_for_clock(dev, clock, 600.0)
    assert dev.run(heavy).freq_mhz == 600.0


def test_run_energy_is_power_times_time_and_the_counter_sees_it(settings: Settings) -> None:
    clock = VirtualClock()
    # about energy accounting, not latency: the lock lands at once
    b = _backend(settings.replace(sim_switch_latency_s=0.0), clock=clock)
    dev = b.devices()[0]
    before = dev.read_state().energy_j
    dev.lock_sm_clocks(1200.0)
    work = WorkUnit(time_at_max_s=2.0, compute_fraction=0.7, memory_activity=0.5)
    r = dev.run(work)
    assert r.freq_mhz == 1200.0
    assert r.time_s == pytest.approx(GPU_MODELS["a100"].duration_s(work, 1200.0))
    assert r.energy_j == pytest.approx(r.power_w * r.time_s)
    clock.advance(0.2)  # let the counter publish
    idle_w = GPU_MODELS["a100"].power_w(1200.0)  # locked clock while idle
    after = dev.read_state().energy_j
    assert after - before == pytest.approx(r.energy_j + idle_w * 0.2, abs=idle_w * 0.1 + 0.002)


def test_energy_counter_is_quantized_in_time_and_to_millijoules(settings: Settings) -> None:
    clock = VirtualClock()
    dev = _backend(settings, clock=clock).devices()[0]
    p_w = GPU_MODELS["a100"].power_w(210.0)
    assert dev.read_state().energy_j == 0.0
    clock.advance(0.05)  # inside one 100 ms update period: the counter has not moved
    assert dev.read_state().energy_j == 0.0
    clock.advance(0.06)  # crossed t = 0.1 s: publishes the energy at the tick, in whole mJ
    e = dev.read_state().energy_j
    assert e == math.floor(p_w * 0.1 * 1e3) / 1e3
    assert e * 1e3 == pytest.approx(round(e * 1e3))


def test_devices_share_a_virtual_clock(settings: Settings) -> None:
    clock = VirtualClock()
    a, b = _backend(settings, clock=clock).devices()
    r = a.run(WorkUnit(time_at_max_s=1.0))
    clock.advance(0.1)
    idle_w = GPU_MODELS["a100"].power_w(210.0)
    assert b.read_state().energy_j == pytest.approx(idle_w * (r.time_s + 0.1), abs=idle_w * 0.1)
    assert a.read_state().energy_j > b.read_state().energy_j * 3


def test_temperature_rises_under_load_and_cools_when_idle(settings: Settings) -> None:
    clock = VirtualClock()
    dev = _backend(settings, clock=clock).devices()[0]
    cold = dev.read_state().temperature_c
    dev.run(WorkUnit(time_at_max_s=10.0, memory_activity=1.0))  # full load: at the 400 W cap
    hot = dev.read_state().temperature_c
    assert 60.0 <= hot <= 70.0  # docs/kareus.md §5.1: full load settles at 60-70 °C
    clock.advance(5.0)
    assert dev.read_state().temperature_c < 32.0  # and 5 s of idle cools below ~32 °C
    assert cold < 32.0


def test_state_persists_across_backend_instances(settings: Settings) -> None:
    clock = VirtualClock(start_s=50.0)
    first = _backend(settings, persist=True, clock=clock).devices()[1]
    first.lock_sm_clocks(1005.0)
    first.set_power_limit(300.0)
    clock.advance(1.0)
    second = _backend(settings, persist=True, clock=clock).devices()[1]
    st = second.read_state()
    assert st.locked_sm_freqs_mhz == (1005.0, 1005.0)
    assert st.power_limit_w == 300.0
    assert st.energy_j > 0
    files = sorted(p.name for p in (settings.state_dir / "simulated").glob("*.json"))
    assert files == ["a100-0.json", "a100-1.json"]
    assert (settings.state_dir / "simulated").stat().st_mode & 0o777 == 0o700


def test_wall_clock_backend_persists_by_default(settings: Settings) -> None:
    b = SimulatedBackend(settings.replace(sim_gpus=1))
    assert isinstance(b.clock, WallClock)
    b.devices()[0].lock_sm_clocks(1410.0)
    again = SimulatedBackend(settings.replace(sim_gpus=1)).devices()[0]
    assert again.read_state().locked_sm_freqs_mhz == (1410.0, 1410.0)
    with pytest.raises(NotSupportedError):
        again.run(WorkUnit(time_at_max_s=1.0))


def test_corrupt_state_file_starts_afresh_with_a_warning(
    settings: Settings, caplog: pytest.LogCaptureFixture
) -> None:
    clock = VirtualClock()
    dev = _backend(settings, persist=True, clock=clock).devices()[0]
    dev.lock_sm_clocks(900.0)
    path = settings.state_dir / "simulated" / "a100-0.json"
    path.write_text("{not json")
    with caplog.at_level(logging.WARNING):
        assert dev.read_state().locked_sm_freqs_mhz is None
    assert "unreadable" in caplog.text
    json.loads(path.read_text())  # rewritten, valid


def test_model_and_count_come_from_the_environment(tmp_path: Path) -> None:
    env = {
        "POWERLIB_SIM_GPUS": "8",
        "POWERLIB_SIM_MODEL": "H100",
        "POWERLIB_STATE_DIR": str(tmp_path),
    }
    b = SimulatedBackend(Settings.from_env(env))
    assert len(b.devices()) == 8
    assert b.devices()[0].info.max_sm_freq_mhz == 1980.0
    assert b.devices()[0].info.is_simulated
    with pytest.raises(ConfigError, match="a100, h100, a40"):
        SimulatedBackend(Settings.from_env({**env, "POWERLIB_SIM_MODEL": "v100"}))
    with pytest.raises(ConfigError, match="POWERLIB_SIM_GPUS"):
        Settings.from_env({**env, "POWERLIB_SIM_GPUS": "many"})


def test_workload_rejects_out_of_range_parameters() -> None:
    with pytest.raises(ValueError):
        WorkUnit(time_at_max_s=-1.0)
    with pytest.raises(ValueError):
        WorkUnit(time_at_max_s=1.0, compute_fraction=1.5)
