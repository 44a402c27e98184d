"""A run that ends before its plan, and a refused plan, each say so in one line per job (issue 36).

Four emulated stages in one process (``LocalGroup``), under the logging Megatron-LM sets up (the
root logger at INFO with a handler): what a user reads is every ``RuntimeWarning`` plus every
log record at INFO or above.

- A run shorter than the sweep: when the ``with`` block ends normally mid-profile, rank 0 warns
  once with how far it got (iterations, clocks profiled) and how many iterations a plan needs, and
  writes ``summary.json`` and its stage's rows of the clocks that ended (``profile.partial.csv``);
  no other rank says anything, nothing is raised (not even where warnings are errors), and a
  block left by an exception adds nothing to the traceback. A rank whose failure no agreement
  carried to rank 0 before the end says it itself.
- A refused plan (a counter too coarse for the instructions): one warning from rank 0, no log
  record above DEBUG on any rank (the warning and a WARNING record from rank 0 plus an INFO
  record from every other rank printed it 1 + world times under Megatron).
"""

from __future__ import annotations

import contextlib
import csv
import json
import logging
import re
import warnings
from pathlib import Path

import pytest
from runtime_helpers import FREQS, emulated_sessions, make_emulator, toy_profile

from powerlib.runtime.phases import RankFailure

SETTLE = 1  # emulated_sessions: warm-up 1, settle 1, at least 1 and at most 4 measured per clock
NEEDED = 1 + len(FREQS) * (SETTLE + 4)


def _lines(caught: list, caplog: pytest.LogCaptureFixture) -> list[str]:
    """What a user of Megatron-LM's logging reads from powerlib: warnings and INFO+ records."""
    warned = [str(w.message) for w in caught if "powerlib" in str(w.message)]
    logged = [
        r.getMessage()
        for r in caplog.records
        if r.levelno >= logging.INFO and r.name.startswith("powerlib")
    ]
    return warned + logged


def _drive(sessions: list, emulator, iterations: int) -> list:
    """Enter every session, run ``iterations`` iterations, leave; the warnings caught."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with contextlib.ExitStack() as stack:
            for s in sessions:
                stack.enter_context(s)
            for _ in range(iterations):
                emulator.run_iteration(sessions)
    return caught


def test_a_run_shorter_than_the_sweep_says_how_far_it_got_once_and_writes_what_it_has(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    emulator = make_emulator(toy_profile(), 4)
    out = tmp_path / "out"
    sessions = emulated_sessions(emulator, out)
    iterations = 1 + 3 * (SETTLE + 1)  # warm-up, then about three clocks
    with caplog.at_level(logging.INFO):
        caught = _drive(sessions, emulator, iterations)
    visited = sessions[0].profiling.sweep.visited
    assert 1 <= len(visited) < len(FREQS)
    [line] = _lines(caught, caplog)
    assert line == (
        f"powerlib: the run ended after {iterations} iterations, before its plan: it profiled "
        f"{len(visited)} of {len(FREQS)} clocks; a plan needs up to {NEEDED} iterations of "
        f"profiling (1 warm-up + {len(FREQS)} clocks x up to {SETTLE + 4}): train longer, or "
        "profile fewer clocks (freqs_mhz) or iterations per clock (max_iterations_per_freq); "
        f"its partial profile and summary.json are in {out}"
    )
    assert all(s.phase == "closed" and s.plan is None for s in sessions)
    assert all(d.read_state().locked_sm_freqs_mhz is None for d in emulator.devices)
    summary = json.loads((out / "summary.json").read_text())
    assert summary == {
        "schema": "powerlib.no-plan.v1",
        "plan": None,
        "ended_before_plan": line.removeprefix("powerlib: ").split("; its partial profile")[0],
        "iterations": iterations,
        "clocks_profiled": len(visited),
        "clocks": len(FREQS),
        "warmup_iterations": 1,
        "max_iterations_per_clock": SETTLE + 4,
        "iterations_needed": NEEDED,
        "partial_profile_stage": 0,
    }
    # rank 0's stage at the clocks that ended, measured: the emulator's times, to the microsecond
    with (out / "profile.partial.csv").open() as f:
        rows = list(csv.DictReader(f))
    truth = {(r.instruction, r.freq_mhz): r for r in toy_profile().rows if r.stage == 0}
    assert sorted((r["instruction"], float(r["frequency"])) for r in rows) == sorted(
        (kind, f) for kind in ("backward", "forward") for f in visited
    )
    for r in rows:
        assert r["stage"] == "0"
        expected = truth[(r["instruction"], float(r["frequency"]))]
        assert float(r["time"]) == pytest.approx(expected.time_s, abs=1e-6)
        assert float(r["energy"]) == pytest.approx(expected.energy_j, rel=0.1)
    assert sorted(f.name for f in out.iterdir()) == ["profile.partial.csv", "summary.json"]


def test_a_run_that_ends_while_warming_up_says_so_and_writes_no_profile(tmp_path: Path) -> None:
    emulator = make_emulator(toy_profile(2), 4)
    sessions = emulated_sessions(emulator, tmp_path / "out", warmup_iterations=3)
    caught = _drive(sessions, emulator, 2)
    [line] = [str(w.message) for w in caught]
    assert line.startswith(
        "powerlib: the run ended after 2 iterations, before its plan: it was still warming up; "
        f"a plan needs up to {3 + len(FREQS) * (SETTLE + 4)} iterations"
    )
    assert line.endswith(f"; summary.json is in {tmp_path / 'out'}")
    assert sorted(f.name for f in (tmp_path / "out").iterdir()) == ["summary.json"]


def test_ending_early_never_raises_where_warnings_are_errors(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    emulator = make_emulator(toy_profile(2), 4)
    sessions = emulated_sessions(emulator, None)
    with warnings.catch_warnings(), caplog.at_level(logging.WARNING):
        warnings.simplefilter("error")  # python -W error, or pytest's filterwarnings = error
        with contextlib.ExitStack() as stack:
            for s in sessions:
                stack.enter_context(s)
            emulator.run_iteration(sessions)
    [record] = [r for r in caplog.records if r.name.startswith("powerlib")]
    assert record.getMessage().startswith("powerlib: the run ended after 1 iterations")
    assert all(s.phase == "closed" for s in sessions)


def test_a_block_left_by_an_exception_adds_nothing(tmp_path: Path) -> None:
    emulator = make_emulator(toy_profile(2), 4)
    sessions = emulated_sessions(emulator, tmp_path / "out")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(KeyError), contextlib.ExitStack() as stack:
            for s in sessions:
                stack.enter_context(s)
            emulator.run_iteration(sessions)
            raise KeyError("the training loop failed")
    assert [str(w.message) for w in caught] == []
    assert not (tmp_path / "out").exists()


def test_a_refused_plan_is_one_line_per_job_under_info_logging(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    emulator = make_emulator(toy_profile(), 4, counter_period_s=0.5)  # too coarse: refused
    sessions = emulated_sessions(emulator, tmp_path / "out")
    with caplog.at_level(logging.INFO):
        caught = _drive(sessions, emulator, 1 + 2 * len(FREQS) + 3)
    [line] = _lines(caught, caplog)
    assert re.match(r"powerlib: the energy counter cannot resolve per-instruction energy", line)
    assert line.endswith("running at the baseline clocks, no plan applied")


def test_a_failure_no_agreement_carried_before_the_end_is_said_by_its_rank(tmp_path: Path) -> None:
    """A rank that failed keeps voting; the run ended before the next vote told rank 0."""
    emulator = make_emulator(toy_profile(2), 4)
    sessions = emulated_sessions(emulator, tmp_path / "out")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with contextlib.ExitStack() as stack:
            for s in sessions:
                stack.enter_context(s)
            for _ in range(3):
                emulator.run_iteration(sessions)
            # as a failed hook does
            sessions[1]._flow.fail(RankFailure("stage 1: the device refused 1200 MHz"))
    lines = sorted(str(w.message) for w in caught)
    assert len(lines) == 2, lines
    assert lines[0] == (
        "powerlib: stage 1: the device refused 1200 MHz; the run ended before every rank knew"
    )
    assert lines[1].startswith("powerlib: the run ended after 3 iterations, before its plan")
