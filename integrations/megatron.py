"""Megatron: megatron-core's pipeline schedules and Megatron-LM's own training loop.

Tested: megatron-core 0.16.1 (Python 3.11, torch 2.13 CPU) and 0.17.1, 0.18.2, 0.19.2 (Python
3.12, torch 2.14.1), gloo, PP=2; newer releases are feature-detected (see *Versions*).

**Megatron-LM's** ``pretrain()`` (``pretrain_gpt.py``-style scripts; ``megatron.training``, which
megatron-core wheels ship from 0.17 on), two lines at the top of the script::

    from powerlib.integrations.megatron import patch_training
    patch_training(out_dir="/scratch/powerlib")         # any powerlib.optimize keyword

or no edit at all: ``POWERLIB_MEGATRON=1 torchrun ... -m powerlib.integrations.megatron
pretrain_gpt.py ARGS`` (keywords as JSON in ``POWERLIB_MEGATRON_OPTIONS``; see :func:`main`).
Megatron-LM's ``train()`` obtains ``forward_backward_func`` **once, before its loop**, and hands
it to every ``train_step``, so the schedules must be hooked before ``train()`` starts:
:func:`patch_training` wraps ``megatron.training.training.train`` (which ``pretrain()`` looks up
by name when it calls it), and each call enters a session built from Megatron's own state
(pipeline size and rank, virtual pipeline size, microbatch count) with :func:`attach` around it.

**megatron-core** alone, one line inside the session (docs/frameworks.md §2.1)::

    with (
        powerlib.optimize(num_stages=pp, num_microbatches=M, stage=pp_rank) as session,
        attach(session),
    ):
        forward_backward_func = get_forward_backward_func()     # inside the with block
        for batch in loader:
            forward_backward_func(forward_step_func=..., num_microbatches=M, ...)
            optimizer.step()

While attached, ``megatron.core.pipeline_parallel.schedules``' module-level ``forward_step``,
``backward_step`` and (0.17+) ``backward_step_multimodule`` (every schedule, ``hybrid_cp_schedule``
and the multi-module MIMO path included, looks them up by name at call time) and its three
``forward_backward_*`` schedules are wrappers, restored on every exit path.
``get_forward_backward_func`` looks the schedules up when it is called, so one obtained *inside*
the block is wrapped; one obtained before ``attach`` raises ``NotSupportedError`` at its first
forward.

- **F** = ``forward_step``, labelled by its ``current_microbatch=`` and ``vp_stage=`` (chunk;
  ``None`` is 0) keywords. **B** = ``backward_step`` (or the MIMO ``backward_step_multimodule``),
  which carries no ids: the schedule hands it the very object ``forward_step`` returned (a
  tensor, a one-element list for a list input, a dict of module outputs under MIMO), so the
  forward wrapper keys ``(microbatch, chunk)`` by that object and the backward pops it (the
  interleaved backward walks the chunks in reverse). Receive waits lie outside both calls.
- **Step**: a schedule call with ``forward_only=False`` is one iteration: ``session.step()`` runs
  when it returns (before ``optimizer.step()``, at the iteration boundary).
- **Eval**: ``forward_step`` is not told ``forward_only``; the schedule wrapper reads it from the
  call's keywords (the schedules take keywords only) and skips those forwards.
- **Stage**: the session's ``stage`` must be ``parallel_state.get_pipeline_model_parallel_rank()``
  (checked at attach if model parallelism is initialised, else at the first schedule call); the
  TP/DP/CP ranks of a pp rank share its stage (docs/frameworks.md §3.6).

Refused at the schedule call (``NotSupportedError``), because these paths run compute past the
hooks: the MoE combined-1F1B path (``overlap_moe_expert_parallel_comm``), which fuses an F and a
B; a full-iteration CUDA graph (``cuda_graph_impl="full_iteration"``, 0.18+, or ``"local"`` with
scope ``full_iteration``), which replays the whole schedule without Python. Activation recompute
runs inside ``backward_step``, so it is part of B. :func:`patch_training` also refuses a batch-size
ramp-up (``--rampup-batch-size``: the microbatch count, and so the plan's workload, changes).

*Versions*: every hooked name and keyword is checked at attach; a megatron-core that lacks one
gets ``NotSupportedError`` naming it (and the tested releases), never a silent partial hookup.

Pure glue: no planning, no device calls; megatron is imported inside :func:`attach` and
:func:`patch_training`; ``enabled=False`` (or no session) makes it a no-op.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import json
import os
import runpy
import sys
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from powerlib.config import megatron_launch
from powerlib.errors import InvalidArgumentError, NotSupportedError, PowerlibError

__all__ = [
    "TESTED_VERSIONS",
    "TrainingPatch",
    "attach",
    "current_session",
    "main",
    "options_from_env",
    "replan",
    "patch_training",
    "workload_from_args",
]

TESTED_VERSIONS = ("0.16.1", "0.17.1", "0.18.2", "0.19.2")
_TESTED = f"tested: megatron-core {', '.join(TESTED_VERSIONS)}"
_ATTACHED: list[Any] = []  # the sessions attach() is driving, innermost last
_SCHEDULES = (
    "forward_backward_no_pipelining",
    "forward_backward_pipelining_without_interleaving",
    "forward_backward_pipelining_with_interleaving",
)
_BACKWARDS = ("backward_step", "backward_step_multimodule")  # the second: 0.17+ (MIMO)
# What patch_training reads from Megatron; a caller's keyword for one of these is refused.
_FROM_MEGATRON = ("num_stages", "num_microbatches", "stage", "schedule", "num_chunks")


def _check_api(schedules: Any) -> None:
    """Raise ``NotSupportedError`` unless ``schedules`` has the names and keywords hooked here."""
    missing = [
        n for n in ("forward_step", "backward_step", *_SCHEDULES) if not hasattr(schedules, n)
    ]
    if not missing:
        fwd = inspect.signature(schedules.forward_step).parameters
        missing = [
            f"forward_step({p}=)" for p in ("current_microbatch", "vp_stage") if p not in fwd
        ]
        for name in _BACKWARDS:
            if hasattr(schedules, name):
                params = list(inspect.signature(getattr(schedules, name)).parameters)
                if params[1:2] != ["output_tensor"]:
                    missing.append(f"{name}(input_tensor, output_tensor, ...)")
    if missing:
        raise NotSupportedError(
            f"megatron.core.pipeline_parallel.schedules lacks {', '.join(missing)}: this "
            f"megatron-core is not one the integration knows ({_TESTED})"
        )


def _check_stage(session: Any, parallel_state: Any) -> None:
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    pp_size = parallel_state.get_pipeline_model_parallel_world_size()
    workload = getattr(getattr(session, "config", None), "workload", None)
    stages = getattr(workload, "num_stages", pp_size)
    if session.stage != pp_rank or stages != pp_size:
        raise InvalidArgumentError(
            f"the session is stage {session.stage} of {stages} but this rank is pipeline rank "
            f"{pp_rank} of {pp_size}: pass stage=parallel_state.get_pipeline_model_parallel_rank() "
            "and num_stages=the pipeline size to powerlib.optimize"
        )


def _full_iteration_graph(config: Any) -> bool:
    """Whether ``config`` (a TransformerConfig or Megatron-LM's args) captures whole iterations."""
    impl = getattr(config, "cuda_graph_impl", "none")
    if impl == "full_iteration":  # 0.18+
        return True
    scope = getattr(config, "cuda_graph_scope", None) or ()
    scopes = [scope] if isinstance(scope, str) else scope
    return impl == "local" and any(getattr(s, "name", s) == "full_iteration" for s in scopes)


def _refused(model: Any) -> str | None:
    """Why this model's config takes a path the hooks do not see, or ``None``."""
    config = getattr(model[0] if isinstance(model, list) else model, "config", None)
    if getattr(config, "overlap_moe_expert_parallel_comm", False):
        return "overlap_moe_expert_parallel_comm (combined 1F1B) bypasses forward/backward_step"
    if _full_iteration_graph(config):
        return "a full-iteration CUDA graph replays without running the hooks"
    return None


class _Hooks:
    """The schedule functions one :func:`attach` wraps, and what they share while they run.

    Attributes:
        forward_only: ``forward_only`` of the running schedule call (``None``: no wrapped one
            runs).
        checked: The session's stage was checked against the pipeline rank.
        pending: The forward output objects waiting for their backward:
            ``id -> (object, microbatch, chunk)``.
    """

    def __init__(self, session: Any, parallel_state: Any, *, checked: bool) -> None:
        self.session = session
        self.parallel_state = parallel_state
        self.forward_only: bool | None = None
        self.checked = checked
        self.pending: dict[int, tuple[Any, int, int]] = {}

    def forward(self, forward_step: Callable[..., Any]) -> Callable[..., Any]:
        """``forward_step`` as the hooks see it: an ``F`` instruction of its microbatch."""

        @functools.wraps(forward_step)
        def hooked_forward(*args: Any, **kwargs: Any) -> Any:
            if self.forward_only is None:
                raise NotSupportedError(
                    "forward_step ran outside a schedule obtained inside powerlib's attach(): "
                    "call get_forward_backward_func() inside the with block (Megatron-LM's "
                    "pretrain(): use patch_training)"
                )
            if self.forward_only:
                return forward_step(*args, **kwargs)
            chunk, microbatch = kwargs.get("vp_stage") or 0, kwargs.get("current_microbatch")
            if microbatch is None:  # every schedule of the tested releases passes it
                raise NotSupportedError("forward_step was called without current_microbatch=")
            self.session.begin("F", microbatch, chunk)
            try:
                result = forward_step(*args, **kwargs)
            finally:
                self.session.end()
            output = result[0]
            self.pending[id(output)] = (output, microbatch, chunk)
            return result

        return hooked_forward

    def backward(self, name: str, backward: Callable[..., Any]) -> Callable[..., Any]:
        """A backward step as the hooks see it: the ``B`` of the forward whose output it gets."""

        @functools.wraps(backward)
        def hooked_backward(*args: Any, **kwargs: Any) -> Any:
            if self.forward_only is None:
                return backward(*args, **kwargs)  # not inside a hooked schedule call
            output = args[1] if len(args) > 1 else kwargs.get("output_tensor")
            entry = self.pending.pop(id(output), None)
            if entry is None or entry[0] is not output:
                raise NotSupportedError(
                    f"{name} got an output no hooked forward_step returned: this schedule "
                    f"does not hand the forward's output back ({_TESTED})"
                )
            self.session.begin("B", entry[1], entry[2])
            try:
                return backward(*args, **kwargs)
            finally:
                self.session.end()

        return hooked_backward

    def schedule(self, schedule: Callable[..., Any]) -> Callable[..., Any]:
        """A pipeline schedule as the hooks see it: a training call is one iteration."""

        @functools.wraps(schedule)
        def hooked_schedule(*args: Any, **kwargs: Any) -> Any:
            forward_only = bool(kwargs.get("forward_only", False))
            if not forward_only:
                reason = _refused(kwargs.get("model"))
                if reason:
                    raise NotSupportedError(f"powerlib cannot follow this schedule: {reason}")
                if not self.checked:
                    _check_stage(self.session, self.parallel_state)
                    self.checked = True
            outer, self.forward_only = self.forward_only, forward_only
            try:
                result = schedule(*args, **kwargs)
            finally:
                self.forward_only = outer
                if outer is None:  # hold no output of a call that failed half-way
                    self.pending.clear()
            if not forward_only:
                self.session.step()
            return result

        return hooked_schedule


@contextlib.contextmanager
def attach(session: Any, *, enabled: bool = True) -> Iterator[None]:
    """Drive ``session``'s hooks from megatron-core's pipeline schedules (see the module doc).

    Args:
        session: This rank's :class:`powerlib.Session`; its ``stage`` is the pp rank.
        enabled: ``False`` attaches nothing.

    Raises:
        NotSupportedError: megatron-core lacks the hooked names; at a schedule call: a path the
            hooks do not see, or a schedule obtained before ``attach``.
        InvalidArgumentError: The session's stage is not this rank's pipeline rank.
    """
    if not enabled or session is None:
        yield
        return
    from megatron.core import parallel_state  # noqa: PLC0415 - optional dependency, imported where used
    from megatron.core.pipeline_parallel import schedules  # noqa: PLC0415 - optional dependency, imported where used

    _check_api(schedules)
    checked = parallel_state.model_parallel_is_initialized()
    if checked:
        _check_stage(session, parallel_state)
    hooks = _Hooks(session, parallel_state, checked=checked)
    names = ("forward_step", *(n for n in _BACKWARDS if hasattr(schedules, n)), *_SCHEDULES)
    originals = {n: getattr(schedules, n) for n in names}
    try:
        schedules.forward_step = hooks.forward(originals["forward_step"])
        for name in _BACKWARDS:
            if name in originals:
                setattr(schedules, name, hooks.backward(name, originals[name]))
        for name in _SCHEDULES:
            setattr(schedules, name, hooks.schedule(originals[name]))
        _ATTACHED.append(session)
        yield
    finally:
        if _ATTACHED and _ATTACHED[-1] is session:
            _ATTACHED.pop()
        for name, original in originals.items():
            setattr(schedules, name, original)


def current_session() -> Any:
    """The session the innermost :func:`attach` drives, or ``None``."""
    return _ATTACHED[-1] if _ATTACHED else None


def replan(deadline_s: float) -> None:
    """Re-plan the attached session for a new straggler deadline (call on every rank, same step).

    Forwards to :meth:`Session.replan <powerlib.runtime.session.Session.replan>`: rank 0
    solves in the background, every rank switches at the same later iteration boundary.

    Raises:
        InvalidArgumentError: No session is attached, or the session refuses (see there).
    """
    session = current_session()
    if session is None:
        raise InvalidArgumentError("replan: no powerlib session is attached to this training loop")
    session.replan(deadline_s)


# -- Megatron-LM's own loop ---------------------------------------------------------------------


def workload_from_args(args: Any, num_microbatches: int, pp_rank: int) -> dict[str, int | str]:
    """The session's workload keywords from Megatron-LM's parsed ``args`` (``get_args()``).

    Raises:
        NotSupportedError: A setting whose iterations the hooks cannot follow (a full-iteration
            CUDA graph; a batch-size ramp-up, which changes the microbatch count mid-run).
    """
    if _full_iteration_graph(args):
        raise NotSupportedError(
            "powerlib cannot follow Megatron with --cuda-graph-impl full_iteration: the captured "
            "iteration replays without running the hooks (use a per-layer CUDA graph scope)"
        )
    if getattr(args, "rampup_batch_size", None):
        raise NotSupportedError(
            "powerlib cannot plan Megatron with --rampup-batch-size: the number of microbatches "
            "per iteration changes during the run (start powerlib after the ramp-up)"
        )
    pp = int(getattr(args, "pipeline_model_parallel_size", 1) or 1)
    vp = getattr(args, "virtual_pipeline_model_parallel_size", None)
    chunks = int(vp) if vp else 1
    return {
        "num_stages": pp,
        "num_microbatches": int(num_microbatches),
        "stage": int(pp_rank),
        "schedule": "interleaved" if chunks > 1 else "1f1b",
        "num_chunks": chunks,
    }


def _training_module() -> Any:
    try:
        from megatron.training import training  # noqa: PLC0415 - optional dependency, imported where used
    except ImportError as err:
        raise NotSupportedError(
            f"Megatron-LM's training loop cannot be imported ({err}): megatron-core wheels ship "
            "megatron.training from 0.17 on (Python 3.12+); with megatron-core alone, use attach"
        ) from None
    if not callable(getattr(training, "train", None)):
        raise NotSupportedError(
            f"megatron.training.training has no train(): not a Megatron-LM the integration "
            f"knows ({_TESTED})"
        )
    return training


class TrainingPatch:
    """What :func:`patch_training` returns: the sessions it ran, and the way back.

    Attributes:
        sessions: Each :class:`powerlib.Session` a patched ``train()`` call ran, in order (their
            ``report()``, ``plan`` and ``phase`` stay readable after ``train()`` returns).
    """

    def __init__(self, training: Any, original: Callable[..., Any]) -> None:
        self.sessions: list[Any] = []
        self._training = training
        self._original = original
        self._wrapper: Callable[..., Any] | None = None

    @property
    def active(self) -> bool:
        """Whether ``megatron.training.training.train`` is still this patch's wrapper."""
        return self._wrapper is not None and self._training.train is self._wrapper

    def restore(self) -> None:
        """Put the original ``train`` back (idempotent; leaves a later patch of it alone)."""
        if self.active:
            self._training.train = self._original
        self._wrapper = None

    def __enter__(self) -> TrainingPatch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.restore()


def patch_training(*, enabled: bool = True, **options: Any) -> TrainingPatch | None:
    """Run every ``megatron.training.training.train()`` call inside a powerlib session.

    Call it once at the top of a ``pretrain_gpt.py``-style script, before ``pretrain(...)``.
    ``pretrain()`` calls ``train()`` by name, so the wrapper runs after Megatron's
    initialisation: it reads the pipeline size and rank, the virtual pipeline size and
    ``get_num_microbatches()`` from Megatron, then runs the original ``train()`` inside
    ``powerlib.optimize(**workload, **options)`` and :func:`attach`. The session profiles, plans
    and applies as in any loop (Megatron's ``evaluate()`` runs forward-only schedules, which
    are not steps), and restores the devices when ``train()`` returns or raises.

    Args:
        enabled: ``False`` patches nothing and returns ``None``.
        **options: Any :func:`powerlib.optimize` keyword (``out_dir``, ``mode``, ``plan_path``,
            ``max_slowdown``, ...) except the workload, which comes from Megatron.

    Returns:
        A :class:`TrainingPatch` (``.restore()``, or use it as a context manager; ``.sessions``).

    Raises:
        NotSupportedError: ``megatron.training`` is missing (megatron-core before 0.17) or
            lacks ``train``; ``train`` is already patched.
        InvalidArgumentError: ``options`` names a workload keyword Megatron provides.
    """
    given = sorted(set(options) & set(_FROM_MEGATRON))
    if given:
        raise InvalidArgumentError(
            f"patch_training reads {', '.join(given)} from Megatron's arguments: do not pass them"
        )
    if not enabled:
        return None
    training = _training_module()
    train = training.train
    if getattr(train, "__powerlib_original__", None) is not None:
        raise NotSupportedError("megatron.training.training.train is already patched by powerlib")
    patch = TrainingPatch(training, train)

    @functools.wraps(train)
    def powered_train(*args: Any, **kwargs: Any) -> Any:
        from megatron.core import parallel_state  # noqa: PLC0415 - optional dependency, imported where used
        from megatron.core.num_microbatches_calculator import (  # noqa: PLC0415 - optional dependency, imported where used
            get_num_microbatches,
        )
        from megatron.training.global_vars import get_args  # noqa: PLC0415 - optional dependency, imported where used

        import powerlib  # noqa: PLC0415 - the session and measurement load when a callback first runs

        workload = workload_from_args(
            get_args(), get_num_microbatches(), parallel_state.get_pipeline_model_parallel_rank()
        )
        with powerlib.optimize(**workload, **options) as session, attach(session):
            patch.sessions.append(session)
            return train(*args, **kwargs)

    powered_train.__powerlib_original__ = train  # type: ignore[attr-defined]
    patch._wrapper = powered_train
    training.train = powered_train
    return patch


_ENV = "POWERLIB_MEGATRON"
_ENV_OPTIONS = "POWERLIB_MEGATRON_OPTIONS"


def options_from_env(environ: Mapping[str, str] | None = None) -> dict[str, Any] | None:
    """The session keywords the launcher passes, or ``None`` when ``POWERLIB_MEGATRON`` is off.

    ``POWERLIB_MEGATRON``: ``1`` on, ``0`` or unset off. ``POWERLIB_MEGATRON_OPTIONS``: a JSON
    object of :func:`powerlib.optimize` keywords (``{"out_dir": "/scratch/pl", "mode": "auto"}``).

    Raises:
        InvalidArgumentError: Another value of ``POWERLIB_MEGATRON``, or options that are not a
            JSON object.
    """
    switch, text = megatron_launch(environ)  # powerlib.config reads the environment
    if switch not in ("0", "1", ""):
        raise InvalidArgumentError(f"{_ENV} must be 1 or 0, not {switch!r}")
    if switch != "1":
        return None
    text = text or "{}"
    try:
        options = json.loads(text)
    except json.JSONDecodeError as err:
        raise InvalidArgumentError(f"{_ENV_OPTIONS} is not JSON: {err}") from None
    if not isinstance(options, dict):
        raise InvalidArgumentError(
            f"{_ENV_OPTIONS} must be a JSON object of powerlib.optimize keywords"
        )
    return options


def main(argv: list[str] | None = None) -> int:
    """``python -m powerlib.integrations.megatron SCRIPT [ARGS...]``: run a Megatron script.

    ``SCRIPT`` runs as ``__main__`` with ``ARGS`` as its ``sys.argv[1:]`` and its folder first on
    ``sys.path``, as ``python SCRIPT ARGS`` runs it (its sibling modules, such as
    ``pretrain_gpt.py``'s ``gpt_builders``, import from any working directory). With
    ``POWERLIB_MEGATRON=1``, :func:`patch_training` is called first (with the keywords of
    ``POWERLIB_MEGATRON_OPTIONS``); otherwise nothing is patched, so one launch line serves both.
    Under torchrun: ``torchrun --nproc-per-node 8 -m powerlib.integrations.megatron
    pretrain_gpt.py ARGS``.
    """
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(main.__doc__)
        return 0 if argv else 2
    script = argv[0]
    if not os.path.isfile(script):
        print(f"error: no such script: {script}", file=sys.stderr)
        return 2
    # As `python script.py` does: the script's folder first on sys.path, so its sibling modules
    # (pretrain_gpt.py's gpt_builders, model_provider) import from any working directory. First
    # of all: patch_training imports megatron.training, which must be the checkout's beside the
    # script, not an installed megatron-core wheel's (a wheel has no dataset-helper Makefile, and
    # Megatron-LM 0.19's job died building it; issue 47).
    folder = os.path.dirname(os.path.realpath(script))
    sys.path.insert(0, folder)
    saved = sys.argv
    patch = None
    try:
        try:
            options = options_from_env()
            patch = patch_training(**options) if options is not None else None
        except PowerlibError as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
        sys.argv = [script, *argv[1:]]
        runpy.run_path(script, run_name="__main__")
    finally:
        sys.argv = saved
        if sys.path and sys.path[0] == folder:
            del sys.path[0]
        if patch is not None:
            patch.restore()
    return 0


if __name__ == "__main__":
    # `python -m` runs this file as __main__, a second copy of the module: run the imported one,
    # whose state (current_session, replan) is the one the script sees when it imports it.
    from powerlib.integrations import megatron as _imported

    sys.exit(_imported.main())
