"""C. Switch landing latency under load, direct and through the runtime's controller.

Direct: ``ControlSession.lock_sm_clocks``, then polling until the clock shows. Through the
runtime's :class:`FrequencyController` (threaded): a request, then the same polling. Median,
p95, max of each. Hands on ``rig.latency`` (E's emulated latency, F's landing estimate).
"""

from __future__ import annotations

import statistics
import time
from typing import Any

# Library names: mend here when one moves (public names only).
from powerlib import ControlSession
from powerlib.runtime import FrequencyController

from .harness import Rig, shown, stats
from .readings import wait_landed

KEY = "C"
TITLE = "switch landing latency"
MAX_LATENCY_S = 0.2

# (call returned, landed, landed after the call returned), seconds from the request
Switch = tuple[float, float | None, float | None]


def _clocks(rig: Rig) -> tuple[float, float]:
    """The high clock (the first B saw land cleanly) and the low one."""
    clean = [
        r["requested_mhz"] for r in rig.b_rows if r.get("within_one_step") and not r["limited"]
    ]
    high = clean[0] if clean else rig.freqs[1]
    low = rig.freqs[-1] if rig.freqs[-1] != high else rig.freqs[-2]
    return high, low


def _direct(
    rig: Rig, control: ControlSession, clocks: tuple[float, float], timeout_s: float
) -> list[Switch]:
    """Switches through the control session, each polled until it shows."""
    dev, s = rig.dev, rig.scale
    high, low = clocks
    tolerance = {f: rig.step_mhz(f) + 0.5 for f in clocks}
    direct: list[Switch] = []
    control.lock_sm_clocks(dev, low)
    wait_landed(dev, low, tolerance[low], timeout_s)
    for i in range(s.switches):
        freq = high if i % 2 == 0 else low
        t0 = time.perf_counter()
        control.lock_sm_clocks(dev, freq)
        t_call = time.perf_counter()
        landed = wait_landed(dev, freq, tolerance[freq], timeout_s)
        direct.append(
            (
                t_call - t0,
                None if landed is None else landed - t0,
                None if landed is None else landed - t_call,
            )
        )
        time.sleep(s.pause_s)
    return direct


def _via_controller(
    rig: Rig, control: ControlSession, clocks: tuple[float, float], timeout_s: float
) -> list[float | None]:
    """Switches requested of the runtime's threaded controller, each polled until it shows."""
    dev, s = rig.dev, rig.scale
    high, low = clocks
    tolerance = {f: rig.step_mhz(f) + 0.5 for f in clocks}
    via: list[float | None] = []
    controller = FrequencyController(control, dev, threaded=True)
    try:
        controller.request(low)
        wait_landed(dev, low, tolerance[low], timeout_s)
        for i in range(s.switches):
            freq = high if i % 2 == 0 else low
            t0 = time.perf_counter()
            controller.request(freq)
            landed = wait_landed(dev, freq, tolerance[freq], timeout_s)
            via.append(None if landed is None else landed - t0)
            time.sleep(s.pause_s)
    finally:
        controller.close()
    return via


def _judge(
    rig: Rig,
    figures: dict[str, Any],
    direct: list[Switch],
    via: list[float | None],
    timeout_s: float,
) -> None:
    """The figures, what C hands on, and the checks."""
    calls = [d[0] for d in direct]
    direct_landed = [d[1] for d in direct if d[1] is not None]
    after_call = [d[2] for d in direct if d[2] is not None]
    via_landed = [v for v in via if v is not None]
    figures["direct"] = {
        "call_s": stats(calls),
        "landing_s": stats(direct_landed),
        "after_call_s": stats(after_call),
        "not_landed": len(direct) - len(direct_landed),
    }
    figures["controller"] = {
        "landing_s": stats(via_landed),
        "not_landed": len(via) - len(via_landed),
    }
    rig.latency = {
        "mean_s": statistics.fmean(via_landed) if via_landed else None,
        "min_s": min(via_landed) if via_landed else None,
        "max_s": max(via_landed) if via_landed else None,
        "after_call_s": statistics.median(after_call) if after_call else 0.0,
    }
    for name, landed, n in (
        ("direct", direct_landed, len(direct)),
        ("controller", via_landed, len(via)),
    ):
        rig.report.check(
            "C",
            f"{name}_all_landed",
            len(landed) == n,
            f"{len(landed)} of {n}",
            f"every switch ({name}) shows on the running clock under load within {timeout_s:g} s",
            judged_in_smoke=True,
        )
        worst = max(landed) if landed else None
        rig.report.check(
            "C",
            f"{name}_max_latency_s",
            worst is not None and worst < MAX_LATENCY_S,
            worst,
            f"the slowest landing < {MAX_LATENCY_S * 1e3:g} ms "
            f"(median {shown(statistics.median(landed)) if landed else '-'} s)",
        )


def run(rig: Rig, part: dict[str, Any]) -> None:
    """Switch landing latency, direct and through the runtime's controller."""
    control = rig.ctl()
    clocks = _clocks(rig)
    part["figures"]["clocks_mhz"] = list(clocks)
    timeout_s = 3.0 if rig.smoke else 1.0  # a busy CI core may stall the poll
    with rig.work.load():
        time.sleep(rig.scale.settle_s)
        direct = _direct(rig, control, clocks, timeout_s)
        via = _via_controller(rig, control, clocks, timeout_s)
    rig.restore()
    _judge(rig, part["figures"], direct, via, timeout_s)
