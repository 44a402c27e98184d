"""A run that ended before its plan: how far the sweep got, said once, and what it has written.

When the ``with`` block ends without an exception while the session still profiles or awaits
rank 0's plan, rank 0 says so in one warning line (how far the sweep got, how many iterations
it needs) and writes what it has to ``out_dir``: ``summary.json`` and its own stage's rows of
the clocks that ended (``profile.partial.csv``). No collective (the other ranks may be gone
already), nothing raised: the training run itself went well.
"""

from __future__ import annotations

import logging
import warnings
from pathlib import Path

from powerlib.runtime.planning_step import add_measured, write_no_plan
from powerlib.runtime.profile_phase import ProfilePhase
from powerlib.runtime.records import Realized

__all__ = ["say_ended_before_plan", "say_ended_in_check", "warn_at_exit"]

logger = logging.getLogger("powerlib.runtime.session")


def say_ended_before_plan(
    profiling: ProfilePhase,
    *,
    rank: int,
    stage: int,
    iterations: int,
    waiting: bool,
    goal: str,
    out_dir: Path | None,
) -> bool:
    """Say (rank 0, or a rank whose failure no agreement carried) that the run ended early.

    Args:
        profiling: The session's profile phase.
        rank: This rank.
        stage: Its pipeline stage.
        iterations: Iterations the run stepped.
        waiting: The sweep ended; rank 0's outcome had not arrived.
        goal: ``profile`` or ``plan``: what the session was making.
        out_dir: Where rank 0 writes what it has.

    Returns:
        Whether this rank warned.
    """
    if rank != 0:
        if profiling.failed is not None:  # no agreement came to carry it to rank 0
            warn_at_exit(f"powerlib: {profiling.failed}; the run ended before every rank knew")
            return True
        logger.debug("powerlib: the run ended before its plan; rank 0 says how far")
        return False
    so_far = profiling.so_far()
    if waiting:
        got = f"it profiled every clock, but rank 0's {goal} had not arrived"
    elif so_far.warming_up:
        got = "it was still warming up"
    else:
        got = f"it profiled {so_far.clocks_profiled} of {so_far.clocks} clocks"
    message = (
        f"powerlib: the run ended after {iterations} iterations, before its {goal}: "
        f"{got}; a {goal} needs up to {so_far.iterations_needed} iterations of "
        f"profiling ({so_far.warmup_iterations} warm-up + {so_far.clocks} clocks x up "
        f"to {so_far.max_iterations_per_clock}): train longer, or profile fewer clocks "
        "(freqs_mhz) or iterations per clock (max_iterations_per_freq)"
    )
    if profiling.failed is not None:
        message += f"; {profiling.failed}"
    rows = []
    try:
        rows = profiling.partial_rows()
    except Exception as err:  # noqa: BLE001 - a finished run must not fail for its partial profile
        logger.debug("powerlib: no partial profile: %s", err)
    info = {
        "ended_before_plan": message.removeprefix("powerlib: "),
        "iterations": iterations,
        **so_far.to_json(),
        "partial_profile_stage": stage if rows else None,
    }
    if write_no_plan(out_dir, info, rows):
        written = "its partial profile and summary.json are" if rows else "summary.json is"
        message += f"; {written} in {out_dir}"
    warn_at_exit(message)
    return True


def say_ended_in_check(*, rank: int, iterations_left: int, out_dir: Path | None) -> Realized:
    """The run ended while the closed loop still measured: no verdict, said once by rank 0.

    Rank 0 writes the ``unfinished`` verdict into ``summary.json`` (``measured``) and warns once;
    the plan ran unjudged, and nothing is estimated from a partial batch.

    Args:
        rank: This rank.
        iterations_left: Iterations the current batch still needed before its exchange.
        out_dir: Where rank 0's ``summary.json`` is.

    Returns:
        The ``unfinished`` verdict (every rank records it in its report).
    """
    reason = (
        f"the run ended during the closed loop's check, {iterations_left} iteration(s) before "
        "its next exchange: the plan ran, but its saving was not measured; train longer, or "
        "pass check_rounds=0 to apply without measuring"
    )
    realized = Realized.nothing("unfinished", reason)
    if rank == 0:
        add_measured(out_dir, realized)
        warn_at_exit(f"powerlib: {reason}")
    return realized


def warn_at_exit(message: str) -> None:
    """One ``RuntimeWarning`` at the ``with`` statement's exit.

    Where warnings are errors (``-W error``) it is a log record instead: a training run that went
    well must not fail for a notice.
    """
    try:
        # the `with` statement's line: here, say_ended_before_plan, Flow, Session.__exit__
        warnings.warn(message, RuntimeWarning, stacklevel=5)
    except Warning:
        logger.warning(message)
