"""The Kareus study workflows, called from Python without click."""

from __future__ import annotations

from pathlib import Path

import pytest

from powerlib.errors import PlanError
from powerlib.kareus.shapes import Parallelism
from powerlib.kareus.sim_model import SimulatedOverlapEvaluator
from powerlib.kareus.study import read_study
from powerlib.planning.choice import Policy

pytest.importorskip("sklearn")
pytest.importorskip("moocore")

from powerlib.kareus.workflow import plan_from_study, search_study  # noqa: E402


def test_search_then_plan_a_study(tmp_path: Path) -> None:
    evaluator = SimulatedOverlapEvaluator(noise=0.01, seed=0, freqs_mhz=(1110.0, 1260.0, 1410.0))
    phases: list[str] = []
    found = search_study(
        tmp_path,
        model="qwen3-1.7b",
        parallelism=Parallelism(tp=8, micro_batch=8, seq_len=4096),
        stage_layers=(15, 13),
        evaluator=evaluator,
        evaluator_info={"kind": "simulated"},
        progress=lambda phase, done, total: phases.append(phase),
    )
    assert [p.partition for p in found.partitions] == ["fwd_attn", "fwd_mlp", "bwd_mlp", "bwd_attn"]
    assert phases[-1] == "components" and "fwd_attn" in phases
    assert read_study(tmp_path).evaluator == {"kind": "simulated"}
    assert found.to_json()["evaluations"] == sum(p.evaluations for p in found.partitions)
    result = plan_from_study(tmp_path, microbatches=4, policy=Policy(), compare=True)
    assert set(result.frontiers) == {"kareus", "perseus", "nanobatch"}
    assert result.summary.overlap.instructions == len(result.choice.options)
    assert result.nanobatch_instructions == result.summary.overlap.nanobatch_instructions
    assert result.summary.comparison is not None
    data = result.summary.to_json()
    assert list(data)[-2:] == ["overlap", "comparison"]
    assert data["overlap"] == result.summary.overlap.to_json()
    assert result.frontier.fastest.time_s <= result.frontiers["perseus"].fastest.time_s + 1e-9
    assert result.plan_metadata.model == "qwen3-1.7b"
    assert result.plan_metadata.to_json()["kareus"] == {
        "model": "qwen3-1.7b",
        "workload": "qwen3-1.7b_tp8_mbs8_seq4096",
        "stage_layers": [15, 13],
        "correction": 1.0,
        "p_static_w": evaluator.p_static_w,
        "evaluator": {"kind": "simulated"},
    }
    (tmp_path / "fwd_mlp.jsonl").unlink()
    with pytest.raises(PlanError, match="--partition fwd_mlp"):
        plan_from_study(tmp_path, microbatches=4, policy=Policy())
