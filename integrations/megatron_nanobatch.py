"""Kareus in megatron-core: a transformer layer that runs a microbatch as two overlapped nanobatches.

Kareus gains its energy by splitting each microbatch into two nanobatches with no data dependency
between them, so that one nanobatch's tensor-parallel collective runs while the other computes
(docs/kareus.md §1.3-1.4). :class:`NanobatchTransformerLayer` is megatron-core's
``TransformerLayer`` (same submodules, parameters, checkpoints) whose ``forward`` executes the
overlap plan of the running instruction; :func:`nanobatch_layer_spec` is the layer spec, used
wherever ``get_gpt_layer_local_spec()`` is::

    from powerlib.integrations.megatron import attach, nanobatch_layer_spec
    model = GPTModel(config, transformer_layer_spec=nanobatch_layer_spec(), ...)
    with powerlib.optimize(..., plan=...) as session, attach(session):
        ...                                  # megatron-core's schedules, unchanged

**When it nanobatches.** Only inside a training instruction the plan marks ``nanobatch``
(:attr:`Overlap.nanobatch <powerlib.runtime.launch_control.Overlap.nanobatch>`), while the
overlap schedule is active. Otherwise (no session, no plan, a Perseus plan, a ``sequential``
instruction, an evaluation step, a schedule that switched itself off) it *is* the stock layer:
``super().forward``. A nanobatched instruction in a configuration this layer cannot split runs
the stock layer too, with one warning naming the reason: micro-batch 1, context parallelism,
MoE, cross-attention, selective recompute of the norms or the MLP, inference, packed sequences.

**The schedule** (two nanobatches ``0`` and ``1``, split along the batch dimension ``b`` of
``[s, b, h]``). Per layer, forward::

    nb0 attention                                           (nothing in flight)
    fwd_attn : nb1 norm, qkv, rope, attention, proj   ||  nb0 attention reduce
    fwd_mlp  : nb0 bias-add, norm, fc1, act, fc2       ||  nb1 attention reduce
    fwd_mlp  : nb1 bias-add, norm, fc1, act, fc2       ||  nb0 MLP reduce
    nb0 bias-add                                       ||  nb1 MLP reduce (not a partition)

and backward, the mirror image (``bwd_mlp``: one nanobatch's MLP backward while the other's fc1
input-gradient reduce runs; ``bwd_attn``: the attention backward against the other's
fc1/qkv input-gradient reduce). Each partition is ``with overlap.partition(key, launch=...)``:
the runtime launches the other nanobatch's collective asynchronously at the plan's launch slot
(``part.slot(name)`` is announced before each slot's first kernel: from module hooks in the
forward, from gradient hooks in the backward) and joins it at the partition's end. Kareus carries
a layer's last collective into the next layer's first compute; this layer joins it inside the
layer (the block hands one finished tensor from layer to layer), so per layer and direction three
of the four collectives are overlapped by a partition.

**Collectives.** Without sequence parallelism the partition's collective is the all-reduce of the
row-parallel output (forward) or of the column-parallel input gradient (backward). With it, the
partition's collective is the reduce-scatter, and the all-gather that follows a norm (forward)
or a bias-add (backward) runs synchronously. The layer's linears run with their own collectives
off (``explicit_expert_comm``: the same GEMMs and bias handling, no communication); the layer
issues every collective itself on the tensor-parallel group (or the plan's SM-limited
communicator: :class:`~powerlib.runtime.sm_groups.SMGroups`).

**Backward.** A nanobatched forward runs under one autograd function whose backward replays the
pieces between collectives in the schedule above (``torch.autograd.backward`` per piece,
gradients accumulate into the parameters as usual). A backward instruction the plan marks
``sequential`` after a nanobatched forward runs the same pieces with each collective joined at
once. Activation recompute (``recompute_granularity="full"``) recomputes the forward inside the
backward instruction: its partitions are the plan's ``recompute_<key>`` settings.

**Numerics** equal the stock layer's up to summation order (the weight gradients are summed over
two nanobatches): ``tests/integrations/test_megatron_nanobatch.py`` checks loss and gradients
against the stock local spec on TP=2 over gloo. Dropout draws its masks in another order, so
with ``hidden_dropout > 0`` the two layers agree in distribution, not bit for bit.

:meth:`NanobatchTransformerLayer.partition_runner` is the callable
:class:`~powerlib.profiling.partition_meter.DeviceEvaluator` needs: it runs exactly one partition of
a given type under a configuration, so ``powerlib kareus search`` can measure on a device.

Requires megatron-core (tested 0.16.1-0.19.2), imported on first use: like every integration,
this module imports no framework at import time. The layer class is made then, from a mixin of
its behaviour and megatron-core's ``TransformerLayer`` (:func:`layer_class`; the module attribute
``NanobatchTransformerLayer`` is that class).
"""

from __future__ import annotations

import dataclasses
import logging
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from powerlib.errors import InvalidArgumentError
from powerlib.planning.kareus.evaluator import Measurement
from powerlib.planning.kareus.partition import Config, Op, PartitionType, Segment
from powerlib.planning.pipeline import Instruction
from powerlib.planning.plan import PartitionSetting, PlannedInstruction
from powerlib.runtime.launch_control import Overlap, OverlapSchedule
from powerlib.runtime.sm_groups import SMGroups

__all__ = [  # noqa: F822 (NanobatchTransformerLayer: made on first use, module __getattr__)
    "NanobatchTransformerLayer",
    "gpt_compute_runner",
    "group_agreement",
    "group_measurement",
    "layer_class",
    "layer_spec",
]

logger = logging.getLogger(__name__)

# The frameworks, bound by _load() on first use (no import at module level: tests/test_boundaries.py)
torch: Any = None
dist: Any = None
_MEGATRON: dict[str, Any] = {}


def _load() -> None:
    global torch, dist
    if torch is None:
        import torch as torch_module  # noqa: PLC0415
        import torch.distributed as dist_module  # noqa: PLC0415

        torch, dist = torch_module, dist_module
    if not _MEGATRON:
        from megatron.core.transformer.identity_op import IdentityOp  # noqa: PLC0415
        from megatron.core.transformer.mlp import MLP  # noqa: PLC0415
        from megatron.core.transformer.transformer_layer import TransformerLayer  # noqa: PLC0415

        _MEGATRON.update(IdentityOp=IdentityOp, MLP=MLP, TransformerLayer=TransformerLayer)


OverlapSource = Any
"""An :class:`Overlap`, an object with ``.overlap`` (a session), a zero-argument callable
returning either, or ``None``: the session attached by :func:`powerlib.integrations.megatron.attach`."""

_ATTENTION_KWARGS = ("rotary_pos_emb", "rotary_pos_cos", "rotary_pos_sin", "rotary_pos_cos_sin")
"""The layer's keyword arguments the nanobatched path passes on to self-attention."""
_IGNORED_KWARGS = ("dynamic_inference_decode_only", "padding_mask")
"""Keyword arguments only the paths it refuses read (MoE routing, inference graphs)."""

_FWD_SLOTS = {  # module -> (slot before its first kernel, slot after it)
    "linear_qkv": ("linear_0", "rope_0"),
    "core_attention": ("attn_0", None),
    "linear_proj": ("linear_1", None),
    "linear_fc1": ("linear_0", "activation_0"),
    "linear_fc2": ("linear_1", None),
}


def _warn(message: str) -> None:
    logger.warning(message)
    warnings.warn(message, RuntimeWarning, stacklevel=3)


def _resolve(source: OverlapSource) -> Overlap | None:
    """The :class:`Overlap` that governs the layer now, or ``None``."""
    if source is None:
        from powerlib.integrations.megatron import current_session  # noqa: PLC0415

        source = current_session()
        if source is None:
            return None
    if callable(source) and not isinstance(source, Overlap):
        source = source()
    if source is None or isinstance(source, Overlap):
        return source
    overlap = getattr(source, "overlap", None)
    return overlap if isinstance(overlap, Overlap) else None


# --------------------------------------------------------------------------------------------
# Collectives
# --------------------------------------------------------------------------------------------


class _Comm:
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


class _Pending:
    """One launched collective: ``launch(group, setting)`` for :meth:`Overlap.partition`."""

    def __init__(self, comm: _Comm, tensor: Callable[[], torch.Tensor]) -> None:
        self._comm = comm
        self._tensor = tensor
        self.work: Any = None
        self.result: torch.Tensor | None = None

    def __call__(self, group: Any, setting: PartitionSetting | None) -> Any:
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


def _grad(t: torch.Tensor) -> torch.Tensor:
    return t.grad if t.grad is not None else torch.zeros_like(t)


# --------------------------------------------------------------------------------------------
# One nanobatch and the schedule
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(eq=False)
class _Half:
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


class _Run:
    """One call of the nanobatched layer: its halves and the schedule over them."""

    def __init__(
        self,
        layer: Any,
        overlap: Overlap | None,
        x: torch.Tensor,
        mask: Any,
        kwargs: dict[str, Any],
        grad: bool,
        retain: bool = False,
    ) -> None:
        self.layer = layer
        self.overlap = overlap
        self.comm = layer._comm()
        self.kwargs = kwargs
        self.grad = grad
        self.retain = retain
        parts = torch.tensor_split(x, 2, dim=1)
        masks = _split_mask(mask, x.shape[1])
        self.halves = [_Half(x=_leaf(p, grad), mask=m) for p, m in zip(parts, masks, strict=True)]
        self.prefix = ""

    # -- partitions -------------------------------------------------------------------------

    @contextmanager
    def partition(self, key: str, pending: _Pending) -> Iterator[Any]:
        if self.overlap is None:
            yield None
            pending.value()
            return
        layer = self.layer
        with self.overlap.partition(self.prefix + key, pending, group=self.comm.group) as part:
            outer, layer._part = layer._part, part
            try:
                part.slot("norm_0")
                yield part
            finally:
                layer._part = outer

    # -- forward pieces ---------------------------------------------------------------------

    def attn(self, h: _Half) -> None:
        lay = self.layer
        h.a = lay.input_layernorm(h.x)
        h.a_in = _leaf(self.comm.gather(h.a.detach()), self.grad)
        with lay._local():
            h.p, h.bias1 = lay.self_attention(h.a_in, attention_mask=h.mask, **self.kwargs)
        if self.grad:
            lay._grad_slots(h.p, "linear_0")

    def mlp(self, h: _Half, r: torch.Tensor) -> None:
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

    def finish(self, h: _Half, r: torch.Tensor) -> None:
        lay = self.layer
        h.qr = _leaf(r, self.grad)
        with lay.bias_dropout_add_exec_handler():
            h.out = lay.mlp_bda(lay.training, lay.config.bias_dropout_fusion)(
                (h.qr, h.bias2), h.hh, lay.hidden_dropout
            )

    def forward(self) -> torch.Tensor:
        h0, h1 = self.halves
        comm = self.comm
        self.attn(h0)
        r0 = _Pending(comm, lambda: h0.p.detach())
        with self.partition("fwd_attn", r0):
            self.attn(h1)
        r1 = _Pending(comm, lambda: h1.p.detach())
        with self.partition("fwd_mlp", r1):
            self.mlp(h0, r0.value())
        q0 = _Pending(comm, lambda: h0.q.detach())
        with self.partition("fwd_mlp", q0):
            self.mlp(h1, r1.value())
        q1 = _Pending(comm, lambda: h1.q.detach())
        q1(None, None)  # the layer's last collective: overlaps nanobatch 0's bias-add only
        self.finish(h0, q0.value())
        self.finish(h1, q1.value())
        return torch.cat([h0.out.detach(), h1.out.detach()], dim=1)

    # -- backward pieces --------------------------------------------------------------------

    def b_mlp(self, h: _Half, g: torch.Tensor) -> None:
        _backward(h.out, g, self.retain)
        _backward(h.q, self.comm.gather(_grad(h.qr)), self.retain)

    def b_attn(self, h: _Half, gb: torch.Tensor) -> None:
        _backward(h.b, gb, self.retain)
        _backward(h.h, _grad(h.hh), self.retain)
        _backward(h.p, self.comm.gather(_grad(h.r)), self.retain)

    def backward(self, g: torch.Tensor) -> torch.Tensor:
        h0, h1 = self.halves
        comm = self.comm
        self.prefix = ""
        g0, g1 = torch.tensor_split(g, 2, dim=1)
        self.b_mlp(h0, g0)
        gb0 = _Pending(comm, lambda: _grad(h0.b_in))
        with self.partition("bwd_mlp", gb0):
            self.b_mlp(h1, g1)
        gb1 = _Pending(comm, lambda: _grad(h1.b_in))
        with self.partition("bwd_attn", gb1):
            self.b_attn(h0, gb0.value())
        ga0 = _Pending(comm, lambda: _grad(h0.a_in))
        with self.partition("bwd_attn", ga0):
            self.b_attn(h1, gb1.value())
        ga1 = _Pending(comm, lambda: _grad(h1.a_in))
        ga1(None, None)  # the layer's last collective: overlaps nanobatch 0's input norm only
        _backward(h0.a, ga0.value(), self.retain)
        _backward(h1.a, ga1.value(), self.retain)
        return torch.cat([_grad(h0.x), _grad(h1.x)], dim=1)


def _split_mask(mask: Any, batch: int) -> list[Any]:
    """The attention mask of each nanobatch (a per-sequence mask is split, a shared one kept)."""
    if isinstance(mask, torch.Tensor) and mask.dim() >= 1 and mask.shape[0] == batch > 1:
        return list(torch.tensor_split(mask, 2, dim=0))
    return [mask, mask]


def _forward_node(ctx: Any, run: _Run, x: Any, anchor: Any) -> Any:  # noqa: ARG001
    with torch.enable_grad():
        out = run.forward()
    ctx.run = run
    return out


def _backward_node(ctx: Any, g: Any) -> tuple[None, Any, None]:
    run, ctx.run = ctx.run, None
    run.overlap = _resolve(run.layer._overlap_source)
    with torch.enable_grad():
        grad_x = run.backward(g.contiguous())
    return None, grad_x, None


_FUNCTION: list[Any] = []


def _function() -> Any:
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


class _NanobatchLayer:
    """The behaviour of :class:`NanobatchTransformerLayer` (a mixin before ``TransformerLayer``).

    megatron-core's ``TransformerLayer`` that executes Kareus overlap plans (module doc).

    Args:
        *args: ``TransformerLayer``'s arguments (config, submodules, layer_number, ...).
        overlap: Where the overlap plan comes from (an :class:`Overlap`, a session, a callable
            returning either); default: the session :func:`~powerlib.integrations.megatron.attach`
            attached.
        **kwargs: ``TransformerLayer``'s keyword arguments.
    """

    def __init__(self, *args: Any, overlap: OverlapSource = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._overlap_source = overlap
        self._part: Any = None  # the partition whose slots the hooks announce
        self._warned: set[str] = set()
        self._hooks = []
        for owner in (self.self_attention, self.mlp):
            for name, (before, after) in _FWD_SLOTS.items():
                module = getattr(owner, name, None)
                if module is not None:
                    self._hooks.append(module.register_forward_pre_hook(self._slot_hook(before)))
                    if after is not None:
                        self._hooks.append(module.register_forward_hook(self._after_hook(after)))
        self._bwd_hooks_on = False

    # -- slot announcements -----------------------------------------------------------------

    def _announce(self, name: str) -> None:
        part = self._part
        if part is not None:
            part.slot(name)

    def _slot_hook(self, name: str) -> Callable[..., None]:
        def hook(module: Any, args: Any) -> None:
            self._announce(name)
            if self._bwd_hooks_on:
                self._input_grad_slot(module, args)

        return hook

    def _after_hook(self, name: str) -> Callable[..., None]:
        def hook(module: Any, args: Any, output: Any) -> None:
            self._announce(name)
            if self._bwd_hooks_on and type(module).__name__.startswith("Column"):
                out = output[0] if isinstance(output, tuple) else output
                self._grad_slots(out, "linear_1")  # fc1 / qkv output: their backward's slot

        return hook

    def _input_grad_slot(self, module: Any, args: Any) -> None:
        """Backward slots on module inputs: attention's before rope, fc2's before activation."""
        first = args[0] if args else None
        if not isinstance(first, torch.Tensor):
            return
        if module is getattr(self.self_attention, "core_attention", None):
            self._grad_slots(first, "rope_0")
        elif module is getattr(self.self_attention, "linear_proj", None):
            self._grad_slots(first, "attn_0")
        elif module is getattr(self.mlp, "linear_fc2", None):
            self._grad_slots(first, "activation_0")

    def _grad_slots(self, t: torch.Tensor, name: str) -> None:
        """Announce backward slot ``name`` when ``t``'s gradient arrives."""
        if t.requires_grad:

            def hook(g: torch.Tensor) -> torch.Tensor:
                self._announce(name)
                return g

            t.register_hook(hook)

    # -- comm-free linears ------------------------------------------------------------------

    def _linears(self) -> list[Any]:
        names = (("self_attention", "linear_qkv"), ("self_attention", "linear_proj"),
                 ("mlp", "linear_fc1"), ("mlp", "linear_fc2"))  # fmt: skip
        return [getattr(getattr(self, a), b) for a, b in names]

    @contextmanager
    def _local(self) -> Iterator[None]:
        """The linears without their own collectives (megatron's expert-parallel flag)."""
        linears = self._linears()
        saved = [lin.explicit_expert_comm for lin in linears]
        self._bwd_hooks_on = torch.is_grad_enabled()
        try:
            for lin in linears:
                lin.explicit_expert_comm = True
            yield
        finally:
            self._bwd_hooks_on = False
            for lin, s in zip(linears, saved, strict=True):
                lin.explicit_expert_comm = s

    def _comm(self) -> _Comm:
        return _Comm(self.tp_group, self.config.sequence_parallel)

    # -- when it nanobatches ----------------------------------------------------------------

    def unsupported(self, hidden_states: torch.Tensor, kwargs: dict[str, Any]) -> str | None:
        """Why this call cannot be nanobatched, or ``None``."""
        cfg = self.config
        if hidden_states.dim() != 3:
            return f"the layer input has shape {tuple(hidden_states.shape)}, not [s, b, h]"
        if hidden_states.shape[1] < 2:
            return f"a micro-batch of {hidden_states.shape[1]} cannot be split into two nanobatches"
        if getattr(cfg, "context_parallel_size", 1) > 1:
            return "context parallelism (splitting along the sequence is not implemented)"
        if not isinstance(self.mlp, _MEGATRON["MLP"]):
            return "the MLP is not megatron's dense MLP (MoE)"
        if not isinstance(self.cross_attention, _MEGATRON["IdentityOp"]):
            return "cross-attention"
        if type(self.self_attention).__name__ != "SelfAttention":
            return f"{type(self.self_attention).__name__} (only SelfAttention)"
        if self.recompute_input_layernorm or self.recompute_pre_mlp_layernorm or self.recompute_mlp:
            return "selective recompute of the norms or the MLP"
        if getattr(cfg, "fp8", None) or getattr(cfg, "fp4", None):
            return "fp8/fp4"
        for name, value in kwargs.items():
            if value is not None and name not in _ATTENTION_KWARGS and name not in _IGNORED_KWARGS:
                return f"{name}="
        if any(getattr(lin, "explicit_expert_comm", None) is None for lin in self._linears()):
            return "this megatron-core's linears have no explicit_expert_comm"
        if not (
            self.self_attention.linear_proj.skip_bias_add and self.mlp.linear_fc2.skip_bias_add
        ):
            return "row-parallel linears that add their own bias"
        return None

    def _nanobatched(self, hidden_states: torch.Tensor, kwargs: dict[str, Any]) -> Overlap | None:
        if not self.training:
            return None
        overlap = _resolve(self._overlap_source)
        if overlap is None or not overlap.active or not overlap.nanobatch:
            return None
        reason = self.unsupported(hidden_states, kwargs)
        if reason is not None:
            if reason not in self._warned:
                self._warned.add(reason)
                _warn(
                    f"powerlib: layer {self.layer_number} runs the plan's nanobatched instructions "
                    f"as the stock layer: {reason}"
                )
            return None
        return overlap

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """``TransformerLayer.forward``; nanobatched when the running instruction is (module doc)."""
        names = ("hidden_states", "attention_mask", "context", "context_mask", "rotary_pos_emb")
        bound = dict(zip(names, args))
        bound.update(kwargs)
        x = bound.pop("hidden_states", None)
        mask = bound.pop("attention_mask", None)
        overlap = self._nanobatched(x, bound) if isinstance(x, torch.Tensor) else None
        if overlap is None:
            return super().forward(*args, **kwargs)
        attn_kwargs = {k: v for k, v in bound.items() if k in _ATTENTION_KWARGS and v is not None}
        grad = torch.is_grad_enabled()
        run = _Run(self, overlap, x, mask, attn_kwargs, grad)
        current = overlap.current
        if current is not None and current.instruction.kind != "forward":
            run.prefix = "recompute_"  # a forward inside a backward instruction: recompute
        if not grad:
            return run.forward(), None
        anchor = torch.empty(0, requires_grad=True)  # the node runs even if x needs no gradient
        return _function().apply(run, x, anchor), None

    # -- measuring partitions ---------------------------------------------------------------

    def partition_runner(
        self,
        hidden_states: torch.Tensor,
        *,
        attention_mask: Any = None,
        synchronize: Callable[[], None] | None = None,
        groups: SMGroups | None = None,
        group_ranks: Sequence[Sequence[int]] | None = None,
        **attention_kwargs: Any,
    ) -> Callable[[PartitionType, Config], Overlap]:
        """``run(ptype, config)`` for :class:`~powerlib.profiling.partition_meter.DeviceEvaluator`.

        Each call runs exactly one partition of type ``ptype.key`` (``fwd_attn``, ``fwd_mlp``,
        ``bwd_mlp``, ``bwd_attn``; a ``recompute_`` key runs its forward type) on one microbatch
        ``hidden_states`` ``[s, b, h]``: the compute of one nanobatch with the other's collective
        launched at ``config.slot`` on a ``config.sm_count``-SM communicator and joined at the
        end, then ``synchronize()`` (default: ``torch.cuda.synchronize`` on CUDA). What comes
        before the partition (the other nanobatch's compute, the forward of a backward partition)
        runs once, when the runner is made. Returns the one-instruction :class:`Overlap` it ran
        under (its ``records`` say where the collective launched).

        Collective on the tensor-parallel group: every rank of it runs the same partitions in the
        same order; on NCCL each new SM count creates its communicator on first use
        (``new_group`` over ``group_ranks``, default the layer's tensor-parallel group: every rank
        of the job must then be in that group or take part alike). The parameter gradients the
        backward partitions accumulate are cleared after each call: measure outside a training
        step.

        Args:
            hidden_states: One microbatch of layer input.
            attention_mask: Its attention mask.
            synchronize: Waits for the device after each run.
            groups: The SM-limited communicators to use (default: new ones).
            group_ranks: Global ranks of the groups :meth:`SMGroups.prepare` creates.
            **attention_kwargs: ``rotary_pos_emb=`` and the like, as the block passes them.

        Raises:
            InvalidArgumentError: This layer cannot nanobatch ``hidden_states``.
        """
        reason = self.unsupported(hidden_states, attention_kwargs)
        if reason is not None:
            raise InvalidArgumentError(f"this layer cannot nanobatch the given input: {reason}")
        if synchronize is None:
            synchronize = torch.cuda.synchronize if hidden_states.is_cuda else (lambda: None)
        groups = groups if groups is not None else SMGroups()
        if group_ranks is None and dist.is_initialized():
            group_ranks = [dist.get_process_group_ranks(self.tp_group)]
        prepared: set[int] = set()
        run = _Run(self, None, hidden_states, attention_mask, attention_kwargs, True, retain=True)
        h0, h1 = run.halves
        comm = run.comm

        def reduced(t: torch.Tensor) -> torch.Tensor:
            return comm.reduce(t.detach().clone(), async_op=False)[1]

        params = [p for p in self.parameters() if p.requires_grad]
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
            gb0 = reduced(_grad(h0.b_in))
        bodies: dict[str, tuple[Callable[[], torch.Tensor], Callable[[], None]]] = {
            "fwd_attn": (lambda: h0.p.detach(), lambda: run.attn(h1)),
            "fwd_mlp": (lambda: h1.p.detach(), lambda: run.mlp(h0, r0)),
            "bwd_mlp": (lambda: _grad(h0.b_in), lambda: run.b_mlp(h1, g)),
            "bwd_attn": (lambda: _grad(h1.b_in), lambda: run.b_attn(h0, gb0)),
        }

        def clear() -> None:
            for p in params:
                p.grad = None
            for h in (h0, h1):
                for t in (h.x, h.a_in, h.r, h.hh, h.b_in, h.qr):
                    if t is not None:
                        t.grad = None

        clear()

        def run_partition(ptype: PartitionType, config: Config) -> Overlap:
            key = ptype.key.removeprefix("recompute_")
            if key not in bodies:
                raise InvalidArgumentError(
                    f"partition type {ptype.key!r}: this layer runs {', '.join(bodies)}"
                )
            source, compute = bodies[key]
            kind = "forward" if key.startswith("fwd") else "backward"
            sm = int(config.sm_count)
            planned = PlannedInstruction(
                instruction=Instruction(stage=0, microbatch=0, kind=kind),
                freq_mhz=float(config.freq_mhz),
                execution="nanobatch",
                overlap={key: PartitionSetting(slot=config.slot, sm_count=sm)},
            )
            measured = Overlap(OverlapSchedule([planned], source="partition_runner"), groups=groups)
            if sm not in prepared:
                groups.prepare({sm}, group_ranks)
                prepared.add(sm)
            measured.begin(kind, 0)
            run.overlap = measured
            pending = _Pending(comm, lambda: source().clone())
            try:
                with torch.enable_grad(), run.partition(key, pending):
                    compute()
                pending.value()
            finally:
                measured.end()
                run.overlap = None
                clear()
            synchronize()
            return measured

        return run_partition

    def sequential_runner(
        self,
        hidden_states: torch.Tensor,
        *,
        attention_mask: Any = None,
        synchronize: Callable[[], None] | None = None,
        **attention_kwargs: Any,
    ) -> Callable[[tuple[Segment, ...], float, int], None]:
        """``run_sequential(segments, freq_mhz, sm_count)`` for ``DeviceEvaluator``.

        One execution of the *stock* layer on ``hidden_states`` (a whole microbatch, no
        nanobatches): its forward for forward segments, its backward (on a forward kept for
        it) for backward segments, with megatron-core's own collectives on the tensor-parallel
        group (``sm_count`` is not applied: the stock collective keeps the default communicator).
        Parameter gradients are cleared after each call.
        """
        stock = _MEGATRON["TransformerLayer"].forward
        if synchronize is None:
            synchronize = torch.cuda.synchronize if hidden_states.is_cuda else (lambda: None)
        params = [p for p in self.parameters() if p.requires_grad]
        x = hidden_states.detach().requires_grad_(True)
        with torch.enable_grad():
            kept, _ = stock(self, x, attention_mask=attention_mask, **attention_kwargs)
        g = torch.ones_like(kept)

        def run(segments: tuple[Segment, ...], freq_mhz: float, sm_count: int) -> None:
            backward = any(op.name.endswith("_bwd") for seg in segments for op in seg.ops)
            with torch.enable_grad():
                if backward:
                    torch.autograd.backward(kept, g, retain_graph=True)
                else:
                    stock(self, x, attention_mask=attention_mask, **attention_kwargs)
            for p in params:
                p.grad = None
            x.grad = None
            synchronize()

        return run


def gpt_compute_runner(
    model: Any,
    tokens: Any,
    positions: Any,
    labels: Any,
    *,
    synchronize: Callable[[], None] | None = None,
) -> Callable[[tuple[Op, ...], float], None]:
    """``run_compute(ops, freq_mhz)`` for ``DeviceEvaluator``: a GPT's work outside its layers.

    The partition model's non-layer work (:mod:`powerlib.planning.kareus.partition`) is the
    embedding on the first stage and the output layer and loss on the last: ``ops`` named
    ``embedding`` / ``output_layer`` / ``loss`` run ``model.embedding`` and (final norm,)
    ``model.output_layer`` and ``model.compute_language_model_loss`` forward; ``*_bwd`` names
    run the embedding's and the output layer's backward on a forward kept for it. ``model`` is a megatron-core ``GPTModel`` built
    with ``pre_process`` and ``post_process`` (a one-layer model for measuring is enough).
    """
    _load()
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
    _load()

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
    """``agree`` for :class:`~powerlib.profiling.partition_meter.DeviceEvaluator` over ``group``.

    Every rank of a tensor-parallel group must run a partition as many times as the others (its
    collectives pair up): the group stops when every rank's time is up (an all-reduce MIN).
    """
    _load()

    def agree(done: bool) -> bool:
        flag = torch.tensor([1 if done else 0], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
        return bool(flag.item())

    return agree


_CLASS: list[type] = []


def layer_class() -> type:
    """``NanobatchTransformerLayer``: the mixin over megatron-core's ``TransformerLayer``."""
    if not _CLASS:
        _load()
        _CLASS.append(
            type(
                "NanobatchTransformerLayer",
                (_NanobatchLayer, _MEGATRON["TransformerLayer"]),
                {"__module__": __name__, "__doc__": _NanobatchLayer.__doc__},
            )
        )
    return _CLASS[0]


def __getattr__(name: str) -> Any:
    if name == "NanobatchTransformerLayer":
        return layer_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def layer_spec(overlap: OverlapSource = None, **local_spec_kwargs: Any) -> Any:
    """``get_gpt_layer_local_spec(**local_spec_kwargs)`` with :class:`NanobatchTransformerLayer`.

    Args:
        overlap: Where the layers take the overlap plan from (:class:`NanobatchTransformerLayer`).
        **local_spec_kwargs: Passed to ``get_gpt_layer_local_spec`` (``normalization=``,
            ``qk_layernorm=``, ...). MoE specs build, but their layers run the stock path.
    """
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: PLC0415

    spec = get_gpt_layer_local_spec(**local_spec_kwargs)
    params = dict(spec.params or {})
    params["overlap"] = overlap
    return dataclasses.replace(spec, module=layer_class(), params=params)
