"""torch.distributed: ``torch.distributed.pipelining`` schedules and hand-written loops.

Two one-line hookups inside a session (docs/frameworks.md §2.3, §2.4)::

    with powerlib.optimize(num_stages=P, num_microbatches=M) as session:
        with attach_pipeline(session, schedule):
            for batch in loader:
                schedule.step(...)                 # every F/B of every local stage is an instruction

    with powerlib.optimize(...) as session, attach_module(session, model, optimizer):
        for batch in loader:                       # DDP/FSDP: forward and backward of ``model``
            loss_fn(model(x), y).backward()        # per microbatch, optimizer.step() ends the step
            optimizer.step()

``attach_pipeline`` wraps each local ``PipelineStage``'s ``forward_one_chunk`` (F),
``backward_one_chunk`` (B, or I when ``full_backward=False``) and ``backward_weight_one_chunk``
(W) (instance attributes, removed on exit) and the schedule's ``step``. The receive waits happen
before those calls, so the bracketed span is compute only. The chunk of a stage is its position
among the rank's stages: ``stage_index = c*P + rank`` for looped schedules, stages ``rank`` and
``2P-1-rank`` for V schedules (ZBVZeroBubble, DualPipeV), which the session is told through
``set_layout``. The session records the order these hooks see in the profile phase and plans on
it, so nothing relies on ``pipeline_order`` (wrong for the last stage of ``Schedule1F1B`` in torch
2.13); zero-bubble and V schedules are planned on the recorded order only (``schedule="recorded"``).
DualPipeV's ``OVERLAP_F_B`` runs its F and B one after the other, and they are hooked as such.
``schedule.eval()`` (forward-only ``step`` with the loss's backward off; torchtitan's validation
calls it) is neither recorded nor counted as an iteration.

Pure glue: no planning and no device calls; torch is imported lazily; ``enabled=False`` (or no
session) makes both a no-op.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

from powerlib.errors import NotSupportedError

__all__ = ["attach_module", "attach_pipeline"]


def _local_stages(schedule: Any) -> list[Any]:
    stages = getattr(schedule, "_stages", None)
    if stages is None:
        stage = getattr(schedule, "_stage", None)
        if stage is None:
            raise NotSupportedError(
                f"{type(schedule).__name__} has neither _stage nor _stages: not a "
                "torch.distributed.pipelining schedule this integration knows (tested: torch 2.13)"
            )
        stages = [stage]
    return sorted(stages, key=lambda s: s.stage_index)


def _splits_backward(schedule: Any) -> bool:
    order = getattr(schedule, "pipeline_order", None) or {}
    for actions in order.values():
        for action in actions or ():
            kind = getattr(getattr(action, "computation_type", None), "value", None)
            if kind in ("I", "W", "OVERLAP_F_B"):
                return True
    return False


def _placement(stages: list[Any], num_ranks: int, rank: int) -> str:
    """``looped`` or ``v``, from the stage indices this rank holds."""
    ids = [s.stage_index for s in stages]
    if ids == [c * num_ranks + rank for c in range(len(ids))]:
        return "looped"
    if ids == [rank, 2 * num_ranks - 1 - rank]:
        return "v"
    raise NotSupportedError(
        f"rank {rank} holds stages {ids}: neither looped (rank + c*{num_ranks}) nor V "
        f"({rank} and {2 * num_ranks - 1 - rank}); powerlib cannot label their chunks"
    )


def _training(schedule: Any) -> bool:
    """Whether ``schedule`` runs a training step, not ``eval()``.

    ``eval()`` (torchtitan's validation calls it) runs ``step()`` with the loss's backward off
    (``_has_backward``): forwards only, neither instructions nor an iteration.
    """
    return bool(getattr(schedule, "_has_backward", True))


def _wrap(
    session: Any, schedule: Any, kind: str, chunk: int, method: Callable[..., Any]
) -> Callable[..., Any]:
    @functools.wraps(method)
    def hooked(microbatch: int, *args: Any, **kwargs: Any) -> Any:
        if not _training(schedule):  # schedule.eval(): not instructions of an iteration
            return method(microbatch, *args, **kwargs)
        if kind == "backward" and kwargs.get("full_backward", True) is False:
            session.begin("backward_input", microbatch, chunk)
        else:
            session.begin(kind, microbatch, chunk)
        try:
            return method(microbatch, *args, **kwargs)
        finally:
            session.end()

    return hooked


@contextlib.contextmanager
def attach_pipeline(session: Any, schedule: Any, *, enabled: bool = True) -> Iterator[None]:
    """Drive ``session``'s hooks from a ``torch.distributed.pipelining`` schedule.

    Args:
        session: The :class:`powerlib.Session` of this rank (its ``stage`` is the pp rank).
        schedule: A ``PipelineScheduleSingle`` (GPipe, 1F1B) or multi-stage schedule
            (Interleaved1F1B, LoopedBFS, InterleavedZeroBubble, ZBVZeroBubble, DualPipeV) built
            over this rank's ``PipelineStage`` objects.
        enabled: ``False`` attaches nothing.

    Raises:
        NotSupportedError: The schedule is not a pipelining schedule, or its stages are placed
            neither looped nor V.
    """
    if not enabled or session is None:
        yield
        return
    stages = _local_stages(schedule)
    workload = session.config.workload
    num_ranks = workload.num_stages
    placement = _placement(stages, num_ranks, stages[0].stage_index % num_ranks)
    name = workload.layout.schedule
    if (
        _splits_backward(schedule)
        or placement == "v"
        or (len(stages) > 1) != (name == "interleaved")
    ):
        name = "recorded"  # no built-in order fits: plan on what the hooks see
    session.set_layout(schedule=name, num_chunks=len(stages), placement=placement)
    patched: list[tuple[Any, str]] = []
    try:
        for chunk, stage in enumerate(stages):
            for method, kind in (
                ("forward_one_chunk", "forward"),
                ("backward_one_chunk", "backward"),
                ("backward_weight_one_chunk", "backward_weight"),
            ):
                setattr(
                    stage, method, _wrap(session, schedule, kind, chunk, getattr(stage, method))
                )
                patched.append((stage, method))
        step = schedule.step

        @functools.wraps(step)
        def hooked_step(*args: Any, **kwargs: Any) -> Any:
            if not _training(schedule):  # schedule.eval(): not a training iteration
                return step(*args, **kwargs)
            result = step(*args, **kwargs)
            session.step()
            return result

        schedule.step = hooked_step
        patched.append((schedule, "step"))
        yield
    finally:
        for obj, name in reversed(patched):
            with contextlib.suppress(AttributeError):
                delattr(obj, name)


@contextlib.contextmanager
def attach_module(
    session: Any, model: Any, optimizer: Any, *, enabled: bool = True
) -> Iterator[None]:
    """Drive ``session``'s hooks from a module (DDP/FSDP or plain) and its optimizer.

    Each forward of ``model`` is instruction ``forward`` of the next microbatch; the backward
    through it is ``backward`` of the same microbatch, from the gradient reaching the output to
    the last parameter gradient accumulated (tensor and post-accumulate-grad hooks: module
    backward hooks warn when the input needs no gradient); ``optimizer.step()`` ends the iteration. Gradient accumulation gives several microbatches per
    step. Stage is the session's (0 without pipelining).

    Args:
        session: This rank's :class:`powerlib.Session`.
        model: A ``torch.nn.Module`` (the DDP/FSDP wrapper or the plain module).
        optimizer: Its ``torch.optim.Optimizer``.
        enabled: ``False`` attaches nothing.
    """
    if not enabled or session is None:
        yield
        return
    state = {"mb": 0, "grads": 0}
    params = [p for p in model.parameters() if p.requires_grad]

    def fwd_pre(module: Any, args: Any) -> None:
        session.begin("forward", state["mb"])

    def fwd_post(module: Any, args: Any, output: Any) -> None:
        session.end()
        outputs = output if isinstance(output, (tuple, list)) else (output,)
        for out in outputs:  # the gradient reaching the output starts the module's backward
            if getattr(out, "requires_grad", False):
                mb = state["mb"]
                out.register_hook(lambda grad, mb=mb: session.begin("backward", mb))
                break

    def grad_done(param: Any) -> None:  # the last parameter gradient ends it
        state["grads"] += 1
        if state["grads"] == len(params):
            state["grads"] = 0
            session.end()
            state["mb"] += 1

    def opt_post(opt: Any, args: Any, kwargs: Any) -> None:
        state["mb"] = state["grads"] = 0
        session.step()

    handles = [
        model.register_forward_pre_hook(fwd_pre),
        model.register_forward_hook(fwd_post),
        optimizer.register_step_post_hook(opt_post),
        *(p.register_post_accumulate_grad_hook(grad_done) for p in params),
    ]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
