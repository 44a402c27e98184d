"""Partition types from layer shapes, as the Kareus artifact forms them (docs/kareus.md §1.4)."""

from __future__ import annotations

import pytest

from powerlib.errors import PlanError
from powerlib.kareus.partition import build_workload, config_space, default_sm_counts, search_budget
from powerlib.kareus.partition_types import ALL_GATHER, ALL_REDUCE, REDUCE_SCATTER, Config
from powerlib.kareus.shapes import MODEL_SHAPES, ModelShape, Parallelism

FREQS = range(900, 1411, 30)  # the artifact's 18 search clocks


def _workload(tp=8, cp=1, mbs=8, seq=4096, model="llama3.2-3b"):
    return build_workload(
        MODEL_SHAPES[model], Parallelism(tp=tp, cp=cp, micro_batch=mbs, seq_len=seq), [15, 13]
    )


def test_tensor_parallel_layer_has_the_artifacts_four_types() -> None:
    w = _workload()
    assert [p.key for p in w.partitions] == ["fwd_attn", "fwd_mlp", "bwd_mlp", "bwd_attn"]
    assert sum(p.per_layer for p in w.partitions if p.phase == "fwd") == 4  # attn, attn, mlp, mlp
    assert sum(p.per_layer for p in w.partitions if p.phase == "bwd") == 4
    attn = w.partition("fwd_attn")
    assert [op.slot for op in attn.ops] == ["norm_0", "linear_0", "rope_0", "attn_0", "linear_1"]
    assert attn.slots == ("norm_0", "linear_0", "rope_0", "attn_0")  # not after the last GEMM
    assert w.partition("fwd_mlp").slots == ("norm_0", "linear_0", "activation_0")
    assert all(p.comm.kind == ALL_REDUCE and p.comm.group_size == 8 for p in w.partitions)


def test_context_parallel_layer_has_the_artifacts_twelve_types() -> None:
    w = _workload(tp=4, cp=2)
    fwd = [p.key for p in w.partitions if p.phase == "fwd"]
    bwd = [p.key for p in w.partitions if p.phase == "bwd"]
    assert fwd == ["fwd_qkv_ar", "fwd_qkv_ag", "fwd_ao_ag", "fwd_ao_ar", "fwd_mlp"]
    assert bwd == [
        "bwd_mlp",
        "bwd_o_ar",
        "bwd_o_ag",
        "bwd_a_ag",
        "bwd_a_rs",
        "bwd_qkv_rs",
        "bwd_qkv_ar",
    ]
    assert sum(p.per_layer for p in w.partitions if p.phase == "fwd") == 6
    assert sum(p.per_layer for p in w.partitions if p.phase == "bwd") == 8
    assert w.partition("fwd_qkv_ag").comm.kind == ALL_GATHER
    assert w.partition("bwd_a_rs").comm.kind == REDUCE_SCATTER
    assert w.partition("fwd_qkv_ag").comm.group_size == 2
    assert w.partition("fwd_qkv_ar").comm.group_size == 4


def test_all_reduce_payload_is_seq_times_half_microbatch_times_hidden() -> None:
    w = _workload()
    comm = w.partition("fwd_attn").comm
    assert comm.payload_bytes == 4096 * (8 / 2) * 3072 * 2  # docs/kareus.md §5.4
    assert comm.wire_bytes == pytest.approx(2 * 7 / 8 * comm.payload_bytes)
    # The sequential (un-split) layer carries the whole microbatch.
    assert w.sequential["fwd"][0].comm.payload_bytes == 2 * comm.payload_bytes
    qkv = w.partition("fwd_attn").ops[1]
    assert qkv.flops == pytest.approx(2 * 4096 * 4 * 3072 * (3 + 2 * 1) * 128)


@pytest.mark.parametrize(("tp", "cp"), [(8, 1), (4, 2)])
@pytest.mark.parametrize("model", ["llama3.2-3b", "qwen3-1.7b"])
def test_spaces_fit_the_exhaustive_limit_and_budgets_the_papers(tp, cp, model) -> None:
    for p in _workload(tp=tp, cp=cp, model=model).partitions:
        space = config_space(p, FREQS)
        assert len(space) == len(set(space)) <= 1080
        slots = len(p.slots) + 1  # plus no overlap
        assert len(space) == 18 * len(default_sm_counts(p.comm.group_size)) * slots
        assert search_budget(p).total in (84, 112, 224)
        assert search_budget(p).total <= len(space)


def test_recompute_makes_a_backward_rerun_the_forward_types() -> None:
    w = _workload()
    assert [p.key for p, _ in w.instruction_types("backward")] == [
        "fwd_attn",
        "fwd_mlp",
        "bwd_mlp",
        "bwd_attn",
    ]
    w2 = build_workload(
        MODEL_SHAPES["llama3.2-3b"],
        Parallelism(tp=8, micro_batch=8, seq_len=4096, recompute=False),
        [28],
    )
    assert [p.key for p, _ in w2.instruction_types("backward")] == ["bwd_mlp", "bwd_attn"]
    assert [op.name for op in w2.stages[0].extra_forward] == ["embedding", "output_layer", "loss"]


def test_bad_shapes_and_splits_are_one_clear_error() -> None:
    with pytest.raises(PlanError, match="add up to 27"):
        build_workload(
            MODEL_SHAPES["llama3.2-3b"], Parallelism(tp=8, micro_batch=8, seq_len=4096), [14, 13]
        )
    with pytest.raises(PlanError, match="at least 2"):
        Parallelism(tp=8, micro_batch=1, seq_len=4096)
    with pytest.raises(PlanError, match="divisible by cp"):
        Parallelism(tp=4, cp=3, micro_batch=8, seq_len=4096)
    with pytest.raises(PlanError, match="multiple of kv_groups"):
        ModelShape(
            name="x", hidden=64, heads=6, kv_groups=4, head_dim=16, ffn=128, layers=2, vocab=100
        )
    with pytest.raises(PlanError, match="unknown partition type 'fwd_qkv_ag'"):
        _workload().partition("fwd_qkv_ag")
    with pytest.raises(PlanError, match="SM counts"):
        config_space(_workload().partitions[0], FREQS, [0, 3])
    with pytest.raises(PlanError, match="positive MHz"):
        config_space(_workload().partitions[0], [])


def test_config_space_is_clock_by_sms_by_slots_and_no_overlap() -> None:
    p = _workload().partition("fwd_mlp")
    space = config_space(p, [1410], [3, 6])
    assert {c.slot for c in space} == {"norm_0", "linear_0", "activation_0", None}
    assert Config(freq_mhz=1410.0, sm_count=3, slot=None) in space
    assert all(c.slot for c in config_space(p, [1410], [3], overlap_only=True))
