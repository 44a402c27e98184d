"""A job that changes device settings inside a ControlSession, for the crash-restore tests.

Usage::

    python tests/safety/child.py MODE [--guardian] [--devices 0,1] [--hold-device N] [--gate]

The backend comes from the environment (``POWERLIB_BACKEND``, ``POWERLIB_STATE_DIR``,
``POWERLIB_SYSFS_ROOT``, ``POWERLIB_SIM_GPUS``). The child prints ``ready`` once the session has
started and ``step K`` after each change (flushed), then, by MODE:

- ``normal``: runs the change sequence once and leaves the ``with`` block;
- ``raise``: runs it once and raises ``RuntimeError`` inside the block (exit code 1);
- ``wait``: runs it once, prints ``done`` and sleeps up to 30 s (for SIGTERM, SIGINT, SIGKILL);
- ``sequence``: repeats the sequence until killed (for a SIGKILL at a random point);
- ``hold``: locks the clocks of ``--hold-device``, prints ``holding`` and sleeps up to 30 s;
- ``die-in-write``: SIGKILLs itself inside its second power-limit change of device 0, after the
  session journaled it and before the device was written (a deterministic crash point).

On the sysfs backend the fake tree is plain files; the child writes them the way the kernel
stores an attribute, all at once (write a temporary file, rename it). A plain ``O_TRUNC`` write
killed halfway would leave an empty file, which no real sysfs attribute can be.

With ``--gate`` it reads one line from stdin before it opens the backend, so that the parent can
prepare the devices while the child's imports run. Every value is derived from the device's own
clock table and power-limit range, so the same sequence runs on both backends.
"""

from __future__ import annotations

import argparse
import itertools
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

from powerlib.backend import Backend
from powerlib.backends._sysfs_io import SysfsIO
from powerlib.backends.sysfs import SysfsBackend
from powerlib.config import Settings
from powerlib.control import ControlSession
from powerlib.device import Device
from powerlib.registry import open_backend

STEP_PAUSE_S = 0.003  # so that a random SIGKILL lands between and inside changes alike


class AtomicFileIO(SysfsIO):
    """Plain files written whole, as a kernel attribute store is: a kill never leaves half."""

    def _raw_write(self, rel: str, path: Path, value: str) -> None:
        if not path.exists():
            raise FileNotFoundError(2, "No such file or directory", rel)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(value)
        os.replace(tmp, path)


def open_from_env() -> Backend:
    settings = Settings.from_env()
    if settings.backend == "sysfs":
        return SysfsBackend(settings, io=AtomicFileIO(settings.sysfs_root))
    return open_backend(settings=settings)


def die_in_second_write(dev: Device) -> None:
    """Make the device's second power-limit write kill the process before it writes."""
    calls = []
    write = dev._set_power_limit  # type: ignore[attr-defined]

    def dying_write(power_limit_w: float) -> float:
        calls.append(power_limit_w)
        if len(calls) == 2:
            os.kill(os.getpid(), signal.SIGKILL)
        return write(power_limit_w)

    dev._set_power_limit = dying_write  # type: ignore[method-assign]


def power_limit_w(dev: Device, fraction: float) -> float:
    """A power limit ``fraction`` of the way through the device's range, whole watts."""
    assert dev.info.power_limit_range_w is not None
    lo, hi = dev.info.power_limit_range_w
    return float(round(lo + fraction * (hi - lo)))


def change_sequence(session: ControlSession, devices: list[Device]) -> list[Callable[[], object]]:
    """Lock clocks to a few values, set the power limit twice, reset and re-lock, per device."""
    steps: list[Callable[[], object]] = []
    for d in devices:
        f = d.info.supported_sm_freqs_mhz
        steps.append(lambda d=d, f=f: session.lock_sm_clocks(d, f[1]))
        steps.append(lambda d=d: session.set_power_limit(d, power_limit_w(d, 0.5)))
    for d in devices:
        f = d.info.supported_sm_freqs_mhz
        steps.append(lambda d=d, f=f: session.lock_sm_clocks(d, f[2], f[-1]))
        steps.append(lambda d=d: session.set_power_limit(d, power_limit_w(d, 0.3)))
    for d in devices:
        f = d.info.supported_sm_freqs_mhz
        steps.append(lambda d=d: session.reset_sm_clocks(d))
        steps.append(lambda d=d: session.reset_power_limit(d))
        steps.append(lambda d=d, f=f: session.lock_sm_clocks(d, f[0]))
    return steps


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "mode", choices=["normal", "raise", "wait", "sequence", "hold", "die-in-write"]
    )
    parser.add_argument("--guardian", action="store_true")
    parser.add_argument("--devices", default="0,1")
    parser.add_argument("--hold-device", type=int, default=0)
    parser.add_argument("--gate", action="store_true")
    args = parser.parse_args()
    if args.gate:
        sys.stdin.readline()
    # A shell may start background jobs with SIGINT ignored; a real job gets Ctrl-C as usual.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)

    def say(line: str) -> None:
        print(line, flush=True)

    with open_from_env() as backend, ControlSession(backend, guardian=args.guardian) as session:
        say("ready")
        if args.mode == "hold":
            session.lock_sm_clocks(
                args.hold_device, backend.device(args.hold_device).info.supported_sm_freqs_mhz[1]
            )
            say("holding")
            time.sleep(30)
            return 0
        devices = [backend.device(int(i)) for i in args.devices.split(",")]
        if args.mode == "die-in-write":
            die_in_second_write(devices[0])
        steps = change_sequence(session, devices)
        rounds = itertools.count() if args.mode == "sequence" else range(1)
        k = 0
        for _ in rounds:
            for step in steps:
                step()
                k += 1
                say(f"step {k}")
                time.sleep(STEP_PAUSE_S)
        if args.mode == "raise":
            raise RuntimeError("the job failed")
        if args.mode == "wait":
            say("done")
            time.sleep(30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
