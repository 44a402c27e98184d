"""G. Restore: after the script's control session ends, and after a SIGKILL.

No lock and the default clock under load once the script's control session has ended; a guarded
child (``ControlSession(guardian=True)`` in a subprocess) killed with SIGKILL while it holds the
lowest clock, the time until the clock recovers, and no journal of the child's left behind.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
from typing import IO, Any

# Library names: mend here when one moves (public names only).
import powerlib
from powerlib import PowerlibError

from .harness import Rig, rounded
from .readings import read_lock, sample_lock, summarize_samples, wait_landed

KEY = "G"
TITLE = "restore after exit and after SIGKILL"
GUARDIAN_LIMIT_S = 3.0
RECOVERED_SHARE = 0.9  # recovered when the loaded clock is back to 90 % of A's default

CHILD = """
import sys, time
from powerlib import ControlSession, open_backend

with open_backend() as backend, ControlSession(backend, guardian=True) as session:
    session.lock_sm_clocks(backend.device(sys.argv[1]), float(sys.argv[2]))
    print("locked", flush=True)
    time.sleep(300)
"""


def _read_line(stream: IO[bytes], timeout_s: float) -> str:
    ready, _, _ = select.select([stream], [], [], timeout_s)
    return stream.readline().decode(errors="replace").strip() if ready else ""


def _after_exit(rig: Rig, figures: dict[str, Any], default: float, threshold: float) -> None:
    """The script's control session ends: no lock, and the default clock under load."""
    rig.close()  # all restored, guardian gone
    with rig.work.load():
        time.sleep(rig.scale.settle_s)
        after = summarize_samples(sample_lock(rig.dev, rig.scale.sample_s))
    figures["after_exit_under_load"] = after
    rig.report.check(
        "G",
        "lock_clear_after_exit",
        "True" not in after["locked"],
        "/".join(after["locked"]),
        "the driver reports no lock after the script's control session ended",
        judged_in_smoke=True,
    )
    running = after["running_mhz"]
    rig.report.check(
        "G",
        "default_clock_after_exit",
        running is not None and running >= threshold,
        running,
        f"under load the clock is back to >= {RECOVERED_SHARE:.0%} of the "
        f"default measured in A ({default:g} MHz)",
        judged_in_smoke=True,
    )


def _kill_guarded_child(
    rig: Rig, figures: dict[str, Any], lowest: float, threshold: float, wait_s: float
) -> tuple[int, float | None]:
    """A guarded child locks ``lowest``, is killed; its pid and the seconds until recovery."""
    dev = rig.dev
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, dev.device_id, repr(lowest)],
        stdout=subprocess.PIPE,
        cwd=rig.tmp,  # the child inherits this process's environment (--smoke: the simulator)
    )
    assert child.stdout is not None
    recovery_s = None
    try:
        line = _read_line(child.stdout, 60.0)
        if line != "locked":
            raise PowerlibError(
                f"the guarded child did not lock the clock (said {line!r}, "
                f"exit code {child.poll()})"
            )
        with rig.work.load():
            landed = wait_landed(dev, lowest, rig.step_mhz(lowest) + 0.5, 2.0)
            figures["child_lock_landed"] = landed is not None
            time.sleep(rig.scale.guardian_settle_s)
            killed = time.perf_counter()
            os.kill(child.pid, signal.SIGKILL)
            while time.perf_counter() - killed < wait_s:
                state = read_lock(dev)
                if state.running_mhz is not None and state.running_mhz >= threshold:
                    recovery_s = time.perf_counter() - killed
                    break
                time.sleep(0.005)
    finally:
        if child.poll() is None:
            child.kill()
        child.wait()
        child.stdout.close()
    return child.pid, recovery_s


def _journals(rig: Rig, figures: dict[str, Any], pid: int) -> None:
    """The guardian removes the child's journal once its restore is done."""
    # Only the child's journals are judged (a dry run: whatever else the state folder holds
    # is left alone).
    end = time.perf_counter() + 2.0
    while True:
        left = [
            o
            for o in powerlib.restore_journals(rig.backend.settings, dry_run=True)
            if o.owner_pid == pid
        ]
        if not left or time.perf_counter() > end:
            break
        time.sleep(0.05)
    figures["child_journal_left"] = [o.action for o in left]
    if left:  # put the GPU back as `powerlib restore` would
        figures["restored_by_script"] = [
            o.action for o in powerlib.restore_journals(rig.backend.settings)
        ]
    rig.report.check(
        "G",
        "no_journal_left",
        not left,
        "none" if not left else "; ".join(o.action for o in left),
        "the guardian restored the child's device and removed its journal",
        judged_in_smoke=True,
    )


def run(rig: Rig, part: dict[str, Any]) -> None:
    """Restore after exit, and the guardian against SIGKILL."""
    dev, report, figures = rig.dev, rig.report, part["figures"]
    default = rig.default_loaded_mhz or dev.info.max_sm_freq_mhz or 0.0
    threshold = RECOVERED_SHARE * default
    _after_exit(rig, figures, default, threshold)
    lowest = dev.info.supported_sm_freqs_mhz[0]
    wait_s = 15.0 if rig.smoke else 2 * GUARDIAN_LIMIT_S  # a busy CI core starts it slowly
    pid, recovery_s = _kill_guarded_child(rig, figures, lowest, threshold, wait_s)
    figures["guardian_recovery_s"] = rounded(recovery_s)
    landed_first = bool(figures["child_lock_landed"])
    report.check(
        "G",
        "guardian_restored",
        landed_first and recovery_s is not None,
        "no" if recovery_s is None else "yes" if landed_first else "the child's lock never landed",
        f"the child's {lowest:g} MHz lock landed, and the clock under load came back after the "
        f"SIGKILL (within {wait_s:g} s) with no command run",
        judged_in_smoke=True,
    )
    report.check(
        "G",
        "guardian_recovery_s",
        recovery_s is not None and recovery_s <= GUARDIAN_LIMIT_S,
        recovery_s if recovery_s is not None else f"not back in {wait_s:g} s",
        f"a guarded child killed with SIGKILL at {lowest:g} MHz: the clock under load is back "
        f"to >= {threshold:g} MHz within {GUARDIAN_LIMIT_S:g} s",
    )
    _journals(rig, figures, pid)
