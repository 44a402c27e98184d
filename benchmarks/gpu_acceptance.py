"""One run that proves powerlib's clock-control path on a real GPU (issue 33, docs/real-gpu.md §9).

Run it as root on a node with one NVIDIA H100 or H200, the NVIDIA driver and CUDA torch::

    sudo python3 benchmarks/gpu_acceptance.py                 # GPU 0 (CUDA order)
    sudo python3 benchmarks/gpu_acceptance.py --device 1 --out /tmp/acceptance.json

It takes about five minutes (it adapts its longest part so that the whole run stays under eight)
and **changes the GPU's SM clock lock** hundreds of times. Every change goes through a
:class:`~powerlib.control.ControlSession`: journaled before it is made, restored at the end of
each part, on an exception, on SIGTERM/SIGHUP and at exit, and by a guardian process if the
script is killed with SIGKILL (``sudo powerlib restore`` puts back anything left). It never
changes a power limit. Run it on an otherwise idle GPU: its figures are the GPU's energy counter.

Seven parts, each with PASS/FAIL checks; the JSON (``--out``, default
``benchmarks/results/gpu_acceptance_<gpu>.json``) is rewritten after every part, so a run cut
short still leaves what it measured:

A. **Environment and read costs**: device, driver, persistence, MIG, permission; the cost of
   each read through the backend (``read_state``, ``read_sm_lock``, ``details``: median, p99);
   the energy counter's update period
   (:func:`~powerlib.measurement.counter_period.estimate_counter_period_s`);
   whether NVML's field timestamps follow the counter's updates; the counter's energy of a
   10 ms on / 10 ms off load against the power readings integrated over it, and against steady
   load and idle power; the default clock under load (what G compares with).
B. **Lock read-back** at six clocks under a steady bf16 matmul: requested against observed
   clock (``Device.read_sm_lock``), power, temperature, clock-event reasons.
C. **Switch landing latency** under load, direct (``ControlSession.lock_sm_clocks``, then
   polling until the clock shows) and through the runtime's
   :class:`~powerlib.runtime.controller.FrequencyController`: median, p95, max.
D. **A real per-instruction profile** of a stack of ``torch.nn.TransformerEncoderLayer``
   sized so that a forward takes about 22 ms and a backward about 45 ms, through
   ``powerlib.optimize(mode="profile")`` at the six clocks, against a reference of each kind
   repeated for 3 s per clock (energy from the counter, aligned on its updates): the error of
   every row, the blocking power, what profiling cost.
E. **An 8-stage pipeline emulated from D's curves** (:mod:`powerlib.emulator`, virtual time)
   with A's counter period and read cost, C's latency and D's noise: the plan the runtime makes
   (:func:`~powerlib.runtime.planning_step.make_plan`) from the reference profile and from the
   runtime's profile, predicted against realized saving and slowdown (the reference curves are
   the emulated GPUs' truth).
F. **The real apply path**: one stage's instructions of E's plan (the runtime profile's, else
   the reference's) run on the GPU by a real ``Session(mode="apply")``, the pipeline's waits
   played by sleeps until each instruction's inputs would arrive (from E's timeline), in
   alternating 10 s blocks against all-max locked and the unlocked default, for the stage with
   the most slack (E's largest stage saving) and for the critical one (the smallest): energy
   per iteration, saving, stage slowdown, clock changes, instructions started before their
   clock landed, beside E's prediction.
G. **Restore**: no lock and the default clock under load once the script's control session
   has ended; a guarded child (``ControlSession(guardian=True)`` in a subprocess) killed with
   SIGKILL while it holds the lowest clock, and the time until the clock recovers.

The script exits 1 when any check fails, 2 when it cannot start (no GPU, no CUDA torch).

``--smoke`` runs every part on the simulated backend (NVML-like: a 50 ms counter, 0.5 ms reads,
20 ms +- 50 % clock latency, 1 % noise), CI-sized and without CUDA, in 20-30 s: four clocks,
0.15 s references, a 4-microbatch pipeline, 0.5 s blocks; the simulated GPU's work API stands
in for the matmul and the layers (the torch layer stack is only built and run once on the
CPU). Checks of powerlib's own mechanics (read-back, landing, apply, restore, guardian) are
judged there; checks whose figures would only restate the simulator's constants are recorded
with the status ``smoke``, never as a pass.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import platform
import re
import select
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import powerlib
from powerlib.control import ControlSession
from powerlib.device import ClockLockState, Device
from powerlib.errors import PlanError, PowerlibError
from powerlib.measurement.counter_period import estimate_counter_period_s
from powerlib.measurement.sampler import DEFAULT_SAMPLE_PERIOD_S
from powerlib.runtime.controller import FrequencyController
from powerlib.runtime.coordination import SingleProcess

SCHEMA = "powerlib.bench.gpu_acceptance.v1"
RESULTS = Path(__file__).resolve().parent / "results"
STAGES = 8  # E and F: the emulated pipeline
LOWEST_SHARE = 0.5  # B, D: the clocks run from the top one down to half of it
FORWARD_S = 0.0225  # D: the forward's target length on the GPU (the backward is about twice)
MAX_LATENCY_S = 0.2  # C
GUARDIAN_LIMIT_S = 3.0  # G
RECOVERED_SHARE = 0.9  # G: recovered when the loaded clock is back to 90 % of the default

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


# -- small helpers ---------------------------------------------------------------------------------


def _r(value: float | None, digits: int = 6) -> float | None:
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
        "median": _r(statistics.median(values)),
        "p95": _r(_pct(values, 0.95)),
        "p99": _r(_pct(values, 0.99)),
        "max": _r(max(values)),
    }


def timed(fn: Callable[[], object], n: int) -> list[float]:
    """Seconds of each of ``n`` calls."""
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def _shown(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def _sleep_until(t: float) -> None:
    left = t - time.perf_counter()
    if left > 0:
        time.sleep(left)


def _gpu_slug(name: str) -> str:
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


# -- the work the GPU runs -------------------------------------------------------------------------


class _OnOff:
    """The on/off load of part A, for any work source with ``busy(seconds)``."""

    def busy(self, seconds: float) -> float:  # pragma: no cover - each work source has its own
        raise NotImplementedError

    def onoff(self, total_s: float, on_s: float, off_s: float) -> float:
        """Alternate ``on_s`` of load and ``off_s`` idle for ``total_s``; the busy seconds."""
        busy = 0.0
        end = time.perf_counter() + total_s
        while time.perf_counter() < end:
            busy += self.busy(on_s)
            time.sleep(off_s)
        return busy


class SimWork(_OnOff):
    """``--smoke``: the simulated GPU's work API (``begin_work``/``end_work``) stands in for kernels.

    A unit's duration at the clock in force is slept on the wall clock, so the session, the
    sampler and the controller see the same timing as they would around a synchronized kernel.
    """

    def __init__(self, dev: Any) -> None:
        from powerlib.backends.simulated_model import WorkUnit

        self.dev = dev
        self.units = {
            "forward": WorkUnit(
                time_at_max_s=0.006, compute_fraction=0.85, sm_activity=0.8, memory_activity=0.3
            ),
            "backward": WorkUnit(
                time_at_max_s=0.012, compute_fraction=0.85, sm_activity=0.95, memory_activity=0.3
            ),
        }
        self.matmul = WorkUnit(time_at_max_s=3600.0, sm_activity=1.0, memory_activity=0.5)

    def describe(self) -> dict[str, Any]:
        """What stands in for the GPU's work."""
        return {
            "kind": "simulated work units (backends/simulated_model.py WorkUnit), slept on the wall clock",
            **{k: dataclasses.asdict(u) for k, u in self.units.items()},
            "matmul_load": dataclasses.asdict(self.matmul),
        }

    def sync(self) -> None:
        """Nothing is queued: every unit is slept through."""

    @contextlib.contextmanager
    def load(self) -> Iterator[None]:
        """A steady full load (the matmul's stand-in) while the block runs."""
        self.dev.begin_work(self.matmul)
        try:
            yield
        finally:
            self.dev.end_work()

    def busy(self, seconds: float) -> float:
        """Load for ``seconds``; returns how long it ran."""
        self.dev.begin_work(self.matmul)
        t0 = time.perf_counter()
        try:
            time.sleep(seconds)
        finally:
            elapsed_s = time.perf_counter() - t0
            self.dev.end_work()
        return elapsed_s

    def run(self, kind: str, microbatch: int) -> None:
        """One instruction, to its end."""
        duration_s = self.dev.begin_work(self.units[kind])
        try:
            time.sleep(duration_s)
        finally:
            self.dev.end_work()

    def prepare(self, kind: str) -> Callable[[], None]:
        """One instruction of ``kind`` as a repeatable call (D's reference)."""
        return lambda: self.run(kind, 0)

    def end_iteration(self) -> None:
        """Nothing to free."""


class TorchWork(_OnOff):
    """The GPU's work on a real device: a bf16 matmul load and a transformer-layer stack.

    The stack is ``torch.nn.TransformerEncoderLayer`` (pre-norm, no dropout, bf16) repeated as many
    times as it takes a forward to last about ``forward_s`` (measured: one layer is timed first);
    a backward takes about twice as long. A forward keeps its graph until its backward, as in a
    pipeline stage. On the CPU (``--smoke``) the same code runs once at tiny sizes.
    """

    def __init__(self, torch: Any, device: Any, *, tiny: bool = False) -> None:
        self.torch = torch
        self.device = device
        self.cuda = device.type == "cuda"
        dtype = torch.bfloat16 if self.cuda else torch.float32
        if tiny:
            d_model, nhead, ff, batch, seq, n = 64, 4, 128, 2, 16, 64
        else:
            d_model, nhead, ff, batch, seq, n = 4096, 32, 16384, 4, 2048, 8192
        self.shape = {
            "d_model": d_model,
            "nhead": nhead,
            "dim_feedforward": ff,
            "batch": batch,
            "seq": seq,
            "dtype": str(dtype).replace("torch.", ""),
        }
        self._layer = lambda: torch.nn.TransformerEncoderLayer(
            d_model,
            nhead,
            ff,
            dropout=0.0,
            batch_first=True,
            norm_first=True,
            device=device,
            dtype=dtype,
        )
        self.x = torch.randn(batch, seq, d_model, device=device, dtype=dtype)
        self.a = torch.randn(n, n, device=device, dtype=dtype)
        self.c = torch.empty_like(self.a)
        self.matmul_s = self._time(lambda: torch.mm(self.a, self.a, out=self.c), 5)
        self.model = torch.nn.Sequential(self._layer())
        one_layer_s = self._time(lambda: self.model(self.x), 3)
        self.layers = 1 if tiny else max(1, min(48, round(FORWARD_S / one_layer_s)))
        if self.layers > 1:
            self.model = torch.nn.Sequential(*(self._layer() for _ in range(self.layers)))
        self.pending: dict[int, Any] = {}
        self.forward_s = self._time(lambda: self.model(self.x), 3)
        self.backward_s = self._time(self.prepare("backward"), 3)
        self.end_iteration()

    def describe(self) -> dict[str, Any]:
        """Sizes and the times measured at the default clocks."""
        return {
            "kind": f"torch.nn.TransformerEncoderLayer x {self.layers} on {self.device}",
            **self.shape,
            "layers": self.layers,
            "forward_s_default_clocks": _r(self.forward_s),
            "backward_s_default_clocks": _r(self.backward_s),
            "matmul_load": f"torch.mm {tuple(self.a.shape)} {self.shape['dtype']}",
            "matmul_s": _r(self.matmul_s),
        }

    def _time(self, fn: Callable[[], object], n: int) -> float:
        fn()
        self.sync()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        self.sync()
        return (time.perf_counter() - t0) / n

    def sync(self) -> None:
        """Wait for the queued kernels."""
        if self.cuda:
            self.torch.cuda.synchronize(self.device)

    @contextlib.contextmanager
    def load(self) -> Iterator[None]:
        """A steady matmul load on a thread while the block runs."""
        stop = threading.Event()

        def spin() -> None:
            if self.cuda:
                self.torch.cuda.set_device(self.device)
            while not stop.is_set():
                for _ in range(4):
                    self.torch.mm(self.a, self.a, out=self.c)
                self.sync()

        thread = threading.Thread(target=spin, name="matmul-load", daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join()

    def busy(self, seconds: float) -> float:
        """Matmuls for about ``seconds``; returns how long they ran."""
        t0 = time.perf_counter()
        for _ in range(max(1, round(seconds / self.matmul_s))):
            self.torch.mm(self.a, self.a, out=self.c)
        self.sync()
        return time.perf_counter() - t0

    def run(self, kind: str, microbatch: int) -> None:
        """Launch one instruction (a forward keeps its graph for the backward)."""
        if kind == "forward":
            self.pending[microbatch] = self.model(self.x).float().square().mean()
        else:
            self.pending.pop(microbatch).backward()

    def prepare(self, kind: str) -> Callable[[], None]:
        """One instruction of ``kind`` as a repeatable call (a backward repeats one graph)."""
        if kind == "forward":
            return lambda: self.model(self.x)
        loss = self.model(self.x).float().square().mean()
        return lambda: loss.backward(retain_graph=True)

    def end_iteration(self) -> None:
        """Drop the graphs and the gradients."""
        self.pending.clear()
        self.model.zero_grad(set_to_none=True)


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
            value = _r(value)  # JSON has no NaN
        if ok is None:
            status = "n/a"
        elif self.smoke and not judged_in_smoke:
            status = "smoke"
        else:
            status = "PASS" if ok else "FAIL"
        self.data["parts"][key]["checks"].append(
            {"name": name, "status": status, "value": value, "criterion": criterion}
        )
        print(f"{status:5} {key}.{name}: {_shown(value)}  [{criterion}]", flush=True)

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


# -- the rig: device, work, control session, and what the parts hand on -------------------------


@dataclasses.dataclass
class Rig:
    """Everything the parts share."""

    args: argparse.Namespace
    scale: Scale
    smoke: bool
    backend: Any
    dev: Device
    work: Any
    report: Report
    tmp: Path
    nvml: tuple[Any, Any] | None = None  # (pynvml, handle) of the same GPU, for A's field reads
    torch: Any = None
    control: ControlSession | None = None
    deadline: float = math.inf
    freqs: list[float] = dataclasses.field(default_factory=list)
    default_loaded_mhz: float | None = None
    counter_period_s: float | None = None
    read_state_s: float | None = None
    b_rows: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    latency: dict[str, Any] = dataclasses.field(default_factory=dict)
    curves: dict[str, Any] | None = None
    emulated: dict[str, Any] | None = None
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

    def step_mhz(self, freq_mhz: float) -> float:
        """The spacing of the supported clocks around ``freq_mhz``."""
        supported = self.dev.info.supported_sm_freqs_mhz
        gaps = [b - a for a, b in zip(supported, supported[1:]) if a - 1 <= freq_mhz <= b + 1]
        return max(gaps) if gaps else 15.0

    def left_s(self) -> float:
        """Seconds left of the budget."""
        return self.deadline - time.perf_counter()


def read_lock(dev: Device) -> ClockLockState:
    """The driver's view of the clock lock, with the running clock filled from read_state."""
    state = dev.read_sm_lock()
    if state.running_mhz is None:
        state = dataclasses.replace(state, running_mhz=dev.read_state().sm_freq_mhz)
    return state


def sample_lock(dev: Device, seconds: float, spacing_s: float = 0.01) -> list[dict[str, Any]]:
    """Lock state, power and temperature read every ``spacing_s`` for ``seconds`` (5 reads at least)."""
    out = []
    end = time.perf_counter() + seconds
    while len(out) < 5 or time.perf_counter() < end:
        lock = read_lock(dev)
        st = dev.read_state()
        out.append({"lock": lock, "power_w": st.power_w, "temperature_c": st.temperature_c})
        time.sleep(spacing_s)
    return out


def summarize_samples(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """Median clock, power, temperature; every reason seen; whether a lock was reported."""
    running = [s["lock"].running_mhz for s in samples if s["lock"].running_mhz is not None]
    powers = [s["power_w"] for s in samples if s["power_w"] is not None]
    temps = [s["temperature_c"] for s in samples if s["temperature_c"] is not None]
    return {
        "reads": len(samples),
        "running_mhz": _r(statistics.median(running)) if running else None,
        "running_min_mhz": min(running) if running else None,
        "running_max_mhz": max(running) if running else None,
        "power_w": _r(statistics.median(powers), 2) if powers else None,
        "temperature_c": _r(statistics.median(temps), 1) if temps else None,
        "reasons": sorted({r for s in samples for r in s["lock"].reasons}),
        "limited": sorted({r for s in samples for r in s["lock"].limited}),
        "locked": sorted({str(s["lock"].locked) for s in samples}),
    }


def wait_landed(
    dev: Device, freq_mhz: float, tolerance_mhz: float, timeout_s: float
) -> float | None:
    """Poll until the running clock is within ``tolerance_mhz`` of ``freq_mhz``; when, or None."""
    end = time.perf_counter() + timeout_s
    while True:
        running = read_lock(dev).running_mhz
        now = time.perf_counter()
        if running is not None and abs(running - freq_mhz) <= tolerance_mhz:
            return now
        if now > end:
            return None


def next_update(dev: Device, timeout_s: float) -> tuple[float, float, list[float]]:
    """Poll the energy counter until it moves: (when, its value, the powers read meanwhile)."""
    first = dev.read_state().energy_j
    if first is None:
        raise PowerlibError(f"{dev.info.name} has no energy counter")
    powers: list[float] = []
    end = time.perf_counter() + timeout_s
    while True:
        st = dev.read_state()
        now = time.perf_counter()
        if st.power_w is not None:
            powers.append(st.power_w)
        if st.energy_j != first:
            assert st.energy_j is not None
            return now, st.energy_j, powers
        if now > end:
            raise PowerlibError(f"the energy counter did not move for {timeout_s:g} s")


@dataclasses.dataclass(frozen=True, slots=True)
class Window:
    """Energy and time of one piece of work, from counter updates on both sides."""

    energy_j: float
    time_s: float
    tail_s: float
    value: Any

    @property
    def power_w(self) -> float:
        """Mean power over the work."""
        return self.energy_j / self.time_s if self.time_s > 0 else math.nan


def counter_window(rig: Rig, body: Callable[[], Any]) -> Window:
    """Run ``body`` between two counter updates; its energy with the idle tail taken off.

    The window opens at a counter update (the work starts right after it) and closes at the
    first update after the work ends; the tail between the two is charged at the power read
    while waiting for that update.
    """
    timeout_s = max(1.0, 5 * (rig.counter_period_s or 0.1))
    t0, e0, _ = next_update(rig.dev, timeout_s)
    value = body()
    rig.work.sync()
    t_end = time.perf_counter()
    t1, e1, powers = next_update(rig.dev, timeout_s)
    tail_w = statistics.fmean(powers) if powers else 0.0
    return Window(e1 - e0 - tail_w * (t1 - t_end), t_end - t0, t1 - t_end, value)


# -- A ---------------------------------------------------------------------------------------------


def environment(rig: Rig) -> dict[str, Any]:
    """Device, driver and software versions."""
    dev, info = rig.dev, rig.dev.info
    env: dict[str, Any] = {
        "name": info.name,
        "device_id": info.device_id,
        "backend": info.backend,
        "index": info.index,
        "simulated": info.is_simulated,
        "supported_sm_mhz": {
            "min": info.min_sm_freq_mhz,
            "max": info.max_sm_freq_mhz,
            "count": len(info.supported_sm_freqs_mhz),
        },
        "clocks_mhz": rig.freqs,
        "power_limit_range_w": info.power_limit_range_w,
        "default_power_limit_w": info.default_power_limit_w,
        "mig_enabled": dev.mig_enabled(),
        "details": dict(dev.details()),
        "python": platform.python_version(),
        "powerlib": powerlib.__version__,
        "kernel": platform.release(),
        "euid": os.geteuid(),
        "work": rig.work.describe(),
    }
    if rig.torch is not None:
        env["torch"] = rig.torch.__version__
        env["cuda"] = rig.torch.version.cuda
    if rig.nvml is not None:
        nvml = rig.nvml[0]
        for key, fn in (
            ("driver", "nvmlSystemGetDriverVersion"),
            ("nvml", "nvmlSystemGetNVMLVersion"),
            ("cuda_driver", "nvmlSystemGetCudaDriverVersion_v2"),
        ):
            with contextlib.suppress(Exception):
                value = getattr(nvml, fn)()
                env[key] = value.decode() if isinstance(value, bytes) else value
    else:
        env["driver"] = f"none ({info.backend} backend)"
    return env


def counter_reads(dev: Device, seconds: float) -> dict[str, Any]:
    """Read the counter back to back for ``seconds``: how often it moved (its period)."""
    reads: list[tuple[float, float | None]] = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        st = dev.read_state()
        reads.append((time.perf_counter(), st.energy_j))
    intervals = [b[0] - a[0] for a, b in zip(reads, reads[1:])]
    changes = sum(1 for a, b in zip(reads, reads[1:]) if a[1] != b[1])
    est = estimate_counter_period_s(intervals, changes)
    return {
        "reads": len(reads),
        "changes": changes,
        "period_s": None if est is None else _r(est[0]),
        "period_is_upper_bound": None if est is None else est[1],
    }


def field_timestamps(rig: Rig, seconds: float) -> dict[str, Any]:
    """Whether NVML's field timestamps move exactly when the energy counter does."""
    if rig.nvml is None:
        return {
            "available": False,
            "why": f"not available: the {rig.dev.info.backend} backend has no NVML field values",
        }
    nvml, handle = rig.nvml
    field = getattr(nvml, "NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION", None)
    if field is None:
        return {"available": False, "why": "not available: pynvml has no energy field id"}
    samples: list[tuple[int, int]] = []
    try:
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            (value,) = nvml.nvmlDeviceGetFieldValues(handle, [field])
            if value.nvmlReturn != 0:
                return {
                    "available": False,
                    "why": f"not available: NVML returned {value.nvmlReturn} for the energy field",
                }
            samples.append((int(value.timestamp), int(value.value.ullVal)))
    except Exception as err:  # a driver without field values, a fake without timestamps
        return {"available": False, "why": f"not available: {type(err).__name__}: {err}"}
    moved = [i for i in range(1, len(samples)) if samples[i][1] != samples[i - 1][1]]
    stamped = [i for i in range(1, len(samples)) if samples[i][0] != samples[i - 1][0]]
    both = set(moved) & set(stamped)
    stamps_at_moves = [samples[i][0] for i in moved]
    periods = [(b - a) / 1e6 for a, b in zip(stamps_at_moves, stamps_at_moves[1:])]
    return {
        "available": True,
        "reads": len(samples),
        "value_changes": len(moved),
        "timestamp_changes": len(stamped),
        "value_changes_with_new_timestamp": len(both),
        "follows_counter_updates": bool(moved) and len(both) == len(moved) == len(stamped),
        "period_from_timestamps_s": _r(statistics.median(periods)) if periods else None,
    }


def part_a(rig: Rig, part: dict[str, Any]) -> None:
    """Environment and read costs."""
    dev, work, s, report = rig.dev, rig.work, rig.scale, rig.report
    env = environment(rig)
    report.data["device"] = env
    figures = part["figures"]
    refusal = rig.backend.control_refusal()
    report.check(
        "A",
        "may_change_clocks",
        refusal is None,
        refusal or "yes",
        "the backend may change clocks here (root and CAP_SYS_ADMIN, docs/real-gpu.md §5)",
    )
    if refusal is not None and not rig.smoke:
        rig.halt = f"the backend may not change clocks here: {refusal}"
    at_start = read_lock(dev)
    figures["lock_at_start_idle"] = at_start.to_json()
    costs = {
        "read_state": timed(dev.read_state, s.reads),
        "read_sm_lock": timed(dev.read_sm_lock, s.reads),
        "details": timed(dev.details, max(5, s.reads // 10)),
    }
    figures["read_cost_s"] = {name: stats(v) for name, v in costs.items()}
    rig.read_state_s = statistics.median(costs["read_state"])
    with work.load():
        time.sleep(s.settle_s)
        loaded = sample_lock(dev, 2 * s.sample_s)
        figures["counter_under_load"] = counter = counter_reads(dev, s.counter_s)
        figures["field_timestamps"] = field_timestamps(rig, s.counter_s)
    figures["default_clock_under_load"] = default = summarize_samples(loaded)
    rig.default_loaded_mhz = default["running_mhz"]
    rig.counter_period_s = counter["period_s"]
    locked = at_start.locked is True or "True" in default["locked"]
    report.check(
        "A",
        "unlocked_at_start",
        not locked,
        f"idle {at_start.locked}, under load {'/'.join(default['locked'])}",
        "the driver reports no clock lock before the script changes anything",
        judged_in_smoke=True,
    )
    report.check(
        "A",
        "read_state_cost_s",
        rig.read_state_s < DEFAULT_SAMPLE_PERIOD_S / 2,
        rig.read_state_s,
        f"median read_state < half the sampler's period ({DEFAULT_SAMPLE_PERIOD_S / 2 * 1e3:g} ms)",
    )
    lock_read_s = statistics.median(costs["read_sm_lock"])
    report.check(
        "A",
        "read_sm_lock_cost_s",
        lock_read_s < 0.005,
        lock_read_s,
        "median read_sm_lock < 5 ms (it follows every clock write)",
    )
    period = counter["period_s"]
    report.check(
        "A",
        "counter_period_s",
        period is not None and period <= 0.2,
        period,
        "the energy counter updates at least every 200 ms under load (NVML: ~100 ms)",
    )
    on = counter_window(rig, lambda: work.busy(s.power_s))
    off = counter_window(rig, lambda: time.sleep(s.power_s))
    onoff = counter_window(
        rig, lambda: with_power_field(dev, lambda: work.onoff(s.onoff_s, 0.01, 0.01))
    )
    busy_s, field_j, field_reads = onoff.value
    steady_j = on.power_w * busy_s + off.power_w * (onoff.time_s - busy_s)
    ratio = onoff.energy_j / field_j if field_j > 0 else math.nan
    figures["power_w"] = {"steady_load": _r(on.power_w, 2), "idle": _r(off.power_w, 2)}
    figures["onoff_10ms"] = {
        "time_s": _r(onoff.time_s),
        "busy_s": _r(busy_s),
        "counter_j": _r(onoff.energy_j, 3),
        "power_field_j": _r(field_j, 3),
        "power_field_reads": field_reads,
        "counter_over_power_field": _r(ratio),
        "busy_x_steady_plus_idle_j": _r(steady_j, 3),
        "counter_over_steady_estimate": _r(onoff.energy_j / steady_j if steady_j > 0 else None),
    }
    report.check(
        "A",
        "onoff_10ms_counter_over_power_field",
        abs(ratio - 1.0) <= 0.10,
        ratio,
        "the counter's energy of a 10 ms on / 10 ms off load within 10 % of the power readings "
        "integrated over it (read back to back on a thread): the counter misses no phase of it",
    )


def with_power_field(dev: Device, body: Callable[[], Any]) -> tuple[Any, float, int]:
    """Run ``body`` while a thread reads the power back to back; its value, the power's integral."""
    samples: list[tuple[float, float]] = []
    stop = threading.Event()

    def poll() -> None:
        while not stop.is_set():
            power_w = dev.read_state().power_w
            if power_w is not None:
                samples.append((time.perf_counter(), power_w))

    thread = threading.Thread(target=poll, name="power-reads", daemon=True)
    thread.start()
    try:
        value = body()
    finally:
        stop.set()
        thread.join()
    joules = math.fsum((b[0] - a[0]) * (a[1] + b[1]) / 2 for a, b in zip(samples, samples[1:]))
    return value, joules, len(samples)


# -- B ---------------------------------------------------------------------------------------------


def part_b(rig: Rig, part: dict[str, Any]) -> None:
    """Lock read-back at each clock under a steady load."""
    dev, s, report, control = rig.dev, rig.scale, rig.report, rig.ctl()
    rows = []
    # Idle first: a session detects an administrator's lock at its `with` line, when the GPU is
    # usually idle; NVML can only show a lock through the clock-event reason 0x2, which it may
    # report only while the lock holds the clock down (docs/real-gpu.md §1).
    idle_freq = rig.freqs[len(rig.freqs) // 2]
    control.lock_sm_clocks(dev, idle_freq)
    time.sleep(s.settle_s)
    idle = dev.read_sm_lock()
    part["figures"]["idle_lock"] = {"requested_mhz": idle_freq, **idle.to_json()}
    report.check(
        "B",
        "idle_lock_visible",
        idle.locked is True,
        f"locked={idle.locked}, {idle.running_mhz} MHz, reasons {list(idle.reasons)}",
        f"the driver reports a lock at {idle_freq:g} MHz on an idle GPU (without it, a lock "
        "set before a session starts cannot be detected at its `with` line)",
    )
    with rig.work.load():
        time.sleep(s.settle_s)
        for freq in rig.freqs:
            row: dict[str, Any] = {"requested_mhz": freq}
            rows.append(row)
            step = rig.step_mhz(freq)
            criterion = (
                f"observed within one step ({step:g} MHz) of {freq:g} MHz under load, unless "
                "the driver reports a limiting reason (power cap, thermal)"
            )
            try:
                row["locked_mhz"] = list(control.lock_sm_clocks(dev, freq))
            except PowerlibError as err:
                row["error"] = f"{type(err).__name__}: {err}"
                report.check(
                    "B", f"clock_{freq:g}", False, row["error"], criterion, judged_in_smoke=True
                )
                continue
            back = dev.last_sm_readback
            row["readback"] = None if back is None else back.to_json()
            time.sleep(s.settle_s)
            row.update(summarize_samples(sample_lock(dev, s.sample_s)))
            observed = row["running_mhz"]
            within = observed is not None and abs(observed - freq) <= step + 0.5
            limited = bool(row["limited"]) and observed is not None and observed < freq
            row["within_one_step"] = within
            shown = f"{observed:g} MHz" if observed is not None else "no clock reported"
            if row["limited"]:
                shown += f" ({', '.join(row['limited'])})"
            report.check(
                "B", f"clock_{freq:g}", within or limited, shown, criterion, judged_in_smoke=True
            )
    rig.restore()
    part["figures"]["clocks"] = rig.b_rows = rows


# -- C ---------------------------------------------------------------------------------------------


def part_c(rig: Rig, part: dict[str, Any]) -> None:
    """Switch landing latency, direct and through the runtime's controller."""
    dev, s, report, control = rig.dev, rig.scale, rig.report, rig.ctl()
    clean = [
        r["requested_mhz"] for r in rig.b_rows if r.get("within_one_step") and not r["limited"]
    ]
    high = clean[0] if clean else rig.freqs[1]
    low = rig.freqs[-1] if rig.freqs[-1] != high else rig.freqs[-2]
    tolerance = {f: rig.step_mhz(f) + 0.5 for f in (high, low)}
    part["figures"]["clocks_mhz"] = [high, low]
    timeout_s = 3.0 if rig.smoke else 1.0  # a busy CI core may stall the poll
    direct: list[tuple[float, float | None, float | None]] = []
    via: list[float | None] = []
    with rig.work.load():
        time.sleep(s.settle_s)
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
    rig.restore()
    calls = [d[0] for d in direct]
    direct_landed = [d[1] for d in direct if d[1] is not None]
    after_call = [d[2] for d in direct if d[2] is not None]
    via_landed = [v for v in via if v is not None]
    figures = part["figures"]
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
        report.check(
            "C",
            f"{name}_all_landed",
            len(landed) == n,
            f"{len(landed)} of {n}",
            f"every switch ({name}) shows on the running clock under load within {timeout_s:g} s",
            judged_in_smoke=True,
        )
        worst = max(landed) if landed else None
        report.check(
            "C",
            f"{name}_max_latency_s",
            worst is not None and worst < MAX_LATENCY_S,
            worst,
            f"the slowest landing < {MAX_LATENCY_S * 1e3:g} ms "
            f"(median {_shown(statistics.median(landed)) if landed else '-'} s)",
        )


# -- D ---------------------------------------------------------------------------------------------


def _torch_on_cpu(rig: Rig) -> None:
    """--smoke: build the layer stack on the CPU and run each kind once (the GPU path's code)."""
    try:
        import torch
    except ImportError:
        rig.report.check(
            "D",
            "torch_layer_stack_on_cpu",
            None,
            "torch is not installed",
            "the layer stack builds and runs a forward and a backward",
        )
        return
    try:
        work = TorchWork(torch, torch.device("cpu"), tiny=True)
        for kind in ("forward", "backward"):
            work.run(kind, 0)
        work.end_iteration()
        ok, shown = True, f"{work.layers} layer, forward {work.forward_s * 1e3:.2f} ms on the CPU"
    except Exception as err:  # the real run would fail the same way
        ok, shown = False, f"{type(err).__name__}: {err}"
    rig.report.check(
        "D",
        "torch_layer_stack_on_cpu",
        ok,
        shown,
        "the layer stack builds and runs a forward and a backward",
        judged_in_smoke=True,
    )


def _run_profile(rig: Rig, order: Sequence[Any], out_dir: Path) -> dict[str, Any]:
    """D's runtime profile: ``powerlib.optimize(mode="profile")`` around the layer stack."""
    from powerlib.planning.profile import Profile

    s, work = rig.scale, rig.work
    iteration_s: list[float] = []
    started = time.perf_counter()
    with powerlib.optimize(
        num_stages=1,
        num_microbatches=s.profile_microbatches,
        schedule="gpipe",  # every forward, then every backward: counter intervals of one kind
        mode="profile",
        backend=rig.backend,
        device=rig.dev,
        coordinator=SingleProcess(),
        freqs_mhz=rig.freqs,
        stop_after_rises=0,  # every one of the clocks
        target_error=s.target_error,
        max_iterations_per_freq=s.max_iterations_per_freq,
        out_dir=out_dir,
        progress=True,
        guardian=rig.guardian,
    ) as session:
        cap = 2 + len(rig.freqs) * s.max_iterations_per_freq + 5
        while session.phase in ("profile", "awaiting-plan") and len(iteration_s) < cap:
            t0 = time.perf_counter()
            for i, ins in enumerate(order):
                with session.instruction(ins.kind, ins.microbatch):
                    work.run(ins.kind, ins.microbatch)
                work.sync()
                time.sleep(s.gap_s * (1 + i % 3))  # uneven gaps: the blocking power shows
            work.end_iteration()
            session.step()
            iteration_s.append(time.perf_counter() - t0)
        info = session.report()
        outcome = session.outcome
        recorded = session.recorder.rows(0)
        p_block_w = session.recorder.p_block_w
    wall_s = time.perf_counter() - started
    path = out_dir / "profile.csv"
    rows = Profile.read(path).rows if path.exists() else tuple(recorded)
    return {
        "rows": {(r.instruction, r.freq_mhz): (r.time_s, r.energy_j) for r in rows},
        "written": path.exists(),
        "refused": None if outcome is None else outcome.baseline_reason,
        "p_block_w": p_block_w,
        "iterations": len(iteration_s),
        "iteration_s": iteration_s,
        "wall_s": wall_s,
        "measured_latency_s": info.get("measured_latency_s"),
        "clock_changes": info.get("frequency_changes"),
    }


def _reference(rig: Rig) -> dict[str, Any]:
    """Each kind repeated ``reference_s`` per clock, its energy from counter updates."""
    s, work, control = rig.scale, rig.work, rig.ctl()
    rows: dict[tuple[str, float], tuple[float, float]] = {}
    cvs: list[float] = []
    idle: dict[float, float] = {}
    chunk = 4
    for freq in rig.freqs:
        control.lock_sm_clocks(rig.dev, freq)
        time.sleep(min(s.settle_s, 0.2))  # the lock lands
        for kind in ("forward", "backward"):
            fn = rig.work.prepare(kind)
            fn()
            work.sync()

            def repeat(fn: Callable[[], None] = fn) -> tuple[int, list[float]]:
                count, chunks = 0, []
                t0 = time.perf_counter()
                while time.perf_counter() - t0 < s.reference_s:
                    tc = time.perf_counter()
                    for _ in range(chunk):
                        fn()
                    work.sync()
                    chunks.append((time.perf_counter() - tc) / chunk)
                    count += chunk
                return count, chunks

            window = counter_window(rig, repeat)
            count, chunks = window.value
            rows[(kind, freq)] = (window.time_s / count, window.energy_j / count)
            if len(chunks) > 2 and statistics.fmean(chunks) > 0:
                # chunks of `chunk` instructions: their spread shrinks by sqrt(chunk)
                cvs.append(statistics.stdev(chunks) / statistics.fmean(chunks) * math.sqrt(chunk))
            work.end_iteration()
        idle[freq] = counter_window(rig, lambda: time.sleep(s.idle_s)).power_w
    rig.restore()
    return {"rows": rows, "idle_w": idle, "time_cv": statistics.median(cvs) if cvs else 0.0}


def part_d(rig: Rig, part: dict[str, Any]) -> None:
    """A real per-instruction profile against a 3 s reference per kind and clock."""
    from powerlib.planning.schedules import build_schedule

    s, report, figures = rig.scale, rig.report, part["figures"]
    if rig.smoke:
        _torch_on_cpu(rig)
    figures["workload"] = rig.work.describe()
    figures["profile_settings"] = {
        "num_stages": 1,
        "num_microbatches": s.profile_microbatches,
        "schedule": "gpipe",
        "freqs_mhz": rig.freqs,
        "target_error": s.target_error,
        "max_iterations_per_freq": s.max_iterations_per_freq,
        "gap_s": [s.gap_s * (1 + i % 3) for i in range(3)],
    }
    order = build_schedule("gpipe", 1, s.profile_microbatches)[0]
    rig.restore()  # the session claims the device itself
    runtime = _run_profile(rig, order, rig.tmp / "profile")
    reference = _reference(rig)
    ref, got = reference["rows"], runtime["rows"]
    table = []
    energy_errors, time_errors = [], []
    for (kind, freq), (t_ref, e_ref) in sorted(ref.items(), key=lambda kv: (kv[0][0], -kv[0][1])):
        row: dict[str, Any] = {
            "kind": kind,
            "freq_mhz": freq,
            "reference_time_s": _r(t_ref),
            "reference_energy_j": _r(e_ref, 4),
        }
        if (kind, freq) in got:
            t_got, e_got = got[(kind, freq)]
            row.update(
                runtime_time_s=_r(t_got),
                runtime_energy_j=_r(e_got, 4),
                time_error=_r(t_got / t_ref - 1),
                energy_error=_r(e_got / e_ref - 1),
            )
            energy_errors.append(abs(e_got / e_ref - 1))
            time_errors.append(abs(t_got / t_ref - 1))
        table.append(row)
    fmax = max(rig.freqs)
    gaps_s = sum(s.gap_s * (1 + i % 3) for i in range(len(order)))
    ref_iteration_s = sum(ref[(ins.kind, fmax)][0] for ins in order) + gaps_s
    spent_s = sum(runtime["iteration_s"])
    extra_s = spent_s - len(runtime["iteration_s"]) * ref_iteration_s
    p_block_ref = statistics.fmean(reference["idle_w"].values())
    p_block_rt = runtime["p_block_w"]
    figures["rows"] = table
    figures["runtime"] = {k: v for k, v in runtime.items() if k not in ("rows", "iteration_s")}
    figures["reference_idle_power_w"] = {f"{f:g}": _r(p, 2) for f, p in reference["idle_w"].items()}
    figures["blocking_power_w"] = {"reference": _r(p_block_ref, 2), "runtime": _r(p_block_rt, 2)}
    figures["time_cv"] = _r(reference["time_cv"])
    figures["profiling_cost"] = {
        "iterations": len(runtime["iteration_s"]),
        "seconds": _r(spent_s, 3),
        "all_max_seconds": _r(len(runtime["iteration_s"]) * ref_iteration_s, 3),
        "extra_seconds": _r(extra_s, 3),
        "extra_percent": _r(100 * extra_s / (spent_s - extra_s), 3) if spent_s > extra_s else None,
    }
    report.check(
        "D",
        "profile_resolved",
        runtime["written"],
        runtime["refused"] or f"{len(got)} rows in {runtime['iterations']} iterations",
        "the runtime resolves every row and writes profile.csv",
    )
    complete = len(energy_errors) == len(ref)
    mean_e = statistics.fmean(energy_errors) if energy_errors else None
    worst_e = max(energy_errors) if energy_errors else None
    worst_t = max(time_errors) if time_errors else None
    report.check(
        "D",
        "energy_error_mean",
        complete and mean_e is not None and mean_e <= 0.05,
        mean_e,
        "every row profiled; mean |energy error| against the reference <= 5 %",
    )
    report.check(
        "D",
        "energy_error_worst",
        worst_e is not None and worst_e <= 0.10,
        worst_e,
        "worst |energy error| of a row <= 10 %",
    )
    report.check(
        "D",
        "time_error_worst",
        worst_t is not None and worst_t <= 0.05,
        worst_t,
        "worst |time error| of a row <= 5 %",
    )
    pb_error = None if p_block_rt is None else p_block_rt / p_block_ref - 1
    report.check(
        "D",
        "blocking_power_error",
        pb_error is not None and abs(pb_error) <= 0.15,
        pb_error if pb_error is not None else "the runtime measured none",
        "the runtime's blocking power within 15 % of the idle power measured at the profiled clocks",
    )
    rig.curves = {
        "reference": ref,
        "runtime": got if runtime["written"] else None,
        "p_block_reference_w": p_block_ref,
        "p_block_runtime_w": p_block_rt,
        "time_cv": reference["time_cv"],
    }


# -- E ---------------------------------------------------------------------------------------------


def _profile8(rows: dict[tuple[str, float], tuple[float, float]]) -> Any:
    """One stage's curves as every stage of the emulated pipeline."""
    from powerlib.planning.profile import Profile, ProfileRow

    return Profile(
        [
            ProfileRow(stage=stage, instruction=kind, freq_mhz=freq, time_s=t, energy_j=e)
            for stage in range(STAGES)
            for (kind, freq), (t, e) in rows.items()
        ],
        source="gpu_acceptance D",
    )


def _releases(emulator: Any, result: Any, stage: int) -> list[tuple[str, int, float]]:
    """Each instruction of ``stage`` and when its inputs from other stages arrived (from start)."""
    dag = emulator.dag
    ends = {ex.instruction: ex.end_s - result.start_s for ex in result.executed}
    preds: dict[int, list[int]] = {}
    for u, v in dag.edges:
        if dag.instructions[u].stage != dag.instructions[v].stage:
            preds.setdefault(v, []).append(u)
    out = []
    for v in dag.stage_order(stage):
        ins = dag.instructions[v]
        ready = max((ends[dag.instructions[u]] for u in preds.get(v, ())), default=0.0)
        out.append((ins.kind, ins.microbatch, ready))
    return out


def emulate_plan(
    plan: Any, truth: Any, model: Any, p_block_w: float, iterations: int
) -> dict[str, Any]:
    """Replay ``plan`` on emulated GPUs whose truth is ``truth`` (as ``powerlib simulate``).

    The session's own apply phase over inline frequency controllers, paired with all-max
    iterations on the same noise draws (:func:`powerlib.emulator.demo.simulate_plan`), plus
    what F needs: each stage's energy and its instructions' release times.
    """
    from powerlib.emulator.demo import run_plan
    from powerlib.emulator.engine import Emulator

    schedule = [[p.instruction for p in plan.stage(s)] for s in range(plan.num_stages)]
    emulator = Emulator(truth, schedule, p_block_w=p_block_w, model=model, seed=0)

    def per_stage(runs: Sequence[Any]) -> list[float]:
        return [
            statistics.fmean(
                dev.energy_at(r.start_s + r.time_s) - dev.energy_at(r.start_s) for r in runs
            )
            for dev in emulator.devices
        ]

    base = [emulator.run_iteration(noise_key=k) for k in range(1, iterations + 1)]
    base_stage_j = per_stage(base)
    runs = run_plan(emulator, plan, iterations)
    plan_stage_j = per_stage(runs)
    base_t = statistics.fmean(r.time_s for r in base)
    plan_t = statistics.fmean(r.time_s for r in runs)
    base_e = statistics.fmean(r.energy_j for r in base)
    plan_e = statistics.fmean(r.energy_j for r in runs)
    return {
        "saving_percent": 100 * (1 - plan_e / base_e),
        "slowdown_percent": 100 * (plan_t / base_t - 1),
        "iteration_s": {"all_max": base_t, "plan": plan_t},
        "stages": [
            {
                "stage": s,
                "all_max_j": b,
                "plan_j": p,
                "saving_percent": 100 * (1 - p / b),
                "releases_plan": _releases(emulator, runs[0], s),
                "releases_all_max": _releases(emulator, base[0], s),
                "iteration_s_plan": runs[0].time_s,
                "iteration_s_all_max": base[0].time_s,
            }
            for s, (b, p) in enumerate(zip(base_stage_j, plan_stage_j))
        ],
    }


def part_e(rig: Rig, part: dict[str, Any]) -> None:
    """The 8-stage pipeline emulated from D's curves: predicted against realized."""
    from powerlib.emulator.engine import NvmlLikeModel
    from powerlib.planning.plan import FrequencyPlan
    from powerlib.runtime.planning_step import PlanSpec, make_plan

    curves, report, figures = rig.curves, rig.report, part["figures"]
    if curves is None:
        raise Skipped("part D produced no curves")
    latency_s = rig.latency.get("mean_s") or 0.02
    spread = 0.0
    if rig.latency.get("max_s") is not None and latency_s > 0:
        spread = min(1.0, (rig.latency["max_s"] - rig.latency["min_s"]) / (2 * latency_s))
    model = NvmlLikeModel(
        counter_period_s=rig.counter_period_s or 0.1,
        duty=1.0,
        read_cost_s=min(rig.read_state_s or 0.003, 0.05),
        switch_latency_s=latency_s,
        latency_spread=spread,
        noise=min(curves["time_cv"], 0.2),
        drift=0.0,
        name=f"measured on {rig.dev.info.name}",
    )
    rig.report.data["emulation"]["E_model"] = model.to_json()
    figures["model"] = model.describe()
    figures["pipeline"] = {
        "stages": STAGES,
        "microbatches": rig.scale.pipeline_microbatches,
        "schedule": "1f1b",
        "truth": "D's reference curves on every stage",
        "policy": "fastest",
    }
    truth = _profile8(curves["reference"])
    rig.emulated = {}
    for name, rows, p_block in (
        ("reference", curves["reference"], curves["p_block_reference_w"]),
        (
            "runtime",
            curves["runtime"],
            curves["p_block_runtime_w"] or curves["p_block_reference_w"],
        ),
    ):
        record: dict[str, Any] = {}
        figures[f"{name}_plan"] = record
        criterion = f"the plan from the {name} profile: |predicted - realized saving| <= 2 points"
        if rows is None:
            record["skipped"] = "D's runtime profile was not resolved"
            report.check("E", f"{name}_saving_gap_points", None, record["skipped"], criterion)
            continue
        path = rig.tmp / f"{name}_{STAGES}stages.csv"
        _profile8(rows).write_csv(path)
        spec = PlanSpec(
            num_stages=STAGES,
            num_microbatches=rig.scale.pipeline_microbatches,
            switch_latency_s=latency_s,
            p_block_w=p_block,
            out_dir=None,
            progress=False,
        )
        record["p_block_w"] = _r(p_block, 2)
        try:
            outcome = make_plan(spec, [{"profile_path": str(path)}])
        except PlanError as err:
            record["refused"] = str(err)
            report.check("E", f"{name}_saving_gap_points", False, str(err), criterion)
            continue
        prediction = outcome.prediction
        record["predicted"] = None if prediction is None else prediction.to_json()
        if outcome.plan is None:
            record["refused"] = outcome.baseline_reason
            report.check(
                "E", f"{name}_saving_gap_points", False, outcome.baseline_reason, criterion
            )
            continue
        plan_path = rig.tmp / f"{name}_plan.json"
        outcome.plan.write(plan_path)
        plan = FrequencyPlan.read(plan_path)
        result = emulate_plan(
            plan, truth, model, curves["p_block_reference_w"], rig.scale.emulated_iterations
        )
        predicted_saving = None if prediction is None else prediction.saving_percent
        predicted_slowdown = None if prediction is None else prediction.slowdown_percent
        record.update(
            predicted_saving_percent=_r(predicted_saving, 4),
            predicted_slowdown_percent=_r(predicted_slowdown, 4),
            realized_saving_percent=_r(result["saving_percent"], 4),
            realized_slowdown_percent=_r(result["slowdown_percent"], 4),
            iteration_s=result["iteration_s"],
            stages=[
                {k: _r(v, 4) for k, v in st.items() if not k.startswith(("releases", "iteration"))}
                for st in result["stages"]
            ],
        )
        rig.emulated[name] = {"plan_path": plan_path, "plan": plan, **result}
        gap = None if predicted_saving is None else abs(predicted_saving - result["saving_percent"])
        report.check(
            "E", f"{name}_saving_gap_points", gap is not None and gap <= 2.0, gap, criterion
        )
        report.check(
            "E",
            f"{name}_realized_slowdown_percent",
            result["slowdown_percent"] <= 1.0,
            result["slowdown_percent"],
            f"the plan from the {name} profile realizes <= 1 % slower than all-max",
        )


# -- F ---------------------------------------------------------------------------------------------


def _landings(
    applied: Sequence[Any], sampler: Any, after_call_s: float
) -> tuple[list[tuple[float, float | None]], str]:
    """When each applied clock change landed, and how that was known.

    Seen in the session's own sampler reads when they show the clock (the first read showing
    the new clock after the previous change landed: late by at most one read interval, so
    "early" instructions are counted generously); else estimated as the controller's write
    plus C's median landing after a write.
    """
    seen = sampler is not None and sampler.reports_clock
    out: list[tuple[float, float | None]] = []
    previous = -math.inf
    for change in applied:
        if not change.ok:
            continue
        landed = None
        if seen and change.freq_mhz is not None:
            found = sampler.first_clock_at(change.freq_mhz, previous)
            landed = None if found is None else found[1]
        if landed is None:
            landed = change.time_s + after_call_s
        out.append((landed, change.freq_mhz))
        previous = landed
    return out, "the session's sampler reads" if seen else "write + C's landing after a write"


def _clock_at(landings: Sequence[tuple[float, float | None]], t: float) -> float | None:
    """The clock in force at ``t``: the change landed last by then (None: unlocked)."""
    landed = [(when, freq) for when, freq in landings if when <= t]
    return max(landed, key=lambda x: x[0])[1] if landed else None


def _block(
    rig: Rig,
    releases: Sequence[tuple[str, int, float]],
    iteration_s: float,
    block_s: float,
    session: Any = None,
) -> dict[str, Any]:
    """Iterations of one stage for ``block_s`` (after one unmeasured), energy from the counter."""
    work = rig.work
    begins: list[tuple[float, str, int]] = []

    def one() -> None:
        start = time.perf_counter()
        for kind, microbatch, ready_s in releases:
            _sleep_until(start + ready_s)
            begins.append((time.perf_counter(), kind, microbatch))
            if session is None:
                work.run(kind, microbatch)
            else:
                with session.instruction(kind, microbatch):
                    work.run(kind, microbatch)
            work.sync()
        _sleep_until(start + iteration_s)  # the rest of the pipeline, then the step
        work.end_iteration()
        if session is not None:
            session.step()

    one()  # the session checks the order here; the clocks warm up
    begins.clear()

    def iterations() -> int:
        n = 0
        t0 = time.perf_counter()
        while n == 0 or time.perf_counter() - t0 < block_s:
            one()
            n += 1
        return n

    window = counter_window(rig, iterations)
    n = window.value
    return {
        "iterations": n,
        "energy_per_iteration_j": window.energy_j / n,
        "time_per_iteration_s": window.time_s / n,
        "begins": begins,
    }


def part_f(rig: Rig, part: dict[str, Any]) -> None:
    """The real apply path for two stages of E's plan against all-max and the default."""
    s, report, figures = rig.scale, rig.report, part["figures"]
    if not rig.emulated:
        raise Skipped("part E produced no plan")
    name = "runtime" if "runtime" in rig.emulated else "reference"
    emulated = rig.emulated[name]
    plan, plan_path = emulated["plan"], emulated["plan_path"]
    stages = emulated["stages"]
    slack = max(stages, key=lambda st: st["saving_percent"])["stage"]
    critical = min(stages, key=lambda st: st["saving_percent"])["stage"]
    chosen = [("most_slack", slack), ("critical", critical)]
    if slack == critical:
        chosen = chosen[:1]
    figures["plan"] = f"E's plan from the {name} profile"
    fmax = max(rig.dev.info.supported_sm_freqs_mhz)
    rounds, block_s = s.rounds, s.block_s
    reserve_s = 30.0 if not rig.smoke else 10.0  # G
    blocks = 3 * rounds * len(chosen)
    per_block_s = block_s + 2 * max(st["iteration_s_plan"] for st in stages) + 1.0
    if rig.left_s() - reserve_s < blocks * per_block_s:
        rounds = 1
        blocks = 3 * len(chosen)
        block_s = max(0.5, (rig.left_s() - reserve_s) / blocks - per_block_s + block_s)
    figures["rounds"], figures["block_s"] = rounds, _r(block_s, 2)
    after_call_s = rig.latency.get("after_call_s") or 0.0
    control = rig.ctl()
    for label, stage in chosen:
        st = stages[stage]
        planned = {
            (p.instruction.kind, p.instruction.microbatch): p.freq_mhz for p in plan.stage(stage)
        }
        record: dict[str, Any] = {"stage": stage, "blocks": []}
        figures[label] = record
        results: dict[str, list[dict[str, Any]]] = {"plan": [], "all_max": [], "default": []}
        plan_ok = True
        for _ in range(rounds):
            for variant in ("plan", "all_max", "default"):
                if variant == "plan":
                    rig.restore()
                    with powerlib.optimize(
                        num_stages=STAGES,
                        num_microbatches=rig.scale.pipeline_microbatches,
                        mode="apply",
                        plan_path=plan_path,
                        stage=stage,
                        backend=rig.backend,
                        device=rig.dev,
                        coordinator=SingleProcess(),
                        out_dir=None,
                        progress=False,
                        check_rounds=0,  # the blocks here are the check
                        guardian=rig.guardian,
                    ) as session:
                        block = _block(
                            rig, st["releases_plan"], st["iteration_s_plan"], block_s, session
                        )
                        assert session.controller is not None
                        session.controller.wait_idle()
                        applied = list(session.controller.applied)
                        phase = session.phase
                        landings, seen_by = _landings(applied, session.sampler, after_call_s)
                    first = block["begins"][0][0] if block["begins"] else math.inf
                    in_window = [c for c in applied if c.time_s >= first]
                    early = sum(
                        1
                        for t, kind, mb in block["begins"]
                        if _clock_at(landings, t) != planned[(kind, mb)]
                    )
                    block.update(
                        landings_from=seen_by,
                        phase=phase,
                        clock_changes_per_iteration=len(in_window) / block["iterations"],
                        failed_changes=sum(1 for c in applied if not c.ok),
                        early_instructions=early,
                        instructions=len(block["begins"]),
                    )
                    plan_ok &= phase == "apply" and bool(applied) and not block["failed_changes"]
                elif variant == "all_max":
                    control.lock_sm_clocks(rig.dev, fmax)
                    block = _block(rig, st["releases_all_max"], st["iteration_s_all_max"], block_s)
                    rig.restore()
                else:
                    rig.restore()
                    block = _block(rig, st["releases_all_max"], st["iteration_s_all_max"], block_s)
                block.pop("begins")
                results[variant].append(block)
                record["blocks"].append(
                    {
                        "variant": variant,
                        **{k: _r(v) if isinstance(v, float) else v for k, v in block.items()},
                    }
                )
                rig.report.save()
        mean = {
            v: (
                statistics.fmean(b["energy_per_iteration_j"] for b in blocks_),
                statistics.fmean(b["time_per_iteration_s"] for b in blocks_),
            )
            for v, blocks_ in results.items()
        }
        saving = 100 * (1 - mean["plan"][0] / mean["all_max"][0])
        slowdown = 100 * (mean["plan"][1] / mean["all_max"][1] - 1)
        early = sum(b["early_instructions"] for b in results["plan"])
        total = sum(b["instructions"] for b in results["plan"])
        record.update(
            energy_per_iteration_j={v: _r(m[0], 4) for v, m in mean.items()},
            time_per_iteration_s={v: _r(m[1]) for v, m in mean.items()},
            saving_vs_all_max_percent=_r(saving, 3),
            saving_vs_default_percent=_r(100 * (1 - mean["plan"][0] / mean["default"][0]), 3),
            stage_slowdown_percent=_r(slowdown, 3),
            clock_changes_per_iteration=_r(
                statistics.fmean(b["clock_changes_per_iteration"] for b in results["plan"]), 2
            ),
            instructions_started_before_their_clock_landed=f"{early} of {total}",
            landings_from=results["plan"][-1]["landings_from"],
            predicted_saving_percent=_r(st["saving_percent"], 3),
            predicted_slowdown_percent=_r(emulated["slowdown_percent"], 3),
        )
        report.check(
            "F",
            f"{label}_plan_applied",
            plan_ok,
            f"stage {stage}: {record['clock_changes_per_iteration']} changes/iteration",
            "the session applied the plan (apply phase, no failed change)",
            judged_in_smoke=True,
        )
        gap = abs(saving - st["saving_percent"])
        report.check(
            "F",
            f"{label}_saving_gap_points",
            gap <= 3.0,
            f"measured {saving:.2f} % vs predicted {st['saving_percent']:.2f} %",
            f"stage {stage}'s measured saving against all-max within 3 points of E's",
        )
        report.check(
            "F",
            f"{label}_stage_slowdown_percent",
            slowdown <= max(1.0, emulated["slowdown_percent"] + 1.0),
            slowdown,
            "the stage's iteration <= 1 % (or E's prediction + 1 point) slower than all-max",
        )
    after = read_lock(rig.dev)
    figures["lock_after_sessions"] = after.to_json()
    report.check(
        "F",
        "released_after_sessions",
        after.locked is not True,
        str(after.locked),
        "no lock reported once the sessions and blocks have ended",
        judged_in_smoke=True,
    )


# -- G ---------------------------------------------------------------------------------------------

CHILD = """
import sys, time
from powerlib.control import ControlSession
from powerlib.registry import open_backend

with open_backend() as backend, ControlSession(backend, guardian=True) as session:
    session.lock_sm_clocks(backend.device(sys.argv[1]), float(sys.argv[2]))
    print("locked", flush=True)
    time.sleep(300)
"""


def _read_line(stream: Any, timeout_s: float) -> str:
    ready, _, _ = select.select([stream], [], [], timeout_s)
    return stream.readline().decode(errors="replace").strip() if ready else ""


def part_g(rig: Rig, part: dict[str, Any]) -> None:
    """Restore after exit, and the guardian against SIGKILL."""
    dev, s, report, figures = rig.dev, rig.scale, rig.report, part["figures"]
    if rig.control is not None:
        rig.control.close()  # the script's control session ends: all restored, guardian gone
        rig.control = None
    default = rig.default_loaded_mhz or dev.info.max_sm_freq_mhz or 0.0
    threshold = RECOVERED_SHARE * default
    with rig.work.load():
        time.sleep(s.settle_s)
        after = summarize_samples(sample_lock(dev, s.sample_s))
    figures["after_exit_under_load"] = after
    report.check(
        "G",
        "lock_clear_after_exit",
        "True" not in after["locked"],
        "/".join(after["locked"]),
        "the driver reports no lock after the script's control session ended",
        judged_in_smoke=True,
    )
    running = after["running_mhz"]
    report.check(
        "G",
        "default_clock_after_exit",
        running is not None and running >= threshold,
        running,
        f"under load the clock is back to >= {RECOVERED_SHARE:.0%} of the "
        f"default measured in A ({default:g} MHz)",
        judged_in_smoke=True,
    )
    lowest = dev.info.supported_sm_freqs_mhz[0]
    wait_s = 15.0 if rig.smoke else 2 * GUARDIAN_LIMIT_S  # a busy CI core starts it slowly
    criterion = (
        f"a guarded child killed with SIGKILL at {lowest:g} MHz: the clock under load is back "
        f"to >= {threshold:g} MHz within {GUARDIAN_LIMIT_S:g} s"
    )
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, dev.device_id, repr(lowest)],
        stdout=subprocess.PIPE,
        cwd=rig.tmp,
        env=dict(os.environ),
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
            time.sleep(s.guardian_settle_s)
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
    figures["guardian_recovery_s"] = _r(recovery_s)
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
        criterion,
    )
    # The guardian removes the child's journal once its restore is done; only the child's
    # journals are judged (a dry run: whatever else the state folder holds is left alone).
    end = time.perf_counter() + 2.0
    while True:
        left = [
            o
            for o in powerlib.restore_journals(rig.backend.settings, dry_run=True)
            if o.owner_pid == child.pid
        ]
        if not left or time.perf_counter() > end:
            break
        time.sleep(0.05)
    figures["child_journal_left"] = [o.action for o in left]
    if left:  # put the GPU back as `powerlib restore` would
        figures["restored_by_script"] = [
            o.action for o in powerlib.restore_journals(rig.backend.settings)
        ]
    report.check(
        "G",
        "no_journal_left",
        not left,
        "none" if not left else "; ".join(o.action for o in left),
        "the guardian restored the child's device and removed its journal",
        judged_in_smoke=True,
    )


# -- main ------------------------------------------------------------------------------------------

PARTS: tuple[tuple[str, str, Callable[[Rig, dict[str, Any]], None]], ...] = (
    ("A", "environment and read costs", part_a),
    ("B", "lock read-back at each clock under load", part_b),
    ("C", "switch landing latency", part_c),
    ("D", "per-instruction profile against a reference", part_d),
    ("E", "8-stage pipeline emulated from D's curves", part_e),
    ("F", "the real apply path", part_f),
    ("G", "restore after exit and after SIGKILL", part_g),
)


def run_part(rig: Rig, key: str, title: str, fn: Callable[[Rig, dict[str, Any]], None]) -> None:
    """Run one part; an error fails its ``ran`` check and the next part still runs."""
    if key == "E":
        source = "powerlib.emulator (virtual time): NvmlLikeModel from A, C and D (see E_model)"
    elif rig.smoke:
        source = "simulated backend, CI-sized (smoke): " + ", ".join(
            f"{k}={v}" for k, v in SMOKE_ENV.items() if k.startswith("POWERLIB_SIM_")
        )
    else:
        source = (
            f"measured on {rig.dev.info.name} ({rig.dev.device_id}), {rig.dev.info.backend} backend"
        )
    part = rig.report.part(key, title, source)
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


def open_rig(
    args: argparse.Namespace, report_path: Path | None, tmp: Path, started: float
) -> Rig | str:
    """The backend, the device and its work; a one-line reason when they cannot be had."""
    smoke = args.smoke
    torch = None
    nvml = None
    try:
        if smoke:
            backend = powerlib.open_backend()
            dev = backend.devices()[0]
            work: Any = SimWork(dev)
        else:
            try:
                import torch
            except ImportError:
                return "torch is not installed: the run needs CUDA torch (or use --smoke)"
            if not torch.cuda.is_available():
                return "CUDA is not available to torch: run on the GPU node (or use --smoke)"
            backend = powerlib.open_backend()
            if backend.name == "simulated":
                backend.close()
                return "POWERLIB_BACKEND=simulated without --smoke: the run needs the GPU's backend"
            torch.cuda.set_device(args.device)
            props = torch.cuda.get_device_properties(args.device)
            uuid = str(getattr(props, "uuid", "")).lower()
            dev = next(
                (
                    d
                    for d in backend.devices()
                    if uuid and d.device_id.lower() in (uuid, f"gpu-{uuid}")
                ),
                None,
            ) or backend.device(args.device)  # a torch without uuid: the same index
            work = TorchWork(torch, torch.device("cuda", args.device))
            if backend.name == "nvidia":
                nvml = _nvml_handle(dev.device_id)
    except (PowerlibError, IndexError) as err:
        return f"no device to run on: {err or 'the backend lists none'}"
    path = report_path or (
        Path(tempfile.gettempdir()) / "gpu_acceptance_smoke.json"
        if smoke
        else RESULTS / f"gpu_acceptance_{_gpu_slug(dev.info.name)}.json"
    )
    scale = SMOKE if smoke else REAL
    rig = Rig(
        args=args,
        scale=scale,
        smoke=smoke,
        backend=backend,
        dev=dev,
        work=work,
        report=Report(path, smoke),
        tmp=tmp,
        nvml=nvml,
        torch=torch,
    )
    rig.deadline = started + (args.budget_s or scale.budget_s)
    rig.freqs = pick_clocks(dev.info.supported_sm_freqs_mhz, scale.clocks)
    return rig


def _nvml_handle(device_id: str) -> tuple[Any, Any] | None:
    """pynvml and the handle of the GPU with this UUID (A's field-timestamp reads)."""
    try:
        from powerlib.backends._nvml_api import import_pynvml

        nvml = import_pynvml()
        nvml.nvmlInit()
        for i in range(nvml.nvmlDeviceGetCount()):
            handle = nvml.nvmlDeviceGetHandleByIndex(i)
            uuid = nvml.nvmlDeviceGetUUID(handle)
            if (uuid.decode() if isinstance(uuid, bytes) else uuid) == device_id:
                return nvml, handle
    except Exception:  # A then says "not available"
        return None
    return None


def main(argv: Sequence[str] | None = None) -> int:
    """Run parts A-G; 0 when every check passed, 1 when one failed, 2 when nothing could run."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="the JSON report (default: see above)")
    parser.add_argument("--device", type=int, default=0, help="CUDA device index (default 0)")
    parser.add_argument("--smoke", action="store_true", help="the simulated backend, CI-sized")
    parser.add_argument("--budget-s", type=float, help="the whole run's time (default 470 s)")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="gpu-acceptance-") as tmp_name:
        tmp = Path(tmp_name)
        if args.smoke:
            os.environ.update(SMOKE_ENV, POWERLIB_STATE_DIR=str(tmp / "state"))
        rig = open_rig(args, args.out, tmp, started)
        if isinstance(rig, str):
            print(f"gpu_acceptance: {rig}", file=sys.stderr)
            return 2
        if not rig.dev.info.capabilities.can_lock_sm_clocks:
            print(f"gpu_acceptance: {rig.dev.info.name} cannot lock its SM clock", file=sys.stderr)
            return 2
        print(
            f"gpu_acceptance: {rig.dev.info.name} ({rig.dev.device_id}), "
            f"{'smoke run on the simulated backend' if rig.smoke else 'real run'}; "
            f"clocks {', '.join(f'{f:g}' for f in rig.freqs)} MHz; report {rig.report.path}",
            flush=True,
        )
        try:
            for key, title, fn in PARTS:
                run_part(rig, key, title, fn)
        finally:
            if rig.control is not None:
                rig.control.close()
            rig.report.save()
            rig.backend.close()
    counts = rig.report.statuses()
    verdict = rig.report.data["summary"]["verdict"]
    print(
        f"\n{verdict}: "
        + ", ".join(f"{n} {status}" for status, n in sorted(counts.items()))
        + f" in {rig.report.data['summary']['elapsed_s']:.1f} s; {rig.report.path}",
        flush=True,
    )
    return 1 if counts.get("FAIL") else 0


if __name__ == "__main__":
    sys.exit(main())
