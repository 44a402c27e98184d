"""Hugging Face ``transformers``: a ``TrainerCallback`` that logs energy per step (docs/callbacks.md).

::

    from powerlib.integrations.huggingface import PowerlibCallback

    cb = PowerlibCallback()                           # or PowerlibCallback(optimize=True)
    trainer = Trainer(model=model, args=args, train_dataset=ds, callbacks=[cb])
    trainer.train()
    cb.result.energy_per_step_j                       # the closed measurement

The callback runs a :func:`powerlib.measure` from ``on_train_begin`` to ``on_train_end``; each
optimizer step (``on_step_begin`` to ``on_step_end``, every accumulated micro-batch included) is
one step of it. At each training log (the entries with ``loss``, and the final summary with
``train_runtime``) it adds the energy of the steps since the previous log to that entry of
``trainer.state.log_history`` and to the ``logs`` the callbacks after it see. An evaluation that
the trainer schedules (``eval_strategy``, ``eval_on_start``) is a window ``eval`` whose energy goes
into its metrics. At ``on_train_end`` the measurement is closed and its totals are added to the
final summary entry (and to ``TrainOutput.metrics``).

``transformers`` has no hook for an exception inside ``train()``: the measurement (a daemon
thread) and an optimize session stay open until :meth:`PowerlibCallback.close`, the next
``train()``, or the end of the process (the session's atexit and signal handlers restore the
clocks). Use the callback as a context manager, or call ``close()`` in a ``finally``, where
training can fail and the process lives on (notebooks).

``PowerlibCallback`` is built on ``transformers.TrainerCallback`` when first looked up (PEP 562):
importing this module imports no framework.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from powerlib.errors import NotSupportedError
from powerlib.integrations._callbacks import MeasuredRun, check_tokens, lazy_class, window_energy

if TYPE_CHECKING:
    import torch
    from transformers import TrainerControl, TrainerState, TrainingArguments

__all__ = ["PowerlibCallback"]  # noqa: F822 (made on first use, module __getattr__)

# -- optimize: the trainer's model and optimizer, as attach_module sees them -----------------------


class _TrainingForwards:
    """The model as ``attach_module`` should see it under the Trainer.

    Two adjustments, both in the hooks' arguments only (nothing the model returns changes):
    forwards in eval mode or without gradients (``evaluate``/``predict`` run the same module) are
    not instructions; and a ``ModelOutput`` (a dict) is handed over as the tuple of its values, so
    the backward starts at the first output that needs a gradient (the loss, when the model
    computes it, else the logits).
    """

    def __init__(self, module: torch.nn.Module) -> None:
        self._module = module

    def parameters(self) -> Any:
        return self._module.parameters()

    @staticmethod
    def _counts(module: torch.nn.Module) -> bool:
        import torch  # noqa: PLC0415 - optional dependency, imported where used

        return module.training and torch.is_grad_enabled()

    def register_forward_pre_hook(self, hook: Callable[..., Any]) -> Any:
        def pre(module: torch.nn.Module, args: Any) -> None:
            if self._counts(module):
                hook(module, args)

        return self._module.register_forward_pre_hook(pre)

    def register_forward_hook(self, hook: Callable[..., Any]) -> Any:
        def post(module: torch.nn.Module, args: Any, output: Any) -> None:
            if not self._counts(module):
                return
            if isinstance(output, Mapping):
                output = tuple(output.values())
            hook(module, args, output)

        return self._module.register_forward_hook(post)


def _torch_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer under wrappers (accelerate's ``AcceleratedOptimizer`` has no step hooks)."""
    import torch  # noqa: PLC0415 - optional dependency, imported where used

    while isinstance(getattr(optimizer, "optimizer", None), torch.optim.Optimizer):
        optimizer = optimizer.optimizer
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise NotSupportedError(
            "optimize=True needs a torch.optim.Optimizer under the Trainer, got "
            f"{type(optimizer).__name__}"
        )
    return optimizer


# -- the callback ----------------------------------------------------------------------------------


class _PowerlibCallbackImpl(MeasuredRun):
    """Energy per step in the Trainer's logs; optionally ``powerlib.optimize`` around training.

    Args:
        devices: What to measure: ``"auto"`` (default) is this process's device (its CUDA
            device, else the local process index: ``devices="local"`` of
            :func:`powerlib.measure`) in a multi-process job and every device of the backend in a
            single process (one process may drive several GPUs); ``None`` is every device; or a
            list of ``Device`` objects, indexes or ids (as :func:`powerlib.measure`). Without a
            device (no GPU, no ``POWERLIB_BACKEND``) the callback warns once and logs no energy;
            training goes on (docs/real-gpu.md §7).
        backend: A backend or its name; default ``POWERLIB_BACKEND``.
        sample_period_s: How often the sampler thread reads each device (default 10 ms).
        tokens_per_step: Tokens this process handles in one optimizer step, for ``J/token``: a
            number, or ``callable(args, state) -> float | None`` called at each step's end. Default:
            from ``state.num_input_tokens_seen`` when ``include_num_input_tokens_seen`` is on
            (its global count divided by ``args.world_size``), else no tokens.
        reduce: ``local`` (this process's devices) or ``world`` (every rank, each device once; a
            collective at every log, which every rank makes anyway).
        optimize: ``True``, or a dict of :func:`powerlib.optimize` options:
            enter a session at train begin (one stage, ``num_microbatches`` the gradient
            accumulation steps, ``out_dir`` default ``<output_dir>/powerlib``), hook the model
            and optimizer (:func:`~powerlib.integrations.torch_distributed.attach_module`), and
            close it at train end. Data parallel or a single process only: not with DeepSpeed
            (use :mod:`powerlib.integrations.deepspeed`) nor ``DataParallel``.
        measure_options: Further :class:`~powerlib.measure_api.Measurement` keywords
            (``align``, ``flush_timeout_s``, ...).

    Attributes:
        measurement: The running (or last) :class:`~powerlib.measure_api.Measurement`.
        session: The optimize session of the last ``train()``, or ``None``.
        result: The closed measurement's result after ``on_train_end``, else ``None``.

    Raises:
        InvalidArgumentError: A bad argument (checked at construction).
    """

    def __init__(
        self,
        *,
        devices: Sequence[Any] | str | None = "auto",
        backend: Any = None,
        sample_period_s: float = 0.01,
        tokens_per_step: float
        | Callable[[TrainingArguments, TrainerState], float | None]
        | None = None,
        reduce: str = "local",
        optimize: bool | Mapping[str, Any] = False,
        measure_options: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__(
            devices=devices, backend=backend, sample_period_s=sample_period_s, reduce=reduce,
            optimize=optimize, accumulation="gradient accumulation steps",
            measure_options=measure_options,
        )  # fmt: skip
        check_tokens(tokens_per_step, "tokens_per_step")
        self.tokens_per_step = tokens_per_step
        self._tokens_at_begin = 0
        self._eval_window: Any = None
        self._final_logs: dict[str, Any] | None = None

    # -- lifecycle -----------------------------------------------------------------------------

    def _forget(self) -> None:
        self._eval_window = None

    def install(self, trainer: Any) -> _PowerlibCallbackImpl:
        """Put this callback right after the Trainer's ``DefaultFlowCallback``.

        The Trainer calls reporting integrations (TensorBoard, W&B, MLflow...) before the
        callbacks passed to it, so they do not see keys a later callback adds to ``logs``;
        ``state.log_history`` gets them either way. Installed this way, the reporters log the
        energy keys too.
        """
        handler = trainer.callback_handler
        if self in handler.callbacks:
            handler.callbacks.remove(self)
        flow = [
            i
            for i, cb in enumerate(handler.callbacks)
            if type(cb).__name__ == "DefaultFlowCallback"
        ]
        handler.callbacks.insert(flow[0] + 1 if flow else 0, self)
        return self

    def _devices(self, args: TrainingArguments) -> Any:
        if self.devices != "auto":
            return self.devices
        if args.world_size > 1:
            from powerlib.measure_api import LOCAL  # noqa: PLC0415 - the session and measurement load when a callback first runs

            return LOCAL  # this process's GPU, as the session picks it (docs/real-gpu.md §4)
        return None

    def _attach(
        self, stack: contextlib.ExitStack, args: TrainingArguments, model: Any, optimizer: Any
    ) -> None:
        import powerlib  # noqa: PLC0415 - the session and measurement load when a callback first runs
        from powerlib.integrations.torch_distributed import attach_module  # noqa: PLC0415 - the session and measurement load when a callback first runs

        assert self._optimize is not None
        if getattr(args, "deepspeed", None) or getattr(args, "deepspeed_plugin", None):
            raise NotSupportedError(
                "optimize=True does not hook DeepSpeed engines: use "
                "powerlib.integrations.deepspeed.attach_engine(session, trainer.model_wrapped)"
            )
        if args.n_gpu > 1:
            raise NotSupportedError(
                f"optimize=True does not hook torch.nn.DataParallel ({args.n_gpu} GPUs in one "
                "process): run one process per GPU (torchrun)"
            )
        if model is None or optimizer is None:
            raise NotSupportedError(
                "optimize=True: the Trainer gave the callback no model or optimizer"
            )
        options: dict[str, Any] = {"out_dir": f"{args.output_dir}/powerlib"}
        options.update(self._optimize)
        self.session = stack.enter_context(
            powerlib.optimize(
                num_stages=1,
                num_microbatches=args.gradient_accumulation_steps,
                **options,
            )
        )
        stack.enter_context(
            attach_module(self.session, _TrainingForwards(model), _torch_optimizer(optimizer))
        )

    def _step_tokens(self, args: TrainingArguments, state: TrainerState) -> float | None:
        spec = self.tokens_per_step
        if spec is None:
            if args.include_num_input_tokens_seen in ("no", False, None):
                return None
            seen = state.num_input_tokens_seen - self._tokens_at_begin
            return seen / max(args.world_size, 1)
        if callable(spec):
            value = spec(args, state)
            return None if value is None else float(value)
        return float(spec)

    def _open_eval(self) -> None:
        if self.running and self._eval_window is None:
            self._eval_window = self.measurement.window("eval")
            self._eval_window.__enter__()

    # -- Trainer events ------------------------------------------------------------------------

    def on_train_begin(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        model: Any = None,
        optimizer: Any = None,
        **kwargs: Any,
    ) -> None:
        """Start the measurement (and the session); a run a failed ``train()`` left is closed."""
        self._final_logs = None
        self._start(self._devices(args), lambda stack: self._attach(stack, args, model, optimizer))
        if args.eval_on_start:
            self._open_eval()

    def on_step_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """An optimizer step (all its accumulated micro-batches) starts."""
        if not self.running:
            return
        if self._eval_window is not None:  # an evaluation was due but did not run
            self._eval_window.__exit__(None, None, None)
            self._eval_window = None
        self._tokens_at_begin = state.num_input_tokens_seen
        self.measurement.begin_step()

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """The step ends after the optimizer step; an evaluation due now opens window ``eval``."""
        if not self.running:
            return
        self.measurement.end_step(tokens=self._step_tokens(args, state))
        if control.should_evaluate:
            self._open_eval()

    def on_epoch_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """An evaluation due at the epoch's end opens window ``eval``."""
        if control.should_evaluate:
            self._open_eval()

    def on_evaluate(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        metrics: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        """Close window ``eval``; its energy goes into the metrics and their log entry."""
        window, self._eval_window = self._eval_window, None
        if window is None or not self.running:
            return
        window.__exit__(None, None, None)
        res = self._now()
        if not res.devices:
            return  # no device: time only (docs/real-gpu.md §7)
        energy_j, time_s = window_energy(res, window.name, window.index)
        prefix = "eval"
        for key in metrics or {}:
            if key.endswith("_runtime"):
                prefix = key[: -len("_runtime")]
                break
        values = {f"{prefix}_energy_j": energy_j}
        if time_s > 0:
            values[f"{prefix}_power_w"] = energy_j / time_s
        if metrics is not None:
            entry = state.log_history[-1] if state.log_history else None
            if entry is not None and all(k in entry for k in metrics):
                entry.update(values)
            metrics.update(values)

    def on_log(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        logs: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        """Add the energy of the steps since the previous training log to this one."""
        if not self.running or logs is None:
            return
        final = "train_runtime" in logs
        if final:
            self._final_logs = logs
        if not (final or "loss" in logs):
            return  # an evaluation's or the user's own log
        values = self._interval.since_last(self._now())
        if not values:
            return
        # Trainer.log appended a copy of ``logs`` to log_history just before calling on_log
        entry = state.log_history[-1] if state.log_history else None
        if entry is not None and all(k in entry for k in logs):
            entry.update(values)
        logs.update(values)

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """Close everything; the totals go into the final summary (``TrainOutput.metrics``)."""
        if not self.running:
            return
        values = self._finish()
        if not values:
            return  # no device: time only (docs/real-gpu.md §7)
        entry = state.log_history[-1] if state.log_history else None
        final = self._final_logs
        if final is not None and entry is not None and all(k in entry for k in final):
            entry.update(values)
            final.update(values)
        else:
            state.log_history.append({**values, "step": state.global_step})


_CLASS: type | None = None


def __getattr__(name: str) -> Any:
    """``PowerlibCallback``: the callback on ``transformers.TrainerCallback``, made on first use."""
    global _CLASS
    if name != "PowerlibCallback":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if _CLASS is None:
        from transformers import TrainerCallback  # noqa: PLC0415 - optional dependency, imported where used

        _CLASS = lazy_class(sys.modules[__name__], name, _PowerlibCallbackImpl, TrainerCallback)
    return _CLASS
