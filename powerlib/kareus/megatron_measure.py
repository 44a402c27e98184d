"""Measuring a megatron-core GPT's Kareus components on a device, over torch.distributed.

The helpers :class:`~powerlib.kareus.meter.DeviceEvaluator` needs besides the layer's own
runners (:meth:`NanobatchTransformerLayer.partition_runner
<powerlib.kareus.megatron.NanobatchTransformerLayer.partition_runner>` and
``sequential_runner``): :func:`gpt_compute_runner` runs a GPT's work outside its layers (the
partition model's embedding, output layer and loss, :mod:`powerlib.kareus.partition`);
:func:`group_measurement` and :func:`group_agreement` make the ranks of a tensor-parallel group
measure alike (docs/kareus.md §2.1). torch is imported on first use.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from powerlib.kareus import megatron_run as _run
from powerlib.kareus.evaluator import Measurement
from powerlib.kareus.partition_types import Op

__all__ = ["gpt_compute_runner", "group_agreement", "group_measurement"]


def gpt_compute_runner(
    model: Any,
    tokens: Any,
    positions: Any,
    labels: Any,
    *,
    synchronize: Callable[[], None] | None = None,
) -> Callable[[tuple[Op, ...], float], None]:
    """``run_compute(ops, freq_mhz)`` for ``DeviceEvaluator``: a GPT's work outside its layers.

    The partition model's non-layer work (:mod:`powerlib.kareus.partition`) is the
    embedding on the first stage and the output layer and loss on the last: ``ops`` named
    ``embedding`` / ``output_layer`` / ``loss`` run ``model.embedding`` and (final norm,)
    ``model.output_layer`` and ``model.compute_language_model_loss`` forward; ``*_bwd`` names
    run the embedding's and the output layer's backward on a forward kept for it. ``model`` is a megatron-core ``GPTModel`` built
    with ``pre_process`` and ``post_process`` (a one-layer model for measuring is enough).
    """
    _run.load()
    torch = _run.torch
    if synchronize is None:
        synchronize = torch.cuda.synchronize if tokens.is_cuda else (lambda: None)
    params = [p for p in model.parameters() if p.requires_grad]
    weight = (
        model.shared_embedding_or_output_weight()
        if getattr(model, "share_embeddings_and_output_weights", False)
        else None
    )
    norm = getattr(model.decoder, "final_layernorm", None)

    def embed() -> Any:
        return model.embedding(input_ids=tokens, position_ids=positions)

    def logits_of(hidden: Any) -> Any:
        if norm is not None:
            hidden = norm(hidden)
        return model.output_layer(hidden, weight=weight)[0]

    with torch.enable_grad():
        emb = embed()
        hidden = emb.detach().requires_grad_(True)
        # kept for the backward runs: the output layer only (the partition model's
        # output_layer_bwd); the loss's backward cannot be replayed, megatron's vocab-parallel
        # cross-entropy rewrites its saved softmax in place
        logits = logits_of(hidden)

    def run(ops: tuple[Op, ...], freq_mhz: float) -> None:
        names = {op.name for op in ops}
        with torch.enable_grad():
            if "embedding" in names:
                embed()
            if names & {"output_layer", "loss"}:
                model.compute_language_model_loss(labels, logits_of(hidden.detach()))
            if "output_layer_bwd" in names:
                torch.autograd.backward(logits, torch.ones_like(logits), retain_graph=True)
            if "embedding_bwd" in names:
                torch.autograd.backward(emb, torch.ones_like(emb), retain_graph=True)
        for p in params:
            p.grad = None
        hidden.grad = None
        synchronize()

    return run


def group_measurement(group: Any = None) -> Callable[[Measurement], Measurement]:
    """``combine`` for ``DeviceEvaluator`` over ``group``: the same figures on every rank.

    A partition's time is its slowest rank's, its energy the group's mean per GPU (the
    evaluator's convention, docs/kareus.md §2.1); the wall time the slowest rank's. Every rank of
    the group then sees the same measurement, so searches running on each of them choose the same
    candidates (and issue the same collectives).
    """
    _run.load()
    torch, dist = _run.torch, _run.dist

    def combine(m: Measurement) -> Measurement:
        size = dist.get_world_size(group)
        peak = torch.tensor([m.time_s, m.wall_s], dtype=torch.float64)
        total = torch.tensor([m.energy_j], dtype=torch.float64)
        dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)
        dist.all_reduce(total, group=group)
        return dataclasses.replace(
            m,
            time_s=float(peak[0]),
            wall_s=float(peak[1]),
            energy_j=float(total[0]) / size,
        )

    return combine


def group_agreement(group: Any = None) -> Callable[[bool], bool]:
    """``agree`` for :class:`~powerlib.kareus.meter.DeviceEvaluator` over ``group``.

    Every rank of a tensor-parallel group must run a partition as many times as the others (its
    collectives pair up): the group stops when every rank's time is up (an all-reduce MIN).
    """
    _run.load()
    torch, dist = _run.torch, _run.dist

    def agree(done: bool) -> bool:
        flag = torch.tensor([1 if done else 0], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
        return bool(flag.item())

    return agree


_CLASS: list[type] = []
