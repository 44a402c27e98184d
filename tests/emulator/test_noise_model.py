"""The emulator's hierarchical noise model (issue 45, point 2): per iteration and slow drift, per
microbatch shared by every stage and pass, independent, persistent per-GPU offsets, rare
fail-slows; every draw a function of (seed, key), so paired runs see identical noise."""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
from pathlib import Path

import pytest
from click.testing import CliRunner
from runtime_helpers import make_emulator, toy_profile

from powerlib.cli import cli
from powerlib.cli.emulate import _NOISE_MODEL_NAMES
from powerlib.emulator.demo import DemoConfig
from powerlib.emulator.device import EmulatedDevice, VirtualTime
from powerlib.emulator.engine import (
    IDEAL_MODEL,
    LIVE_NOISE_KEYS,
    NVML_LIKE_MODEL,
    Emulator,
    IterationResult,
)
from powerlib.emulator.noise_model import (
    FIXED_LENGTH,
    IID,
    NOISE_MODELS,
    VARIABLE_LENGTH,
    NoiseDraws,
    NoiseModel,
)
from powerlib.errors import InvalidArgumentError
from powerlib.planning.perseus.noise import TimeNoise

QUIET = NoiseModel(name="custom")  # no structure: build a single part with dataclasses.replace


def _only(**parts: float) -> NoiseModel:
    """A structure with nothing but ``parts`` (the rest zero)."""
    return dataclasses.replace(QUIET, **parts)


def _ratios(emulator: Emulator, result: IterationResult) -> dict[tuple[int, str, int], float]:
    """Each instruction's time over its table time, by (stage, kind, microbatch)."""
    out = {}
    for ex in result.executed:
        ins = ex.instruction
        (freq,) = {f for _, _, f in ex.segments}
        table_s = emulator.devices[ins.stage]._table[ins.kind][freq][0]
        out[ins.stage, ins.kind, ins.microbatch] = (ex.end_s - ex.start_s) / table_s
    return out


def test_the_presets_are_the_traces_figures() -> None:
    """fixed-length and variable-length as the ByteDance traces decompose; iid is the stress case."""
    assert list(NOISE_MODELS) == list(_NOISE_MODEL_NAMES)  # the CLI offers exactly the presets
    fixed, fixed_cv = NOISE_MODELS["fixed-length"]
    variable, variable_cv = NOISE_MODELS["variable-length"]
    iid, iid_cv = NOISE_MODELS["iid"]
    assert (fixed, variable, iid) == (FIXED_LENGTH, VARIABLE_LENGTH, IID)
    assert (fixed.iteration_cv, fixed.drift_cv, fixed.microbatch_cv, fixed_cv) == (
        0.010, 0.005, 0.0, 0.004
    )  # fmt: skip
    assert (variable.iteration_cv, variable.microbatch_cv, variable_cv) == (0.010, 0.017, 0.0035)
    for m in (fixed, variable):
        assert (m.gpu_time_cv, m.gpu_power_cv, m.fail_slow_rate) == (0.005, 0.03, 0.02)
        assert m.fail_slow_iterations == (5.0, 500.0) and m.fail_slow_factor == (1.1, 1.5)
        assert not m.is_iid
    assert iid.is_iid and iid_cv == 0.02
    # the default device is fixed-length; the ideal one has no noise at all
    assert NVML_LIKE_MODEL.noise_model is FIXED_LENGTH and NVML_LIKE_MODEL.noise == 0.004
    assert NVML_LIKE_MODEL.time_noise() == TimeNoise(0.01, 0.0, 0.004)
    assert IDEAL_MODEL.time_noise().is_zero
    stress = NVML_LIKE_MODEL.with_noise_model("iid")
    assert stress.time_noise() == TimeNoise.iid(0.02) and stress.noise_model.is_iid
    assert "2 % i.i.d. noise" in stress.describe()
    assert NVML_LIKE_MODEL.with_noise_model("iid", 0.01).noise == 0.01
    assert "variable-length noise (1 % per iteration + 0.5 % drift, 1.7 % per microbatch" in (
        NVML_LIKE_MODEL.with_noise_model("variable-length").describe()
    )
    data = json.loads(json.dumps(NVML_LIKE_MODEL.to_json()))
    assert data == NVML_LIKE_MODEL.to_json()  # JSON all the way down (no tuples)
    assert data["noise_model"]["name"] == "fixed-length" and data["noise"] == 0.004
    with pytest.raises(ValueError, match="unknown noise model 'gaussian'; choose one of"):
        NVML_LIKE_MODEL.with_noise_model("gaussian")
    with pytest.raises(ValueError, match="iteration_cv must be in"):
        NoiseModel(iteration_cv=-0.01)
    with pytest.raises(ValueError, match="fail_slow_factor"):
        NoiseModel(fail_slow_factor=(0.9, 1.2))


def test_the_iteration_factor_is_shared_by_every_instruction() -> None:
    emulator = make_emulator(toy_profile(), 4, noise_model=_only(iteration_cv=0.01), seed=3)
    factors = []
    for key in range(1, 201):
        ratios = set(_ratios(emulator, emulator.run_iteration(noise_key=key)).values())
        assert max(ratios) - min(ratios) < 1e-12  # one factor for all 32 instructions
        factors.append(ratios.pop())
    assert statistics.pstdev(factors) == pytest.approx(0.01, rel=0.15)


def test_the_microbatch_factor_is_shared_by_its_stages_and_passes() -> None:
    """The same microbatch has one factor on every stage, forward and backward (the data); two
    microbatches have two."""
    emulator = make_emulator(toy_profile(), 4, noise_model=_only(microbatch_cv=0.017), seed=3)
    spread = []
    for key in range(1, 51):
        ratios = _ratios(emulator, emulator.run_iteration(noise_key=key))
        per_mb = [{r for (_, _, mb), r in ratios.items() if mb == m} for m in range(4)]
        assert all(max(rs) - min(rs) < 1e-12 for rs in per_mb)
        spread.append(statistics.pstdev(rs.pop() for rs in per_mb))
    assert statistics.fmean(spread) > 0.005


def test_variable_length_noise_correlates_adjacent_stages_as_the_traces_do() -> None:
    """The same microbatch on adjacent stages: +0.95/+0.97 in ByteDance's traces."""
    clock = VirtualTime()
    draws = NoiseDraws(VARIABLE_LENGTH, seed=7)
    table = {"forward": {1000.0: (0.01, 3.0)}}
    devs = [
        EmulatedDevice(
            index=i, table=table, clock=clock, p_block_w=80.0, noise=0.0035, seed=7 + i,
            noise_draws=draws,
        )
        for i in range(2)
    ]  # fmt: skip
    a, b = [], []
    for key in range(1, 1501):
        for dev in devs:
            dev.reseed_noise(key)
        for mb in range(4):
            a.append(devs[0].noise_factors("forward", mb)[0])
            b.append(devs[1].noise_factors("forward", mb)[0])
    assert 0.94 <= statistics.correlation(a, b) <= 0.99
    # the per-instruction spread is the traces' total (drift included: 2 % +- a little)
    assert statistics.pstdev(a) == pytest.approx(math.sqrt(0.01**2 + 0.017**2 + 0.0035**2), rel=0.2)


def test_persistent_offsets_are_the_truth_profile() -> None:
    """A GPU's offsets hold in every iteration: an emulator of the truth profile without noise
    runs exactly what the noisy one runs (time x offset, energy x time and power offsets)."""
    structure = _only(gpu_time_cv=0.005, gpu_power_cv=0.03)
    noisy = make_emulator(toy_profile(), 4, noise_model=structure, seed=11)
    offsets = [(d.gpu_time_factor, d.gpu_power_factor) for d in noisy.devices]
    assert len(set(offsets)) == 4 and all(t != 1.0 and p != 1.0 for t, p in offsets)
    truth = noisy.truth_profile()
    assert truth.num_stages == 4
    exact = make_emulator(truth, 4, seed=11)
    for key in (1, 2):
        a, b = noisy.run_iteration(noise_key=key), exact.run_iteration(noise_key=key)
        assert a.time_s == pytest.approx(b.time_s, rel=1e-12)
        assert a.energy_j == pytest.approx(b.energy_j, rel=1e-12)
    # the same seed draws the same GPUs; another seed, others
    again = make_emulator(toy_profile(), 4, noise_model=structure, seed=11)
    other = make_emulator(toy_profile(), 4, noise_model=structure, seed=12)
    assert offsets == [(d.gpu_time_factor, d.gpu_power_factor) for d in again.devices]
    assert offsets != [(d.gpu_time_factor, d.gpu_power_factor) for d in other.devices]
    # without structure the truth is the profile itself
    assert make_emulator(toy_profile(), 4, noise=0.02).truth_profile().rows == toy_profile().rows


def test_fail_slows_are_rare_episodes_deterministic_per_gpu() -> None:
    rate = FIXED_LENGTH.fail_slow_rate  # 0.02 per 1000 GPU-iterations
    draws = NoiseDraws(FIXED_LENGTH, seed=0)
    episodes = [ep for dev in range(8) for ep in draws.fail_slow_episodes(dev, 0, 999_999)]
    expected = rate * 8 * 1_000_000 / 1000  # 160
    assert abs(len(episodes) - expected) < 4 * math.sqrt(expected)
    assert all(5 <= ep.end - ep.start <= 500 and 1.1 <= ep.factor <= 1.5 for ep in episodes)
    durations = sorted(ep.end - ep.start for ep in episodes)
    assert durations[0] < 20 and durations[-1] > 200  # log-uniform over two decades
    ep = draws.fail_slow_episodes(3, 0, 999_999)[0]
    fresh = NoiseDraws(FIXED_LENGTH, seed=0)  # a function of (seed, device, key) alone
    assert fresh.fail_slow_factor(3, ep.start) == ep.factor
    assert fresh.fail_slow_factor(3, ep.end - 1) == ep.factor
    assert fresh.fail_slow_factor(3, ep.start - 1) == 1.0 or any(
        e.start <= ep.start - 1 < e.end for e in episodes
    )
    assert NoiseDraws(FIXED_LENGTH, seed=1).fail_slow_episodes(3, 0, 999_999) != (
        draws.fail_slow_episodes(3, 0, 999_999)
    )
    # a device in an episode runs that much slower
    structure = _only(fail_slow_rate=rate)
    emulator = make_emulator(toy_profile(), 4, noise_model=structure, seed=0)
    slow = next(e for e in emulator.noise_draws.fail_slow_episodes(0, 0, 999_999))
    ratios = _ratios(emulator, emulator.run_iteration(noise_key=slow.start))
    assert ratios[0, "forward", 0] == pytest.approx(slow.factor, rel=1e-12)


def test_the_drift_is_slow_common_mode_and_of_its_size() -> None:
    draws = NoiseDraws(_only(drift_cv=0.005), seed=4)
    values = [draws.drift(k) for k in range(0, 60_000, 7)]
    assert statistics.pstdev(values) == pytest.approx(0.005, rel=0.2)
    steps = [abs(draws.drift(k + 1) - draws.drift(k)) for k in range(0, 5000, 50)]
    assert max(steps) < 1e-4  # smooth: periods of hundreds to thousands of iterations
    assert draws.drift(LIVE_NOISE_KEYS + 3) == NoiseDraws(draws.model, seed=4).drift(
        LIVE_NOISE_KEYS + 3
    )


def test_a_key_decides_every_draw_so_plan_and_all_max_are_paired() -> None:
    """Two runs on one key see the same noise whatever ran before; unkeyed iterations use keys of
    their own (``LIVE_NOISE_KEYS + index``)."""
    model = NVML_LIKE_MODEL.with_noise_model("variable-length")
    model = dataclasses.replace(model, counter_period_s=0.0, read_cost_s=0.0, drift=0.0)
    model = dataclasses.replace(model, switch_latency_s=0.0, latency_spread=0.0, counter_phase=0.0)
    model = dataclasses.replace(model, noise_model=dataclasses.replace(
        VARIABLE_LENGTH, fail_slow_rate=500.0
    ))  # fmt: skip
    a = make_emulator(toy_profile(), 4, model=model, seed=2)
    b = make_emulator(toy_profile(), 4, model=model, seed=2)
    for _ in range(3):
        a.run_iteration()
    first = _ratios(a, a.run_iteration(noise_key=9))
    assert _ratios(b, b.run_iteration(noise_key=9)) == pytest.approx(first, rel=1e-12)
    assert _ratios(b, b.run_iteration(noise_key=10)) != pytest.approx(first, rel=1e-6)
    # a's next unkeyed iteration is its fifth (index 4): key LIVE_NOISE_KEYS + 4
    live = _ratios(a, a.run_iteration())
    assert _ratios(b, b.run_iteration(noise_key=LIVE_NOISE_KEYS + 4)) == pytest.approx(
        live, rel=1e-12
    )


def test_iid_is_the_emulator_as_it_was() -> None:
    """No structure: independent time and energy factors of ``noise``, nothing else, and an
    unkeyed iteration runs on from the devices' streams (the stress case of issue 32)."""
    clock = VirtualTime()
    table = {"forward": {1000.0: (0.01, 3.0)}}
    plain = EmulatedDevice(index=0, table=table, clock=clock, p_block_w=80.0, noise=0.02, seed=5)
    iid = EmulatedDevice(
        index=0, table=table, clock=clock, p_block_w=80.0, noise=0.02, seed=5,
        noise_draws=NoiseDraws(IID, seed=5),
    )  # fmt: skip
    rng_draws = [plain.noise_factors("forward", m) for m in range(20)]
    assert [iid.noise_factors("forward", m) for m in range(20)] == rng_draws
    t, e = zip(*rng_draws)
    assert statistics.correlation(t, e) < 0.6  # time and energy drawn apart
    emulator = make_emulator(toy_profile(), 4, model=NVML_LIKE_MODEL.with_noise_model("iid"))
    assert emulator.noise_draws.model.is_iid
    assert all(d.noise_draws is None and d.gpu_time_factor == 1.0 for d in emulator.devices)


def test_the_demo_takes_a_noise_model_override() -> None:
    assert DemoConfig().effective_model() is NVML_LIKE_MODEL
    assert DemoConfig(noise_model="fixed-length").effective_model() is NVML_LIKE_MODEL
    stress = DemoConfig(noise_model="iid").effective_model()
    assert stress.noise_model is IID and stress.noise == 0.02
    assert stress.name == "NVML-like (modified)"
    variable = DemoConfig(noise_model="variable-length", noise=0.005).effective_model()
    assert variable.noise_model is VARIABLE_LENGTH and variable.noise == 0.005
    with pytest.raises(InvalidArgumentError, match="unknown noise model"):
        DemoConfig(noise_model="pink").effective_model()


def test_demo_and_simulate_take_noise_model(tmp_path: Path) -> None:
    """``--noise-model`` on both commands (a 2-stage toy pipeline, so it is quick)."""
    profile = tmp_path / "toy.csv"
    profile.write_text(toy_profile(2).to_csv_text())
    out = tmp_path / "out"
    common = ["--profile", str(profile), "--json"]
    demo = CliRunner().invoke(
        cli,
        ["demo", *common, "--microbatches", "4", "--truth-iterations", "2", "--no-plot"]
        + ["--out-dir", str(out), "--noise-model", "variable-length"],
    )
    assert demo.exit_code == 0, demo.output
    model = json.loads(demo.stdout)["model"]
    assert model["noise_model"] == VARIABLE_LENGTH.to_json() and model["noise"] == 0.0035
    simulate = CliRunner().invoke(
        cli,
        ["simulate", str(out / "plan.json"), *common, "--iterations", "2"]
        + ["--noise-model", "iid", "--no-grid"],
    )
    assert simulate.exit_code == 0, simulate.output
    data = json.loads(simulate.stdout)
    assert data["model"]["noise_model"]["name"] == "iid" and data["model"]["noise"] == 0.02
    assert "2 % i.i.d. noise" in data["model_description"]
    refused = CliRunner().invoke(cli, ["demo", "--noise-model", "pink"])
    assert refused.exit_code == 2 and "pink" in refused.output
