"""One rank of the torch.distributed integration tests (launched by test_torch_distributed.py).

``pp_worker.py OUT KIND[,KIND...]`` runs, for each kind in turn, a 2-stage-per-rank or
1-stage-per-rank pipeline with the named ``torch.distributed.pipelining`` schedule (or ``ddp``: a DDP model with two accumulated
microbatches) through a session with the integration attached, on the simulated backend: profile
three clocks, plan on rank 0, apply. Each pipeline iteration also runs ``schedule.eval()`` (but
for the V schedules, ``NO_EVAL``), which must be neither recorded nor counted. Each stage's module sleeps ``BASE_S * f_max / f`` (``clocked.py``) in forward
and backward for the clock in force (the simulated GPU does not run torch). Then it applies a plan
whose stage-1 order was tampered with, and records the warnings. Writes ``OUT/KIND/rank<R>.json``.
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from clocked import SWEEP, Block, Delay, drive, record, tampered_plan

import powerlib
from powerlib.integrations.torch_distributed import attach_module, attach_pipeline

M = 4
# torch 2.13's own eval() fails on the V schedules (their forward-only runtime waits on a
# receive no peer posts), so only these are not evaluated each iteration
NO_EVAL = ("zbv", "dualpipev")


def _pipeline(kind: str, rank: int, world: int):
    from torch.distributed.pipelining import (
        PipelineStage,
        Schedule1F1B,
        ScheduleDualPipeV,
        ScheduleGPipe,
        ScheduleInterleaved1F1B,
        ScheduleInterleavedZeroBubble,
        ScheduleLoopedBFS,
        ScheduleZBVZeroBubble,
    )

    v_shape = kind in ("zbv", "dualpipev")
    chunks = 2 if kind in ("interleaved", "loopedbfs", "interleavedzb") or v_shape else 1
    if v_shape:  # rank r holds stages r and 2P-1-r
        ids = [rank, 2 * world - 1 - rank]
    else:
        ids = [rank + k * world for k in range(chunks)]
    stages = [
        PipelineStage(Block(delay_weight_grad=True), i, world * chunks, torch.device("cpu"))
        for i in ids
    ]
    loss = lambda out, tgt: ((out - tgt) ** 2).mean()  # noqa: E731
    cls = {
        "gpipe": ScheduleGPipe,
        "1f1b": Schedule1F1B,
        "interleaved": ScheduleInterleaved1F1B,
        "loopedbfs": ScheduleLoopedBFS,
        "interleavedzb": ScheduleInterleavedZeroBubble,
        "zbv": ScheduleZBVZeroBubble,
        "dualpipev": ScheduleDualPipeV,
    }[kind]
    schedule = cls(stages if chunks > 1 else stages[0], n_microbatches=M, loss_fn=loss)
    params = [p for s in stages for p in s.submod.parameters()]
    opt = torch.optim.SGD(params, lr=0.01)
    first, last = 0, 0 if v_shape else (world * chunks - 1) % world

    def run(call) -> None:
        x, y = torch.randn(M * 2, 16), torch.randn(M * 2, 16)
        if rank == first and rank == last:
            call(x, target=y, losses=[])
        elif rank == first:
            call(x)
        elif rank == last:
            call(target=y, losses=[])
        else:
            call()

    def iteration() -> None:
        run(schedule.step)
        opt.step()
        opt.zero_grad()
        # a validation pass, as torchtitan runs it: neither instructions nor a step
        if kind not in NO_EVAL:
            with torch.no_grad():
                run(schedule.eval)

    return schedule, iteration, chunks


def main() -> int:
    """Run each kind named (comma-separated) in turn, in one process group: a torch process and
    gloo start once for every schedule (a launch costs seconds on a 2-core CI machine)."""
    out, kinds = Path(sys.argv[1]), sys.argv[2].split(",")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=world)
    backend = powerlib.open_backend()
    device = backend.device(rank)
    Delay.device = device
    for kind in kinds:
        (out / kind).mkdir(parents=True, exist_ok=True)
        result = run_kind(kind, out / kind, rank, world, device)
        dist.barrier()
        (out / kind / f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()
    return 0


def run_kind(kind: str, out: Path, rank: int, world: int, device: Any) -> dict:
    """One schedule (or DDP): profile, plan and apply, then a tampered plan; what each rank saw."""
    torch.manual_seed(0)
    before = device.read_state().locked_sm_freqs_mhz
    result: dict = {"rank": rank}

    if kind == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(Block(delay_weight_grad=True))
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        num_stages, stage, schedule_name, chunks = 1, 0, "1f1b", 1

        def iteration() -> None:
            for _ in range(2):  # two accumulated microbatches
                model(torch.randn(8, 16)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()

        def attach(session):
            return attach_module(session, model, opt)

        microbatches = 2
    else:
        schedule, iteration, chunks = _pipeline(kind, rank, world)
        num_stages, stage, microbatches = world, rank, M
        # zero-bubble and V schedules: no built-in order; the integration sets the placement
        schedule_name = {"gpipe": "gpipe", "1f1b": "1f1b", "interleaved": "interleaved"}.get(
            kind, "interleaved" if kind == "loopedbfs" else "recorded"
        )

        def attach(session):
            return attach_pipeline(session, schedule)

    common = {
        "num_stages": num_stages,
        "num_microbatches": microbatches,
        "stage": stage,
        "schedule": schedule_name,
        "num_chunks": chunks,
        "device": rank,
        "progress": rank == 0,
    }
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with (
            powerlib.optimize(
                **SWEEP,
                out_dir=out / "auto",
                **common,
            ) as session,
            attach(session),
        ):
            result["auto"] = record(session, drive(session, lambda i: iteration()))
    result["auto"]["warnings"] = [str(w.message) for w in caught if issubclass(w.category, Warning)]
    for w in caught:
        print(f"rank {rank} warning: {w.message}", file=sys.stderr, flush=True)

    if num_stages > 1:
        tampered = tampered_plan(out / "auto" / "plan.json", out / "tampered.json", rank)
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
                result["mismatch"] = {"phase": session.phase}
        result["mismatch"]["warnings"] = [
            str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)
        ]
    result["restored"] = device.read_state().locked_sm_freqs_mhz == before
    return result


if __name__ == "__main__":
    sys.exit(main())
