"""DeepSpeed: the pipeline engine (``TrainSchedule``, DualPipeV) and ZeRO engines without PP.

One line inside the session hooks an engine (docs/frameworks.md §2.2)::

    with powerlib.optimize(num_stages=P, num_microbatches=M, stage=engine.stage_id) as session:
        with attach_pipeline(session, engine):       # engine from deepspeed.initialize
            for _ in range(steps):
                engine.train_batch(data_iter)        # every ForwardPass/BackwardPass is one

    with powerlib.optimize(num_stages=1, num_microbatches=GAS, stage=0) as session:
        with attach_engine(session, engine):         # ZeRO-0/1/2/3 without pipelining
            for x, y in loader:
                engine.backward(loss_fn(engine(x), y))   # F and B of microbatch i (also
                engine.step()                        # scale(loss).backward()); the boundary ends it

``attach_pipeline`` wraps the F/B entries of a copy of the engine class's ``_INSTRUCTION_MAP``
(patching ``_exec_forward_pass`` has no effect: the map holds the original functions) and the
engine's ``train_batch``; send/receive are separate instructions, so the span is compute only.
The microbatch is counted per ``train_batch`` (instructions carry only ``buffer_id``);
DualPipeV's carry ``phase`` and ``buffer_id = phase * M + mb``: chunk = phase (chunk 0 holds
model piece ``r``, chunk 1 piece ``2P - 1 - r``: the V placement, planned on the recorded order).

Tested: deepspeed 0.19.8, torch 2.13 CPU, gloo (PP=2, PP2xDP2, DualPipeV on 2 ranks, ZeRO-1
with DP=2). Limits: the pipeline engine refuses ZeRO-2/3; ``eval_batch`` and forwards without
gradients are not hooked (they run at whatever clock is in force); the ZeRO backward at the
boundary includes the gradient reduction; private DeepSpeed names are checked at attach time.

Pure glue: no planning and no device calls; deepspeed is imported lazily; ``enabled=False`` (or
no session) makes both a no-op.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

from powerlib.errors import InvalidArgumentError, NotSupportedError

__all__ = ["attach_engine", "attach_pipeline"]

_TESTED = "tested: deepspeed 0.19.8"


def _unsupported(what: str) -> NotSupportedError:
    return NotSupportedError(f"{what}: not a DeepSpeed version this integration knows ({_TESTED})")


def _pipe_types(engine: Any) -> tuple[type, type, dict[Any, Any], bool]:
    """ForwardPass, BackwardPass, the engine class's map, and whether it is DualPipeV."""
    try:
        from deepspeed.runtime.pipe import schedule  # noqa: PLC0415 - optional dependency, imported where used
        from deepspeed.runtime.pipe.engine import PipelineEngine  # noqa: PLC0415 - optional dependency, imported where used
    except ImportError as err:
        raise _unsupported(f"deepspeed.runtime.pipe cannot be imported ({err})") from None
    if not isinstance(engine, PipelineEngine):
        raise InvalidArgumentError(
            f"{type(engine).__name__} is not a DeepSpeed PipelineEngine; use attach_engine"
        )
    fwd, bwd = getattr(schedule, "ForwardPass", None), getattr(schedule, "BackwardPass", None)
    table = getattr(type(engine), "_INSTRUCTION_MAP", None)
    if not isinstance(table, dict) or fwd not in table or bwd not in table:
        raise _unsupported(f"{type(engine).__name__} has no _INSTRUCTION_MAP with F/B entries")
    for name in ("train_batch", "stage_id", "num_stages", "micro_batches"):
        if not hasattr(engine, name):
            raise _unsupported(f"{type(engine).__name__} has no {name}")
    try:
        from deepspeed.runtime.pipe.dualpipev import DualPipeVEngine  # noqa: PLC0415 - optional dependency, imported where used
    except ImportError:
        return fwd, bwd, table, False
    return fwd, bwd, table, isinstance(engine, DualPipeVEngine)


def _check_shape(session: Any, engine: Any) -> None:
    if engine.stage_id != session.stage:
        raise InvalidArgumentError(
            f"the engine's pipeline stage is {engine.stage_id}, the session's {session.stage}: "
            "pass stage=engine.stage_id to powerlib.optimize"
        )
    num_stages = session.config.workload.num_stages
    if engine.num_stages != num_stages:
        raise InvalidArgumentError(
            f"the engine has {engine.num_stages} pipeline stage(s), the session {num_stages}"
        )


@contextlib.contextmanager
def attach_pipeline(session: Any, engine: Any, *, enabled: bool = True) -> Iterator[None]:
    """Drive ``session``'s hooks from a DeepSpeed ``PipelineEngine`` (or ``DualPipeVEngine``).

    Args:
        session: This rank's entered :class:`powerlib.Session` (``stage`` = ``engine.stage_id``).
        engine: The engine ``deepspeed.initialize`` returned for a ``PipelineModule``.
        enabled: ``False`` attaches nothing.

    Raises:
        NotSupportedError: The DeepSpeed version lacks the private names the hooks use.
        InvalidArgumentError: Not a pipeline engine, or its stage differs from the session's.
    """
    if not enabled or session is None:
        yield
        return
    fwd, bwd, table, dualpipev = _pipe_types(engine)
    _check_shape(session, engine)
    if dualpipev:
        session.set_layout(num_chunks=2, placement="v", schedule="recorded")
    state = {"active": False, "F": 0, "B": 0}
    num_mb = engine.micro_batches

    def wrap(kind: str, method: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(method)
        def hooked(self: Any, buffer_id: int, **kwargs: Any) -> Any:
            if self is not engine or not state["active"]:  # other engines, eval_batch
                return method(self, buffer_id, **kwargs)
            phase = kwargs.get("phase")
            if phase is None:
                mb, chunk = state[kind], 0
            else:
                mb, chunk = buffer_id - phase * num_mb, phase
            state[kind] += 1
            session.begin(kind, mb, chunk)
            try:
                return method(self, buffer_id, **kwargs)
            finally:
                session.end()

        return hooked

    cls = type(engine)
    own = "_INSTRUCTION_MAP" in cls.__dict__
    train_batch = engine.train_batch

    @functools.wraps(train_batch)
    def hooked_train_batch(*args: Any, **kwargs: Any) -> Any:
        state.update(active=True, F=0, B=0)
        try:
            result = train_batch(*args, **kwargs)
        finally:
            state["active"] = False
        session.step()
        return result

    cls._INSTRUCTION_MAP = {**table, fwd: wrap("F", table[fwd]), bwd: wrap("B", table[bwd])}
    try:
        engine.train_batch = hooked_train_batch
        yield
    finally:
        with contextlib.suppress(AttributeError):
            del engine.train_batch
        if own:
            cls._INSTRUCTION_MAP = table
        else:
            del cls._INSTRUCTION_MAP


class _EngineHooks:
    """The engine methods :func:`attach_engine` wraps, and the counts they share.

    Attributes:
        forwards: Forwards of the current iteration (the next ``F``'s microbatch).
        backwards: Backwards of the current iteration (the next ``B``'s microbatch).
        open: A ``B`` began and has not ended.
    """

    def __init__(self, session: Any, engine: Any, torch: Any) -> None:
        self.session = session
        self.engine = engine
        self.torch = torch
        self.forwards = 0
        self.backwards = 0
        self.open = False

    def open_backward(self) -> bool:
        """Begin the next B unless one is open; whether this call began it."""
        if self.open:
            return False
        self.session.begin("B", self.backwards)
        self.backwards += 1
        self.open = True
        return True

    def close_backward(self) -> None:
        if self.open:
            self.open = False
            self.session.end()

    def _on_gradient(self, grad: Any) -> Any:
        """A manual backward reached a hooked tensor: B runs until autograd's pass ends."""
        if self.open_backward():
            self.torch.autograd.Variable._execution_engine.queue_callback(self.close_backward)
        return grad

    def watch(self, tensor: Any) -> None:
        if isinstance(tensor, self.torch.Tensor) and tensor.requires_grad:
            tensor.register_hook(self._on_gradient)

    def forward(self, forward: Callable[..., Any]) -> Callable[..., Any]:
        torch = self.torch

        @functools.wraps(forward)
        def hooked_forward(*args: Any, **kwargs: Any) -> Any:
            if not torch.is_grad_enabled():  # evaluation: not an instruction
                return forward(*args, **kwargs)
            self.session.begin("F", self.forwards)
            self.forwards += 1
            try:
                output = forward(*args, **kwargs)
            finally:
                self.session.end()
            outputs = output if isinstance(output, (tuple, list)) else (output,)
            first = next(
                (o for o in outputs if isinstance(o, torch.Tensor) and o.requires_grad), None
            )
            self.watch(first)  # a plain loss.backward() reaches the forward's output first
            return output

        return hooked_forward

    def backward(self, backward: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(backward)
        def hooked_backward(*args: Any, **kwargs: Any) -> Any:
            began = self.open_backward()
            try:
                return backward(*args, **kwargs)
            finally:
                if began:
                    self.close_backward()

        return hooked_backward

    def scale(self, scale: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(scale)
        def hooked_scale(loss: Any) -> Any:
            scaled = scale(loss)
            self.watch(scaled)  # the scaled loss gets its gradient first: B starts there
            return scaled

        return hooked_scale

    def step(self, step: Callable[..., Any]) -> Callable[..., Any]:
        engine = self.engine

        @functools.wraps(step)
        def hooked_step(*args: Any, **kwargs: Any) -> Any:
            managed = getattr(engine, "managed_gradient_accumulation", lambda: True)()
            boundary = engine.is_gradient_accumulation_boundary() or not managed
            result = step(*args, **kwargs)
            if boundary:
                self.forwards = self.backwards = 0
                self.session.step()
            return result

        return hooked_step


@contextlib.contextmanager
def attach_engine(session: Any, engine: Any, *, enabled: bool = True) -> Iterator[None]:
    """Drive ``session``'s hooks from a DeepSpeed engine without pipelining (ZeRO-0/1/2/3).

    The i-th ``engine(...)`` forward with gradients enabled is instruction ``("F", i)``; the i-th
    backward is ``("B", i)``, whichever way it is started: ``engine.backward(loss)`` (bracketed
    as a call), ``engine.scale(loss).backward()`` or a plain ``loss.backward()`` (DeepSpeed's
    manual paths: B starts when the gradient reaches the scaled loss, or else the forward's
    output, and ends when autograd finishes that backward pass). ``engine.step()`` at the
    gradient-accumulation boundary ends the iteration and restarts the count.

    Args:
        session: This rank's :class:`powerlib.Session` (``num_microbatches`` = accumulation steps).
        engine: The ``DeepSpeedEngine`` ``deepspeed.initialize`` returned.
        enabled: ``False`` attaches nothing.

    Raises:
        NotSupportedError: The engine lacks ``is_gradient_accumulation_boundary``.
        InvalidArgumentError: ``engine`` is a pipeline engine (use :func:`attach_pipeline`).
    """
    if not enabled or session is None:
        yield
        return
    import torch  # noqa: PLC0415 - optional dependency, imported where used

    if hasattr(type(engine), "_INSTRUCTION_MAP"):
        raise InvalidArgumentError("a DeepSpeed PipelineEngine: use attach_pipeline")
    for name in ("forward", "backward", "step", "is_gradient_accumulation_boundary"):
        if not callable(getattr(engine, name, None)):
            raise _unsupported(f"{type(engine).__name__} has no {name}()")
    names = ("forward", "backward", "step", "scale")
    originals = {
        name: getattr(engine, name) for name in names if callable(getattr(engine, name, None))
    }
    hooks = _EngineHooks(session, engine, torch)
    try:
        engine.forward = hooks.forward(originals["forward"])
        engine.backward = hooks.backward(originals["backward"])
        engine.step = hooks.step(originals["step"])
        if "scale" in originals:
            engine.scale = hooks.scale(originals["scale"])
        yield
    finally:
        hooks.close_backward()
        for name in originals:
            with contextlib.suppress(AttributeError):
                delattr(engine, name)
