"""Device failures on the real paths, not stubs: one warning, baseline clocks, the true reason
(docs/real-gpu.md §2, §3).

The NVML case runs a real ``powerlib.optimize(mode="apply")`` on the fake pynvml (real nvidia-ml-py error
types) whose lock call starts timing out mid-apply; the read case profiles on the simulated
backend while its reads start failing. Nothing here ran on a real GPU.
"""

from __future__ import annotations

import json
import time
import warnings
from pathlib import Path

import pytest

import powerlib.device
from powerlib.backends.nvidia import NvidiaBackend
from powerlib.config import Settings
from powerlib.errors import DeviceLostError
from powerlib.runtime.coordination import SingleProcess
from powerlib.runtime.session import optimize
from powerlib.testing.fake_nvml import H100_SXM5_80GB, FakeNvml

pytest.importorskip("pynvml")


def _plan(path: Path) -> Path:
    def ins(kind: str, mb: int, freq: float, t: float) -> dict:
        return {"kind": kind, "microbatch": mb, "chunk": 0, "freq_mhz": freq, "planned_time_s": t}

    plan = {
        "schema": "powerlib.plan.v1",
        "workload": {
            "num_stages": 1,
            "num_microbatches": 2,
            "schedule": "1f1b",
            "num_chunks": 1,
            "placement": "looped",
            "p_block_w": 80.0,
            "unit_time_s": 0.001,
            "order": "filter-then-subtract",
            "cost_model": "exp",
            "deadline_s": None,
            "profile_source": "test",
            "order_source": "recorded",
        },
        "policy": "fastest",
        "iteration": 1,
        "time_s": 0.12,
        "energy_j": 1.0,
        "effective_energy_j": 1.0,
        "baseline_energy_j": 1.2,
        "saving": 0.1,
        "stages": [
            {
                "stage": 0,
                "instructions": [
                    ins("forward", 0, 1050.0, 0.02),
                    ins("forward", 1, 1980.0, 0.02),
                    ins("backward", 0, 1050.0, 0.04),
                    ins("backward", 1, 1980.0, 0.04),
                ],
            }
        ],
    }
    path.write_text(json.dumps(plan))
    return path


def test_a_timeout_mid_apply_resets_the_gpu_ends_apply_and_warns_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(powerlib.device, "TRANSIENT_RETRY_DELAYS_S", (0.0, 0.0, 0.0))
    settings = Settings(state_dir=tmp_path / "state", sysfs_root=tmp_path / "sys")
    fake = FakeNvml([H100_SXM5_80GB])
    fake.gpus[0].busy = True
    session = optimize(
        num_stages=1,
        num_microbatches=2,
        mode="apply",
        plan_path=_plan(tmp_path / "plan.json"),
        backend=NvidiaBackend(settings, nvml=fake),
        device=0,
        coordinator=SingleProcess(),
        out_dir=None,
        progress=False,
        threaded=False,
        check_rounds=0,
        guardian=False,
        settings=settings,
    )
    phases = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with session:
            for it in range(8):
                if it == 3:
                    fake.fail("nvmlDeviceSetGpuLockedClocks", fake.NVML_ERROR_TIMEOUT)  # for good
                for kind, mb in (("forward", 0), ("forward", 1), ("backward", 0), ("backward", 1)):
                    with session.instruction(kind, mb):
                        pass
                session.step()
                phases.append(session.phase)
            assert fake.gpus[0].locked_mhz is None  # at the baseline, not stuck at 1050 MHz
            assert session.control is not None
            assert "Timeout" in next(iter(session.control.degraded.values()))
    assert phases[:3] == ["apply"] * 3 and phases[-1] == "done"
    runtime = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(runtime) == 1, runtime
    assert "could not set" in runtime[0] and "reset to its baseline" in runtime[0]
    assert not list((tmp_path / "state").rglob("*.json"))  # restored, no journal left


def test_a_device_that_stops_answering_mid_profile_is_named_as_the_reason(
    tmp_path: Path,
) -> None:
    settings = Settings(
        state_dir=tmp_path / "state",
        sysfs_root=tmp_path / "sys",
        backend="simulated",
        sim_gpus=1,
        sim_energy_period_s=0.0,
    )
    session = optimize(
        num_stages=1,
        num_microbatches=1,
        mode="profile",
        device=0,
        settings=settings,
        coordinator=SingleProcess(),
        out_dir=None,
        progress=False,
        guardian=False,
        warmup_iterations=1,
    )
    reads = {"n": 0}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with session:
            dev = session.device
            assert dev is not None
            real = dev.read_state

            def failing() -> powerlib.device.PowerState:
                reads["n"] += 1
                if reads["n"] > 3:
                    raise DeviceLostError("injected: the GPU fell off the bus", device="x")
                return real()

            dev.read_state = failing  # type: ignore[method-assign]
            for _ in range(20):
                for kind in ("forward", "backward"):
                    with session.instruction(kind):
                        time.sleep(0.02)
                session.step()  # never raises
                if session.phase == "done":
                    break
            assert session.phase == "done"
            assert session.controller is not None and session.controller.wait_idle()
            assert dev.read_sm_lock().locked is False  # reset to the baseline
    runtime = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(runtime) == 1, runtime
    assert "fell off the bus" in runtime[0] and "resolve" not in runtime[0]
    assert session.sampler is not None and session.sampler.failure is not None
