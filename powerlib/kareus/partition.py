"""Kareus's partitioned overlap model: operations, partitions and their configuration spaces.

A microbatch is split into two nanobatches with no data dependency between them and run staggered,
so that a collective of one nanobatch overlaps compute of the other (docs/kareus.md §1.3-1.4). A
**partition** is one collective of one nanobatch plus the contiguous run of the other nanobatch's
compute that does not depend on it; partitions of one *type* repeat in every layer and share one
configuration within an instruction.

The forward and backward operation lists of a transformer layer are built from its shapes
(:class:`ModelShape`, :class:`Parallelism`) and cut at every collective into *segments*. Segment
``i`` of nanobatch 0 overlaps the collective still in flight from nanobatch 1's previous segment,
and segment ``i`` of nanobatch 1 overlaps nanobatch 0's collective of segment ``i`` (§1.4). Type
keys are ``<phase>_<segment>`` when both nanobatches of a segment overlap the same collective kind
(``fwd_attn``, ``fwd_mlp``; the TP-only layer) and ``<phase>_<segment>_<collective>`` otherwise
(``fwd_qkv_ag``, ``bwd_a_rs``; context parallelism), as in the Kareus artifact's schedule files.

The shapes live in :mod:`powerlib.kareus.shapes`, the operation, partition and
configuration types in :mod:`powerlib.kareus.partition_types`; this module builds a
stage's partitions from them (:func:`build_workload`) and gives each partition type its
configuration space and search budget. It re-exports the names of both, the package's public path.

Everything here is arithmetic on shapes: no device, no torch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from powerlib.errors import PlanError
from powerlib.kareus.partition_types import (
    ALL_GATHER,
    ALL_REDUCE,
    BLOCK_SIZE,
    REDUCE_SCATTER,
    Collective,
    Config,
    Op,
    PartitionType,
    Segment,
)
from powerlib.kareus.shapes import MODEL_SHAPES, ModelShape, Parallelism

__all__ = [
    "Budget",
    "StageWork",
    "PartitionWorkload",
    "build_workload",
    "config_space",
    "default_sm_counts",
    "search_budget",
]

_BF16 = 2  # bytes per element


# --------------------------------------------------------------------------------------------
# PartitionWorkload: the partitions and the non-partition work of each stage
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class StageWork:
    """What one pipeline stage runs per microbatch.

    Attributes:
        stage: Stage index.
        layers: Transformer layers on the stage.
        extra_forward: Non-partition compute of a forward (embedding on the first stage; output
            layer and loss on the last), at microbatch size.
        extra_backward: Their backward.
    """

    stage: int
    layers: int
    extra_forward: tuple[Op, ...]
    extra_backward: tuple[Op, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class PartitionWorkload:
    """A model, its parallelism and its stages: everything the search and composition need.

    Attributes:
        model: Layer shapes.
        parallelism: TP/CP degrees, micro-batch, sequence, recompute.
        stages: Per stage, its layers and extra work.
        segments: ``{"fwd": [...], "bwd": [...]}``: one layer's segments at nanobatch size.
        sequential: ``{"fwd": [...], "bwd": [...]}``: one layer's segments at microbatch size
            (no nanobatching; execution-model switching, docs/kareus.md §4.5).
        partitions: Every partition type, forward types first, in layer order.
    """

    model: ModelShape
    parallelism: Parallelism
    stages: tuple[StageWork, ...]
    segments: dict[str, tuple[Segment, ...]] = field(hash=False)
    sequential: dict[str, tuple[Segment, ...]] = field(hash=False)
    partitions: tuple[PartitionType, ...]

    @property
    def label(self) -> str:
        """``llama3.2-3b_tp8_mbs8_seq4096``-like label."""
        key = next((k for k, m in MODEL_SHAPES.items() if m == self.model), self.model.name)
        return f"{key}_{self.parallelism.label}"

    def partition(self, key: str) -> PartitionType:
        """The partition type called ``key``.

        Raises:
            PlanError: Unknown key.
        """
        for p in self.partitions:
            if p.key == key:
                return p
        known = ", ".join(p.key for p in self.partitions)
        raise PlanError(f"unknown partition type {key!r}; this workload has {known}")

    def phases(self, kind: str) -> tuple[str, ...]:
        """The layer phases an instruction of ``kind`` runs, in order.

        A forward runs ``fwd``; a backward runs ``bwd`` and, with recompute, ``fwd`` first
        (docs/kareus.md §1.4).

        Raises:
            PlanError: For a kind other than forward or backward.
        """
        if kind == "forward":
            return ("fwd",)
        if kind == "backward":
            return ("fwd", "bwd") if self.parallelism.recompute else ("bwd",)
        raise PlanError(f"Kareus plans forward and backward instructions, not {kind!r}")

    def instruction_types(self, kind: str) -> list[tuple[PartitionType, int]]:
        """Partition types an instruction of ``kind`` runs, with occurrences per layer."""
        phases = self.phases(kind)
        return [(p, p.per_layer) for p in self.partitions if p.phase in phases]


def _gemm(name: str, slot: str, m: float, k: float, n: float) -> Op:
    """An ``m×k @ k×n`` bf16 GEMM: 2mkn FLOPs, read both operands, write the result."""
    flops = 2.0 * m * k * n
    data = _BF16 * (m * k + k * n + m * n)
    tiles = math.ceil(m / 128) * math.ceil(n / 128)
    return Op(name=name, slot=slot, flops=flops, hbm_bytes=data, ctas=max(1, tiles))


def _elementwise(name: str, slot: str, elements: float, passes: float, flops_per: float) -> Op:
    """A memory-bound op touching ``elements`` bf16 values ``passes`` times."""
    return Op(
        name=name,
        slot=slot,
        flops=flops_per * elements,
        hbm_bytes=_BF16 * elements * passes,
        ctas=max(1, math.ceil(elements / (BLOCK_SIZE * 4))),
    )


def _attention(
    name: str,
    slot: str,
    tokens: float,
    seq_len: int,
    kv_tokens: float,
    heads: float,
    kv_heads: float,
    d: int,
    backward: bool,
) -> Op:
    """Causal flash attention over ``tokens`` queries (all sequences).

    Each query sees ``seq_len`` keys of its own sequence, half of them masked; ``kv_tokens``
    keys and values are read.
    """
    flops = 4.0 * tokens * seq_len * heads * d * 0.5 * (2.5 if backward else 1.0)
    data = _BF16 * (tokens * heads * d * (4 if backward else 2) + 2 * kv_tokens * kv_heads * d)
    ctas = max(1, math.ceil(tokens / 128) * int(heads))
    return Op(name=name, slot=slot, flops=flops, hbm_bytes=data, ctas=ctas)


@dataclass(frozen=True, slots=True)
class _LayerOps:
    """One layer's forward ops, its attention backward and the sizes of its collectives."""

    norm: Op
    qkv: Op
    rope: Op
    attn: Op
    proj: Op
    fc1: Op
    act: Op
    fc2: Op
    attn_b: Op
    tp_ar: Collective  # the tensor-parallel all-reduce of one segment's output
    kv_bytes: float  # gathered K and V (context parallelism: one fused collective)


def _layer_ops(model: ModelShape, par: Parallelism, batch: float) -> _LayerOps:
    """The ops of one layer for ``batch`` sequences on one GPU."""
    h, d = model.hidden, model.head_dim
    q_heads = model.heads / par.tp
    kv_heads = model.kv_groups / par.tp
    qkv_out = (q_heads + 2 * kv_heads) * d
    tokens = batch * par.seq_len / par.cp  # this rank's share of the sequence
    kv_tokens = batch * par.seq_len  # causal attention sees the whole (gathered) sequence
    ffn = model.ffn / par.tp
    tp_ar = Collective(kind=ALL_REDUCE, payload_bytes=_BF16 * tokens * h, group_size=par.tp)
    attention = (tokens, par.seq_len, kv_tokens, q_heads, kv_heads, d)
    return _LayerOps(
        norm=_elementwise("bda_norm", "norm_0", tokens * h, 4, 8),
        qkv=_gemm("qkv", "linear_0", tokens, h, qkv_out),
        rope=_elementwise("qkv_post_rope", "rope_0", tokens * qkv_out, 2, 6),
        attn=_attention("flash_attn", "attn_0", *attention, backward=False),
        proj=_gemm("out_proj", "linear_1", tokens, q_heads * d, h),
        fc1=_gemm("fc1", "linear_0", tokens, h, 2 * ffn),
        act=_elementwise("swiglu", "activation_0", tokens * ffn, 3, 4),
        fc2=_gemm("fc2", "linear_1", tokens, ffn, h),
        attn_b=_attention("flash_attn_bwd", "attn_0", *attention, backward=True),
        tp_ar=tp_ar,
        kv_bytes=_BF16 * 2 * kv_tokens * kv_heads * d,
    )


# Backward: data and weight gradients double each GEMM; memory-bound ops re-read their input.
def _bwd_gemm(op: Op, slot: str) -> Op:
    return Op(
        name=op.name + "_bwd",
        slot=slot,
        flops=2 * op.flops,
        hbm_bytes=2 * op.hbm_bytes,
        ctas=op.ctas,
    )


def _bwd_elem(op: Op, slot: str) -> Op:
    return Op(
        name=op.name + "_bwd",
        slot=slot,
        flops=1.5 * op.flops,
        hbm_bytes=1.5 * op.hbm_bytes,
        ctas=op.ctas,
    )


def _layer_segments(
    model: ModelShape, par: Parallelism, batch: float
) -> dict[str, tuple[Segment, ...]]:
    """One layer's forward and backward segments for ``batch`` sequences on one GPU."""
    ops = _layer_ops(model, par, batch)
    tp_ar = ops.tp_ar
    norm_b = _bwd_elem(ops.norm, "norm_0")
    mlp_fwd = Segment(name="mlp", ops=(ops.norm, ops.fc1, ops.act, ops.fc2), comm=tp_ar)
    mlp_bwd = Segment(
        name="mlp",
        ops=(
            norm_b,
            _bwd_gemm(ops.fc2, "linear_0"),
            _bwd_elem(ops.act, "activation_0"),
            _bwd_gemm(ops.fc1, "linear_1"),
        ),
        comm=tp_ar,
    )
    if par.cp == 1:
        attn_fwd = (ops.norm, ops.qkv, ops.rope, ops.attn, ops.proj)
        attn_bwd = (
            norm_b,
            _bwd_gemm(ops.proj, "linear_0"),
            ops.attn_b,
            _bwd_elem(ops.rope, "rope_0"),
            _bwd_gemm(ops.qkv, "linear_1"),
        )
        return {
            "fwd": (Segment(name="attn", ops=attn_fwd, comm=tp_ar), mlp_fwd),
            "bwd": (mlp_bwd, Segment(name="attn", ops=attn_bwd, comm=tp_ar)),
        }
    ag = Collective(kind=ALL_GATHER, payload_bytes=ops.kv_bytes, group_size=par.cp)
    rs = Collective(kind=REDUCE_SCATTER, payload_bytes=ops.kv_bytes, group_size=par.cp)
    fwd = (
        Segment(name="qkv", ops=(ops.norm, ops.qkv, ops.rope), comm=ag),
        Segment(name="ao", ops=(ops.attn, ops.proj), comm=tp_ar),
        mlp_fwd,
    )
    bwd = (
        mlp_bwd,
        Segment(name="o", ops=(norm_b, _bwd_gemm(ops.proj, "linear_0")), comm=ag),
        Segment(name="a", ops=(ops.attn_b,), comm=rs),
        Segment(
            name="qkv",
            ops=(_bwd_elem(ops.rope, "rope_0"), _bwd_gemm(ops.qkv, "linear_0")),
            comm=tp_ar,
        ),
    )
    return {"fwd": fwd, "bwd": bwd}


def _partitions(phase: str, segments: Sequence[Segment]) -> list[PartitionType]:
    """Pair each segment's compute with the collectives in flight (docs/kareus.md §1.4).

    Nanobatch 0's segment ``i`` overlaps nanobatch 1's collective of segment ``i−1`` (the
    previous layer's last for ``i = 0``); nanobatch 1's segment ``i`` overlaps nanobatch 0's
    collective of segment ``i``.
    """
    out: list[PartitionType] = []
    n = len(segments)
    for i, seg in enumerate(segments):
        first = segments[(i - 1) % n].comm  # in flight during nanobatch 0's compute
        second = seg.comm  # in flight during nanobatch 1's compute
        slots: list[str] = []
        for op in seg.ops:
            if op.slot not in slots:
                slots.append(op.slot)
        candidates = tuple(slots[:-1]) if len(slots) > 1 else tuple(slots)
        if first.kind == second.kind:
            comm = first if first.wire_bytes >= second.wire_bytes else second
            out.append(
                PartitionType(
                    key=f"{phase}_{seg.name}",
                    phase=phase,
                    ops=seg.ops,
                    comm=comm,
                    slots=candidates,
                    per_layer=2,
                )
            )
        else:
            for comm in (first, second):
                out.append(
                    PartitionType(
                        key=f"{phase}_{seg.name}_{comm.abbrev}",
                        phase=phase,
                        ops=seg.ops,
                        comm=comm,
                        slots=candidates,
                        per_layer=1,
                    )
                )
    return out


def _extras(
    model: ModelShape, par: Parallelism, stage: int, num_stages: int
) -> tuple[tuple[Op, ...], tuple[Op, ...]]:
    tokens = par.micro_batch * par.seq_len / par.cp
    fwd: list[Op] = []
    bwd: list[Op] = []
    if stage == 0:
        emb = _elementwise("embedding", "embedding_0", tokens * model.hidden, 2, 0)
        fwd.append(emb)
        bwd.extend(
            [
                Op(
                    name="embedding_bwd",
                    slot="embedding_0",
                    flops=0.0,
                    hbm_bytes=2 * emb.hbm_bytes,
                    ctas=emb.ctas,
                )
            ]
        )
    if stage == num_stages - 1:
        out = _gemm("output_layer", "linear_0", tokens, model.hidden, model.vocab / par.tp)
        loss = _elementwise("loss", "loss_0", tokens * model.vocab / par.tp, 3, 5)
        fwd.extend([out, loss])
        bwd.extend(
            [
                Op(
                    name="output_layer_bwd",
                    slot="linear_0",
                    flops=2 * out.flops,
                    hbm_bytes=2 * out.hbm_bytes,
                    ctas=out.ctas,
                )
            ]
        )
    return tuple(fwd), tuple(bwd)


def build_workload(
    model: ModelShape, parallelism: Parallelism, stage_layers: Sequence[int]
) -> PartitionWorkload:
    """Partitions and stage work of ``model`` under ``parallelism``, split ``stage_layers``.

    Args:
        model: Layer shapes (e.g. ``MODEL_SHAPES["llama3.2-3b"]``).
        parallelism: TP/CP degrees, micro-batch and sequence.
        stage_layers: Layers per pipeline stage (the artifact's PP=2 split is 15/13).

    Raises:
        PlanError: If the stage split is empty, has a non-positive entry or does not add up to
            the model's layers.
    """
    layers = [int(n) for n in stage_layers]
    if not layers or any(n < 1 for n in layers):
        raise PlanError(f"stage_layers must be positive layer counts, got {list(stage_layers)}")
    if sum(layers) != model.layers:
        raise PlanError(
            f"stage_layers {layers} add up to {sum(layers)}, but {model.name} has "
            f"{model.layers} layers"
        )
    half = _layer_segments(model, parallelism, parallelism.micro_batch / 2)
    full = _layer_segments(model, parallelism, parallelism.micro_batch)
    partitions = _partitions("fwd", half["fwd"]) + _partitions("bwd", half["bwd"])
    stages = []
    for s, n in enumerate(layers):
        fwd, bwd = _extras(model, parallelism, s, len(layers))
        stages.append(StageWork(stage=s, layers=n, extra_forward=fwd, extra_backward=bwd))
    return PartitionWorkload(
        model=model,
        parallelism=parallelism,
        stages=tuple(stages),
        segments=half,
        sequential=full,
        partitions=tuple(partitions),
    )


# --------------------------------------------------------------------------------------------
# Configuration spaces and search budgets
# --------------------------------------------------------------------------------------------


def default_sm_counts(group_size: int) -> tuple[int, ...]:
    """SM counts searched (docs/kareus.md §1.4): 3, 6, …, 30 for groups of 4+ GPUs, else 1-20."""
    return tuple(range(3, 31, 3)) if group_size >= 4 else tuple(range(1, 21))


def config_space(
    ptype: PartitionType,
    freqs_mhz: Sequence[float],
    sm_counts: Sequence[int] | None = None,
    *,
    overlap_only: bool = False,
) -> list[Config]:
    """Every configuration of ``ptype``: clock × SM count × (launch slots + no overlap).

    Args:
        ptype: The partition type.
        freqs_mhz: Clocks to search (the artifact: 900-1410 MHz in 30 MHz steps).
        sm_counts: SM counts; default :func:`default_sm_counts` of the collective's group.
        overlap_only: Leave out the no-overlap configurations.

    Raises:
        PlanError: On an empty or non-positive frequency or SM list.
    """
    freqs = sorted({float(f) for f in freqs_mhz})
    if not freqs or freqs[0] <= 0:
        raise PlanError(f"frequencies must be positive MHz values, got {list(freqs_mhz)}")
    sms = default_sm_counts(ptype.comm.group_size) if sm_counts is None else tuple(sm_counts)
    if not sms or min(sms) < 1:
        raise PlanError(f"SM counts must be positive integers, got {list(sms)}")
    slots: list[str | None] = list(ptype.slots)
    if not overlap_only:
        slots.append(None)
    return [
        Config(freq_mhz=f, sm_count=int(s), slot=slot)
        for f in freqs
        for s in sorted(set(sms))
        for slot in slots
    ]


@dataclass(frozen=True, slots=True)
class Budget:
    """Search budget of one partition type: initial samples, batches, batch size."""

    n_init: int
    batches: int
    batch_size: int

    @property
    def total(self) -> int:
        """Maximum evaluations."""
        return self.n_init + self.batches * self.batch_size


_BUDGETS = {"small": Budget(36, 3, 16), "medium": Budget(48, 4, 16), "large": Budget(96, 4, 32)}


def search_budget(ptype: PartitionType) -> Budget:
    """The paper's budget for the partition's size class (36/3/16, 48/4/16, 96/4/32)."""
    return _BUDGETS[ptype.size_class]
