"""Helpers of the runtime tests: a small DVFS-shaped profile and emulated pipelines."""

from __future__ import annotations

import pytest

from powerlib.emulator.engine import Emulator
from powerlib.planning.profile import Profile
from powerlib.planning.profile_rows import ProfileRow
from powerlib.planning.schedules import build_schedule

FREQS = (1410.0, 1305.0, 1200.0, 1095.0, 990.0, 885.0, 780.0)


def toy_profile(num_stages: int = 4, freqs: tuple[float, ...] = FREQS) -> Profile:
    """Stage-imbalanced profile: time ~ 0.3 + 0.7 f_max/f, power = static + dynamic ~ f^2.4.

    Below ~900 MHz the static power makes energy rise again (so the sweep's stop rule has
    something to find).
    """
    rows = []
    for stage in range(num_stages):
        scale = 1.0 + 0.15 * stage  # later stages are heavier: earlier ones have slack
        for kind, base_s in (("forward", 0.020), ("backward", 0.040)):
            for f in freqs:
                time_s = base_s * scale * (0.3 + 0.7 * freqs[0] / f)
                power_w = 140.0 + 260.0 * (f / freqs[0]) ** 2.4
                rows.append(
                    ProfileRow(
                        stage=stage,
                        instruction=kind,
                        freq_mhz=f,
                        time_s=time_s,
                        energy_j=power_w * time_s,
                    )
                )
    return Profile(rows, source="toy")


@pytest.fixture
def toy() -> Profile:
    return toy_profile()


def make_emulator(profile: Profile, microbatches: int = 4, **kwargs: object) -> Emulator:
    stages = profile.num_stages
    return Emulator(
        profile,
        build_schedule("1f1b", stages, microbatches),
        p_block_w=kwargs.pop("p_block_w", 80.0),
        **kwargs,
    )  # type: ignore[arg-type]


EXACT_SWEEP: dict[str, object] = {
    "reference_iterations": 1,
    "rotating_reference": False,
    "target_time_error": 0.5,
}
"""A sweep of exactly one iteration per clock, every stage at it: for tests that count the
sweep's iterations (the reference block, the rotating reference and the time target that issue
45 added have tests of their own: test_noise_estimate.py, test_rotating_reference.py)."""


def emulated_sessions(emulator: Emulator, tmp_out, **kwargs: object) -> list:
    """One session per stage of ``emulator``, coordinated in-process (not yet entered)."""
    from powerlib.runtime.coordination import LocalGroup
    from powerlib.runtime.session import optimize

    n = emulator.num_stages
    group = LocalGroup(n)
    options: dict[str, object] = {
        "num_stages": n,
        "num_microbatches": len(emulator.dag.instructions) // (2 * n),
        "backend": emulator.backend,
        "clock": emulator.clock,
        "threaded": False,
        "out_dir": tmp_out,
        "progress": False,
        "warmup_iterations": 1,
        "settle_iterations": 1,
        "iterations_per_freq": 1,
        **EXACT_SWEEP,
        "check_rounds": 0,  # the closed loop has tests of its own (test_closed_loop.py)
    }
    options.update(kwargs)
    return [
        optimize(stage=s, device=s, coordinator=group.member(s), **options)
        for s in range(n)
    ]
