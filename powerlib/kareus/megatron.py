"""Kareus in megatron-core: a transformer layer that runs a microbatch as two overlapped nanobatches.

Kareus gains its energy by splitting each microbatch into two nanobatches with no data dependency
between them, so that one nanobatch's tensor-parallel collective runs while the other computes
(docs/kareus.md §1.3-1.4). :class:`NanobatchTransformerLayer` is megatron-core's
``TransformerLayer`` (same submodules, parameters, checkpoints) whose ``forward`` executes the
Kareus plan of the running instruction; :func:`nanobatch_layer_spec` is the layer spec, used
wherever ``get_gpt_layer_local_spec()`` is::

    from powerlib.integrations.megatron import attach
    from powerlib.kareus.megatron import nanobatch_layer_spec
    model = GPTModel(config, transformer_layer_spec=nanobatch_layer_spec(), ...)
    session = powerlib.optimize(..., mode="apply", plan_path="kareus_plan.json")
    with session, attach(session):
        ...                                  # megatron-core's schedules, unchanged

The session adds Kareus's registered launch control when the Kareus plan arrives
(:func:`powerlib.kareus.launch.for_partition_plans`), on Megatron's tensor-parallel groups; the
same holds with Megatron-LM's ``train()`` (``powerlib.integrations.megatron.patch_training``).
``powerlib.kareus.launch.attach(session, group_ranks=...)`` before the ``with`` chooses other
groups.

**When it nanobatches.** Only inside a training instruction the plan marks ``nanobatch``
(:attr:`LaunchControl.nanobatch <powerlib.kareus.launch.LaunchControl.nanobatch>`), while the
partition schedule is active. Otherwise (no session, no plan, a Perseus plan, a ``sequential``
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
fc1/qkv input-gradient reduce). Each partition is ``with control.partition(key, launch=...)``:
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
communicator: :class:`~powerlib.kareus.sm_groups.SMGroups`).

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
:class:`~powerlib.kareus.meter.DeviceEvaluator` needs: it runs exactly one partition of
a given type under a configuration, so ``powerlib kareus search`` can measure on a device.

The run of one call (the two nanobatches, their collectives, the autograd node) is in
:mod:`powerlib.kareus.megatron_run`; measuring a GPT's other components in
:mod:`powerlib.kareus.megatron_measure`.

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
from typing import TYPE_CHECKING, Any

from powerlib.errors import InvalidArgumentError
from powerlib.kareus import megatron_run as _run
from powerlib.kareus.launch import LaunchControl, active_control
from powerlib.kareus.megatron_measure import PartitionRunner
from powerlib.kareus.megatron_run import Run, function, load
from powerlib.kareus.partition_types import Config, PartitionType, Segment
from powerlib.kareus.sm_groups import SMGroups

__all__ = [  # noqa: F822 (NanobatchTransformerLayer: made on first use, module __getattr__)
    "ControlSource",
    "NanobatchTransformerLayer",
    "layer_class",
    "nanobatch_layer_spec",
]

logger = logging.getLogger(__name__)

# torch and torch.distributed, bound by _load() on first use (megatron_run holds the imports)
torch: Any = None
dist: Any = None


def _load() -> None:
    global torch, dist
    load()
    torch, dist = _run.torch, _run.dist


ControlSource = Any
"""A :class:`~powerlib.kareus.launch.LaunchControl`, a session (its launch control), a
zero-argument callable returning either, or ``None``: :func:`~powerlib.kareus.launch.active_control`
(the launch control of the innermost open session that applied a plan to it)."""

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


def _resolve(source: ControlSource) -> LaunchControl | None:
    """The :class:`LaunchControl` that governs the layer now, or ``None``."""
    if source is None:
        return active_control()
    if callable(source) and not isinstance(source, LaunchControl):
        source = source()
    if source is None or isinstance(source, LaunchControl):
        return source
    for listener in getattr(source, "instruction_listeners", ()):
        if isinstance(listener, LaunchControl):
            return listener
    return None


if TYPE_CHECKING:

    class _TransformerLayer:
        """What the mixin uses of megatron-core's ``TransformerLayer`` (its base at run time)."""

        config: Any
        tp_group: Any
        layer_number: int
        training: bool
        self_attention: Any
        cross_attention: Any
        mlp: Any
        recompute_input_layernorm: bool
        recompute_pre_mlp_layernorm: bool
        recompute_mlp: bool

        def __init__(self, *args: Any, **kwargs: Any) -> None: ...
        def parameters(self) -> Iterator[Any]: ...
        def forward(self, *args: Any, **kwargs: Any) -> Any: ...

else:
    _TransformerLayer = object


class _NanobatchLayer(_TransformerLayer):
    """The behaviour of :class:`NanobatchTransformerLayer` (a mixin before ``TransformerLayer``).

    megatron-core's ``TransformerLayer`` that executes Kareus plans (module doc).

    Args:
        *args: ``TransformerLayer``'s arguments (config, submodules, layer_number, ...).
        control: Where the plan comes from (:data:`ControlSource`): a
            :class:`~powerlib.kareus.launch.LaunchControl`, a session, a callable returning
            either; default: :func:`~powerlib.kareus.launch.active_control`.
        **kwargs: ``TransformerLayer``'s keyword arguments.
    """

    def __init__(self, *args: Any, control: ControlSource = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._control_source = control
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

    def _comm(self) -> _run.Comm:
        return _run.Comm(self.tp_group, self.config.sequence_parallel)

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
        megatron = load()
        if not isinstance(self.mlp, megatron.mlp):
            return "the MLP is not megatron's dense MLP (MoE)"
        if not isinstance(self.cross_attention, megatron.identity_op):
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

    def launch_control(self) -> LaunchControl | None:
        """The :class:`~powerlib.kareus.launch.LaunchControl` that governs the layer now."""
        return _resolve(self._control_source)

    def _nanobatched(
        self, hidden_states: torch.Tensor, kwargs: dict[str, Any]
    ) -> LaunchControl | None:
        if not self.training:
            return None
        control = self.launch_control()
        if control is None or not control.active or not control.nanobatch:
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
        return control

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """``TransformerLayer.forward``; nanobatched when the running instruction is (module doc)."""
        names = ("hidden_states", "attention_mask", "context", "context_mask", "rotary_pos_emb")
        bound = dict(zip(names, args))
        bound.update(kwargs)
        x = bound.pop("hidden_states", None)
        mask = bound.pop("attention_mask", None)
        control = self._nanobatched(x, bound) if isinstance(x, torch.Tensor) else None
        if control is None:
            return super().forward(*args, **kwargs)
        attn_kwargs = {k: v for k, v in bound.items() if k in _ATTENTION_KWARGS and v is not None}
        grad = torch.is_grad_enabled()
        run = Run(self, control, x, mask, attn_kwargs, grad)
        current = control.current
        if current is not None and current.instruction.kind != "forward":
            run.prefix = "recompute_"  # a forward inside a backward instruction: recompute
        if not grad:
            return run.forward(), None
        anchor = torch.empty(0, requires_grad=True)  # the node runs even if x needs no gradient
        return function().apply(run, x, anchor), None

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
    ) -> Callable[[PartitionType, Config], LaunchControl]:
        """``run(ptype, config)`` for :class:`~powerlib.kareus.meter.DeviceEvaluator`.

        Each call runs exactly one partition of type ``ptype.key`` (``fwd_attn``, ``fwd_mlp``,
        ``bwd_mlp``, ``bwd_attn``; a ``recompute_`` key runs its forward type) on one microbatch
        ``hidden_states`` ``[s, b, h]``: the compute of one nanobatch with the other's collective
        launched at ``config.slot`` on a ``config.sm_count``-SM communicator and joined at the
        end, then ``synchronize()`` (default: ``torch.cuda.synchronize`` on CUDA). What comes
        before the partition (the other nanobatch's compute, the forward of a backward partition)
        runs once, when the runner is made. Returns the one-instruction launch control it ran
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
        run = Run(self, None, hidden_states, attention_mask, attention_kwargs, True, retain=True)
        params = [p for p in self.parameters() if p.requires_grad]
        return PartitionRunner(run, params, groups, group_ranks, synchronize)

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
        stock = load().transformer_layer.forward
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


_CLASS: list[type] = []


def layer_class() -> type:
    """``NanobatchTransformerLayer``: the mixin over megatron-core's ``TransformerLayer``."""
    if not _CLASS:
        _load()
        _CLASS.append(
            type(
                "NanobatchTransformerLayer",
                (_NanobatchLayer, load().transformer_layer),
                {"__module__": __name__, "__doc__": _NanobatchLayer.__doc__},
            )
        )
    return _CLASS[0]


def __getattr__(name: str) -> Any:
    if name == "NanobatchTransformerLayer":
        return layer_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def nanobatch_layer_spec(control: ControlSource = None, **local_spec_kwargs: Any) -> Any:
    """A layer spec whose layers execute Kareus plans (two overlapped nanobatches).

    ``get_gpt_layer_local_spec(**local_spec_kwargs)`` with megatron-core's ``TransformerLayer``
    replaced by :class:`NanobatchTransformerLayer`: use it wherever the local spec is
    (``GPTModel(config, transformer_layer_spec=...)``). The layers follow the plan of the launch
    control attached to the running session (:func:`powerlib.kareus.launch.attach`), or ``control``;
    without a plan, or in a ``sequential`` instruction, they are the stock layer.

    Args:
        control: Where the layers take the plan from (:class:`NanobatchTransformerLayer`).
        **local_spec_kwargs: Passed to ``get_gpt_layer_local_spec`` (``normalization=``,
            ``qk_layernorm=``, ...). MoE specs build, but their layers run the stock path.
    """
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: PLC0415 - optional dependency, imported where used

    spec = get_gpt_layer_local_spec(**local_spec_kwargs)
    params = dict(spec.params or {})
    params["control"] = control
    return dataclasses.replace(spec, module=layer_class(), params=params)
