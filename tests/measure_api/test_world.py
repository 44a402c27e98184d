"""m.result(reduce="world") over real torch.distributed (gloo) ranks: each device counted once."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch.distributed")

sys.path.insert(0, str(Path(__file__).parents[1]))
from multiproc import launch_ranks  # noqa: E402

from powerlib.measure_api import DeviceEnergy, MeasurementResult, WindowEnergy, reduce_results  # noqa: E402

WORKER = Path(__file__).with_name("world_worker.py")

pytestmark = pytest.mark.integration


def _rank0(logs: list[str]) -> dict:
    line = next(line for line in logs[0].splitlines() if line.startswith("{"))
    return json.loads(line)


def test_ranks_sharing_devices_count_each_once(tmp_path: Path) -> None:
    out = _rank0(launch_ranks(WORKER, ["shared"], world=2, state=tmp_path))
    world, locals_ = out["world"], out["locals"]
    assert world["reduce"] == "world" and world["ranks"] == 2
    ids = [d["device_id"] for d in world["devices"]]
    assert len(ids) == 2 == len(set(ids))  # 2 GPUs, although 2 ranks x 2 GPUs were read
    assert all(d["rank"] == 0 for d in world["devices"])  # the lowest rank's reading is kept
    naive = sum(loc["energy_j"] for loc in locals_)
    assert world["energy_j"] == pytest.approx(locals_[0]["energy_j"], rel=1e-6)
    assert world["energy_j"] < 0.6 * naive  # a plain sum over ranks double counts
    assert world["steps"] == 4
    assert world["tokens"] == 4 * (100 + 200) and out["tokens_max"] == 4 * 200
    # each step's world energy comes from the owning rank's step window only
    step_e = [w["energy_j"] for w in world["windows"] if w["kind"] == "step" and w["rank"] == 1]
    assert step_e == [0.0] * 4


def test_ranks_on_their_own_devices_add_up(tmp_path: Path) -> None:
    out = _rank0(launch_ranks(WORKER, ["own"], world=2, state=tmp_path))
    world, locals_ = out["world"], out["locals"]
    assert len(world["devices"]) == 2
    assert {d["rank"] for d in world["devices"]} == {0, 1}
    assert world["energy_j"] == pytest.approx(sum(loc["energy_j"] for loc in locals_), rel=1e-6)
    assert world["energy_per_step_j"] == pytest.approx(
        sum(w["energy_j"] for w in world["windows"] if w["kind"] == "step") / 4, rel=1e-6
    )


def _dev(host: str, dev_id: str, rank: int, energy: float) -> DeviceEnergy:
    return DeviceEnergy(
        device_id=dev_id, index=0, name="x", backend="simulated", hostname=host, rank=rank,
        energy_j=energy, time_s=1.0, average_power_w=energy, source="counter", estimated=False,
        counter_resets=0, counter_wraps=0, samples=10,
    )  # fmt: skip


def test_the_same_id_on_two_hosts_is_two_devices() -> None:
    """sysfs zone ids (package-0) and simulated UUIDs repeat across nodes: hosts tell them apart."""

    def res(host: str, rank: int) -> MeasurementResult:
        return MeasurementResult(
            reduce="local", ranks=1, start_unix_s=0.0, time_s=1.0,
            devices=(_dev(host, "package-0", rank, 50.0),),
            windows=(WindowEnergy(kind="step", name="step", index=0, rank=rank, start_s=0.0,
                                  time_s=1.0, energy_j=50.0, tokens=None,
                                  device_energy_j={"package-0": 50.0}),),
        )  # fmt: skip

    world = reduce_results([res("a", 0), res("a", 1), res("b", 2)])
    assert world.energy_j == 100.0
    assert world.step_energy_j == [100.0]
    with pytest.raises(ValueError, match="tokens_reduce"):
        reduce_results([res("a", 0)], tokens_reduce="mean")
