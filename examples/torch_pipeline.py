"""powerlib around a torch.distributed.pipelining job (1F1B, one stage per rank).

Run on CPU with simulated GPUs (no GPU needed)::

    POWERLIB_BACKEND=simulated POWERLIB_SIM_GPUS=2 \
        torchrun --standalone --nproc-per-node 2 examples/torch_pipeline.py

On a GPU cluster drop ``POWERLIB_BACKEND`` (NVIDIA or AMD is found), run as root (clock locking),
and pass your own model split. Rank 0 writes profile.csv, frontier.csv, plan.json to
powerlib-out/.
"""

from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage, Schedule1F1B

import powerlib
from powerlib.integrations.torch_distributed import attach_pipeline

MICROBATCHES = 4


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
        for _ in range(20):
            x, y = torch.randn(64 * MICROBATCHES, 2048), torch.randn(64 * MICROBATCHES, 2048)
            if rank == 0:
                schedule.step(x)
            elif rank == world - 1:
                schedule.step(target=y, losses=[])
            else:
                schedule.step()
            opt.step()
            opt.zero_grad()
        if rank == 0:
            print(json.dumps(session.report().to_json()))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
