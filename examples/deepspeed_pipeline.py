"""powerlib around a DeepSpeed pipeline-parallel job (``PipelineModule``, one stage per rank).

Run on CPU with simulated GPUs (no GPU needed)::

    POWERLIB_BACKEND=simulated POWERLIB_SIM_GPUS=2 POWERLIB_SIM_ENERGY_PERIOD_S=0.001 \
        DS_ACCELERATOR=cpu torchrun --standalone --nproc-per-node 2 examples/deepspeed_pipeline.py

On a GPU cluster drop ``POWERLIB_BACKEND`` and ``DS_ACCELERATOR`` (NVIDIA or AMD is found, NCCL is
used), run as root (clock locking), and pass your own layers. With more ranks than stages the
rest are data-parallel replicas: pass ``stage=engine.stage_id``. Rank 0 writes profile.csv,
frontier.csv, plan.json to powerlib-out/.
"""

from __future__ import annotations

import json
import os
import sys

import deepspeed
import deepspeed.comm
import torch
from deepspeed.pipe import PipelineModule

import powerlib
from powerlib.integrations.deepspeed import attach_pipeline

MICROBATCHES = 4
STEPS = 20


def main() -> None:
    """Train a toy pipeline through a powerlib session."""
    if deepspeed.get_accelerator().device_name() == "cpu":
        # CPU only: skip the 80-100 s JIT build of DeepSpeed's shared-memory op (a sys.modules
        # lookup: ``import deepspeed.comm.torch`` would bind the torch package instead).
        sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None
    deepspeed.init_distributed()
    world = deepspeed.comm.get_world_size()
    layers = [
        torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.GELU()) for _ in range(2 * world)
    ]
    model = PipelineModule(layers=layers, num_stages=world, loss_fn=torch.nn.functional.mse_loss)
    engine, *_ = deepspeed.initialize(
        model=model,
        model_parameters=[p for p in model.parameters() if p.requires_grad],
        config={
            "train_micro_batch_size_per_gpu": 32,
            "gradient_accumulation_steps": MICROBATCHES,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
            "steps_per_print": STEPS,
        },
    )

    def batches():
        while True:
            yield torch.randn(32, 1024), torch.randn(32, 1024)

    data = batches()
    with (
        powerlib.optimize(
            num_stages=engine.num_stages,
            num_microbatches=MICROBATCHES,
            stage=engine.stage_id,
            # simulated GPUs: a short sweep (the default sweeps every supported clock)
            freqs_mhz=[1410, 1200, 990]
            if os.environ.get("POWERLIB_BACKEND") == "simulated"
            else None,
            iterations_per_freq=3,
        ) as session,
        attach_pipeline(session, engine),
    ):
        for _ in range(STEPS):
            engine.train_batch(data)  # every ForwardPass/BackwardPass is one instruction
        if engine.global_rank == 0:
            print(json.dumps(session.report().to_json()))
    deepspeed.comm.destroy_process_group()


if __name__ == "__main__":
    main()
