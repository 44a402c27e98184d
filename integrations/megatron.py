"""Megatron-core: the pipeline schedules of ``megatron.core.pipeline_parallel`` (tested: 0.16.1).

One line inside the session (docs/frameworks.md §2.1)::

    from powerlib.integrations.megatron import attach

    with (
        powerlib.optimize(num_stages=pp, num_microbatches=M, stage=pp_rank) as session,
        attach(session),
    ):
        for batch in loader:
            forward_backward_func = get_forward_backward_func()     # inside the with block
            forward_backward_func(forward_step_func=..., num_microbatches=M, ...)
            optimizer.step()

While attached, ``megatron.core.pipeline_parallel.schedules``' module-level ``forward_step`` and
``backward_step`` (every schedule, ``hybrid_cp_schedule`` included, looks them up by name at call
time) and its three ``forward_backward_*`` schedules are wrappers, restored on every exit path.
``get_forward_backward_func`` also looks the schedules up at call time, so one obtained *inside*
the block is wrapped (Megatron-LM's ``train_step`` asks every step); one obtained before
``attach`` raises ``NotSupportedError`` at its first forward.

- **F** = ``forward_step``, labelled by its ``current_microbatch=`` and ``vp_stage=`` (chunk;
  ``None`` is 0) keywords. **B** = ``backward_step``, which carries no ids: the schedule hands it
  the very object ``forward_step`` returned (a tensor, or a one-element list for a list input),
  so the forward wrapper keys ``(microbatch, chunk)`` by that object and the backward pops it
  (the interleaved backward walks the chunks in reverse). Receive waits lie outside both calls.
- **Step**: a schedule call with ``forward_only=False`` is one iteration: ``session.step()`` runs
  when it returns (before ``optimizer.step()``, at the iteration boundary).
- **Eval**: 0.16.1's ``forward_step`` is not told ``forward_only``; the schedule wrapper reads it
  from the call's keywords (the schedules take keywords only) and skips those forwards.
- **Stage**: the session's ``stage`` must be ``parallel_state.get_pipeline_model_parallel_rank()``
  (checked at attach if model parallelism is initialised, else at the first schedule call); the
  TP/DP/CP ranks of a pp rank share its stage (docs/frameworks.md §3.6).

Limits: the MoE combined-1F1B path (``overlap_moe_expert_parallel_comm``) fuses an F and a B past
these hooks and a full-iteration CUDA graph replays without Python: both are refused at the
schedule call. Activation recompute runs inside ``backward_step``, so it is part of B. 0.16.1 has
no zero-bubble (I/W) schedule. Names are feature-detected at attach (``NotSupportedError``).

Pure glue: no planning, no device calls; megatron is imported inside :func:`attach`;
``enabled=False`` (or no session) makes it a no-op.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable, Iterator
from typing import Any

from powerlib.errors import InvalidArgumentError, NotSupportedError

__all__ = ["TESTED_VERSION", "attach"]

TESTED_VERSION = "0.16.1"
_SCHEDULES = (
    "forward_backward_no_pipelining",
    "forward_backward_pipelining_without_interleaving",
    "forward_backward_pipelining_with_interleaving",
)


def _check_api(schedules: Any) -> None:
    """Raise ``NotSupportedError`` unless ``schedules`` has the names and keywords hooked here."""
    missing = [
        n for n in ("forward_step", "backward_step", *_SCHEDULES) if not hasattr(schedules, n)
    ]
    if not missing:
        fwd = inspect.signature(schedules.forward_step).parameters
        bwd = list(inspect.signature(schedules.backward_step).parameters)
        missing = [
            f"forward_step({p}=)" for p in ("current_microbatch", "vp_stage") if p not in fwd
        ]
        if bwd[1:2] != ["output_tensor"]:
            missing.append("backward_step(input_tensor, output_tensor, ...)")
    if missing:
        raise NotSupportedError(
            f"megatron.core.pipeline_parallel.schedules lacks {', '.join(missing)}: this "
            f"megatron-core is not one the integration knows (tested: {TESTED_VERSION})"
        )


def _check_stage(session: Any, parallel_state: Any) -> None:
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    pp_size = parallel_state.get_pipeline_model_parallel_world_size()
    stages = getattr(getattr(session, "spec", None), "num_stages", pp_size)
    if session.stage != pp_rank or stages != pp_size:
        raise InvalidArgumentError(
            f"the session is stage {session.stage} of {stages} but this rank is pipeline rank "
            f"{pp_rank} of {pp_size}: pass stage=parallel_state.get_pipeline_model_parallel_rank() "
            "and num_stages=the pipeline size to powerlib.optimize"
        )


def _refused(model: Any) -> str | None:
    """Why this model's config takes a path the hooks do not see, or ``None``."""
    config = getattr(model[0] if isinstance(model, list) else model, "config", None)
    if getattr(config, "overlap_moe_expert_parallel_comm", False):
        return "overlap_moe_expert_parallel_comm (combined 1F1B) bypasses forward/backward_step"
    scope = getattr(config, "cuda_graph_scope", None) or ()
    scopes = [scope] if isinstance(scope, str) else scope
    if getattr(config, "cuda_graph_impl", "none") == "local" and any(
        getattr(s, "name", s) == "full_iteration" for s in scopes
    ):
        return "a full-iteration CUDA graph replays without running the hooks"
    return None


@contextlib.contextmanager
def attach(session: Any, *, enabled: bool = True) -> Iterator[None]:
    """Drive ``session``'s hooks from megatron-core's pipeline schedules (see the module doc).

    Args:
        session: This rank's :class:`powerlib.Session`; its ``stage`` is the pp rank.
        enabled: ``False`` attaches nothing.

    Raises:
        NotSupportedError: megatron-core lacks the hooked names (tested: 0.16.1); at a schedule
            call: a path the hooks do not see, or a schedule obtained before ``attach``.
        InvalidArgumentError: The session's stage is not this rank's pipeline rank.
    """
    if not enabled or session is None:
        yield
        return
    from megatron.core import parallel_state  # noqa: PLC0415
    from megatron.core.pipeline_parallel import schedules  # noqa: PLC0415

    _check_api(schedules)
    checked = parallel_state.model_parallel_is_initialized()
    if checked:
        _check_stage(session, parallel_state)
    # forward_only of the running schedule call (None: no wrapped one runs); the forward output
    # objects waiting for their backward: id -> (object, microbatch, chunk)
    state: dict[str, Any] = {"forward_only": None, "checked": checked}
    pending: dict[int, tuple[Any, int, int]] = {}
    forward_step, backward_step = schedules.forward_step, schedules.backward_step

    @functools.wraps(forward_step)
    def hooked_forward(*args: Any, **kwargs: Any) -> Any:
        if state["forward_only"] is None:
            raise NotSupportedError(
                "forward_step ran outside a schedule obtained inside powerlib's attach(): call "
                "get_forward_backward_func() inside the with block"
            )
        if state["forward_only"]:
            return forward_step(*args, **kwargs)
        chunk, microbatch = kwargs.get("vp_stage") or 0, kwargs.get("current_microbatch")
        if microbatch is None:  # every schedule of 0.16.1 passes it
            raise NotSupportedError("forward_step was called without current_microbatch=")
        session.begin("F", microbatch, chunk)
        try:
            result = forward_step(*args, **kwargs)
        finally:
            session.end()
        output = result[0]
        pending[id(output)] = (output, microbatch, chunk)
        return result

    @functools.wraps(backward_step)
    def hooked_backward(*args: Any, **kwargs: Any) -> Any:
        output = args[1] if len(args) > 1 else kwargs.get("output_tensor")
        entry = pending.pop(id(output), None)
        if entry is None or entry[0] is not output:
            raise NotSupportedError(
                "backward_step got an output no hooked forward_step returned: this schedule "
                f"does not hand the forward's output back (tested: megatron-core {TESTED_VERSION})"
            )
        session.begin("B", entry[1], entry[2])
        try:
            return backward_step(*args, **kwargs)
        finally:
            session.end()

    def wrap_schedule(schedule: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(schedule)
        def hooked_schedule(*args: Any, **kwargs: Any) -> Any:
            forward_only = bool(kwargs.get("forward_only", False))
            if not forward_only:
                reason = _refused(kwargs.get("model"))
                if reason:
                    raise NotSupportedError(f"powerlib cannot follow this schedule: {reason}")
                if not state["checked"]:
                    _check_stage(session, parallel_state)
                    state["checked"] = True
            outer, state["forward_only"] = state["forward_only"], forward_only
            try:
                result = schedule(*args, **kwargs)
            finally:
                state["forward_only"] = outer
                if outer is None:  # hold no output of a call that failed half-way
                    pending.clear()
            if not forward_only:
                session.step()
            return result

        return hooked_schedule

    originals = {n: getattr(schedules, n) for n in ("forward_step", "backward_step", *_SCHEDULES)}
    try:
        schedules.forward_step = hooked_forward
        schedules.backward_step = hooked_backward
        for name in _SCHEDULES:
            setattr(schedules, name, wrap_schedule(originals[name]))
        yield
    finally:
        for name, original in originals.items():
            setattr(schedules, name, original)
