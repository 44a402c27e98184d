"""The DeepSpeed integration with real DeepSpeed engines on CPU (gloo, simulated GPUs).

For each engine the session profiles through the integration, rank 0 plans on the order the
hooks recorded, and every rank's requested and applied clocks in the first managed iteration
equal its stage of the plan: ``PipelineEngine`` with PP=2 and PP2xDP2, ``DualPipeVEngine`` (two
chunks per rank, V placement) and a ZeRO-1 engine without pipelining. A plan whose order differs
from what the engine really runs is caught on its first iteration (warn, reset, keep training).
Two launches (2 and 4 ranks) run all cases; the shm-op JIT build is skipped in the worker.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from multiproc import collapse, launch_ranks

import powerlib

torch = pytest.importorskip("torch")
pytest.importorskip("deepspeed")
if not torch.distributed.is_gloo_available():
    pytest.skip("gloo is not available", allow_module_level=True)

from clocked import assert_profiled_then_applied  # noqa: E402  (imports torch)

pytestmark = [pytest.mark.integration, pytest.mark.deepspeed]

WORKER = Path(__file__).with_name("ds_worker.py")


def _launch(tmp: Path, world: int, cases: list[str]) -> list[dict]:
    launch_ranks(WORKER, [str(tmp), *cases], world, tmp / "state")
    return [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(world)]


def _check_applied(res: dict, case: str) -> None:
    where = f"rank {res['rank']} {case}"
    auto = res[case]["auto"]
    assert auto["warnings"] == [], (where, auto["warnings"])
    assert auto["phase"] == "apply", where
    assert auto["order_source"] == "recorded", where
    assert_profiled_then_applied(auto)
    plan_freqs = [f for *_, f in auto["plan"]]
    assert auto["requested"] == auto["plan"], where  # same instructions, order and clocks
    assert auto["applied_first_iteration"] == collapse(plan_freqs), where
    assert res[case]["restored"], where
    assert res[case]["hooks_removed"], where


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    """ZeRO-1 first: a pipeline engine leaves its grid as DeepSpeed's global model-parallel unit."""
    cases = ["zero", "pp"]
    if hasattr(powerlib.Session, "set_layout"):
        cases.append("dualpipev")
    results = _launch(tmp_path_factory.mktemp("ds2"), 2, cases)
    for rank, res in enumerate(results):
        res["rank"] = rank
    return results


def test_pipeline_engine_applies_the_plan_and_catches_a_wrong_order(two_ranks: list[dict]) -> None:
    for res in two_ranks:
        assert res["backend"] == "gloo"
        _check_applied(res, "pp")
        assert "pipeline stage" in res["pp"]["wrong_stage_error"]
    plans = [res["pp"]["auto"]["plan"] for res in two_ranks]
    # TrainSchedule is 1F1B: stage 0 runs one extra forward before its first backward
    assert [(k, mb) for k, mb, _, _ in plans[0][:3]] == [
        ("forward", 0),
        ("forward", 1),
        ("backward", 0),
    ]
    assert [k for k, *_ in plans[1]] == ["forward", "backward"] * 4
    assert {c for plan in plans for _, _, c, _ in plan} == {0}
    mismatch = [res["pp"]["mismatch"] for res in two_ranks]
    assert [len(m["warnings"]) for m in mismatch] == [0, 1]
    assert "does not run the plan's instruction order" in mismatch[1]["warnings"][0]
    assert [m["phase"] for m in mismatch] == ["apply", "done"]


def test_zero_engine_without_pipelining_applies_the_plan(two_ranks: list[dict]) -> None:
    for res in two_ranks:
        _check_applied(res, "zero")
        assert [(k, mb) for k, mb, _, _ in res["zero"]["auto"]["plan"]] == [
            (kind, mb) for mb in range(4) for kind in ("forward", "backward")
        ]
    assert two_ranks[0]["zero"]["auto"]["plan"] == two_ranks[1]["zero"]["auto"]["plan"]


def test_dualpipev_engine_applies_a_v_plan(two_ranks: list[dict]) -> None:
    if "dualpipev" not in two_ranks[0]:
        pytest.skip("this powerlib has no Session.set_layout (V placement)")
    for r, res in enumerate(two_ranks):
        _check_applied(res, "dualpipev")
        # chunk 0 (phase 0) holds model piece r, chunk 1 (phase 1) piece 2P-1-r
        assert res["dualpipev"]["phase_pieces"] == [r, 3 - r]
        plan = res["dualpipev"]["auto"]["plan"]
        assert sorted((k, mb, c) for k, mb, c, _ in plan) == sorted(
            (k, mb, c) for k in ("forward", "backward") for mb in range(4) for c in (0, 1)
        )
    # docs/frameworks.md §3.4: the executed DualPipeV order of rank 0, P=2, M=4
    expected = "F0p0 F1p0 F2p0 F0p1 B0p1 F1p1 F3p0 B1p1 F2p1 B0p0 B2p1 F3p1 B1p0 B3p1 B2p0 B3p0"
    got = [f"{k[0].upper()}{mb}p{c}" for k, mb, c, _ in two_ranks[0]["dualpipev"]["auto"]["plan"]]
    assert " ".join(got) == expected


def test_pipeline_with_data_parallel_replicas_applies_one_plan_per_stage(
    tmp_path: Path,
) -> None:
    results = _launch(tmp_path, 4, ["ppdp"])
    for rank, res in enumerate(results):
        res["rank"] = rank
        _check_applied(res, "ppdp")
        assert res["ppdp"]["stage"] == rank // 2  # pipe is the outer axis: rank = pp * dp + dp
    assert results[0]["ppdp"]["auto"]["plan"] == results[1]["ppdp"]["auto"]["plan"]
    assert results[2]["ppdp"]["auto"]["plan"] == results[3]["ppdp"]["auto"]["plan"]
    assert results[0]["ppdp"]["auto"]["plan"] != results[2]["ppdp"]["auto"]["plan"]


def test_attach_is_a_no_op_when_disabled_and_refuses_what_it_cannot_hook() -> None:
    from deepspeed.runtime.pipe.engine import PipelineEngine

    from powerlib.integrations.deepspeed import attach_engine, attach_pipeline

    with attach_pipeline(None, object()), attach_engine(object(), object(), enabled=False):
        pass
    with (
        pytest.raises(powerlib.InvalidArgumentError, match="not a DeepSpeed PipelineEngine"),
        attach_pipeline(object(), object()),
    ):
        pass

    class Renamed(PipelineEngine):  # a DeepSpeed whose private names moved
        _INSTRUCTION_MAP: dict = {}

    engine = Renamed.__new__(Renamed)
    with pytest.raises(powerlib.NotSupportedError, match="deepspeed 0.19.8"):
        with attach_pipeline(object(), engine):
            pass
    with pytest.raises(powerlib.InvalidArgumentError, match="use attach_pipeline"):
        with attach_engine(object(), engine):
            pass
