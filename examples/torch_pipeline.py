"""powerlib around a torch.distributed.pipelining job (1F1B, one stage per rank).

Run on CPU with simulated GPUs (no GPU needed)::

    POWERLIB_BACKEND=simulated POWERLIB_SIM_GPUS=2 POWERLIB_SIM_TIME_FOLLOWS_CLOCK=1 \
        torchrun --standalone --nproc-per-node 2 examples/torch_pipeline.py

``POWERLIB_SIM_TIME_FOLLOWS_CLOCK=1`` makes an instruction's time follow the locked clock
(docs/backends.md, "It follows the job"); without it a lower clock only lowers power.

On a GPU cluster drop ``POWERLIB_BACKEND`` (NVIDIA or AMD is found), run as root (clock locking),
and pass your own model split. Rank 0 writes profile.csv, frontier.csv, plan.json and summary.json
to powerlib-out/.

The loop trains until the session has said what the plan achieved: it profiles, rank 0 plans, and
the closed loop measures the plan (the ``check`` phase, docs/runtime.md) until its verdict; then
rank 0 prints the session's report (JSON) and one verdict line, also when no plan was applied
(the reason from summary.json) or the bound on iterations came first. Every rank leaves the loop
at the same iteration: the phase changes inside ``schedule.step`` (the session's collectives).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage, Schedule1F1B

import powerlib
from powerlib.integrations.torch_distributed import attach_pipeline
from powerlib.runtime import SessionPhase

MICROBATCHES = 4
MAX_ITERATIONS = 200
"""A bound: on simulated GPUs the verdict arrives after about 50 iterations."""
UNDECIDED = (
    SessionPhase.NOT_STARTED,
    SessionPhase.PROFILE,
    SessionPhase.AWAITING_PLAN,
    SessionPhase.CHECK,
)
"""The phases before the session's verdict (docs/runtime.md)."""


def verdict_line(report: Any, out_dir: Path = Path("powerlib-out")) -> str:
    """One line saying what the session concluded (``session.report()``'s verdict).

    Args:
        report: The session's :class:`~powerlib.runtime.records.SessionReport`.
        out_dir: Where rank 0 wrote ``summary.json`` (the reason when no plan was applied).
    """
    if report.realized is not None:
        return f"powerlib verdict: {report.realized.line()}"
    reason = None
    summary = out_dir / "summary.json"
    if report.plan is None and summary.is_file():
        reason = json.loads(summary.read_text(encoding="utf-8")).get("refused")
    if reason:
        return f"powerlib verdict: no plan applied: {reason}"
    return (
        f"powerlib verdict: none after {report.iterations} iterations "
        f"(phase {report.phase}, plan {'applied' if report.plan else 'none'})"
    )


def main() -> None:
    """Train a toy pipeline through a powerlib session."""
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cpu")  # torch.device("cuda", int(os.environ["LOCAL_RANK"])) on GPUs
    block = torch.nn.Sequential(
        torch.nn.Linear(2048, 2048), torch.nn.GELU(), torch.nn.Linear(2048, 2048)
    )
    stage = PipelineStage(block, rank, world, device)
    schedule = Schedule1F1B(
        stage, n_microbatches=MICROBATCHES, loss_fn=torch.nn.functional.mse_loss
    )
    opt = torch.optim.AdamW(block.parameters(), lr=1e-3)

    with (
        powerlib.optimize(
            num_stages=world,
            num_microbatches=MICROBATCHES,
            # simulated GPUs: a short sweep (the default sweeps every supported clock)
            freqs_mhz=[1410, 1200, 990]
            if os.environ.get("POWERLIB_BACKEND") == "simulated"
            else None,
            iterations_per_freq=3,
        ) as session,
        attach_pipeline(session, schedule),
    ):
        iteration = 0
        while session.phase in UNDECIDED and iteration < MAX_ITERATIONS:
            iteration += 1
            x, y = torch.randn(64 * MICROBATCHES, 2048), torch.randn(64 * MICROBATCHES, 2048)
            if rank == 0:
                schedule.step(x)
            elif rank == world - 1:
                schedule.step(target=y, losses=[])
            else:
                schedule.step()
            opt.step()
            opt.zero_grad()
        report = session.report()
    if rank == 0:
        print(json.dumps(report.to_json()))
        print(verdict_line(report), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
