"""B. Lock read-back at each clock under a steady load.

First one lock on the idle GPU (whether the driver shows it), then each of the run's clocks
under a steady bf16 matmul: requested against observed clock (``Device.read_sm_lock``), power,
temperature, clock-event reasons. Hands on ``rig.b_rows`` (C picks its clean high clock there).
"""

from __future__ import annotations

import time
from typing import Any

# Library names: mend here when one moves (public names only).
from powerlib import PowerlibError

from .harness import Rig
from .readings import sample_lock, summarize_samples

KEY = "B"
TITLE = "lock read-back at each clock under load"


def _idle_lock(rig: Rig, part: dict[str, Any]) -> None:
    """A lock set on the idle GPU: does the driver report it?"""
    # A session detects an administrator's lock at its `with` line, when the GPU is usually
    # idle; NVML can only show a lock through the clock-event reason 0x2, which it may report
    # only while the lock holds the clock down (docs/real-gpu.md §1).
    idle_freq = rig.freqs[len(rig.freqs) // 2]
    rig.ctl().lock_sm_clocks(rig.dev, idle_freq)
    time.sleep(rig.scale.settle_s)
    idle = rig.dev.read_sm_lock()
    part["figures"]["idle_lock"] = {"requested_mhz": idle_freq, **idle.to_json()}
    rig.report.check(
        "B",
        "idle_lock_visible",
        idle.locked is True,
        f"locked={idle.locked}, {idle.running_mhz} MHz, reasons {list(idle.reasons)}",
        f"the driver reports a lock at {idle_freq:g} MHz on an idle GPU (without it, a lock "
        "set before a session starts cannot be detected at its `with` line)",
    )


def _clock(rig: Rig, freq: float) -> dict[str, Any]:
    """Lock ``freq`` under the running load, read it back, check it: the clock's row."""
    dev, report = rig.dev, rig.report
    row: dict[str, Any] = {"requested_mhz": freq}
    step = rig.step_mhz(freq)
    criterion = (
        f"observed within one step ({step:g} MHz) of {freq:g} MHz under load, unless "
        "the driver reports a limiting reason (power cap, thermal)"
    )
    try:
        row["locked_mhz"] = list(rig.ctl().lock_sm_clocks(dev, freq))
    except PowerlibError as err:
        row["error"] = f"{type(err).__name__}: {err}"
        report.check("B", f"clock_{freq:g}", False, row["error"], criterion, judged_in_smoke=True)
        return row
    back = dev.last_sm_readback
    row["readback"] = None if back is None else back.to_json()
    time.sleep(rig.scale.settle_s)
    row.update(summarize_samples(sample_lock(dev, rig.scale.sample_s)))
    observed = row["running_mhz"]
    within = observed is not None and abs(observed - freq) <= step + 0.5
    limited = bool(row["limited"]) and observed is not None and observed < freq
    row["within_one_step"] = within
    shown = f"{observed:g} MHz" if observed is not None else "no clock reported"
    if row["limited"]:
        shown += f" ({', '.join(row['limited'])})"
    report.check("B", f"clock_{freq:g}", within or limited, shown, criterion, judged_in_smoke=True)
    return row


def run(rig: Rig, part: dict[str, Any]) -> None:
    """Lock read-back at each clock under a steady load."""
    rig.ctl()
    _idle_lock(rig, part)
    rows = []
    with rig.work.load():
        time.sleep(rig.scale.settle_s)
        for freq in rig.freqs:
            rows.append(_clock(rig, freq))
    rig.restore()
    part["figures"]["clocks"] = rig.b_rows = rows
