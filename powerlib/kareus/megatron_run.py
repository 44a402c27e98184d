"""The nanobatched layer's run: two nanobatches, their collectives and the autograd node.

One call of :class:`~powerlib.kareus.megatron.NanobatchTransformerLayer` (the schedule in
:mod:`powerlib.kareus.megatron`'s module doc) is a :class:`Run`: the microbatch split into two
nanobatches along the batch dimension (:class:`Half`), cut at every tensor-parallel collective,
with each piece of compute between collectives run inside a partition of the launch control
(:meth:`powerlib.kareus.launch.LaunchControl.partition`) that launches the other nanobatch's
collective (:class:`Pending`) at the plan's slot and joins it at the partition's end. The forward
runs under one autograd node (:func:`function`) whose backward replays the pieces in reverse.

torch and megatron-core are bound by :func:`load` on first use (no framework import at module
level: tests/test_boundaries.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from powerlib.kareus.launch import LaunchControl
from powerlib.planning.plan import PartitionSetting

__all__ = [
    "Comm",
    "Half",
    "MegatronClasses",
    "Pending",
    "Run",
    "detached",
    "function",
    "grad_of",
    "load",
]

# The frameworks, bound by load() on first use
torch: Any = None
dist: Any = None


@dataclasses.dataclass(frozen=True, slots=True)
class MegatronClasses:
    """The megatron-core classes the nanobatched layer extends and checks against."""

    identity_op: type[Any]
    mlp: type[Any]
    transformer_layer: type[Any]


_MEGATRON: list[MegatronClasses] = []


def load() -> MegatronClasses:
    """Import torch, ``torch.distributed`` and the megatron-core classes the layer needs."""
    global torch, dist
    if torch is None:
        import torch as torch_module  # noqa: PLC0415 - optional dependency, imported where used
        import torch.distributed as dist_module  # noqa: PLC0415 - optional dependency, imported where used

        torch, dist = torch_module, dist_module
    if not _MEGATRON:
        from megatron.core.transformer.identity_op import IdentityOp  # noqa: PLC0415 - optional dependency, imported where used
        from megatron.core.transformer.mlp import MLP  # noqa: PLC0415 - optional dependency, imported where used
        from megatron.core.transformer.transformer_layer import TransformerLayer  # noqa: PLC0415 - optional dependency, imported where used

        _MEGATRON.append(MegatronClasses(IdentityOp, MLP, TransformerLayer))
    return _MEGATRON[0]


# --------------------------------------------------------------------------------------------
# Collectives
# --------------------------------------------------------------------------------------------


class Comm:
    """The tensor-parallel collectives of one layer: all-reduce, or reduce-scatter/all-gather."""

    def __init__(self, group: Any, sequence_parallel: bool) -> None:
        self.group = group
        self.sp = bool(sequence_parallel)
        self.size = dist.get_world_size(group) if dist.is_initialized() else 1

    def reduce(self, t: torch.Tensor, group: Any = None, *, async_op: bool = True) -> Any:
        """Start the partition's collective on ``t``: ``(work, result)``; ``result`` valid after wait."""
        group = self.group if group is None else group
        t = t.contiguous()
        if self.size == 1:
            return None, t
        if not self.sp:
            return dist.all_reduce(t, group=group, async_op=async_op), t
        out = t.new_empty((t.shape[0] // self.size, *t.shape[1:]))
        return dist.reduce_scatter_tensor(out, t, group=group, async_op=async_op), out

    def gather(self, t: torch.Tensor) -> torch.Tensor:
        """The synchronous all-gather along the sequence (identity without sequence parallelism)."""
        if not self.sp or self.size == 1:
            return t
        t = t.contiguous()
        out = t.new_empty((t.shape[0] * self.size, *t.shape[1:]))
        dist.all_gather_into_tensor(out, t, group=self.group)
        return out


class Pending:
    """One launched collective: ``launch(group, setting)`` for :meth:`LaunchControl.partition`."""

    def __init__(self, comm: Comm, tensor: Callable[[], torch.Tensor]) -> None:
        self._comm = comm
        self._tensor = tensor
        self.work: Any = None
        self.result: torch.Tensor | None = None

    def __call__(self, group: Any, setting: PartitionSetting | None) -> Any:
        """Launch the collective on ``group`` (the launch control's callback): its work."""
        self.work, self.result = self._comm.reduce(self._tensor(), group)
        return self.work

    def value(self) -> torch.Tensor:
        """The collective's result (joined)."""
        if self.result is None:
            self(None, None)
        if self.work is not None:
            self.work.wait()
            self.work = None
        assert self.result is not None
        return self.result


def _leaf(t: torch.Tensor, grad: bool) -> torch.Tensor:
    return t.detach().requires_grad_(grad)


def _backward(t: torch.Tensor, g: torch.Tensor | None, retain: bool) -> None:
    if g is not None and t.requires_grad:
        torch.autograd.backward(t, g, retain_graph=retain)


def grad_of(t: torch.Tensor) -> torch.Tensor:
    """``t``'s gradient, zeros when none arrived."""
    return t.grad if t.grad is not None else torch.zeros_like(t)


def detached(t: torch.Tensor | None) -> torch.Tensor:
    """``t``, which an earlier piece of the schedule made, detached."""
    assert t is not None, "the schedule reads a tensor before the piece that makes it"
    return t.detach()


# --------------------------------------------------------------------------------------------
# One nanobatch and the schedule
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(eq=False)
class Half:
    """One nanobatch's tensors, cut at every collective (leaves are where gradients meet)."""

    x: torch.Tensor  # layer input (leaf)
    mask: Any
    a: torch.Tensor | None = None  # input norm output (shard with SP)
    a_in: torch.Tensor | None = None  # attention input (leaf; gathered with SP)
    p: torch.Tensor | None = None  # attention output before its reduce
    bias1: torch.Tensor | None = None
    r: torch.Tensor | None = None  # reduced attention output (leaf)
    h: torch.Tensor | None = None  # after the attention bias-add
    hh: torch.Tensor | None = None  # the same (leaf)
    b: torch.Tensor | None = None  # pre-MLP norm output
    b_in: torch.Tensor | None = None  # MLP input (leaf; gathered with SP)
    q: torch.Tensor | None = None  # MLP output before its reduce
    bias2: torch.Tensor | None = None
    qr: torch.Tensor | None = None  # reduced MLP output (leaf)
    out: torch.Tensor | None = None


class Run:
    """One call of the nanobatched layer: its halves and the schedule over them."""

    def __init__(
        self,
        layer: Any,
        control: LaunchControl | None,
        x: torch.Tensor,
        mask: Any,
        kwargs: dict[str, Any],
        grad: bool,
        retain: bool = False,
    ) -> None:
        self.layer = layer
        self.control = control
        self.comm = layer._comm()
        self.kwargs = kwargs
        self.grad = grad
        self.retain = retain
        parts = torch.tensor_split(x, 2, dim=1)
        masks = _split_mask(mask, x.shape[1])
        self.halves = [Half(x=_leaf(p, grad), mask=m) for p, m in zip(parts, masks, strict=True)]
        self.prefix = ""

    # -- partitions -------------------------------------------------------------------------

    @contextmanager
    def partition(self, key: str, pending: Pending) -> Iterator[Any]:
        """One partition of the run: ``pending`` launched at its slot, joined at the end."""
        if self.control is None:
            yield None
            pending.value()
            return
        layer = self.layer
        with self.control.partition(self.prefix + key, pending, group=self.comm.group) as part:
            outer, layer._part = layer._part, part
            try:
                part.slot("norm_0")
                yield part
            finally:
                layer._part = outer

    # -- forward pieces ---------------------------------------------------------------------

    def attn(self, h: Half) -> None:
        """Nanobatch ``h``'s input norm and self-attention, up to its row-parallel output."""
        lay = self.layer
        h.a = lay.input_layernorm(h.x)
        h.a_in = _leaf(self.comm.gather(h.a.detach()), self.grad)
        with lay._local():
            h.p, h.bias1 = lay.self_attention(h.a_in, attention_mask=h.mask, **self.kwargs)
        if self.grad:
            lay._grad_slots(h.p, "linear_0")

    def mlp(self, h: Half, r: torch.Tensor) -> None:
        """Nanobatch ``h``'s attention bias-add (``r``: reduced), norm and MLP."""
        lay = self.layer
        h.r = _leaf(r, self.grad)
        with lay.bias_dropout_add_exec_handler():
            h.h = lay.self_attn_bda(lay.training, lay.config.bias_dropout_fusion)(
                (h.r, h.bias1), h.x, lay.hidden_dropout
            )
        h.hh = _leaf(h.h, self.grad)
        h.b = lay.pre_mlp_layernorm(h.hh)
        h.b_in = _leaf(self.comm.gather(h.b.detach()), self.grad)
        with lay._local():
            h.q, h.bias2 = lay.mlp(h.b_in)
        if self.grad:
            lay._grad_slots(h.q, "linear_0")

    def finish(self, h: Half, r: torch.Tensor) -> None:
        """Nanobatch ``h``'s MLP bias-add (``r``: the reduced MLP output)."""
        lay = self.layer
        h.qr = _leaf(r, self.grad)
        with lay.bias_dropout_add_exec_handler():
            h.out = lay.mlp_bda(lay.training, lay.config.bias_dropout_fusion)(
                (h.qr, h.bias2), h.hh, lay.hidden_dropout
            )

    def forward(self) -> torch.Tensor:
        """The forward schedule (module doc of :mod:`powerlib.kareus.megatron`): the output."""
        h0, h1 = self.halves
        comm = self.comm
        self.attn(h0)
        r0 = Pending(comm, lambda: detached(h0.p))
        with self.partition("fwd_attn", r0):
            self.attn(h1)
        r1 = Pending(comm, lambda: detached(h1.p))
        with self.partition("fwd_mlp", r1):
            self.mlp(h0, r0.value())
        q0 = Pending(comm, lambda: detached(h0.q))
        with self.partition("fwd_mlp", q0):
            self.mlp(h1, r1.value())
        q1 = Pending(comm, lambda: detached(h1.q))
        q1(None, None)  # the layer's last collective: overlaps nanobatch 0's bias-add only
        self.finish(h0, q0.value())
        self.finish(h1, q1.value())
        return torch.cat([detached(h0.out), detached(h1.out)], dim=1)

    # -- backward pieces --------------------------------------------------------------------

    def b_mlp(self, h: Half, g: torch.Tensor) -> None:
        """Nanobatch ``h``'s MLP backward from output gradient ``g``."""
        _backward(h.out, g, self.retain)
        _backward(h.q, self.comm.gather(grad_of(h.qr)), self.retain)

    def b_attn(self, h: Half, gb: torch.Tensor) -> None:
        """Nanobatch ``h``'s attention backward (``gb``: the reduced MLP-input gradient)."""
        _backward(h.b, gb, self.retain)
        _backward(h.h, grad_of(h.hh), self.retain)
        _backward(h.p, self.comm.gather(grad_of(h.r)), self.retain)

    def backward(self, g: torch.Tensor) -> torch.Tensor:
        """The backward schedule, the forward's mirror image: the input gradient."""
        h0, h1 = self.halves
        comm = self.comm
        self.prefix = ""
        g0, g1 = torch.tensor_split(g, 2, dim=1)
        self.b_mlp(h0, g0)
        gb0 = Pending(comm, lambda: grad_of(h0.b_in))
        with self.partition("bwd_mlp", gb0):
            self.b_mlp(h1, g1)
        gb1 = Pending(comm, lambda: grad_of(h1.b_in))
        with self.partition("bwd_attn", gb1):
            self.b_attn(h0, gb0.value())
        ga0 = Pending(comm, lambda: grad_of(h0.a_in))
        with self.partition("bwd_attn", ga0):
            self.b_attn(h1, gb1.value())
        ga1 = Pending(comm, lambda: grad_of(h1.a_in))
        ga1(None, None)  # the layer's last collective: overlaps nanobatch 0's input norm only
        _backward(h0.a, ga0.value(), self.retain)
        _backward(h1.a, ga1.value(), self.retain)
        return torch.cat([grad_of(h0.x), grad_of(h1.x)], dim=1)


def _split_mask(mask: Any, batch: int) -> list[Any]:
    """The attention mask of each nanobatch (a per-sequence mask is split, a shared one kept)."""
    if isinstance(mask, torch.Tensor) and mask.dim() >= 1 and mask.shape[0] == batch > 1:
        return list(torch.tensor_split(mask, 2, dim=0))
    return [mask, mask]


def _forward_node(ctx: Any, run: Run, x: Any, anchor: Any) -> Any:
    with torch.enable_grad():
        out = run.forward()
    ctx.run = run
    return out


def _backward_node(ctx: Any, g: Any) -> tuple[None, Any, None]:
    run, ctx.run = ctx.run, None
    run.control = run.layer.launch_control()
    with torch.enable_grad():
        grad_x = run.backward(g.contiguous())
    return None, grad_x, None


_FUNCTION: list[Any] = []


def function() -> Any:
    """The nanobatched layer as one autograd node: its backward runs the backward schedule."""
    if not _FUNCTION:
        _FUNCTION.append(
            type(
                "NanobatchFunction",
                (torch.autograd.Function,),
                {"forward": staticmethod(_forward_node), "backward": staticmethod(_backward_node)},
            )
        )
    return _FUNCTION[0]


# --------------------------------------------------------------------------------------------
# The layer
# --------------------------------------------------------------------------------------------
