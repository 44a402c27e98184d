"""powerlib around a plain DDP loop (no pipeline: every rank is stage 0).

Run on CPU with simulated GPUs::

    POWERLIB_BACKEND=simulated POWERLIB_SIM_GPUS=2 \
        torchrun --standalone --nproc-per-node 2 examples/ddp.py

Each forward of the model is an instruction, its backward another, ``optimizer.step()`` ends the
iteration; two accumulated microbatches per step here.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

import powerlib
from powerlib.integrations.torch_distributed import attach_module


def main() -> None:
    """Train a toy DDP model through a powerlib session."""
    dist.init_process_group("gloo")
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(512, 512))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    with (
        powerlib.optimize(
            num_stages=1,
            num_microbatches=2,
            stage=0,  # data-parallel replicas share stage 0
            freqs_mhz=[1410, 1200, 990]
            if os.environ.get("POWERLIB_BACKEND") == "simulated"
            else None,
        ) as session,
        attach_module(session, model, opt),
    ):
        for _ in range(20):
            for _ in range(2):
                model(torch.randn(32, 512)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
