"""Measuring a megatron-core GPT's Kareus components on a device, over torch.distributed.

What :class:`~powerlib.kareus.meter.DeviceEvaluator` needs: :class:`PartitionRunner`, the
layer's one-partition runner (:meth:`NanobatchTransformerLayer.partition_runner
<powerlib.kareus.megatron.NanobatchTransformerLayer.partition_runner>` makes it; the layer's
``sequential_runner`` runs the stock layer); :func:`gpt_compute_runner` runs a GPT's work outside its layers (the
partition model's embedding, output layer and loss, :mod:`powerlib.kareus.partition`);
:func:`group_measurement` and :func:`group_agreement` make the ranks of a tensor-parallel group
measure alike (docs/kareus.md §2.1). torch is imported on first use.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from powerlib.errors import InvalidArgumentError
from powerlib.kareus import megatron_run as _run
from powerlib.kareus.evaluator import Measurement
from powerlib.kareus.launch import LaunchControl
from powerlib.kareus.launch_schedule import PartitionSchedule
from powerlib.kareus.partition_types import Config, Op, PartitionType
from powerlib.kareus.sm_groups import SMGroups
from powerlib.planning.pipeline import Instruction
from powerlib.planning.plan import PartitionSetting, PlannedInstruction

__all__ = ["PartitionRunner", "gpt_compute_runner", "group_agreement", "group_measurement"]


class PartitionRunner:
    """The layer's one-partition runner: ``run(ptype, config)`` for ``DeviceEvaluator``.

    Made by :meth:`NanobatchTransformerLayer.partition_runner
    <powerlib.kareus.megatron.NanobatchTransformerLayer.partition_runner>` (which documents a
    call). Everything before the partitions (both nanobatches' forward and the MLP backward the
    backward partitions start from) runs once, when it is made; each call then runs one
    partition's compute with the other nanobatch's collective launched under a one-instruction
    launch control.
    """

    def __init__(
        self,
        run: _run.Run,
        params: list[Any],
        groups: SMGroups,
        group_ranks: Sequence[Sequence[int]] | None,
        synchronize: Callable[[], None],
    ) -> None:
        self._run = run
        self._params = params
        self._groups = groups
        self._group_ranks = group_ranks
        self._synchronize = synchronize
        self._prepared: set[int] = set()  # SM counts whose communicators exist
        self._bodies = self._prepare()
        self._clear()

    def _prepare(self) -> dict[str, tuple[Callable[[], Any], Callable[[], None]]]:
        """Run what comes before the partitions; per type, its collective's input and compute."""
        run = self._run
        h0, h1 = run.halves
        comm = run.comm

        def reduced(t: Any) -> Any:
            return comm.reduce(t.detach().clone(), async_op=False)[1]

        torch = _run.torch
        with torch.enable_grad():  # everything before the partitions, once
            run.attn(h0)
            run.attn(h1)
            r0, r1 = reduced(h0.p), reduced(h1.p)
            run.mlp(h0, r0)
            run.mlp(h1, r1)
            run.finish(h0, reduced(h0.q))
            run.finish(h1, reduced(h1.q))
            g = torch.ones_like(h0.out)
            run.b_mlp(h0, g)
            run.b_mlp(h1, g)
            gb0 = reduced(_run.grad_of(h0.b_in))
        return {
            "fwd_attn": (lambda: _run.detached(h0.p), lambda: run.attn(h1)),
            "fwd_mlp": (lambda: _run.detached(h1.p), lambda: run.mlp(h0, r0)),
            "bwd_mlp": (lambda: _run.grad_of(h0.b_in), lambda: run.b_mlp(h1, g)),
            "bwd_attn": (lambda: _run.grad_of(h1.b_in), lambda: run.b_attn(h0, gb0)),
        }

    def _clear(self) -> None:
        """Drop the gradients a partition accumulated (parameters and the halves' leaves)."""
        for p in self._params:
            p.grad = None
        for h in self._run.halves:
            for t in (h.x, h.a_in, h.r, h.hh, h.b_in, h.qr):
                if t is not None:
                    t.grad = None

    def _control(self, key: str, kind: str, config: Config) -> LaunchControl:
        """A launch control of one instruction with one partition: ``key`` under ``config``."""
        sm = int(config.sm_count)
        planned = PlannedInstruction(
            instruction=Instruction(stage=0, microbatch=0, kind=kind),
            freq_mhz=float(config.freq_mhz),
            execution="nanobatch",
            overlap={key: PartitionSetting(slot=config.slot, sm_count=sm)},
        )
        control = LaunchControl(
            PartitionSchedule([planned], source="partition_runner"), groups=self._groups
        )
        if sm not in self._prepared:
            self._groups.prepare({sm}, self._group_ranks)
            self._prepared.add(sm)
        return control

    def __call__(self, ptype: PartitionType, config: Config) -> LaunchControl:
        """Run one partition of type ``ptype.key``: the launch control it ran under."""
        key = ptype.key.removeprefix("recompute_")
        if key not in self._bodies:
            raise InvalidArgumentError(
                f"partition type {ptype.key!r}: this layer runs {', '.join(self._bodies)}"
            )
        source, compute = self._bodies[key]
        kind = "forward" if key.startswith("fwd") else "backward"
        measured = self._control(key, kind, config)
        run = self._run
        measured.begin(kind, 0)
        run.control = measured
        pending = _run.Pending(run.comm, lambda: source().clone())
        try:
            with _run.torch.enable_grad(), run.partition(key, pending):
                compute()
            pending.value()
        finally:
            measured.end()
            run.control = None
            self._clear()
        self._synchronize()
        return measured


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
