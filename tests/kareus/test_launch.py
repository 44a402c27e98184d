"""Kareus's launch control: schedules from plans, launch points, fallbacks, SM-share communicators.

Unit tests run against fakes of ``torch.distributed`` where the real thing needs NCCL (the CPU wheel
has no ProcessGroupNCCL); ``test_launch_session.py`` drives the launch control from a session,
with real gloo all-reduces in two processes.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from launch_cases import ATTN, MLP, ORDER, Recorder, kareus_plan_data, run_partition

from powerlib.errors import InvalidArgumentError, NotSupportedError, PlanError
from powerlib.kareus.launch import LaunchControl
from powerlib.kareus.launch_schedule import PartitionSchedule
from powerlib.kareus.sm_groups import SMGroups, nccl_options
from powerlib.planning.plan import FrequencyPlan, PartitionSetting
from powerlib.runtime.listeners import plan_has_partitions

ROOT = Path(__file__).resolve().parents[2]


class FakeDist:
    """Just enough of ``torch.distributed`` for :class:`SMGroups` (backend name chosen)."""

    def __init__(
        self, backend: str = "nccl", rank: int = 0, world: int = 4, nccl: bool = True
    ) -> None:
        self.backend = backend
        self.rank = rank
        self.world = world
        self.created: list[tuple[list[int], str, int, int]] = []
        if nccl:

            class Config:
                min_ctas = -1
                max_ctas = -1

            class Options:
                def __init__(self) -> None:
                    self.config = Config()

            class ProcessGroupNCCL:
                pass

            ProcessGroupNCCL.Options = Options  # type: ignore[attr-defined]
            self.ProcessGroupNCCL = ProcessGroupNCCL

    def get_backend(self, group: Any = None) -> str:
        return self.backend if group is None or isinstance(group, tuple) else group["backend"]

    def get_world_size(self, group: Any = None) -> int:
        return self.world

    def get_rank(self, group: Any = None) -> int:
        return self.rank

    def get_process_group_ranks(self, group: Any) -> list[int]:
        return list(group["ranks"])

    def new_group(self, ranks: list[int], backend: str, pg_options: Any) -> Any:
        self.created.append(
            (ranks, backend, pg_options.config.min_ctas, pg_options.config.max_ctas)
        )
        if self.rank not in ranks:
            return "NON_GROUP_MEMBER"
        return {"ranks": ranks, "backend": "nccl", "sm": pg_options.config.max_ctas}


# -- schedule -----------------------------------------------------------------------------------


def test_the_schedule_follows_the_plan_instruction_by_instruction() -> None:
    plan = FrequencyPlan.from_json(kareus_plan_data(2))
    assert plan_has_partitions(plan)
    sched = PartitionSchedule.from_plan(plan, 0)
    assert sched.sm_counts == (3, 6, 9, 12, 20, 21)
    assert PartitionSchedule.from_plan(plan, 1).sm_counts == (6, 30)
    assert sched.config("fwd_attn") is None  # no instruction running
    assert sched.begin((0, 0, 0, "forward")).execution == "nanobatch"
    assert sched.config("fwd_attn") == PartitionSetting("rope_0", 12, 1024)
    assert sched.config("bwd_attn") is None  # not configured in a forward: default path
    sched.end()
    assert sched.config("fwd_attn") is None
    sched.begin((0, 0, 0, "backward"))
    assert sched.config("bwd_attn") == PartitionSetting("attn_0", 3, 1024)
    sched.begin((0, 0, 1, "forward"))
    assert sched.current.execution == "sequential" and sched.config("fwd_attn") is None
    sched.begin((0, 0, 1, "backward"))
    assert sched.config("bwd_mlp") == PartitionSetting(None, 20, 1024)
    assert sched.end_step() and sched.active and sched.iteration == 1
    assert sched.position == 0
    with pytest.raises(PlanError, match="no stage 5"):
        PartitionSchedule.from_plan(plan, 5)


def test_a_perseus_plan_is_not_an_overlap_plan() -> None:
    data = kareus_plan_data()
    for ins in data["stages"][0]["instructions"]:
        ins.pop("execution", None)
        ins.pop("overlap", None)
    plan = FrequencyPlan.from_json(data)
    control = LaunchControl()
    assert not plan_has_partitions(plan) and control.load(plan, 0) is False
    assert control.schedule is None and not control.active


@pytest.mark.parametrize(
    ("loop", "detail"),
    [
        (ORDER[:3], "the iteration ran 3 instruction(s), the plan has 4"),
        ([ORDER[1], ORDER[0]], "instruction 0 is backward mb0, the plan expects forward mb0"),
        (ORDER + [("forward", 2)], "instruction 4 forward mb2 is beyond the plan's 4"),
    ],
)
def test_a_loop_off_the_plan_warns_once_and_takes_the_default_path(loop: list, detail: str) -> None:
    control = _planned_control()
    rec = Recorder()
    with pytest.warns(RuntimeWarning) as caught:
        for _ in range(2):
            for kind, mb in loop:
                control.begin(kind, mb)
                run_partition(control, "fwd_attn", ATTN, rec)
                control.end()
            control.step()
    messages = [str(w.message) for w in caught]
    assert len(messages) == 1 and detail in messages[0] and "default path" in messages[0]
    assert not control.active and control.schedule.disabled == detail
    assert control.records[-1].path == "no-plan" and rec.calls[-1][1] is None
    assert control.report().disabled == detail


def test_a_step_without_instructions_is_not_checked() -> None:
    control = LaunchControl.from_plan(FrequencyPlan.from_json(kareus_plan_data()), 0)
    assert control.step() and control.active  # an evaluation step: hooks skipped
    with pytest.raises(InvalidArgumentError, match="instruction kind"):
        control.begin("F")


# -- launch points ----------------------------------------------------------------------------


def _planned_control() -> LaunchControl:
    """An control whose SM counts cannot be enforced (a fake gloo group), warning silenced."""
    control = LaunchControl(groups=SMGroups(dist=FakeDist("gloo"), warn=lambda m: None))
    control.load(FrequencyPlan.from_json(kareus_plan_data()), 0)
    return control


def test_the_collective_launches_once_at_the_planned_slot_and_is_joined_at_exit() -> None:
    control = _planned_control()
    rec = Recorder()
    control.begin("forward", 0)
    assert control.nanobatch
    run_partition(control, "fwd_attn", ATTN + ["rope_0"], rec)  # rope_0 again: no second launch
    assert rec.events == [
        "compute norm_0",
        "compute linear_0",
        "launch",
        "compute rope_0",
        "compute attn_0",
        "compute linear_1",
        "compute rope_0",
        "wait",
    ]
    group, setting, at = rec.calls[0]
    assert (group, setting, at) == (None, PartitionSetting("rope_0", 12, 1024), "rope_0")
    r = control.records[-1]
    assert (r.key, r.planned_slot, r.launched_at, r.sm_count, r.enforced, r.path, r.position) == (
        "fwd_attn",
        "rope_0",
        "rope_0",
        12,
        False,
        "overlap",
        0,
    )


@pytest.mark.parametrize(
    ("instruction", "key", "path", "setting"),
    [
        (("forward", 1), "fwd_attn", "sequential", None),
        (("forward", 0), "bwd_mlp", "no-setting", None),
        (("backward", 1), "bwd_mlp", "no-overlap", PartitionSetting(None, 20, 1024)),
        (None, "fwd_attn", "no-plan", None),
    ],
)
def test_nothing_to_overlap_launches_at_exit_on_the_default_group(
    instruction: tuple[str, int] | None, key: str, path: str, setting: PartitionSetting | None
) -> None:
    control = _planned_control()
    if instruction is not None:
        for kind, mb in ORDER:
            control.begin(kind, mb)
            if (kind, mb) == instruction:
                break
    else:
        control = LaunchControl()
    rec = Recorder()
    tp_group = {"ranks": [0, 1], "backend": "gloo"}
    run_partition(control, key, MLP, rec, group=tp_group)
    assert rec.calls == [(tp_group, setting, "exit")]
    assert rec.events[-2:] == ["launch", "wait"]
    assert control.records[-1].path == path and control.records[-1].launched_at is None


def test_a_slot_the_code_never_announces_launches_at_exit_with_one_warning() -> None:
    control = _planned_control()
    control.begin("forward", 0)
    rec = Recorder()
    with pytest.warns(RuntimeWarning, match="never announced its planned launch slot 'rope_0'"):
        for _ in range(3):
            run_partition(control, "fwd_attn", ["norm_0", "linear_0", "attn_0"], rec)
    assert [c[2] for c in rec.calls] == ["exit"] * 3
    assert {r.path for r in control.records} == {"slot-not-reached"}


def test_a_bad_slot_name_is_ignored_with_one_warning() -> None:
    control = _planned_control()
    control.begin("forward", 0)
    rec = Recorder()
    with pytest.warns(RuntimeWarning, match=r"part.slot\('RoPE'\).*not a launch slot name"):
        run_partition(control, "fwd_attn", ["norm_0", "RoPE", "rope_0"], rec)
        run_partition(control, "fwd_attn", ["norm_0", "RoPE", "rope_0"], rec)
    assert [c[2] for c in rec.calls] == ["rope_0", "rope_0"]


def test_a_failing_partition_body_launches_nothing_more() -> None:
    control = _planned_control()
    control.begin("forward", 0)
    rec = Recorder()
    with (
        pytest.raises(RuntimeError, match="boom"),
        control.partition("fwd_attn", launch=rec) as part,
    ):
        part.slot("norm_0")
        raise RuntimeError("boom")
    assert rec.calls == [] and not part.launched


# -- SM shares ----------------------------------------------------------------------------------


def test_gloo_records_the_sm_counts_and_warns_once() -> None:
    dist = FakeDist("gloo")
    control = LaunchControl(groups=SMGroups(dist=dist))
    control.load(FrequencyPlan.from_json(kareus_plan_data()), 0)
    assert dist.created == []  # nothing to create on gloo
    rec = Recorder()
    with pytest.warns(
        RuntimeWarning, match="gloo backend cannot limit a collective's SMs"
    ) as caught:
        for kind, mb in ORDER:
            control.begin(kind, mb)
            run_partition(control, "fwd_attn", ATTN, rec)
            run_partition(control, "fwd_mlp", MLP, rec)
            run_partition(control, "bwd_attn", ATTN, rec)
            control.end()
        control.step()
    assert len(caught) == 1
    assert not any(r.enforced for r in control.records)
    assert control.requested_sm_counts() == {
        "bwd_attn": [3, 21],
        "fwd_attn": [9, 12],
        "fwd_mlp": [6],
    }
    assert {r.path for r in control.records} == {"overlap", "sequential", "no-setting"}
    assert [(r.position, r.key, r.launched_at) for r in control.records if r.path == "overlap"] == [
        (0, "fwd_attn", "rope_0"),
        (0, "fwd_mlp", "norm_0"),
        (1, "fwd_attn", "linear_0"),
        (1, "fwd_mlp", "norm_0"),
        (1, "bwd_attn", "attn_0"),
        (3, "fwd_attn", "rope_0"),
        (3, "fwd_mlp", "activation_0"),
        (3, "bwd_attn", "rope_0"),
    ]


def test_nccl_gets_one_communicator_per_group_and_sm_count_in_the_same_order_on_every_rank() -> (
    None
):
    plan = FrequencyPlan.from_json(kareus_plan_data(2))
    tp_groups = [[0, 1], [2, 3]]
    creations = []
    controls = []
    for rank in range(4):
        dist = FakeDist("nccl", rank=rank)
        control = LaunchControl(groups=SMGroups(dist=dist))
        control.load(plan, rank // 2, group_ranks=tp_groups)
        creations.append(dist.created)
        controls.append(control)
    every_sm = [3, 6, 9, 12, 20, 21, 30]  # both stages' counts: new_group is collective
    assert creations[0] == [(r, "nccl", sm, sm) for r in tp_groups for sm in every_sm]
    assert all(c == creations[0] for c in creations)
    assert sorted(controls[2].groups.groups) == sorted(((2, 3), sm) for sm in every_sm)
    # a launch at a planned slot runs on the communicator with that CTA limit
    control = controls[0]
    control.begin("forward", 0)
    rec = Recorder()
    run_partition(control, "fwd_attn", ATTN, rec, group={"ranks": [1, 0], "backend": "nccl"})
    group, setting, at = rec.calls[0]
    assert group["sm"] == 12 and group["ranks"] == [0, 1] and at == "rope_0"
    assert control.records[-1].enforced
    # a group that was not prepared falls back to itself, with one warning
    with pytest.warns(RuntimeWarning, match=r"no SM-limited communicator for ranks \[0, 2\]"):
        run_partition(control, "fwd_mlp", MLP, rec, group={"ranks": [0, 2], "backend": "nccl"})
    assert (
        rec.calls[-1][0] == {"ranks": [0, 2], "backend": "nccl"}
        and not control.records[-1].enforced
    )


def test_a_torch_without_nccl_options_degrades_to_the_default_groups() -> None:
    dist = FakeDist("nccl", nccl=False)
    groups = SMGroups(dist=dist, warn=lambda m: None)
    assert groups.prepare([3, 6]) == 0 and dist.created == []
    with pytest.raises(NotSupportedError, match="no ProcessGroupNCCL"):
        nccl_options(3, dist)
    with pytest.raises(InvalidArgumentError, match="positive integer"):
        nccl_options(0, FakeDist())


def test_real_nccl_options_carry_the_cta_limits() -> None:
    torch = pytest.importorskip("torch")
    if not torch.distributed.is_available() or not torch.distributed.is_nccl_available():
        # The CPU wheel CI installs has no ProcessGroupNCCL: the option object cannot exist here,
        # so what is checked instead is that asking for it is one clear error.
        with pytest.raises(NotSupportedError, match="no ProcessGroupNCCL"):
            nccl_options(12)
        pytest.skip("torch is built without NCCL (CPU wheel): ProcessGroupNCCL.Options unavailable")
    options = nccl_options(12)
    assert options.config.min_ctas == 12 and options.config.max_ctas == 12


def test_without_a_process_group_sm_counts_are_recorded_with_one_warning() -> None:
    control = LaunchControl.from_plan(FrequencyPlan.from_json(kareus_plan_data()), 0)
    control.begin("forward", 0)
    rec = Recorder()
    if "torch.distributed" in sys.modules and sys.modules["torch.distributed"].is_initialized():
        pytest.skip("a process group is initialised in this test process")
    with pytest.warns(RuntimeWarning, match="no torch.distributed process group"):
        run_partition(control, "fwd_attn", ATTN, rec)
        run_partition(control, "fwd_mlp", MLP, rec)
    assert [r.sm_count for r in control.records] == [12, 6]


def test_the_module_imports_and_works_without_torch() -> None:
    code = """
import importlib.abc, sys, warnings
class _Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split('.')[0] == 'torch':
            raise ImportError('blocked: ' + name)
sys.meta_path.insert(0, _Block())
from powerlib.kareus.launch import LaunchControl
import powerlib.kareus.meter, powerlib.runtime
o = LaunchControl()
o.begin('forward')
calls = []
with o.partition('fwd_attn', launch=lambda g, s: calls.append((g, s))) as part:
    part.slot('norm_0')
assert calls == [(None, None)], calls
print('ok', 'torch' in sys.modules)
"""
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "ok False"
