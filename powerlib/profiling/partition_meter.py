"""Measuring Kareus partitions on real devices: the :class:`Evaluator` behind the per-partition search.

:class:`DeviceEvaluator` implements :class:`~powerlib.planning.kareus.evaluator.Evaluator` through
the device contract. The caller supplies what only the framework can do, a callable that runs one
partition on the GPU and waits for it (``run(ptype, config)``: both nanobatches' compute with the
collective launched at ``config.slot`` on ``config.sm_count`` SMs, then a device synchronise); the
evaluator follows :class:`~powerlib.planning.kareus.evaluator.MeasureProtocol` around it
(docs/kareus.md §2.1 "Measurement", §6.1 item 3):

1. lock the SM clock of every device to ``config.freq_mhz`` (min = max), through a
   :class:`~powerlib.control.ControlSession`: journaled before the change, restored afterwards;
2. wait ``settle_s`` (drivers apply clocks asynchronously);
3. run the partition for ``warmup_s`` without measuring;
4. run it repeatedly for at least ``window_s``, reading every device's energy counter before and
   after: time per execution = window / executions, energy per execution = mean over devices of
   the counter delta / executions (the slowest *rank* of a multi-process group is the caller's to
   take, e.g. an all-reduce max of :attr:`Measurement.time_s`);
5. idle ``cooldown_s`` (mean energy follows the temperature at the window's start);
6. restore the clocks, on every exit path (an exception in ``run`` included).

Time comes from ``clock`` and waiting from ``sleep``: wall time by default, or a simulated
backend's :class:`~powerlib.backends.simulated.VirtualClock` (``clock=vc.now``,
``sleep=vc.advance``) whose simulated work advances it, so tests run the protocol without sleeping.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import Any

from powerlib.control import ControlSession
from powerlib.device import Backend, Device
from powerlib.errors import InvalidArgumentError, NotSupportedError
from powerlib.planning.kareus.evaluator import Measurement, MeasureProtocol
from powerlib.planning.kareus.partition import Config, Op, PartitionType, Segment
from powerlib.profiling.meter import EnergyMeter

__all__ = ["DeviceEvaluator", "RunCompute", "RunPartition", "RunSequential"]

RunPartition = Callable[[PartitionType, Config], Any]
"""``run(ptype, config)``: one execution of a partition on the GPU, synchronised at the end."""
RunSequential = Callable[[tuple[Segment, ...], float, int], Any]
"""``run(segments, freq_mhz, sm_count)``: the segments without overlap, synchronised."""
RunCompute = Callable[[tuple[Op, ...], float], Any]
"""``run(ops, freq_mhz)``: compute ops alone, synchronised."""


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
        meters: list[EnergyMeter] = []
        start = clock()
        try:
            for dev in self._devices:
                control.lock_sm_clocks(dev, freq_mhz, freq_mhz)
            meters = [EnergyMeter(dev, clock=clock) for dev in self._devices]
            if protocol.settle_s:
                sleep(protocol.settle_s)
            t = clock()
            if protocol.warmup_s > 0:
                while True:
                    self._once(once)
                    if self._stop(clock() - t >= protocol.warmup_s):
                        break
            temps = [dev.read_state().temperature_c for dev in self._devices]
            e0 = [m.read_j() for m in meters]
            t0 = clock()
            count = 0
            while True:
                self._once(once)
                count += 1
                if self._stop(clock() - t0 >= protocol.window_s):
                    break
            t1 = clock()
            e1 = [m.read_j() for m in meters]
            if protocol.cooldown_s:
                sleep(protocol.cooldown_s)
        finally:
            for m in meters:
                m.close()
            control.restore()  # every exit path: the clocks go back to what they were
        self.evaluations += 1
        energy_j = sum(b - a for a, b in zip(e0, e1)) / len(meters) / count
        known = [c for c in temps if c is not None]
        measured = Measurement(
            time_s=(t1 - t0) / count,
            energy_j=energy_j,
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
