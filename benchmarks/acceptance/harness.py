"""What every part of the acceptance run shares: its scale, the report, the rig, the part loop.

A part is a function ``run(rig, part)``: it measures, writes its figures into ``part["figures"]``
and records each check with :meth:`Report.check` (PASS, FAIL, ``n/a``, or ``smoke`` for a figure
the smoke run does not judge). :func:`run_part` opens its record, turns :class:`Skipped` and any
error into a ``ran`` check (the next part still runs), restores the clocks and rewrites the JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, Protocol

from powerlib import ControlSession, Device

SCHEMA = "powerlib.bench.gpu_acceptance.v1"
RESULTS = Path(__file__).resolve().parents[1] / "results"
STAGES = 8  # E and F: the emulated pipeline
LOWEST_SHARE = 0.5  # B, D: the clocks run from the top one down to half of it

SMOKE_ENV = {
    "POWERLIB_BACKEND": "simulated",
    "POWERLIB_SIM_GPUS": "1",
    "POWERLIB_SIM_MODEL": "h100",
    "POWERLIB_SIM_CLOCK": "wall",
    # NVML-like, with a 50 ms counter instead of 100 ms so that CI-sized instructions resolve
    "POWERLIB_SIM_ENERGY_PERIOD_S": "0.05",
    "POWERLIB_SIM_SWITCH_LATENCY_S": "0.02",
    "POWERLIB_SIM_LATENCY_SPREAD": "0.5",
    "POWERLIB_SIM_READ_COST_S": "0.0005",
    "POWERLIB_SIM_NOISE": "0.01",
    "POWERLIB_SIM_SEED": "0",
}


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Scale:
    """How long each part measures (the real run, or the CI-sized smoke run)."""

    budget_s: float  # the whole run; F shrinks its blocks to stay inside it
    clocks: int  # B, D: how many clocks
    reads: int  # A: reads timed per kind
    counter_s: float  # A: back-to-back counter reads under load
    power_s: float  # A: steady-load and idle windows
    onoff_s: float  # A: the 10 ms on/off load
    settle_s: float  # B, C, G: after a lock or a load starts, before reading
    sample_s: float  # B, G: reads per clock
    switches: int  # C: per path
    pause_s: float  # C: between two switches
    profile_microbatches: int  # D
    gap_s: float  # D: wait between instructions (the pipeline's receive)
    target_error: float  # D: the sweep's target
    max_iterations_per_freq: int  # D
    reference_s: float  # D: each kind repeated this long per clock
    idle_s: float  # D: idle (blocking) power per clock
    pipeline_microbatches: int  # E, F
    emulated_iterations: int  # E
    block_s: float  # F
    rounds: int  # F
    guardian_settle_s: float  # G: the guarded child runs this long before SIGKILL


REAL = Scale(
    budget_s=470.0,
    clocks=6,
    reads=200,
    counter_s=1.0,
    power_s=2.0,
    onoff_s=2.0,
    settle_s=1.0,
    sample_s=0.5,
    switches=20,
    pause_s=0.05,
    profile_microbatches=8,  # 16 instructions an iteration: rows resolve against a 100 ms counter
    gap_s=0.005,
    target_error=0.02,
    max_iterations_per_freq=8,
    reference_s=3.0,
    idle_s=1.0,
    pipeline_microbatches=8,
    emulated_iterations=6,
    block_s=10.0,
    rounds=2,
    guardian_settle_s=1.0,
)
SMOKE = Scale(
    budget_s=120.0,
    clocks=4,
    reads=40,
    counter_s=0.4,
    power_s=0.3,
    onoff_s=0.4,
    settle_s=0.1,
    sample_s=0.1,
    switches=6,
    pause_s=0.02,
    profile_microbatches=4,
    gap_s=0.002,
    target_error=0.1,
    max_iterations_per_freq=8,
    reference_s=0.15,
    idle_s=0.06,
    pipeline_microbatches=4,
    emulated_iterations=3,
    block_s=0.5,
    rounds=1,
    guardian_settle_s=0.5,
)


class Skipped(Exception):
    """A part cannot run because an earlier one did not produce what it needs."""


def use_smoke_environment(tmp: Path) -> None:
    """``--smoke``: the simulated backend for this process and its children; state under ``tmp``."""
    os.environ.update(SMOKE_ENV, POWERLIB_STATE_DIR=str(tmp / "state"))


# -- figures ---------------------------------------------------------------------------------------


def rounded(value: float | None, digits: int = 6) -> float | None:
    """``value`` rounded for the JSON; None for None, NaN and infinities (JSON has no NaN)."""
    return None if value is None or not math.isfinite(value) else round(value, digits)


def _pct(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def stats(values: Sequence[float]) -> dict[str, Any]:
    """n, median, p95, p99, max of some seconds (or other figures)."""
    if not values:
        return {"n": 0}
    return {
        "n": len(values),
        "median": rounded(statistics.median(values)),
        "p95": rounded(_pct(values, 0.95)),
        "p99": rounded(_pct(values, 0.99)),
        "max": rounded(max(values)),
    }


def timed(fn: Callable[[], object], n: int) -> list[float]:
    """Seconds of each of ``n`` calls."""
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def shown(value: Any) -> str:
    """A figure as a PASS/FAIL line shows it."""
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def sleep_until(t: float) -> None:
    """Sleep until ``time.perf_counter()`` reaches ``t`` (not at all if it has)."""
    left = t - time.perf_counter()
    if left > 0:
        time.sleep(left)


def gpu_slug(name: str) -> str:
    """``h100`` for "NVIDIA H100 80GB HBM3": the report's default file name."""
    lowered = name.lower()
    match = re.search(r"\b(gh|[a-z])\d{2,4}[a-z]?\b", lowered)
    return match.group(0) if match else re.sub(r"[^a-z0-9]+", "-", lowered).strip("-")


def pick_clocks(supported: Sequence[float], n: int) -> list[float]:
    """``n`` supported clocks from the top one down to ``LOWEST_SHARE`` of it, high to low."""
    top = supported[-1]
    low = max(supported[0], LOWEST_SHARE * top)
    picked: list[float] = []
    for i in range(n):
        target = top - i * (top - low) / max(n - 1, 1)
        nearest = min(supported, key=lambda f: (abs(f - target), f))
        if nearest not in picked:
            picked.append(nearest)
    return sorted(picked, reverse=True)


# -- the report ------------------------------------------------------------------------------------


class Report:
    """The JSON document and the PASS/FAIL lines; written after every part."""

    def __init__(self, path: Path, smoke: bool) -> None:
        self.path = path
        self.smoke = smoke
        self.started = time.perf_counter()
        self.data: dict[str, Any] = {
            "schema": SCHEMA,
            "smoke": smoke,
            "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "device": {},
            "emulation": {},
            "parts": {},
            "summary": {},
        }

    def part(self, key: str, title: str, source: str) -> dict[str, Any]:
        """A new part's record."""
        part = {"title": title, "source": source, "figures": {}, "checks": []}
        self.data["parts"][key] = part
        self.data["emulation"][key] = source
        print(f"\n== {key}. {title}", flush=True)
        return part

    def check(
        self,
        key: str,
        name: str,
        ok: bool | None,
        value: Any,
        criterion: str,
        *,
        judged_in_smoke: bool = False,
    ) -> None:
        """Record one check: PASS, FAIL, ``n/a`` (``ok`` None), or ``smoke`` (not judged there)."""
        if isinstance(value, float):
            value = rounded(value)  # JSON has no NaN
        if ok is None:
            status = "n/a"
        elif self.smoke and not judged_in_smoke:
            status = "smoke"
        else:
            status = "PASS" if ok else "FAIL"
        self.data["parts"][key]["checks"].append(
            {"name": name, "status": status, "value": value, "criterion": criterion}
        )
        print(f"{status:5} {key}.{name}: {shown(value)}  [{criterion}]", flush=True)

    def statuses(self) -> dict[str, int]:
        """How many checks have each status."""
        counts: dict[str, int] = {}
        for part in self.data["parts"].values():
            for check in part["checks"]:
                counts[check["status"]] = counts.get(check["status"], 0) + 1
        return counts

    def save(self) -> None:
        """Write the JSON (atomically: a reader never sees half of it)."""
        counts = self.statuses()
        self.data["summary"] = {
            "checks": counts,
            "verdict": "FAIL" if counts.get("FAIL") else "PASS",
            "elapsed_s": round(time.perf_counter() - self.started, 2),
        }
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(self.data, indent=1, default=str) + "\n", encoding="utf-8")
        os.replace(tmp, self.path)

    def verdict_line(self) -> str:
        """The run's last line: the verdict, the count of each status, the time, the file."""
        counts = self.statuses()
        return (
            f"\n{self.data['summary']['verdict']}: "
            + ", ".join(f"{n} {status}" for status, n in sorted(counts.items()))
            + f" in {self.data['summary']['elapsed_s']:.1f} s; {self.path}"
        )


# -- the rig: device, work, control session, and what the parts hand on -------------------------


class Work(Protocol):
    """The GPU's work (``work.TorchWork`` on a GPU, ``work.SimWork`` in ``--smoke``)."""

    def describe(self) -> dict[str, Any]:
        """What runs, for the report."""

    def sync(self) -> None:
        """Wait for the queued work."""

    def load(self) -> AbstractContextManager[None]:
        """A steady full load while the block runs."""

    def busy(self, seconds: float) -> float:
        """Load for about ``seconds``; how long it ran."""

    def onoff(self, total_s: float, on_s: float, off_s: float) -> float:
        """Alternate load and idle for ``total_s``; the busy seconds."""

    def run(self, kind: str, microbatch: int) -> None:
        """One instruction (``forward`` or ``backward``)."""

    def prepare(self, kind: str) -> Callable[[], None]:
        """One instruction of ``kind`` as a repeatable call."""

    def end_iteration(self) -> None:
        """Drop what an iteration kept."""


@dataclasses.dataclass
class Rig:
    """Everything the parts share, and what each hands on to the next."""

    args: argparse.Namespace
    scale: Scale
    smoke: bool
    backend: Any
    dev: Device
    work: Work
    report: Report
    tmp: Path
    nvml: tuple[Any, Any] | None = None  # (pynvml, handle) of the same GPU, for A's field reads
    torch: Any = None
    control: ControlSession | None = None
    deadline: float = math.inf
    freqs: list[float] = dataclasses.field(default_factory=list)
    default_loaded_mhz: float | None = None  # A -> G
    counter_period_s: float | None = None  # A -> E
    read_state_s: float | None = None  # A -> E
    b_rows: list[dict[str, Any]] = dataclasses.field(default_factory=list)  # B -> C
    latency: dict[str, Any] = dataclasses.field(default_factory=dict)  # C -> E, F
    curves: dict[str, Any] | None = None  # D -> E
    emulated: dict[str, Any] | None = None  # E -> F
    halt: str | None = None  # why the parts after A cannot run

    @property
    def guardian(self) -> bool:
        """Guard the script's own changes against SIGKILL (the smoke run's G tests it apart)."""
        return not self.smoke

    def ctl(self) -> ControlSession:
        """The script's control session (one for the whole run, guarded on a real GPU)."""
        if self.control is None:
            self.control = ControlSession(self.backend, guardian=self.guardian).start()
        return self.control

    def restore(self) -> None:
        """Put the clocks back and release the device (a session may claim it next)."""
        if self.control is not None:
            for outcome in self.control.restore():
                if not outcome.ok:
                    print(f"restore: {outcome}", file=sys.stderr, flush=True)

    def close(self) -> None:
        """End the script's control session (everything restored, guardian gone)."""
        if self.control is not None:
            self.control.close()
            self.control = None

    def step_mhz(self, freq_mhz: float) -> float:
        """The spacing of the supported clocks around ``freq_mhz``."""
        supported = self.dev.info.supported_sm_freqs_mhz
        gaps = [b - a for a, b in zip(supported, supported[1:]) if a - 1 <= freq_mhz <= b + 1]
        return max(gaps) if gaps else 15.0

    def left_s(self) -> float:
        """Seconds left of the budget."""
        return self.deadline - time.perf_counter()


# -- one part --------------------------------------------------------------------------------------

PartFn = Callable[[Rig, dict[str, Any]], None]


def part_source(rig: Rig, key: str) -> str:
    """What produced a part's figures (the report's ``emulation`` entry)."""
    if key == "E":
        return "powerlib.emulator (virtual time): NvmlLikeModel from A, C and D (see E_model)"
    if rig.smoke:
        return "simulated backend, CI-sized (smoke): " + ", ".join(
            f"{k}={v}" for k, v in SMOKE_ENV.items() if k.startswith("POWERLIB_SIM_")
        )
    return f"measured on {rig.dev.info.name} ({rig.dev.device_id}), {rig.dev.info.backend} backend"


def run_part(rig: Rig, key: str, title: str, fn: PartFn) -> None:
    """Run one part; an error fails its ``ran`` check and the next part still runs."""
    part = rig.report.part(key, title, part_source(rig, key))
    started = time.perf_counter()
    try:
        if rig.halt is not None:
            raise Skipped(rig.halt)
        fn(rig, part)
    except Skipped as why:
        part["skipped"] = str(why)
        rig.report.check(key, "ran", None, str(why), "the part runs")
    except Exception as err:  # one broken part must not hide the others' figures
        part["error"] = f"{type(err).__name__}: {err}"
        traceback.print_exc()
        rig.report.check(
            key, "ran", False, part["error"], "the part runs to its end", judged_in_smoke=True
        )
    finally:
        try:
            rig.restore()
        finally:
            part["elapsed_s"] = round(time.perf_counter() - started, 2)
            rig.report.save()
