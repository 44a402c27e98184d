"""Measuring Kareus partitions on real devices: the :class:`Evaluator` behind the per-partition search.

:class:`DeviceEvaluator` implements :class:`~powerlib.kareus.evaluator.Evaluator` through
the device contract. The caller supplies what only the framework can do, a callable that runs one
partition on the GPU and waits for it (``run(ptype, config)``: both nanobatches' compute with the
collective launched at ``config.slot`` on ``config.sm_count`` SMs, then a device synchronise); the
evaluator follows :class:`~powerlib.kareus.evaluator.MeasureProtocol` around it
(docs/kareus.md §2.1 "Measurement", §6.1 item 3):

1. lock the SM clock of every device to ``config.freq_mhz`` (min = max), through a
   :class:`~powerlib.control.ControlSession`: journaled before the change, restored afterwards;
2. wait ``settle_s`` (drivers apply clocks asynchronously);
3. run the partition for ``warmup_s`` without measuring;
4. time-stamp one energy-counter update just before the window (:class:`SpanMeter`: executions
   with a read of every counter after each, until each counter moves), run the partition
   repeatedly for at least ``window_s`` without reading anything, then time-stamp one update
   after it the same way: time per execution = window / executions; energy per execution = mean
   over devices of (counter delta between the two updates / time between them) × time per
   execution, with the bound :attr:`Measurement.energy_rel_error` from the two updates'
   brackets (the slowest *rank* of a multi-process group is the caller's to take, e.g. an
   all-reduce max of :attr:`Measurement.time_s`);
5. idle ``cooldown_s`` (mean energy follows the temperature at the window's start);
6. restore the clocks, on every exit path (an exception in ``run`` included).

Time comes from ``clock`` and waiting from ``sleep``: wall time by default, or a simulated
backend's :class:`~powerlib.backends.simulated.VirtualClock` (``clock=vc.now``,
``sleep=vc.advance``) whose simulated work advances it, so tests run the protocol without sleeping.

Why two time-stamped updates and not two reads (docs/measurement.md §2 "Knots"): NVML publishes
the counter about every 100 ms and a read returns the last published value, so the delta of two
reads ``L`` seconds apart is off by up to one update, ``P / L`` of the energy, by chance (20 % of
a 0.5 s window's, still 2 % of the protocol's 5 s). The value an update publishes is the
exact energy at an instant inside its bracket (the read before it to the read that saw it), so
the energy between two updates is exact and only their times are uncertain, by half a bracket
each: the error is then a bracket (one execution and a read), not an update, and it is stated.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any

from powerlib.backend import Backend
from powerlib.control import ControlSession
from powerlib.device import Device
from powerlib.errors import DeviceError, InvalidArgumentError, NotSupportedError
from powerlib.kareus.energy_counter import EnergyMeter
from powerlib.kareus.evaluator import Measurement, MeasureProtocol
from powerlib.kareus.partition_types import Config, Op, PartitionType, Segment

__all__ = [
    "COUNTER_WAIT_S",
    "CounterSpan",
    "DeviceEvaluator",
    "RunCompute",
    "RunPartition",
    "RunSequential",
    "SpanMeter",
]

RunPartition = Callable[[PartitionType, Config], Any]
"""``run(ptype, config)``: one execution of a partition on the GPU, synchronised at the end."""
RunSequential = Callable[[tuple[Segment, ...], float, int], Any]
"""``run(segments, freq_mhz, sm_count)``: the segments without overlap, synchronised."""
RunCompute = Callable[[tuple[Op, ...], float], Any]
"""``run(ops, freq_mhz)``: compute ops alone, synchronised."""

COUNTER_WAIT_S = 2.0
"""How long :class:`SpanMeter` runs executions waiting for a counter to move (NVML: ~0.1 s)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class CounterSpan:
    """One device's energy between two counter updates that a :class:`SpanMeter` time-stamped.

    Attributes:
        energy_j: The counter's delta between the two updates: exact (to the counter's unit),
            since each update publishes the energy at the instant it happens.
        span_s: Time between the updates, from the middle of one bracket to the middle of the
            other.
        brackets_s: Widths of the two brackets (each update happened inside its own).
        reads_s: Time spent reading counters within the brackets' outer edges: idle time
            that the run in the window, which reads nothing, does not have.
    """

    energy_j: float
    span_s: float
    brackets_s: tuple[float, float]
    reads_s: float

    @property
    def power_w(self) -> float:
        """Mean power of the run: the energy over the span less half its reads (see below)."""
        run_s = self.span_s - self.reads_s / 2
        return self.energy_j / run_s if run_s > 0 else math.inf

    @property
    def rel_error(self) -> float:
        """Bound on the relative error of :attr:`power_w` as the mean power of the run.

        Each update lies within half its bracket of the bracket's middle, so the true span
        ``S`` is within ``h = (w1 + w2) / 2`` of :attr:`span_s`. The run's power ``p`` fills it
        but for ``g`` seconds of reads, when the device drew between nothing and ``p``, so
        ``p`` lies between ``E / S`` and ``E / (S − g)``: :attr:`power_w` takes the middle,
        ``E / (span_s − g / 2)``, and is off by at most ``(h + g / 2) / (span_s − h − g)``;
        ``inf`` when that leaves no time (docs/kareus.md §2.1 "How powerlib measures energy").
        """
        half_s = sum(self.brackets_s) / 2
        left_s = self.span_s - half_s - self.reads_s
        if left_s <= 0:
            return math.inf
        return (half_s + self.reads_s / 2) / left_s

    def to_json(self) -> dict[str, object]:
        """The fields, with ``power_w`` and ``rel_error``."""
        return {
            "energy_j": self.energy_j,
            "span_s": self.span_s,
            "brackets_s": list(self.brackets_s),
            "reads_s": self.reads_s,
            "power_w": self.power_w,
            "rel_error": self.rel_error,
        }


class SpanMeter:
    """Time-stamps one update of every energy counter before a window and one after it.

    A counter read returns the last value the driver published (NVML: every ~100 ms), so the
    update that a read first shows happened between the read before it and that read: a knot
    of docs/measurement.md §2, whose value is the exact energy at an instant inside that
    bracket. :meth:`first_update` and :meth:`last_update` run executions with a read of every
    counter after each until every counter has moved; between the two calls the caller runs
    its window without reads. Reads cost (NVML: ~3 ms each), so only the executions next to
    the two updates are read after, and the reads that fall inside the span count in its
    bound (:attr:`CounterSpan.rel_error`).

    Args:
        devices: The devices, read in this order through an
            :class:`~powerlib.kareus.energy_counter.EnergyMeter` each (closed by :meth:`close`).
        clock: Time source in seconds (the caller's: wall or virtual).
        stop: Called after every execution with whether *this* process has seen every counter
            move; returns whether to stop (a group's agreement, so that every rank runs as many
            executions; default: stop when done).
        wait_s: Executions run for at most this long waiting for a counter to move.

    Raises:
        NotSupportedError: A device reports neither an energy counter nor power.
    """

    def __init__(
        self,
        devices: Sequence[Device],
        *,
        clock: Callable[[], float] = time.perf_counter,
        stop: Callable[[bool], bool] | None = None,
        wait_s: float = COUNTER_WAIT_S,
    ) -> None:
        self._devices = list(devices)
        self._meters: list[EnergyMeter] = []
        try:
            for dev in self._devices:
                self._meters.append(EnergyMeter(dev, clock=clock))
        except BaseException:
            self.close()
            raise
        self._clock = clock
        self._stop = stop or (lambda done: done)
        self._wait_s = wait_s
        self._knots: list[list[tuple[float, float, float]]] = [[] for _ in self._meters]
        self._reads: list[tuple[float, float]] = []  # (start, end) of each round of reads

    def close(self) -> None:
        """Stop the meters' samplers (power-integrating devices only). Idempotent."""
        for meter in self._meters:
            meter.close()

    def __enter__(self) -> SpanMeter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def first_update(self, once: Callable[[], Any]) -> int:
        """Run ``once`` until every counter has moved; returns the executions run."""
        return self._poll(once)

    def last_update(self, once: Callable[[], Any]) -> int:
        """Like :meth:`first_update`, after the window; returns the executions run."""
        return self._poll(once)

    @property
    def first_brackets_s(self) -> tuple[float, ...]:
        """Width of each counter's first bracket (after :meth:`first_update`)."""
        return tuple(knots[0][1] - knots[0][0] for knots in self._knots if knots)

    def spans(self) -> tuple[CounterSpan, ...]:
        """Per counter, the span from its first to its last time-stamped update.

        Raises:
            InvalidArgumentError: :meth:`first_update` and :meth:`last_update` have not both run.
        """
        out = []
        for knots in self._knots:
            if len(knots) < 2:
                raise InvalidArgumentError("spans() needs first_update() and last_update() first")
            (lo1, hi1, e1), (lo2, hi2, e2) = knots[0], knots[-1]
            reads_s = math.fsum(
                max(0.0, min(end, hi2) - max(start, lo1)) for start, end in self._reads
            )
            out.append(
                CounterSpan(
                    energy_j=e2 - e1,
                    span_s=(lo2 + hi2) / 2 - (lo1 + hi1) / 2,
                    brackets_s=(hi1 - lo1, hi2 - lo2),
                    reads_s=reads_s,
                )
            )
        return tuple(out)

    def _read(self, which: Iterable[int]) -> tuple[float, float, dict[int, float]]:
        start = self._clock()
        values = {i: self._meters[i].read_j() for i in which}
        end = self._clock()
        self._reads.append((start, end))
        return start, end, values

    def _poll(self, once: Callable[[], Any]) -> int:
        pending = set(range(len(self._meters)))
        start, _, values = self._read(pending)
        last = {i: (start, value) for i, value in values.items()}  # read start, value seen
        begin = self._clock()
        runs = 0
        while True:
            once()
            runs += 1
            if pending:
                start, end, values = self._read(sorted(pending))
                for i, value in values.items():
                    if value != last[i][1]:  # updated since the read before: a bracket
                        self._knots[i].append((last[i][0], end, value))
                        pending.discard(i)
                    last[i] = (start, value)
            late = bool(pending) and self._clock() - begin > self._wait_s
            if self._stop(not pending or late):  # a late rank stops with its group, then fails
                break
        if pending:
            dev = self._devices[min(pending)]
            raise DeviceError(
                f"the energy counter of {dev.info.name} did not move in {self._wait_s:g} s "
                "of executions, so their energy cannot be measured",
                device=dev.device_id,
            )
        return runs


class DeviceEvaluator:
    """Measures partitions on real (or simulated) devices with the thermally stable protocol.

    Args:
        backend: The open backend of ``devices``; the evaluator's own
            :class:`~powerlib.control.ControlSession` changes their clocks through it.
        run: Runs one partition under a configuration and waits for the device.
        p_static_w: Power of a GPU that holds a context and waits (blocked on P2P), in watts:
            measured on the machine (85 W on A100).
        devices: The devices one execution uses (this process's); default: every device of
            ``backend``.
        protocol: Settle, warm-up, window and cool-down durations.
        freqs_mhz: Clocks the search may use; default: the clocks every device supports.
        run_sequential: Runs segments without overlap (for :meth:`evaluate_sequential`).
        run_compute: Runs compute ops alone (for :meth:`evaluate_compute`).
        clock: Time source in seconds (default ``time.perf_counter``).
        sleep: Waits a number of seconds (default ``time.sleep``).
        agree: For a ``run`` that issues collectives (a tensor-parallel partition): makes every
            rank of the group run the same number of executions. Called after each execution
            of the warm-up and of the window with whether *this* rank's time is up; returns
            whether the group stops (e.g. an all-reduce MIN of the flag over the group, so that
            every rank has run at least its window). Default: each rank decides alone.
        combine: Applied to every measurement before it is returned: for a group, the group's
            figure (e.g. the slowest rank's time and the mean energy), so that every rank of it
            gets the same numbers and a search on each rank takes the same decisions (and so
            issues the same collectives). Default: this rank's own.

    Raises:
        InvalidArgumentError: No devices, a device without lockable clocks, a negative
            ``p_static_w``, or a clock some device does not support.
    """

    def __init__(
        self,
        backend: Backend,
        run: RunPartition,
        *,
        p_static_w: float,
        devices: Sequence[Device] | None = None,
        protocol: MeasureProtocol | None = None,
        freqs_mhz: Sequence[float] | None = None,
        run_sequential: RunSequential | None = None,
        run_compute: RunCompute | None = None,
        clock: Callable[[], float] = time.perf_counter,
        sleep: Callable[[float], None] = time.sleep,
        agree: Callable[[bool], bool] | None = None,
        combine: Callable[[Measurement], Measurement] | None = None,
    ) -> None:
        devs = list(backend.devices() if devices is None else devices)
        if not devs:
            raise InvalidArgumentError("the evaluator needs at least one device")
        if not (isinstance(p_static_w, int | float) and p_static_w >= 0):
            raise InvalidArgumentError(
                f"p_static_w must be a non-negative power in W, got {p_static_w!r}"
            )
        common: set[float] | None = None
        for dev in devs:
            supported = set(dev.info.supported_sm_freqs_mhz)
            if not supported:
                raise InvalidArgumentError(
                    f"{dev.info.name} cannot lock its SM clock, so it cannot be evaluated",
                    device=dev.device_id,
                )
            common = supported if common is None else common & supported
        assert common is not None
        if freqs_mhz is None:
            freqs = tuple(sorted(common))
        else:
            freqs = tuple(sorted({float(f) for f in freqs_mhz}))
            odd = [f for f in freqs if f not in common]
            if odd or not freqs:
                raise InvalidArgumentError(
                    f"the devices cannot all lock {odd[0]:g} MHz" if odd else "freqs_mhz is empty"
                )
        self._backend = backend
        self._devices = devs
        self._run = run
        self._run_sequential = run_sequential
        self._run_compute = run_compute
        self._p_static_w = float(p_static_w)
        self._freqs = freqs
        self.protocol = protocol or MeasureProtocol()
        self._clock = clock
        self._sleep = sleep
        self._agree = agree
        self._combine = combine
        self._control: ControlSession | None = None
        self.evaluations = 0

    # -- Evaluator protocol ------------------------------------------------------------------------

    @property
    def p_static_w(self) -> float:
        """Power of a GPU that holds a context and waits (blocked on P2P), in watts."""
        return self._p_static_w

    @property
    def freqs_mhz(self) -> tuple[float, ...]:
        """Clocks the evaluator can lock, ascending."""
        return self._freqs

    @property
    def devices(self) -> list[Device]:
        """The measured devices."""
        return list(self._devices)

    def evaluate(self, ptype: PartitionType, config: Config) -> Measurement:
        """One execution of ``ptype`` under ``config`` (thermally stable protocol)."""
        return self._measure(config.freq_mhz, lambda: self._run(ptype, config))

    def evaluate_sequential(
        self, segments: tuple[Segment, ...], freq_mhz: float, sm_count: int
    ) -> Measurement:
        """One execution of ``segments`` without overlap (needs ``run_sequential``).

        Raises:
            NotSupportedError: The evaluator was built without ``run_sequential``.
        """
        fn = self._run_sequential
        if fn is None:
            raise NotSupportedError(
                "this DeviceEvaluator has no run_sequential to run segments with"
            )
        return self._measure(freq_mhz, lambda: fn(segments, freq_mhz, sm_count))

    def evaluate_compute(self, ops: tuple[Op, ...], freq_mhz: float) -> Measurement:
        """One execution of compute ``ops`` alone, on all SMs (needs ``run_compute``).

        Raises:
            NotSupportedError: The evaluator was built without ``run_compute``.
        """
        fn = self._run_compute
        if fn is None:
            raise NotSupportedError("this DeviceEvaluator has no run_compute to run ops with")
        return self._measure(freq_mhz, lambda: fn(ops, freq_mhz))

    # -- lifecycle -------------------------------------------------------------------------------

    def close(self) -> None:
        """Restore every device and release the control session. Idempotent."""
        if self._control is not None:
            self._control.close()
            self._control = None

    def __enter__(self) -> DeviceEvaluator:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # -- the protocol ----------------------------------------------------------------------------

    def _measure(self, freq_mhz: float, once: Callable[[], Any]) -> Measurement:
        if float(freq_mhz) not in self._freqs:
            raise InvalidArgumentError(
                f"{freq_mhz:g} MHz is not one of the evaluator's clocks "
                f"({self._freqs[0]:g}-{self._freqs[-1]:g} MHz)"
            )
        protocol = self.protocol
        clock, sleep = self._clock, self._sleep
        if self._control is None:
            self._control = ControlSession(self._backend).start()
        control = self._control
        meter: SpanMeter | None = None
        start = clock()
        try:
            for dev in self._devices:
                control.lock_sm_clocks(dev, freq_mhz, freq_mhz)
            meter = SpanMeter(self._devices, clock=clock, stop=self._stop)
            if protocol.settle_s:
                sleep(protocol.settle_s)
            t = clock()
            if protocol.warmup_s > 0:
                while True:
                    self._once(once)
                    if self._stop(clock() - t >= protocol.warmup_s):
                        break
            temps = [dev.read_state().temperature_c for dev in self._devices]
            # Not two reads around the window: a counter updated every ~100 ms would be off by
            # up to one update (module docstring); one time-stamped update on each side instead.
            meter.first_update(lambda: self._once(once))
            t0 = clock()
            count = 0
            while True:
                self._once(once)
                count += 1
                if self._stop(clock() - t0 >= protocol.window_s):
                    break
            t1 = clock()
            meter.last_update(lambda: self._once(once))
            spans = meter.spans()
            if protocol.cooldown_s:
                sleep(protocol.cooldown_s)
        finally:
            if meter is not None:
                meter.close()
            control.restore()  # every exit path: the clocks go back to what they were
        self.evaluations += 1
        time_s = (t1 - t0) / count
        # the window's mean power (energy between the updates over the time between them) times
        # the time of one execution; the bound weighs each device's by its energy
        energies_j = [span.power_w * time_s for span in spans]
        total_j = math.fsum(energies_j)
        rel = math.fsum(e * span.rel_error for e, span in zip(energies_j, spans))
        known = [c for c in temps if c is not None]
        measured = Measurement(
            time_s=time_s,
            energy_j=total_j / len(spans),
            energy_rel_error=rel / total_j if total_j > 0 else math.inf,
            p_static_w=self._p_static_w,
            wall_s=clock() - start,
            avg_freq_mhz=None,  # clocks read between executions show the idle clock, not the run's
            start_temp_c=sum(known) / len(known) if known else None,
        )
        return measured if self._combine is None else self._combine(measured)

    def _stop(self, elapsed: bool) -> bool:
        return elapsed if self._agree is None else bool(self._agree(elapsed))

    def _once(self, once: Callable[[], Any]) -> None:
        before = self._clock()
        once()
        if self._clock() <= before:
            raise InvalidArgumentError(
                "one execution took no time on the evaluator's clock: the run callable must "
                "advance it (synchronise the device; on a virtual clock, run simulated work)"
            )
