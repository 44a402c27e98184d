"""The clock-change landing latency, measured under a load (``powerlib check --load``).

An idle GPU parks its clock whatever the lock says, so the latency is measured while a short
load runs on the device (the backend's own, simulated work on the simulator; else a float16
torch matmul loop on the CUDA/ROCm device with the GPU's UUID): a low clock is locked, then a high
one, a few times, through a :class:`~powerlib.control.ControlSession` (journaled first, always
restored), and each change is timed until the running clock shows it (docs/real-gpu.md §8). The
readiness check that reports it is :mod:`powerlib.node_check.check`.
"""

from __future__ import annotations

import contextlib
import statistics
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from powerlib.backend import Backend, gpu_uuid_key
from powerlib.device import Device, DeviceKind

__all__ = [
    "LANDING_REPETITIONS",
    "LANDING_TIMEOUT_S",
    "LOAD_WARMUP_S",
    "LatencyCheck",
    "measure_landing_latency",
]

LANDING_REPETITIONS = 3
"""Low-then-high clock pairs the landing latency is measured over (two landings each)."""

LANDING_TIMEOUT_S = 1.0
"""How long one clock change may take to show in the running clock before it counts as missed."""

LOAD_WARMUP_S = 0.2
"""How long a real load runs before the first clock change (the clock ramps up from idle)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class LatencyCheck:
    """The clock-change landing latency: from a lock request to the running clock showing it.

    Attributes:
        measured: True when clock changes were made and timed.
        reason: Why it was not measured (``None`` when it was).
        load: What ran while it was measured (``"simulated work"``, ``"torch matmul on cuda:0"``).
        low_mhz: The low clock locked.
        high_mhz: The high clock locked.
        samples_s: Each landing's latency, in order (low, high, low, high, ...).
        missed: Changes that did not show within the timeout (power cap, thermal limit...).
        median_s: Median of ``samples_s`` (``None`` without samples).
        max_s: Maximum of ``samples_s`` (``None`` without samples).
    """

    measured: bool
    reason: str | None = None
    load: str | None = None
    low_mhz: float | None = None
    high_mhz: float | None = None
    samples_s: tuple[float, ...] = ()
    missed: int = 0

    @property
    def median_s(self) -> float | None:
        """Median landing latency."""
        return statistics.median(self.samples_s) if self.samples_s else None

    @property
    def max_s(self) -> float | None:
        """Slowest landing."""
        return max(self.samples_s) if self.samples_s else None

    def to_json(self) -> dict[str, object]:
        """JSON-ready fields."""
        return {
            "measured": self.measured,
            "reason": self.reason,
            "load": self.load,
            "low_mhz": self.low_mhz,
            "high_mhz": self.high_mhz,
            "samples_s": list(self.samples_s),
            "missed": self.missed,
            "median_s": self.median_s,
            "max_s": self.max_s,
        }


class _LoadUnavailable(Exception):
    """No load can run on this device here; the message says why."""


def _cuda_ordinal(torch: Any, dev: Device, backend: Backend) -> int:
    """The CUDA ordinal of ``dev``: by UUID, else by index when both list the same GPUs."""
    count = torch.cuda.device_count()
    uuids = []
    for i in range(count):
        uuid = getattr(torch.cuda.get_device_properties(i), "uuid", None)
        uuids.append(None if uuid is None else str(uuid))
    wanted = gpu_uuid_key(dev.device_id)
    for i, uuid in enumerate(uuids):
        if uuid is not None and gpu_uuid_key(uuid) == wanted:
            return i
    if all(u is None for u in uuids) and count == len(backend.devices()):
        return dev.index
    raise _LoadUnavailable(f"no CUDA device has this GPU's UUID {dev.device_id}")


@contextlib.contextmanager
def _torch_load(dev: Device, backend: Backend) -> Iterator[str]:
    """A half-precision matmul loop on the device, in a thread, until the block ends."""
    try:
        import torch  # noqa: PLC0415 - optional, and slow to import
    except ImportError as err:
        raise _LoadUnavailable("torch is not installed") from err
    if not torch.cuda.is_available():
        raise _LoadUnavailable("torch has no usable CUDA/ROCm device")
    ordinal = _cuda_ordinal(torch, dev, backend)
    stop = threading.Event()
    failure: list[BaseException] = []

    def spin() -> None:
        try:
            cuda = torch.device("cuda", ordinal)
            a = torch.randn(4096, 4096, device=cuda, dtype=torch.float16)
            while not stop.is_set():
                for _ in range(8):
                    a = torch.matmul(a, a).clamp_(-1.0, 1.0)
                torch.cuda.synchronize(cuda)
        except BaseException as err:  # noqa: BLE001 - reported by the caller
            failure.append(err)

    thread = threading.Thread(target=spin, name="powerlib-check-load", daemon=True)
    thread.start()
    try:
        time.sleep(LOAD_WARMUP_S)
        if failure:
            raise _LoadUnavailable(f"the torch load failed: {failure[0]}")
        yield f"torch float16 matmul on cuda:{ordinal}"
    finally:
        stop.set()
        thread.join(timeout=10.0)


@contextlib.contextmanager
def _load_on(dev: Device, backend: Backend) -> Iterator[str]:
    """Run a load on ``dev`` for the block; yields what runs. Raises _LoadUnavailable."""
    own = backend.steady_load(dev)
    if own is not None:
        with own as what:
            yield what
        return
    if dev.info.kind is DeviceKind.GPU and dev.info.vendor in ("nvidia", "amd"):
        with _torch_load(dev, backend) as what:
            yield what
        return
    raise _LoadUnavailable(f"powerlib has no load generator for {dev.info.backend} devices")


def _virtual_time(backend: Backend) -> bool:
    """The backend's time only moves when told to (the simulator on a virtual clock)."""
    return backend.virtual_time


def _landing_tolerance_mhz(supported: Sequence[float], target: float) -> float:
    """Half the gap to the nearest supported neighbours of ``target`` (at least 1 MHz)."""
    gaps = [abs(f - target) for f in supported if f != target]
    return max(1.0, min(gaps) / 2) if gaps else 1.0


def _wait_landing(
    dev: Device, target_mhz: float, tolerance_mhz: float, t0: float, timeout_s: float
) -> float | None:
    """Seconds from ``t0`` until the running clock shows ``target_mhz``; ``None``: timed out."""
    while True:
        freq = dev.read_state().sm_freq_mhz
        now = time.perf_counter()
        if freq is not None and abs(freq - target_mhz) <= tolerance_mhz:
            return now - t0
        if now - t0 > timeout_s:
            return None


def measure_landing_latency(
    backend: Backend,
    dev: Device,
    *,
    repetitions: int = LANDING_REPETITIONS,
    timeout_s: float = LANDING_TIMEOUT_S,
) -> LatencyCheck:
    """Time clock changes from the lock request until the running clock shows them, under load.

    The only device change ``powerlib check`` makes: through a
    :class:`~powerlib.control.ControlSession` (journaled first, restored when it ends, also on
    an error or a signal), a clock at a quarter of the supported range is locked, then one at
    three quarters, ``repetitions`` times, while a load runs (simulated work on the simulator, a
    torch matmul loop on a GPU). Each landing is timed from just before the request to the
    first ``read_state`` whose ``sm_freq_mhz`` shows it, so it includes one read's cost.

    Returns:
        The samples, or the reason nothing was measured (no load generator, no torch...).

    Raises:
        PowerlibError: A driver error while changing or reading the clock (the session has put
            the device back by then).
    """
    from powerlib.control import ControlSession  # noqa: PLC0415 - control imports much

    freqs = dev.info.supported_sm_freqs_mhz
    if not freqs:
        return LatencyCheck(measured=False, reason="the device cannot lock its clock")
    low, high = freqs[len(freqs) // 4], freqs[(3 * len(freqs)) // 4]
    if low == high:
        return LatencyCheck(measured=False, reason="the device supports a single clock")
    if _virtual_time(backend):
        return LatencyCheck(
            measured=False,
            reason="the simulated clock is virtual (POWERLIB_SIM_CLOCK): nothing lands while "
            "no work runs",
        )
    samples: list[float] = []
    missed = 0
    try:
        # No guardian: its start-up would compete with the seconds being timed, and the session
        # holds a clock for a few seconds only (a SIGKILL leaves a journal for
        # `powerlib restore` or the next session, docs/real-gpu.md §6).
        with _load_on(dev, backend) as what, ControlSession(backend, guardian=False) as session:
            for _ in range(repetitions):
                for target in (low, high):
                    tolerance = _landing_tolerance_mhz(freqs, target)
                    t0 = time.perf_counter()
                    session.lock_sm_clocks(dev, target, target)
                    latency = _wait_landing(dev, target, tolerance, t0, timeout_s)
                    if latency is None:
                        missed += 1
                    else:
                        samples.append(latency)
    except _LoadUnavailable as err:
        return LatencyCheck(measured=False, reason=f"no load: {err}")
    return LatencyCheck(
        measured=True,
        load=what,
        low_mhz=low,
        high_mhz=high,
        samples_s=tuple(samples),
        missed=missed,
    )
