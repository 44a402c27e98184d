"""What the trainer callbacks share (docs/callbacks.md): argument checks and the logged figures.

Framework-free: :mod:`powerlib.integrations.huggingface` and :mod:`powerlib.integrations.lightning`
build their callback classes on it, and both log the same keys.
"""

from __future__ import annotations

import contextlib
import inspect
import math
from collections.abc import Callable, Mapping
from types import TracebackType
from typing import Any

from powerlib.errors import InvalidArgumentError

RESERVED = ("num_stages", "num_microbatches")
"""Session options a callback sets itself (one stage; the gradient accumulation steps)."""


class MeasuredRun:
    """What both callbacks are: one measurement (and perhaps a session) from start to end.

    The framework's own ``Callback`` follows this class in the made class's bases
    (:func:`lazy_class`), so ``super().__init__()`` reaches it. Subclasses say what a run is
    (their hooks), drop their per-run state in :meth:`_forget`, and hook a session into the
    stack in the ``attach`` they pass to :meth:`_start`.
    """

    def __init__(
        self,
        *,
        devices: Any,
        backend: Any,
        sample_period_s: Any,
        reduce: str,
        optimize: bool | Mapping[str, Any] | None,
        accumulation: str,
        measure_options: Mapping[str, Any] | None,
    ) -> None:
        super().__init__()
        self.sample_period_s = check_common(devices, reduce, sample_period_s)
        self.devices = devices
        self.backend = backend
        self.reduce = reduce
        self._optimize = optimize_options(optimize, accumulation)
        self._measure_options = dict(measure_options or {})
        self.measurement: Any = None
        self.session: Any = None
        self.result: Any = None
        self._stack: contextlib.ExitStack | None = None
        self._interval = Interval()

    @property
    def running(self) -> bool:
        """Whether a measurement is open (between the run's start and its end)."""
        return self._stack is not None

    def close(self) -> None:
        """Close what the run's start opened (hooks, session, measurement), without logging.

        Idempotent. For the exception path where the framework has no hook for it.
        """
        stack, self._stack = self._stack, None
        self._forget()
        if stack is not None:
            stack.close()

    def __enter__(self) -> MeasuredRun:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _forget(self) -> None:
        """Drop the per-run state the hooks keep (the measurement's stack is closing)."""

    def _start(self, devices: Any, attach: Callable[[contextlib.ExitStack], None]) -> None:
        """Open a run: close one a failure left, then open the measurement.

        With ``optimize``, ``attach`` enters the session (and its hooks) into the run's stack.
        """
        import powerlib  # noqa: PLC0415 - the session and measurement load when a callback first runs

        self.close()
        self.result = None
        self._interval = Interval()
        stack = contextlib.ExitStack()
        try:
            options = {"backend": self.backend, "sample_period_s": self.sample_period_s}
            options.update(self._measure_options)
            self.measurement = stack.enter_context(powerlib.measure(devices, **options))
            self.session = None
            if self._optimize is not None:
                attach(stack)
        except BaseException:
            stack.close()
            raise
        self._stack = stack

    def _now(self) -> Any:
        """The running measurement's result so far (``reduce`` over the world: a collective)."""
        return self.measurement.result(self.reduce)

    def _finish(self) -> dict[str, float]:
        """Close the run; keep its result and return its totals for the trainer's logs."""
        measurement = self.measurement
        self.close()
        self.result = measurement.result(self.reduce)
        return totals(self.result)


class Interval:
    """Cumulative step totals at the previous log: each log reports the steps since then.

    Every log takes the difference of the cumulative figures, so the logged ``energy_j`` values
    add up to the steps' energy at the last log, even though the newest steps of a running
    measurement are provisional (extrapolated from power until the counter publishes).
    """

    def __init__(self) -> None:
        self.steps = 0
        self.energy_j = 0.0
        self.time_s = 0.0
        self.tokens = 0.0

    def since_last(self, res: Any) -> dict[str, float]:
        """The figures of the steps since the previous call; ``{}`` if none.

        ``energy_j``, ``energy_per_step_j``, ``energy_total_j`` and, where known, ``power_w``
        and ``energy_per_token_j``; ``{}`` without a measured device (time only, docs/real-gpu.md
        §7).
        """
        if not res.devices:
            return {}
        steps = res.num_steps
        if steps <= self.steps:
            return {}
        energy_j = math.fsum(res.step_energy_j)
        time_s = math.fsum(res.step_time_s)
        tokens = res.tokens or 0.0
        d_steps = steps - self.steps
        d_energy = energy_j - self.energy_j
        d_time = time_s - self.time_s
        d_tokens = tokens - self.tokens
        self.steps, self.energy_j, self.time_s, self.tokens = steps, energy_j, time_s, tokens
        out = {
            "energy_j": d_energy,
            "energy_per_step_j": d_energy / d_steps,
            "energy_total_j": res.energy_j,
        }
        if d_time > 0:
            out["power_w"] = d_energy / d_time
        if d_tokens > 0:
            out["energy_per_token_j"] = d_energy / d_tokens
        return out


def totals(res: Any, prefix: str = "train_") -> dict[str, float]:
    """The closed measurement's figures, ``train_``-prefixed (none without a measured device)."""
    if not res.devices:
        return {}
    values = {
        "energy_j": res.energy_j,
        "steps_energy_j": math.fsum(res.step_energy_j),
        "power_w": res.average_power_w,
        "energy_per_step_j": res.energy_per_step_j,
        "energy_per_token_j": res.energy_per_token_j,
    }
    return {prefix + k: float(v) for k, v in values.items() if v is not None}


def window_energy(res: Any, name: str, index: int) -> tuple[float, float]:
    """Energy (every rank's share) and length (the longest rank's) of window ``name`` #``index``."""
    found = [w for w in res.window(name) if w.index == index]
    return math.fsum(w.energy_j for w in found), max((w.time_s for w in found), default=0.0)


def optimize_options(
    optimize: bool | Mapping[str, Any] | None, accumulation: str
) -> dict[str, Any] | None:
    """``optimize`` as Session keywords, checked now so that a typo fails at construction.

    ``accumulation`` names the trainer's gradient accumulation setting, for the error message.
    """
    if optimize is False or optimize is None:
        return None
    if optimize is True:
        return {}
    if not isinstance(optimize, Mapping):
        raise InvalidArgumentError(
            f"optimize must be True, False or a dict of powerlib.optimize options, got {optimize!r}"
        )
    options = dict(optimize)
    reserved = sorted(k for k in options if k in RESERVED)
    if reserved:
        raise InvalidArgumentError(
            f"optimize: {', '.join(reserved)} are set by the callback (one stage, the trainer's "
            f"{accumulation}); leave them out"
        )
    from powerlib.runtime.session import optimize as make_session  # noqa: PLC0415 - the session and measurement load when a callback first runs

    known = set(inspect.signature(make_session).parameters)
    unknown = sorted(set(options) - known)
    if unknown:
        raise InvalidArgumentError(
            f"optimize: unknown powerlib.optimize option(s) {', '.join(unknown)}"
        )
    return options


def check_common(devices: Any, reduce: str, sample_period_s: Any) -> float:
    """The arguments both callbacks take; returns ``sample_period_s`` as a float."""
    if isinstance(devices, str) and devices != "auto":
        raise InvalidArgumentError(
            f"devices must be 'auto', None or a list of devices, got {devices!r}"
        )
    if reduce not in ("local", "world"):
        raise InvalidArgumentError(f"reduce must be 'local' or 'world', got {reduce!r}")
    if isinstance(sample_period_s, bool) or not (
        isinstance(sample_period_s, (int, float))
        and math.isfinite(sample_period_s)
        and sample_period_s > 0
    ):
        raise InvalidArgumentError(
            f"sample_period_s must be a positive number of seconds, got {sample_period_s!r}"
        )
    return float(sample_period_s)


def check_tokens(tokens: Any, name: str) -> None:
    """``tokens`` is ``None``, a callable, or a finite number >= 0."""
    if tokens is None or callable(tokens):
        return
    if isinstance(tokens, bool) or not isinstance(tokens, (int, float)):
        raise InvalidArgumentError(f"{name} must be a number, a callable or None, got {tokens!r}")
    if not (math.isfinite(tokens) and tokens >= 0):
        raise InvalidArgumentError(f"{name} must be a finite number >= 0, got {tokens!r}")


def lazy_class(module: Any, name: str, impl: type, base: type) -> type:
    """``type(name, (impl, base))`` with the module, name and docstring a user expects."""
    cls = type(name, (impl, base), {"__doc__": impl.__doc__, "__module__": module.__name__})
    cls.__qualname__ = name
    return cls
