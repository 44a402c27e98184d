"""Kareus's launch control driven by a session: attach, the listener hooks, the refusal of a
Kareus plan nothing carries out, and real gloo all-reduces launched at the planned slots in two
processes (``launch_worker.py``).
"""

from __future__ import annotations

import dataclasses
import json
import warnings
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest
from launch_cases import ATTN, ORDER, Recorder, kareus_plan_data, run_partition

from powerlib.config import Settings
from powerlib.errors import InvalidArgumentError, PlanError
from powerlib.kareus.launch import LaunchControl, active_control, attach
from powerlib.planning.plan import FrequencyPlan, PartitionSetting
from powerlib.runtime.coordination import SingleProcess
from powerlib.runtime.session import Session, optimize

WORKER = Path(__file__).with_name("launch_worker.py")


# -- the session ----------------------------------------------------------------------------------


def _session(plan_path: Path, tmp_path: Path) -> Session:
    from powerlib.backends.simulated import SimulatedBackend, VirtualClock

    clock = VirtualClock()
    backend = SimulatedBackend(
        Settings(backend="simulated", sim_gpus=1, state_dir=tmp_path / "st"), clock=clock
    )
    return optimize(
        num_stages=1,
        num_microbatches=2,
        mode="apply",
        plan_path=plan_path,
        backend=backend,
        device=0,
        coordinator=SingleProcess(),
        clock=clock.now,
        threaded=False,
        out_dir=None,
        progress=False,
    )


def _perseus_plan_data() -> dict[str, Any]:
    data = kareus_plan_data()
    for ins in data["stages"][0]["instructions"]:
        ins.pop("execution", None)
        ins.pop("overlap", None)
    return data


def test_the_session_drives_the_launch_control_from_its_hooks(tmp_path: Path) -> None:
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(kareus_plan_data()))
    session = _session(path, tmp_path)
    control = attach(session)
    assert attach(session) is control and session.instruction_listeners == (control,)
    assert not control.active and active_control() is None  # the plan arrives at the with line
    seen = []
    with session, warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # no process group: SMs recorded only
        assert control.active and control.schedule.stage == 0 and active_control() is control
        for _ in range(2):
            for kind, mb in ORDER:
                with session.instruction(kind, microbatch=mb):
                    seen.append((control.nanobatch, control.config("fwd_attn")))
                    run_partition(control, "fwd_attn", ATTN, Recorder())
            session.step()
    assert active_control() is None  # the session closed
    assert seen[:4] == [
        (True, PartitionSetting("rope_0", 12)),
        (True, PartitionSetting("linear_0", 9)),
        (False, None),
        (True, PartitionSetting("rope_0", 12)),
    ]
    assert seen[4:] == seen[:4]
    report = control.report()
    assert report.active and report.iterations == 2
    assert report.requested_sm_counts == {"fwd_attn": [9, 12]}
    assert report.to_json() == {
        "loaded": True,
        "active": True,
        "disabled": None,
        "iterations": 2,
        "communicators": len(control.groups.groups),
        "launches": len(control.records),
        "paths": report.paths,
        "enforced": report.enforced,
        "requested_sm_counts": {"fwd_attn": [9, 12]},
    }


def test_a_launch_control_given_as_a_session_keyword_takes_the_plan(tmp_path: Path) -> None:
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(kareus_plan_data()))
    asked = []
    control = LaunchControl(group_ranks=lambda: asked.append(1) or [[0]])
    session = _session(path, tmp_path)
    config = session.config
    session = Session(
        dataclasses.replace(config, run=dataclasses.replace(config.run, listeners=(control,)))
    )
    with session:
        assert control.active and asked == [1] and attach(session) is control


def test_a_kareus_plan_brings_its_launch_control_through_the_registration(tmp_path: Path) -> None:
    """Kareus registers itself (entry point powerlib.instruction_listeners:partitions): a
    session given a Kareus plan and no launch control adds the registered one at the with line."""
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(kareus_plan_data()))
    session = _session(path, tmp_path)
    assert session.instruction_listeners == ()
    with session, warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # no process group: SMs recorded only
        (control,) = session.instruction_listeners
        assert isinstance(control, LaunchControl) and control.active
        assert active_control() is control and control.schedule.stage == 0
        with session.instruction("forward", microbatch=0):
            assert control.config("fwd_attn") == PartitionSetting("rope_0", 12)
        session.step()
    assert active_control() is None


def test_a_perseus_plan_adds_no_registered_listener(tmp_path: Path) -> None:
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(_perseus_plan_data()))
    session = _session(path, tmp_path)
    with session:
        assert session.instruction_listeners == ()


def _entry_points(value: str | None) -> Any:
    found = (
        []
        if value is None
        else [metadata.EntryPoint("partitions", value, "powerlib.instruction_listeners")]
    )
    return lambda *, group: [e for e in found if e.group == group]


@pytest.mark.parametrize(
    "registered", [None, "powerlib_no_such_module:make"], ids=["none", "broken"]
)
def test_a_kareus_plan_nothing_takes_is_refused_at_the_with_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
    registered: str | None,
) -> None:  # fmt: skip
    monkeypatch.setattr(metadata, "entry_points", _entry_points(registered))
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(kareus_plan_data()))
    session = _session(path, tmp_path)
    with pytest.raises(PlanError) as caught, session:
        pass
    message = str(caught.value)
    assert "\n" not in message and "plan.json" in message
    assert "per-partition launch points and SM counts" in message
    assert "powerlib.instruction_listeners:partitions" in message
    assert "powerlib.kareus.launch.attach(session)" in message
    assert session.phase == "closed" and session.plan is None
    failed = [r for r in caplog.records if "failed to load" in r.getMessage()]
    assert len(failed) == (0 if registered is None else 1)


def test_a_perseus_plan_leaves_the_launch_control_inactive(tmp_path: Path) -> None:
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(_perseus_plan_data()))
    with _session(path, tmp_path) as session:
        control = attach(session)  # after the plan arrived: it gets the plan now
        assert control.schedule is None and active_control() is control
        with session.instruction("forward", 0):
            assert control.config("fwd_attn") is None and not control.active
        with pytest.raises(InvalidArgumentError, match="before the first instruction"):
            session.add_instruction_listener(LaunchControl())
        assert "overlap" not in session.report().to_json()


class _Listener:
    """Records what the session hands an instruction listener."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def plan_applied(self, plan: FrequencyPlan, stage: int) -> bool:
        self.calls.append(("plan", plan.policy, stage))
        return False

    def begin(self, kind: str, microbatch: int, chunk: int) -> None:
        self.calls.append(("begin", kind, microbatch, chunk))

    def end(self) -> None:
        self.calls.append(("end",))

    def step(self) -> None:
        self.calls.append(("step",))

    def close(self) -> None:
        self.calls.append(("close",))


def test_a_listener_hears_the_plan_every_instruction_and_the_close(tmp_path: Path) -> None:
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(_perseus_plan_data()))
    listener = _Listener()
    session = _session(path, tmp_path)
    session.add_instruction_listener(listener)
    with pytest.raises(InvalidArgumentError, match="added to the session already"):
        session.add_instruction_listener(listener)
    with pytest.raises(InvalidArgumentError, match="needs plan_applied"):
        session.add_instruction_listener(object())
    with session:
        for kind, mb in ORDER:
            with session.instruction(kind[0].upper(), mb):
                pass
        session.step()
    assert listener.calls == [
        ("plan", "min-energy", 0),
        *[call for kind, mb in ORDER for call in (("begin", kind, mb, 0), ("end",))],
        ("step",),
        ("close",),
    ]


# -- two processes on gloo ----------------------------------------------------------------------


def test_two_gloo_ranks_launch_at_the_planned_slots(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    from multiproc import launch_ranks

    data = kareus_plan_data()
    plan_path = tmp_path / "plan.json"
    plan_path.write_text(json.dumps(data))
    launch_ranks(WORKER, [str(plan_path), str(tmp_path)], 2, tmp_path / "state")
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    plan = FrequencyPlan.from_json(data).stage(0)
    for res in results:
        assert (
            res["all_correct"] and res["checked"] == 2 * 2 * 12
        )  # iterations x layers x partitions
        assert res["report"]["active"] and res["report"]["disabled"] is None
        assert res["report"]["enforced"] == 0 and res["report"]["communicators"] == 0
        records = res["records"]
        for rec in records:
            p = plan[rec["position"]]
            setting = p.overlap.get(rec["key"]) if p.execution == "nanobatch" else None
            assert rec["sm_count"] == (None if setting is None else setting.sm_count)
            assert rec["planned_slot"] == (None if setting is None else setting.slot)
            # where the collective really started, seen by the worker's own slot tracking
            assert (
                rec["launched_at"]
                == rec["worker_slot"]
                == (None if setting is None else setting.slot)
            )
        planned = {}
        for p in plan:
            for key, s in p.overlap.items():
                planned.setdefault(key, set()).add(s.sm_count)
        assert res["report"]["requested_sm_counts"] == {k: sorted(v) for k, v in planned.items()}
        assert {r["path"] for r in records} == {"overlap", "no-overlap", "sequential", "no-setting"}
    assert results[0]["records"] == results[1]["records"]
