"""The overlap runtime: schedules from plans, launch points, fallbacks, SM-share communicators.

Unit tests run against fakes of ``torch.distributed`` where the real thing needs NCCL (the CPU wheel
has no ProcessGroupNCCL); ``test_two_gloo_ranks_launch_at_the_planned_slots`` runs real gloo
all-reduces in two processes through a session.
"""

from __future__ import annotations

import json
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest

from powerlib.config import Settings
from powerlib.errors import InvalidArgumentError, NotSupportedError, PlanError
from powerlib.planning.plan import FrequencyPlan, PartitionSetting
from powerlib.runtime.coordination import SingleProcess
from powerlib.runtime.launch_control import (
    Overlap,
    OverlapSchedule,
    SMGroups,
    nccl_options,
    plan_has_overlap,
)
from powerlib.runtime.session import Session

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("overlap_worker.py")


def _nb(**settings: tuple[str | None, int]) -> dict[str, Any]:
    return {
        "execution": "nanobatch",
        "overlap": {
            k: {"slot": s, "sm_count": n, "block_size": 1024} for k, (s, n) in settings.items()
        },
    }


def overlap_plan_data(num_stages: int = 1) -> dict[str, Any]:
    """Stage 0: F0 B0 F1 B1 with every fallback in it; other stages: a plain 1F1B with other SMs."""
    stage0 = [
        {
            "kind": "forward",
            "microbatch": 0,
            "freq_mhz": 1410.0,
            **_nb(fwd_attn=("rope_0", 12), fwd_mlp=("norm_0", 6)),
        },
        {
            "kind": "backward",
            "microbatch": 0,
            "freq_mhz": 1200.0,
            **_nb(fwd_attn=("linear_0", 9), fwd_mlp=("norm_0", 6), bwd_attn=("attn_0", 3)),
        },
        {"kind": "forward", "microbatch": 1, "freq_mhz": 1410.0},  # sequential
        {
            "kind": "backward",
            "microbatch": 1,
            "freq_mhz": 1200.0,
            **_nb(
                fwd_attn=("rope_0", 12),
                fwd_mlp=("activation_0", 6),
                bwd_attn=("rope_0", 21),
                bwd_mlp=(None, 20),
            ),
        },
    ]
    stages = [{"stage": 0, "instructions": stage0}]
    for s in range(1, num_stages):
        stages.append(
            {
                "stage": s,
                "instructions": [
                    {
                        "kind": "forward",
                        "microbatch": 0,
                        "freq_mhz": 1410.0,
                        **_nb(fwd_attn=("attn_0", 30)),
                    },
                    {
                        "kind": "backward",
                        "microbatch": 0,
                        "freq_mhz": 1410.0,
                        **_nb(bwd_attn=("attn_0", 6)),
                    },
                    {
                        "kind": "forward",
                        "microbatch": 1,
                        "freq_mhz": 1410.0,
                        **_nb(fwd_attn=("attn_0", 30)),
                    },
                    {
                        "kind": "backward",
                        "microbatch": 1,
                        "freq_mhz": 1410.0,
                        **_nb(bwd_attn=("attn_0", 6)),
                    },
                ],
            }
        )
    return {
        "schema": "powerlib.plan.v1",
        "workload": {"num_stages": num_stages, "num_microbatches": 2, "schedule": "1f1b"},
        "policy": "min-energy",
        "stages": stages,
    }


ORDER = [("forward", 0), ("backward", 0), ("forward", 1), ("backward", 1)]


class Recorder:
    """A ``launch`` callback that records its calls and hands back a waitable handle."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, PartitionSetting | None, str | None]] = []
        self.events: list[str] = []
        self.at: str | None = None

    def __call__(self, group: Any, setting: PartitionSetting | None) -> Any:
        self.calls.append((group, setting, self.at))
        self.events.append("launch")
        recorder = self

        class Work:
            def wait(self) -> None:
                recorder.events.append("wait")

        return Work()


def run_partition(
    overlap: Overlap, key: str, slots: list[str], rec: Recorder, group: Any = None
) -> None:
    with overlap.partition(key, launch=rec, group=group) as part:
        for slot in slots:
            rec.at = slot
            part.slot(slot)
            rec.events.append(f"compute {slot}")
        rec.at = "exit"


ATTN = ["norm_0", "linear_0", "rope_0", "attn_0", "linear_1"]
MLP = ["norm_0", "linear_0", "activation_0", "linear_1"]


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
    plan = FrequencyPlan.from_json(overlap_plan_data(2))
    assert plan_has_overlap(plan)
    sched = OverlapSchedule.from_plan(plan, 0)
    assert sched.sm_counts == (3, 6, 9, 12, 20, 21)
    assert OverlapSchedule.from_plan(plan, 1).sm_counts == (6, 30)
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
        OverlapSchedule.from_plan(plan, 5)


def test_a_perseus_plan_is_not_an_overlap_plan() -> None:
    data = overlap_plan_data()
    for ins in data["stages"][0]["instructions"]:
        ins.pop("execution", None)
        ins.pop("overlap", None)
    plan = FrequencyPlan.from_json(data)
    overlap = Overlap()
    assert not plan_has_overlap(plan) and overlap.load(plan, 0) is False
    assert overlap.schedule is None and not overlap.active


@pytest.mark.parametrize(
    ("loop", "detail"),
    [
        (ORDER[:3], "the iteration ran 3 instruction(s), the plan has 4"),
        ([ORDER[1], ORDER[0]], "instruction 0 is backward mb0, the plan expects forward mb0"),
        (ORDER + [("forward", 2)], "instruction 4 forward mb2 is beyond the plan's 4"),
    ],
)
def test_a_loop_off_the_plan_warns_once_and_takes_the_default_path(loop: list, detail: str) -> None:
    overlap = _planned_overlap()
    rec = Recorder()
    with pytest.warns(RuntimeWarning) as caught:
        for _ in range(2):
            for kind, mb in loop:
                overlap.begin(kind, mb)
                run_partition(overlap, "fwd_attn", ATTN, rec)
                overlap.end()
            overlap.step()
    messages = [str(w.message) for w in caught]
    assert len(messages) == 1 and detail in messages[0] and "default path" in messages[0]
    assert not overlap.active and overlap.schedule.disabled == detail
    assert overlap.records[-1].path == "no-plan" and rec.calls[-1][1] is None
    assert overlap.report()["disabled"] == detail


def test_a_step_without_instructions_is_not_checked() -> None:
    overlap = Overlap.from_plan(FrequencyPlan.from_json(overlap_plan_data()), 0)
    assert overlap.step() and overlap.active  # an evaluation step: hooks skipped
    with pytest.raises(InvalidArgumentError, match="instruction kind"):
        overlap.begin("F")


# -- launch points ----------------------------------------------------------------------------


def _planned_overlap() -> Overlap:
    """An overlap whose SM counts cannot be enforced (a fake gloo group), warning silenced."""
    overlap = Overlap(groups=SMGroups(dist=FakeDist("gloo"), warn=lambda m: None))
    overlap.load(FrequencyPlan.from_json(overlap_plan_data()), 0)
    return overlap


def test_the_collective_launches_once_at_the_planned_slot_and_is_joined_at_exit() -> None:
    overlap = _planned_overlap()
    rec = Recorder()
    overlap.begin("forward", 0)
    assert overlap.nanobatch
    run_partition(overlap, "fwd_attn", ATTN + ["rope_0"], rec)  # rope_0 again: no second launch
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
    r = overlap.records[-1]
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
    overlap = _planned_overlap()
    if instruction is not None:
        for kind, mb in ORDER:
            overlap.begin(kind, mb)
            if (kind, mb) == instruction:
                break
    else:
        overlap = Overlap()
    rec = Recorder()
    tp_group = {"ranks": [0, 1], "backend": "gloo"}
    run_partition(overlap, key, MLP, rec, group=tp_group)
    assert rec.calls == [(tp_group, setting, "exit")]
    assert rec.events[-2:] == ["launch", "wait"]
    assert overlap.records[-1].path == path and overlap.records[-1].launched_at is None


def test_a_slot_the_code_never_announces_launches_at_exit_with_one_warning() -> None:
    overlap = _planned_overlap()
    overlap.begin("forward", 0)
    rec = Recorder()
    with pytest.warns(RuntimeWarning, match="never announced its planned launch slot 'rope_0'"):
        for _ in range(3):
            run_partition(overlap, "fwd_attn", ["norm_0", "linear_0", "attn_0"], rec)
    assert [c[2] for c in rec.calls] == ["exit"] * 3
    assert {r.path for r in overlap.records} == {"slot-not-reached"}


def test_a_bad_slot_name_is_ignored_with_one_warning() -> None:
    overlap = _planned_overlap()
    overlap.begin("forward", 0)
    rec = Recorder()
    with pytest.warns(RuntimeWarning, match=r"part.slot\('RoPE'\).*not a launch slot name"):
        run_partition(overlap, "fwd_attn", ["norm_0", "RoPE", "rope_0"], rec)
        run_partition(overlap, "fwd_attn", ["norm_0", "RoPE", "rope_0"], rec)
    assert [c[2] for c in rec.calls] == ["rope_0", "rope_0"]


def test_a_failing_partition_body_launches_nothing_more() -> None:
    overlap = _planned_overlap()
    overlap.begin("forward", 0)
    rec = Recorder()
    with (
        pytest.raises(RuntimeError, match="boom"),
        overlap.partition("fwd_attn", launch=rec) as part,
    ):
        part.slot("norm_0")
        raise RuntimeError("boom")
    assert rec.calls == [] and not part.launched


# -- SM shares ----------------------------------------------------------------------------------


def test_gloo_records_the_sm_counts_and_warns_once() -> None:
    dist = FakeDist("gloo")
    overlap = Overlap(groups=SMGroups(dist=dist))
    overlap.load(FrequencyPlan.from_json(overlap_plan_data()), 0)
    assert dist.created == []  # nothing to create on gloo
    rec = Recorder()
    with pytest.warns(
        RuntimeWarning, match="gloo backend cannot limit a collective's SMs"
    ) as caught:
        for kind, mb in ORDER:
            overlap.begin(kind, mb)
            run_partition(overlap, "fwd_attn", ATTN, rec)
            run_partition(overlap, "fwd_mlp", MLP, rec)
            run_partition(overlap, "bwd_attn", ATTN, rec)
            overlap.end()
        overlap.step()
    assert len(caught) == 1
    assert not any(r.enforced for r in overlap.records)
    assert overlap.requested_sm_counts() == {
        "bwd_attn": [3, 21],
        "fwd_attn": [9, 12],
        "fwd_mlp": [6],
    }
    assert {r.path for r in overlap.records} == {"overlap", "sequential", "no-setting"}
    assert [(r.position, r.key, r.launched_at) for r in overlap.records if r.path == "overlap"] == [
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
    plan = FrequencyPlan.from_json(overlap_plan_data(2))
    tp_groups = [[0, 1], [2, 3]]
    creations = []
    overlaps = []
    for rank in range(4):
        dist = FakeDist("nccl", rank=rank)
        overlap = Overlap(groups=SMGroups(dist=dist))
        overlap.load(plan, rank // 2, group_ranks=tp_groups)
        creations.append(dist.created)
        overlaps.append(overlap)
    every_sm = [3, 6, 9, 12, 20, 21, 30]  # both stages' counts: new_group is collective
    assert creations[0] == [(r, "nccl", sm, sm) for r in tp_groups for sm in every_sm]
    assert all(c == creations[0] for c in creations)
    assert sorted(overlaps[2].groups.groups) == sorted(((2, 3), sm) for sm in every_sm)
    # a launch at a planned slot runs on the communicator with that CTA limit
    overlap = overlaps[0]
    overlap.begin("forward", 0)
    rec = Recorder()
    run_partition(overlap, "fwd_attn", ATTN, rec, group={"ranks": [1, 0], "backend": "nccl"})
    group, setting, at = rec.calls[0]
    assert group["sm"] == 12 and group["ranks"] == [0, 1] and at == "rope_0"
    assert overlap.records[-1].enforced
    # a group that was not prepared falls back to itself, with one warning
    with pytest.warns(RuntimeWarning, match=r"no SM-limited communicator for ranks \[0, 2\]"):
        run_partition(overlap, "fwd_mlp", MLP, rec, group={"ranks": [0, 2], "backend": "nccl"})
    assert (
        rec.calls[-1][0] == {"ranks": [0, 2], "backend": "nccl"}
        and not overlap.records[-1].enforced
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
    overlap = Overlap.from_plan(FrequencyPlan.from_json(overlap_plan_data()), 0)
    overlap.begin("forward", 0)
    rec = Recorder()
    if "torch.distributed" in sys.modules and sys.modules["torch.distributed"].is_initialized():
        pytest.skip("a process group is initialised in this test process")
    with pytest.warns(RuntimeWarning, match="no torch.distributed process group"):
        run_partition(overlap, "fwd_attn", ATTN, rec)
        run_partition(overlap, "fwd_mlp", MLP, rec)
    assert [r.sm_count for r in overlap.records] == [12, 6]


def test_the_module_imports_and_works_without_torch() -> None:
    code = """
import importlib.abc, sys, warnings
class _Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split('.')[0] == 'torch':
            raise ImportError('blocked: ' + name)
sys.meta_path.insert(0, _Block())
from powerlib.runtime.launch_control import Overlap
import powerlib.profiling.partition_meter, powerlib.runtime
o = Overlap()
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


# -- the session ----------------------------------------------------------------------------------


def _session(plan_path: Path, tmp_path: Path) -> Session:
    from powerlib.backends.simulated import SimulatedBackend, VirtualClock

    clock = VirtualClock()
    backend = SimulatedBackend(
        Settings(backend="simulated", sim_gpus=1, state_dir=tmp_path / "st"), clock=clock
    )
    return Session(
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


def test_the_session_drives_the_overlap_schedule_from_its_hooks(tmp_path: Path) -> None:
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(overlap_plan_data()))
    session = _session(path, tmp_path)
    seen = []
    with session, warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # no process group: SMs recorded only
        assert session.overlap.active and session.overlap.schedule.stage == 0
        for _ in range(2):
            for kind, mb in ORDER:
                with session.instruction(kind, microbatch=mb):
                    seen.append((session.overlap.nanobatch, session.overlap.config("fwd_attn")))
                    run_partition(session.overlap, "fwd_attn", ATTN, Recorder())
            session.step()
        report = session.report()
    assert seen[:4] == [
        (True, PartitionSetting("rope_0", 12)),
        (True, PartitionSetting("linear_0", 9)),
        (False, None),
        (True, PartitionSetting("rope_0", 12)),
    ]
    assert seen[4:] == seen[:4]
    assert report["overlap"]["active"] and report["overlap"]["iterations"] == 2
    assert report["overlap"]["requested_sm_counts"] == {"fwd_attn": [9, 12]}


def test_a_perseus_plan_leaves_the_session_overlap_inactive(tmp_path: Path) -> None:
    data = overlap_plan_data()
    for ins in data["stages"][0]["instructions"]:
        ins.pop("execution", None)
        ins.pop("overlap", None)
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(data))
    with _session(path, tmp_path) as session:
        with session.instruction("forward", 0):
            assert session.overlap.config("fwd_attn") is None and not session.overlap.active
        assert session.report()["overlap"] is None


# -- two processes on gloo ----------------------------------------------------------------------


def test_two_gloo_ranks_launch_at_the_planned_slots(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    from multiproc import launch_ranks

    data = overlap_plan_data()
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
