"""One rank of the Megatron-core integration tests (launched by test_megatron.py).

``megatron_worker.py OUT SCHEDULE...`` runs, for each named schedule (``1f1b``: Megatron's
non-interleaved 1F1B; ``interleaved``: virtual pipeline size 2), a PP=2 megatron-core training
loop (``get_forward_backward_func`` with M=4 microbatches) through a session with
``powerlib.integrations.megatron.attach`` on the simulated backend: profile three clocks, plan on
rank 0, apply. Each iteration also runs a ``forward_only=True`` evaluation pass, which must not
count as instructions. Each stage's module sleeps ``BASE_S * f_max / f`` (``clocked.py``) in forward and backward
for the clock in force (the simulated GPU does not run torch). Then it applies a plan whose
stage-1 order was tampered with, and records the warnings; and checks that a session whose stage
is not the pipeline rank is refused. Megatron runs on CPU through the test-only shims of
``megatron_shims.py``. One process does every schedule (``parallel_state`` is re-initialised in
between) because importing megatron-core costs seconds. Writes ``rank<R>.json``.
"""

from __future__ import annotations

import json
import os
import sys
import time
import types
import warnings
from pathlib import Path

import megatron.core.transformer.multi_token_prediction  # noqa: F401
import megatron_shims as shims
import torch
import torch.distributed as dist
from clocked import SWEEP, Block, Delay, drive, record, tampered_plan
from megatron.core import parallel_state
from megatron.core.pipeline_parallel import get_forward_backward_func, schedules
from megatron.core.transformer.transformer_config import TransformerConfig

import powerlib
from powerlib.errors import InvalidArgumentError
from powerlib.integrations.megatron import attach

M = 4
SEQ, MBS, HIDDEN = 4, 2, 16
# forward_step imports multi_token_prediction lazily, and that import warns "Apex is not
# installed": imported above, so the warning does not land in the sessions' warning records.


def _forward_step_func(data_iterator, model):
    x, y = next(data_iterator)  # every chunk reads the microbatch; only the first uses x

    def loss_func(out: torch.Tensor):
        loss = ((out - y) ** 2).mean()
        return loss, {"loss": loss.detach()}

    return model(x), loss_func


def _training(kind: str, world: int):
    """The model chunks of this rank and one training iteration (plus an eval pass)."""
    vp = 2 if kind == "interleaved" else None
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        pipeline_model_parallel_size=world, virtual_pipeline_model_parallel_size=vp
    )
    config = TransformerConfig(
        num_layers=world * (vp or 1),
        hidden_size=HIDDEN,
        num_attention_heads=1,
        pipeline_model_parallel_size=world,
        virtual_pipeline_model_parallel_size=vp,
        pipeline_dtype=torch.float32,
        use_cpu_initialization=True,
    )
    chunks = [shims.StageModule(Block(HIDDEN), config) for _ in range(vp or 1)]
    opt = torch.optim.SGD([p for c in chunks for p in c.parameters()], lr=0.01)

    def run(forward_only: bool) -> None:
        batches = [(torch.randn(SEQ, MBS, HIDDEN), torch.randn(SEQ, MBS, HIDDEN)) for _ in range(M)]
        data = [iter(batches) for _ in chunks]
        forward_backward_func = get_forward_backward_func()  # inside attach: the hooked one
        with shims.cuda_to_cpu():
            forward_backward_func(
                forward_step_func=_forward_step_func,
                data_iterator=data if vp else data[0],
                model=chunks if vp else chunks[0],
                num_microbatches=M,
                seq_length=SEQ,
                micro_batch_size=MBS,
                forward_only=forward_only,
            )

    def iteration() -> None:
        run(forward_only=False)
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            run(forward_only=True)  # evaluation: not an instruction, not a step

    return iteration, vp or 1


def _case(kind: str, out: Path, rank: int, world: int, device: powerlib.Device) -> dict:
    iteration, chunks = _training(kind, world)
    common = {
        "num_stages": world,
        "num_microbatches": M,
        "stage": parallel_state.get_pipeline_model_parallel_rank(),
        "schedule": kind,
        "num_chunks": chunks,
        "device": rank,
        "progress": rank == 0,
    }
    originals = (schedules.forward_step, schedules.backward_step)
    before = device.read_state().locked_sm_freqs_mhz
    result: dict = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with (
            powerlib.optimize(
                **SWEEP,
                out_dir=out / kind / "auto",
                **common,
            ) as session,
            attach(session),
        ):
            result["auto"] = record(session, drive(session, lambda i: iteration()))
    result["auto"]["warnings"] = [str(w.message) for w in caught if issubclass(w.category, Warning)]
    result["auto"]["restored"] = device.read_state().locked_sm_freqs_mhz == before
    result["auto"]["unpatched"] = (schedules.forward_step, schedules.backward_step) == originals

    tampered = tampered_plan(out / kind / "auto" / "plan.json", out / kind / "tampered.json", rank)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with (
            powerlib.optimize(
                mode="apply", plan_path=tampered, out_dir=None, check_rounds=0, **common
            ) as session,
            attach(session),
        ):
            for _ in range(2):
                iteration()
            result["mismatch"] = {"phase": session.phase, "iterations": session.iteration}
    result["mismatch"]["warnings"] = [
        str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)
    ]
    result["mismatch"]["restored"] = device.read_state().locked_sm_freqs_mhz == before

    wrong = types.SimpleNamespace(stage=world - 1 - rank)  # attach checks before any hook
    try:
        with attach(wrong):
            result["wrong_stage"] = "accepted"
    except InvalidArgumentError as err:
        result["wrong_stage"] = str(err)
    return result


def main() -> int:
    out, kinds = Path(sys.argv[1]), sys.argv[2:]
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=world)
    shims.install()
    torch.manual_seed(0)
    backend = powerlib.open_backend()
    device = backend.device(rank)
    Delay.device = device
    result: dict = {"rank": rank}
    for kind in kinds:
        t0 = time.perf_counter()
        result[kind] = _case(kind, out, rank, world, device)
        result[kind]["wall_s"] = time.perf_counter() - t0
        dist.barrier()
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
