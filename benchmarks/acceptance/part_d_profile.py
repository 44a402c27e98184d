"""D. A real per-instruction profile against a reference per kind and clock.

A stack of ``torch.nn.TransformerEncoderLayer`` sized so that a forward takes about 22 ms and a
backward about 45 ms, profiled through ``powerlib.optimize(mode="profile")`` at the run's clocks,
against a reference of each kind repeated for 3 s per clock (energy from the counter, aligned on
its updates): the error of every row, the blocking power, what profiling cost. In ``--smoke`` the
layer stack is only built and run once on the CPU. Hands on ``rig.curves`` (E).
"""

from __future__ import annotations

import functools
import math
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

# Library names: mend here when one moves (and the session readers below).
import powerlib
from powerlib import Session
from powerlib.planning.profile import Profile
from powerlib.planning.schedules import build_schedule
from powerlib.runtime import SessionPhase, SingleProcess
from powerlib.runtime.records import NoPlan, Outcome, ProfileOnly

from .harness import Rig, rounded
from .readings import counter_window
from .work import TorchWork

KEY = "D"
TITLE = "per-instruction profile against a reference"
Rows = dict[tuple[str, float], tuple[float, float]]  # (kind, MHz) -> (seconds, joules)


# -- what the script reads of a profiling session (the runtime's restructure may move it) --------


def _profiling(session: Session) -> bool:
    """Whether the session still profiles (or waits for its plan)."""
    return session.phase in (SessionPhase.PROFILE, SessionPhase.AWAITING_PLAN)


def _refusal(outcome: Outcome | None) -> str | None:
    """Why rank 0 wrote no profile (or made no plan), when it says so."""
    return outcome.reason if isinstance(outcome, (ProfileOnly, NoPlan)) else None


def _profile_outcome(session: Session) -> dict[str, Any]:
    """What the session measured: its rows, blocking power, refusal, latency, clock changes."""
    report = session.report()
    return {
        "recorded": session.recorder.rows(0),
        "p_block_w": session.recorder.p_block_w,
        "refused": _refusal(session.outcome),
        "measured_latency_s": report.measured_latency_s,
        "clock_changes": report.frequency_changes,
    }


# -- the two measurements ------------------------------------------------------------------------


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
        while _profiling(session) and len(iteration_s) < cap:
            t0 = time.perf_counter()
            for i, ins in enumerate(order):
                with session.instruction(ins.kind, ins.microbatch):
                    work.run(ins.kind, ins.microbatch)
                work.sync()
                time.sleep(s.gap_s * (1 + i % 3))  # uneven gaps: the blocking power shows
            work.end_iteration()
            session.step()
            iteration_s.append(time.perf_counter() - t0)
        measured = _profile_outcome(session)
    wall_s = time.perf_counter() - started
    path = out_dir / "profile.csv"
    recorded = measured.pop("recorded")
    rows = Profile.read(path).rows if path.exists() else tuple(recorded)
    return {
        "rows": {(r.instruction, r.freq_mhz): (r.time_s, r.energy_j) for r in rows},
        "written": path.exists(),
        "refused": measured["refused"],
        "p_block_w": measured["p_block_w"],
        "iterations": len(iteration_s),
        "iteration_s": iteration_s,
        "wall_s": wall_s,
        "measured_latency_s": measured["measured_latency_s"],
        "clock_changes": measured["clock_changes"],
    }


def _repeat(rig: Rig, fn: Callable[[], None], chunk: int) -> tuple[int, list[float]]:
    """``fn`` in chunks for ``reference_s``: how many ran, and each chunk's seconds per call."""
    count, chunks = 0, []
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < rig.scale.reference_s:
        tc = time.perf_counter()
        for _ in range(chunk):
            fn()
        rig.work.sync()
        chunks.append((time.perf_counter() - tc) / chunk)
        count += chunk
    return count, chunks


def _reference(rig: Rig) -> dict[str, Any]:
    """Each kind repeated ``reference_s`` per clock, its energy from counter updates."""
    s, work, control = rig.scale, rig.work, rig.ctl()
    rows: Rows = {}
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
            window = counter_window(rig, functools.partial(_repeat, rig, fn, chunk))
            count, chunks = window.value
            rows[(kind, freq)] = (window.time_s / count, window.energy_j / count)
            if len(chunks) > 2 and statistics.fmean(chunks) > 0:
                # chunks of `chunk` instructions: their spread shrinks by sqrt(chunk)
                cvs.append(statistics.stdev(chunks) / statistics.fmean(chunks) * math.sqrt(chunk))
            work.end_iteration()
        idle[freq] = counter_window(rig, lambda: time.sleep(s.idle_s)).power_w
    rig.restore()
    return {"rows": rows, "idle_w": idle, "time_cv": statistics.median(cvs) if cvs else 0.0}


# -- the comparison --------------------------------------------------------------------------------


def _table(ref: Rows, got: Rows) -> tuple[list[dict[str, Any]], list[float], list[float]]:
    """One row per (kind, clock): reference against runtime; the |energy| and |time| errors."""
    table = []
    energy_errors, time_errors = [], []
    for (kind, freq), (t_ref, e_ref) in sorted(ref.items(), key=lambda kv: (kv[0][0], -kv[0][1])):
        row: dict[str, Any] = {
            "kind": kind,
            "freq_mhz": freq,
            "reference_time_s": rounded(t_ref),
            "reference_energy_j": rounded(e_ref, 4),
        }
        if (kind, freq) in got:
            t_got, e_got = got[(kind, freq)]
            row.update(
                runtime_time_s=rounded(t_got),
                runtime_energy_j=rounded(e_got, 4),
                time_error=rounded(t_got / t_ref - 1),
                energy_error=rounded(e_got / e_ref - 1),
            )
            energy_errors.append(abs(e_got / e_ref - 1))
            time_errors.append(abs(t_got / t_ref - 1))
        table.append(row)
    return table, energy_errors, time_errors


def _settings(rig: Rig) -> dict[str, Any]:
    s = rig.scale
    return {
        "num_stages": 1,
        "num_microbatches": s.profile_microbatches,
        "schedule": "gpipe",
        "freqs_mhz": rig.freqs,
        "target_error": s.target_error,
        "max_iterations_per_freq": s.max_iterations_per_freq,
        "gap_s": [s.gap_s * (1 + i % 3) for i in range(3)],
    }


def _cost(rig: Rig, order: Sequence[Any], ref: Rows, runtime: dict[str, Any]) -> dict[str, Any]:
    """What profiling cost: its iterations' time against the same iterations at all-max."""
    gap_s = rig.scale.gap_s
    fmax = max(rig.freqs)
    gaps_s = sum(gap_s * (1 + i % 3) for i in range(len(order)))
    ref_iteration_s = sum(ref[(ins.kind, fmax)][0] for ins in order) + gaps_s
    spent_s = sum(runtime["iteration_s"])
    extra_s = spent_s - len(runtime["iteration_s"]) * ref_iteration_s
    return {
        "iterations": len(runtime["iteration_s"]),
        "seconds": rounded(spent_s, 3),
        "all_max_seconds": rounded(len(runtime["iteration_s"]) * ref_iteration_s, 3),
        "extra_seconds": rounded(extra_s, 3),
        "extra_percent": (
            rounded(100 * extra_s / (spent_s - extra_s), 3) if spent_s > extra_s else None
        ),
    }


def _checks(
    rig: Rig,
    runtime: dict[str, Any],
    n_ref: int,
    errors: tuple[list[float], list[float]],
    pb_error: float | None,
) -> None:
    report, (energy_errors, time_errors) = rig.report, errors
    report.check(
        "D",
        "profile_resolved",
        runtime["written"],
        runtime["refused"] or f"{len(runtime['rows'])} rows in {runtime['iterations']} iterations",
        "the runtime resolves every row and writes profile.csv",
    )
    complete = len(energy_errors) == n_ref
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
    report.check(
        "D",
        "blocking_power_error",
        pb_error is not None and abs(pb_error) <= 0.15,
        pb_error if pb_error is not None else "the runtime measured none",
        "the runtime's blocking power within 15 % of the idle power measured at the profiled clocks",
    )


def run(rig: Rig, part: dict[str, Any]) -> None:
    """A real per-instruction profile against a 3 s reference per kind and clock."""
    figures = part["figures"]
    if rig.smoke:
        _torch_on_cpu(rig)
    figures["workload"] = rig.work.describe()
    figures["profile_settings"] = _settings(rig)
    order = build_schedule("gpipe", 1, rig.scale.profile_microbatches)[0]
    rig.restore()  # the session claims the device itself
    runtime = _run_profile(rig, order, rig.tmp / "profile")
    reference = _reference(rig)
    ref, got = reference["rows"], runtime["rows"]
    table, energy_errors, time_errors = _table(ref, got)
    p_block_ref = statistics.fmean(reference["idle_w"].values())
    p_block_rt = runtime["p_block_w"]
    figures["rows"] = table
    figures["runtime"] = {k: v for k, v in runtime.items() if k not in ("rows", "iteration_s")}
    figures["reference_idle_power_w"] = {
        f"{f:g}": rounded(p, 2) for f, p in reference["idle_w"].items()
    }
    figures["blocking_power_w"] = {
        "reference": rounded(p_block_ref, 2),
        "runtime": rounded(p_block_rt, 2),
    }
    figures["time_cv"] = rounded(reference["time_cv"])
    figures["profiling_cost"] = _cost(rig, order, ref, runtime)
    pb_error = None if p_block_rt is None else p_block_rt / p_block_ref - 1
    _checks(rig, runtime, len(ref), (energy_errors, time_errors), pb_error)
    rig.curves = {
        "reference": ref,
        "runtime": got if runtime["written"] else None,
        "p_block_reference_w": p_block_ref,
        "p_block_runtime_w": p_block_rt,
        "time_cv": reference["time_cv"],
    }
