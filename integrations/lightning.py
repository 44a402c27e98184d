"""Lightning: a ``Callback`` that logs energy per step (docs/callbacks.md).

::

    from powerlib.integrations.lightning import PowerlibCallback

    cb = PowerlibCallback()                           # or PowerlibCallback(optimize=True)
    trainer = lightning.pytorch.Trainer(callbacks=[cb], ...)
    trainer.fit(model, loader)
    cb.result.energy_per_step_j                       # the closed measurement

The callback runs a :func:`powerlib.measure` from ``on_fit_start`` to ``on_train_end``; each
optimizer step is one step of it (from the first batch it accumulates to the batch after which
``trainer.global_step`` advances). Every ``log_every_n_steps`` steps it logs, through
``pl_module.log`` (so into ``trainer.callback_metrics`` and the trainer's loggers), the energy of
the steps since the previous log. Validation runs are windows ``validation`` (the sanity check:
``sanity_check``), logged at their epoch end. At ``on_train_end`` it closes the measurement and
sends its totals to every logger (``logger.log_metrics``: Lightning forbids ``self.log`` there).
``on_exception`` (and ``teardown``) close it too.

``PowerlibCallback`` is built on ``lightning.pytorch.Callback`` (``pytorch_lightning.Callback``
where only that package is installed) and ``PLPowerlibCallback`` on ``pytorch_lightning.Callback``,
each when first looked up (PEP 562): importing this module imports no framework.
"""

from __future__ import annotations

import contextlib
import importlib
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from powerlib.errors import InvalidArgumentError, NotSupportedError
from powerlib.integrations._callbacks import MeasuredRun, check_tokens, lazy_class, window_energy

__all__ = ["PLPowerlibCallback", "PowerlibCallback"]  # noqa: F822 (module __getattr__)

# -- the callback ----------------------------------------------------------------------------------


class _PowerlibCallbackImpl(MeasuredRun):
    """Energy per step in Lightning's logs; optionally ``powerlib.optimize`` around ``fit``.

    Args:
        devices: What to measure: ``"auto"`` (default) is this process's device (its CUDA
            device, else ``LOCAL_RANK``: ``devices="local"`` of :func:`powerlib.measure`) in a
            multi-process job and every device of the backend in a single process; ``None`` is
            every device; or a list of ``Device`` objects, indexes or ids (as
            :func:`powerlib.measure`). Without a device (no GPU, no ``POWERLIB_BACKEND``) the
            callback warns once and logs no energy; training goes on (docs/real-gpu.md §7).
        backend: A backend or its name; default ``POWERLIB_BACKEND``.
        sample_period_s: How often the sampler thread reads each device (default 10 ms).
        tokens_per_batch: Tokens in one training batch of this process, for ``J/token``: a
            number, or ``callable(batch) -> float | None`` (``lambda b: b["input_ids"].numel()``);
            a step's tokens are those of the batches it accumulates. Default: no tokens.
        reduce: ``local`` (this process's devices) or ``world`` (every rank, each device once;
            a collective at every log, which every rank reaches).
        optimize: ``True``, or a dict of :func:`powerlib.optimize` options:
            enter a session at fit start (one stage, ``num_microbatches`` the trainer's
            ``accumulate_grad_batches``, ``out_dir`` default ``<default_root_dir>/powerlib``),
            drive its instructions from the trainer's hooks (forward: batch start to
            ``on_before_backward``; backward: to ``on_after_backward``; the step: the batch after
            which ``global_step`` advances), and close it at train end or on an exception.
            Automatic optimization with one optimizer only.
        log_every_n_steps: Log every this many optimizer steps; default the trainer's.
        prog_bar: Also show the logged values in the progress bar.
        measure_options: Further :class:`~powerlib.measure_api.Measurement` keywords.

    Attributes:
        measurement: The running (or last) :class:`~powerlib.measure_api.Measurement`.
        session: The optimize session of the last ``fit``, or ``None``.
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
        tokens_per_batch: float | Callable[[Any], float | None] | None = None,
        reduce: str = "local",
        optimize: bool | Mapping[str, Any] = False,
        log_every_n_steps: int | None = None,
        prog_bar: bool = False,
        measure_options: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__(
            devices=devices, backend=backend, sample_period_s=sample_period_s, reduce=reduce,
            optimize=optimize, accumulation="accumulate_grad_batches",
            measure_options=measure_options,
        )  # fmt: skip
        check_tokens(tokens_per_batch, "tokens_per_batch")
        if log_every_n_steps is not None and (
            isinstance(log_every_n_steps, bool)
            or not isinstance(log_every_n_steps, int)
            or log_every_n_steps < 1
        ):
            raise InvalidArgumentError(
                f"log_every_n_steps must be a positive integer or None, got {log_every_n_steps!r}"
            )
        self.tokens_per_batch = tokens_per_batch
        self.log_every_n_steps = log_every_n_steps
        self.prog_bar = bool(prog_bar)
        self._step: Any = None
        self._step_global = 0
        self._step_tokens: float | None = None
        self._window: Any = None
        self._instruction: str | None = None
        self._microbatch = 0

    # -- lifecycle -----------------------------------------------------------------------------

    def _forget(self) -> None:
        self._step = self._window = self._instruction = None

    def _devices(self, trainer: Any) -> Any:
        if self.devices != "auto":
            return self.devices
        if trainer.world_size > 1:
            from powerlib.measure_api import LOCAL  # noqa: PLC0415 - the session and measurement load when a callback first runs

            return LOCAL  # this process's GPU, as the session picks it (docs/real-gpu.md §4)
        return None

    def _attach(self, stack: contextlib.ExitStack, trainer: Any, pl_module: Any) -> None:
        import powerlib  # noqa: PLC0415 - the session and measurement load when a callback first runs

        assert self._optimize is not None
        if not pl_module.automatic_optimization or len(trainer.optimizers) != 1:
            raise NotSupportedError(
                "optimize=True drives automatic optimization with one optimizer; this "
                f"module has automatic_optimization={pl_module.automatic_optimization} "
                f"and {len(trainer.optimizers)} optimizer(s)"
            )
        options = {"out_dir": f"{trainer.default_root_dir}/powerlib"}
        options.update(self._optimize)
        self.session = stack.enter_context(
            powerlib.optimize(
                num_stages=1,
                num_microbatches=trainer.accumulate_grad_batches,
                **options,
            )
        )

    def _batch_tokens(self, batch: Any) -> float | None:
        spec = self.tokens_per_batch
        if spec is None:
            return None
        value = spec(batch) if callable(spec) else spec
        return None if value is None else float(value)

    def _begin(self, kind: str) -> None:
        self.session.begin(kind, self._microbatch)
        self._instruction = kind

    def _end(self) -> None:
        self._instruction = None
        self.session.end()

    def _log(self, pl_module: Any, values: Mapping[str, float], **options: Any) -> None:
        for key, value in values.items():
            pl_module.log(
                key,
                float(value),
                prog_bar=self.prog_bar,
                logger=True,
                batch_size=1,
                **options,
            )

    # -- Lightning hooks -----------------------------------------------------------------------

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        """Start the measurement (and the session)."""
        self._microbatch = 0
        self._start(self._devices(trainer), lambda stack: self._attach(stack, trainer, pl_module))

    def on_train_batch_start(
        self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int
    ) -> None:
        """The first batch of an optimizer step starts the step; each batch is a forward."""
        if not self.running:
            return
        if self._step is None:
            self._step = self.measurement.begin_step()
            self._step_global = trainer.global_step
            self._step_tokens = None
        if self.session is not None:
            self._begin("forward")

    def on_before_backward(self, trainer: Any, pl_module: Any, loss: Any) -> None:
        """The forward ends, the backward of the same micro-batch starts."""
        if self.session is not None and self._instruction == "forward":
            self._end()
            self._begin("backward")

    def on_after_backward(self, trainer: Any, pl_module: Any) -> None:
        """The backward ends."""
        if self.session is not None and self._instruction == "backward":
            self._end()
            self._microbatch += 1

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """The batch after which ``global_step`` advanced ends the step; log when one is due."""
        if not self.running or self._step is None:
            return
        tokens = self._batch_tokens(batch)
        if tokens is not None:
            self._step_tokens = (self._step_tokens or 0.0) + tokens
        if self.session is not None and self._instruction is not None:
            self._end()  # a training_step that returned None: no backward came
        if trainer.global_step <= self._step_global:
            return  # accumulating
        self.measurement.end_step(tokens=self._step_tokens)
        self._step = None
        if self.session is not None:
            self.session.step()
            self._microbatch = 0
        every = self.log_every_n_steps or trainer.log_every_n_steps
        if every and trainer.global_step % every == 0:
            values = self._interval.since_last(self._now())
            if values:
                self._log(pl_module, values, on_step=True, on_epoch=False)

    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        """A validation run (or the sanity check) is a window."""
        if self.running and self._window is None:
            name = "sanity_check" if trainer.sanity_checking else "validation"
            self._window = self.measurement.window(name)
            self._window.__enter__()

    def on_validation_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        """Close the window; a validation's energy is logged with its metrics."""
        window, self._window = self._window, None
        if window is None or not self.running:
            return
        window.__exit__(None, None, None)
        if window.name != "validation":
            return  # Lightning drops what the sanity check logs
        res = self._now()
        if not res.devices:
            return  # no device: time only (docs/real-gpu.md §7)
        energy_j, time_s = window_energy(res, window.name, window.index)
        values = {"validation_energy_j": energy_j}
        if time_s > 0:
            values["validation_power_w"] = energy_j / time_s
        self._log(pl_module, values, on_step=False, on_epoch=True)

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        """A window still open (an epoch end that did not come) closes here."""
        window, self._window = self._window, None
        if window is not None and self.running:
            window.__exit__(None, None, None)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        """Close everything and send the totals to the loggers."""
        if not self.running:
            return
        values = self._finish()
        if not values:
            return  # no device: time only (docs/real-gpu.md §7)
        for logger in trainer.loggers:
            logger.log_metrics(values, step=trainer.global_step)

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        """Close everything (the session restores the clocks)."""
        self.close()

    def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
        """Close whatever is still open."""
        self.close()

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        """Close whatever is still open."""
        self.close()


_CLASSES: dict[str, type] = {}


def _base(name: str) -> type:
    if name == "PLPowerlibCallback":
        return importlib.import_module("pytorch_lightning").Callback
    try:
        return importlib.import_module("lightning.pytorch").Callback
    except ImportError:  # only the older package name is installed
        return importlib.import_module("pytorch_lightning").Callback


def __getattr__(name: str) -> Any:
    """``PowerlibCallback`` and ``PLPowerlibCallback``: the callback on each package's base."""
    if name not in ("PowerlibCallback", "PLPowerlibCallback"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if name not in _CLASSES:
        base = _base(name)
        made = next((c for c in _CLASSES.values() if issubclass(c, base)), None)
        _CLASSES[name] = made or lazy_class(
            sys.modules[__name__], name, _PowerlibCallbackImpl, base
        )
    return _CLASSES[name]
