"""powerlib around a megatron-core pipeline (PP = number of ranks, 1F1B; megatron-core 0.16.1-0.19.2).

Run on CPU with simulated GPUs (no GPU needed)::

    POWERLIB_BACKEND=simulated POWERLIB_SIM_GPUS=2 POWERLIB_SIM_ENERGY_PERIOD_S=0.001 \
    POWERLIB_STATE_DIR=/tmp/mg-example-state \
        torchrun --standalone --nproc-per-node 2 examples/megatron_pipeline.py

On a GPU cluster drop ``POWERLIB_BACKEND`` (NVIDIA or AMD is found), run as root (clock locking)
and use your own model chunks (a ``GPTModel`` per pp rank); the CPU-only block below is skipped
when CUDA is available. Rank 0 writes profile.csv, frontier.csv, plan.json to powerlib-out/.

Megatron-core's schedules assume CUDA in three places, so on a CPU-only machine this example
patches them (the block marked CPU ONLY). They are inlined rather than imported from
``tests/integrations/megatron_shims.py`` (the same shims, documented item by item) so the example
stands alone; they patch ``torch.cuda`` process-wide and have no place in a GPU job.
"""

from __future__ import annotations

import contextlib
import json
import os

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.enums import ModelType
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.transformer.transformer_config import TransformerConfig
from torch.overrides import TorchFunctionMode

import powerlib
from powerlib.integrations.megatron import attach

MICROBATCHES = 4
SEQ, MICROBATCH_SIZE, HIDDEN = 32, 4, 1024
ON_GPU = torch.cuda.is_available()

# ---- CPU ONLY: megatron-core 0.16.1's schedules on a machine without CUDA --------------------
if not ON_GPU:
    torch.cuda.current_device = lambda: torch.device("cpu")  # P2P receive buffers
    torch.cuda.synchronize = lambda device=None: None  # the sync after batched P2P


class _CudaToCpu(TorchFunctionMode):
    """``device="cuda"`` keywords become ``"cpu"`` (the schedules' ``total_num_tokens``)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        device = kwargs.get("device")
        if str(device).startswith("cuda"):
            kwargs["device"] = "cpu"
        return func(*args, **kwargs)


# ---- end of CPU ONLY ---------------------------------------------------------------------------


class Stage(torch.nn.Module):
    """One pipeline stage; megatron needs ``config``, ``model_type`` and ``set_input_tensor``."""

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        self.config = config
        self.model_type = ModelType.encoder_or_decoder
        self.body = torch.nn.Sequential(
            torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.GELU(), torch.nn.Linear(HIDDEN, HIDDEN)
        )
        self.input_tensor: torch.Tensor | None = None

    def set_input_tensor(self, input_tensor: list[torch.Tensor | None]) -> None:
        """The activation received from the previous stage (``[None]`` on the first)."""
        self.input_tensor = input_tensor[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The first stage reads the batch, the others the received activation."""
        return self.body(x if self.input_tensor is None else self.input_tensor)


def forward_step(data_iterator, model):
    """Megatron's ``forward_step_func``: the output and its loss function."""
    x, y = next(data_iterator)

    def loss_func(out: torch.Tensor):
        loss = torch.nn.functional.mse_loss(out, y)
        return loss, {"loss": loss.detach()}

    return model(x), loss_func


def main() -> None:
    """Train a toy megatron-core pipeline through a powerlib session."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if ON_GPU:
        torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl" if ON_GPU else "gloo")
    world = dist.get_world_size()
    parallel_state.initialize_model_parallel(pipeline_model_parallel_size=world)
    config = TransformerConfig(
        num_layers=world,
        hidden_size=HIDDEN,
        num_attention_heads=1,
        pipeline_model_parallel_size=world,
        pipeline_dtype=torch.float32,
        use_cpu_initialization=not ON_GPU,
    )
    device = torch.device("cuda", local_rank) if ON_GPU else torch.device("cpu")
    model = Stage(config).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()

    with (
        powerlib.optimize(
            num_stages=world,
            num_microbatches=MICROBATCHES,
            stage=pp_rank,
            # simulated GPUs: a short sweep (the default sweeps every supported clock)
            freqs_mhz=[1410, 1200, 990]
            if os.environ.get("POWERLIB_BACKEND") == "simulated"
            else None,
            iterations_per_freq=3,
        ) as session,
        attach(session),  # every forward_step/backward_step is an instruction
    ):
        for _ in range(20):
            batches = [
                (
                    torch.randn(SEQ, MICROBATCH_SIZE, HIDDEN, device=device),
                    torch.randn(SEQ, MICROBATCH_SIZE, HIDDEN, device=device),
                )
                for _ in range(MICROBATCHES)
            ]
            forward_backward_func = get_forward_backward_func()  # inside attach: hooked
            with contextlib.nullcontext() if ON_GPU else _CudaToCpu():
                forward_backward_func(
                    forward_step_func=forward_step,
                    data_iterator=iter(batches),
                    model=model,
                    num_microbatches=MICROBATCHES,
                    seq_length=SEQ,
                    micro_batch_size=MICROBATCH_SIZE,
                )  # session.step() runs when it returns
            opt.step()
            opt.zero_grad()
        if dist.get_rank() == 0:
            print(json.dumps(session.report().to_json()))
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
