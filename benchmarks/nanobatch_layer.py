"""Stock vs nanobatched megatron-core transformer layer: time and energy per layer, side by side.

Run on GPUs (tensor parallelism = the number of ranks, NCCL, the NVIDIA backend for energy)::

    POWERLIB_BACKEND=nvidia torchrun --nproc-per-node 2 benchmarks/nanobatch_layer.py \\
        --hidden 4096 --heads 32 --seq-len 4096 --micro-batch 4 --out nanobatch_layer.json

or as a CPU smoke run (gloo, the simulated backend: times are CPU times and the energy is the
simulated GPU's, which does not run torch, so neither says anything about a GPU)::

    POWERLIB_BACKEND=simulated POWERLIB_SIM_GPUS=2 torchrun --standalone --nproc-per-node 2 \\
        benchmarks/nanobatch_layer.py --smoke

Both layers are built from the same seed with the local spec (``get_gpt_layer_local_spec``) and
``nanobatch_layer_spec``. Each runs ``--iters`` forward+backward passes of one microbatch,
alternating stock and nanobatched rounds so drift hits both alike; the nanobatched layer runs
under a one-microbatch Kareus plan whose launch slots and SM count come from ``--slots`` /
``--sm-count`` (default: each partition type's first compute slot after the norm, 8 SMs). Time is
wall time between device synchronisations (max over ranks), over ``--iters`` passes or more.
Energy is not the delta of two counter reads around them: NVML publishes its counter about every
100 ms, so that would be off by up to an update (10 % of a 1 s round). Each round time-stamps one
counter update before its timed passes and one after (synchronised passes, each followed by a
read, until the counter moves: :class:`~powerlib.kareus.meter.SpanMeter`, docs/kareus.md
§2.1 "How powerlib measures energy"); energy per pass = the energy between the two updates over
the time between them × the time per pass, summed over ranks, with ``energy_rel_error``, the
bound from the updates' brackets. A round runs enough passes for that bound to reach
``--energy-rel-target`` (about one pass over the round's length). JSON to stdout (and ``--out``)
from rank 0.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

DEFAULT_SLOTS = {"fwd_attn": "linear_0", "fwd_mlp": "linear_0", "bwd_mlp": "linear_0",
                 "bwd_attn": "linear_0"}  # fmt: skip


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--ffn", type=int, default=None, help="default 4 x hidden")
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--sequence-parallel", action="store_true")
    p.add_argument("--iters", type=int, default=20, help="measured passes per layer and round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument(
        "--energy-rel-target",
        type=float,
        default=0.01,
        help="run more than --iters passes in a round until the energy's bound is about this "
        "(0: exactly --iters)",
    )
    p.add_argument("--sm-count", type=int, default=8)
    p.add_argument("--slots", type=json.loads, default=DEFAULT_SLOTS, help="JSON {type: slot}")
    p.add_argument("--smoke", action="store_true", help="tiny sizes, 2 passes (a CPU check)")
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args()
    if a.smoke:
        a.hidden, a.heads, a.seq_len, a.micro_batch = 32, 4, 16, 4
        a.iters, a.rounds, a.warmup, a.energy_rel_target = 2, 1, 1, 0.0
    a.ffn = a.ffn or 4 * a.hidden
    return a


def _finite(value: Any) -> Any:
    """``value`` with every non-finite float (an unbounded error) as ``None``: JSON has neither."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


def main() -> int:
    args = _args()
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer.spec_utils import build_module
    from megatron.core.transformer.transformer_config import TransformerConfig

    import powerlib
    from powerlib.kareus.launch import LaunchControl
    from powerlib.kareus.launch_schedule import PartitionSchedule
    from powerlib.kareus.megatron import nanobatch_layer_spec
    from powerlib.kareus.meter import SpanMeter
    from powerlib.planning.pipeline import Instruction
    from powerlib.planning.plan import PartitionSetting, PlannedInstruction

    cuda = torch.cuda.is_available()
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local = int(os.environ.get("LOCAL_RANK", rank))
    if cuda:
        torch.cuda.set_device(local)
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world)
    if not cuda:  # megatron-core asks for the current CUDA device in a few places
        torch.cuda.current_device = lambda: torch.device("cpu")  # type: ignore[assignment]
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
    dtype = torch.bfloat16 if cuda else torch.float32
    config = TransformerConfig(
        num_layers=1,
        hidden_size=args.hidden,
        num_attention_heads=args.heads,
        ffn_hidden_size=args.ffn,
        tensor_model_parallel_size=world,
        sequence_parallel=args.sequence_parallel,
        use_cpu_initialization=not cuda,
        params_dtype=dtype,
        bf16=cuda,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    device = torch.device("cuda", local) if cuda else torch.device("cpu")

    def layer(spec: Any) -> Any:
        torch.manual_seed(0)
        model_parallel_cuda_manual_seed(0, inference_rng_tracker=not cuda)
        return build_module(spec, config=config, layer_number=1).to(device)

    planned = [
        PlannedInstruction(
            instruction=Instruction(stage=0, microbatch=0, kind=kind),
            freq_mhz=0.0,
            execution="nanobatch",
            overlap={
                k: PartitionSetting(slot=s, sm_count=args.sm_count) for k, s in args.slots.items()
            },  # fmt: skip
        )
        for kind in ("forward", "backward")
    ]
    control = LaunchControl(PartitionSchedule(planned, source="benchmark"))
    control.groups.prepare({args.sm_count}, None)
    stock = layer(get_gpt_layer_local_spec())
    nano = layer(nanobatch_layer_spec(control=control))
    seq = args.seq_len // (world if args.sequence_parallel else 1)
    x = torch.randn(seq, args.micro_batch, args.hidden, device=device, dtype=dtype)
    mask = torch.triu(torch.ones(args.seq_len, args.seq_len, dtype=torch.bool, device=device), 1)
    mask = mask.view(1, 1, args.seq_len, args.seq_len)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    backend = powerlib.open_backend()
    gpu = backend.device(local % len(backend.devices()))

    def reduce(value: int, op: Any) -> int:
        flag = torch.tensor([value], dtype=torch.int64, device=device)
        dist.all_reduce(flag, op=op)
        return int(flag.item())

    def agree(done: bool) -> bool:  # every rank runs as many passes: their collectives pair up
        return bool(reduce(int(done), dist.ReduceOp.MIN))

    def one_pass(module: Any, planned_run: bool) -> None:
        inp = x.detach().requires_grad_(True)
        if planned_run:
            control.begin("forward", 0)
        out, _ = module(inp, attention_mask=mask)
        if planned_run:
            control.end()
            control.begin("backward", 0)
        out.backward(torch.ones_like(out))
        if planned_run:
            control.end()
            control.step()
        module.zero_grad(set_to_none=True)

    def passes(module: Any, n: int, planned_run: bool) -> dict[str, Any]:
        def polled() -> None:  # a counter read follows: the pass must have finished
            one_pass(module, planned_run)
            sync()

        sync()
        dist.barrier()
        with SpanMeter([gpu], stop=agree) as span:
            t = time.perf_counter()
            polled_n = span.first_update(polled)
            if args.energy_rel_target > 0:  # the bound is about one bracket over the round
                per_pass_s = (time.perf_counter() - t) / polled_n  # with its reads: a bit long
                want = max(span.first_brackets_s) / args.energy_rel_target / per_pass_s
                n = reduce(max(n, math.ceil(want)), dist.ReduceOp.MAX)
            t0 = time.perf_counter()
            for _ in range(n):
                one_pass(module, planned_run)
            sync()
            t1 = time.perf_counter()
            polled_n += span.last_update(polled)
            (counted,) = span.spans()
        time_s = (t1 - t0) / n
        mine = (time_s, counted.power_w * time_s, counted.rel_error)
        ranks: list[Any] = [None] * world
        dist.all_gather_object(ranks, mine)
        energy_j = math.fsum(e for _, e, _ in ranks)
        return {
            "time_s": max(t for t, _, _ in ranks),
            "energy_j": energy_j,
            # of the sum over ranks: each rank's bound, weighed by its energy
            "energy_rel_error": math.fsum(e * r for _, e, r in ranks) / energy_j
            if energy_j > 0
            else math.inf,
            "passes": n,
            "polled_passes": polled_n,
        }

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for module, planned_run in ((stock, False), (nano, True)):
            for _ in range(args.warmup):
                one_pass(module, planned_run)
        sync()
        rounds = []
        for _ in range(args.rounds):
            rounds.append({"stock": passes(stock, args.iters, False),
                           "nanobatch": passes(nano, args.iters, True)})  # fmt: skip

    def median(variant: str, key: str) -> float:
        return statistics.median(r[variant][key] for r in rounds)

    def worst(variant: str) -> float:  # the median round's energy is within every round's bound
        return max(r[variant]["energy_rel_error"] for r in rounds)

    stock_t, nano_t = median("stock", "time_s"), median("nanobatch", "time_s")
    stock_e, nano_e = median("stock", "energy_j"), median("nanobatch", "energy_j")
    report = control.report()
    result = {
        "benchmark": "nanobatch_layer",
        "device": torch.cuda.get_device_name(local) if cuda else platform.processor() or "cpu",
        "backend": backend.name if hasattr(backend, "name") else type(backend).__name__,
        "collectives": dist.get_backend(),
        "tensor_parallel": world,
        "shape": {
            "hidden": args.hidden,
            "heads": args.heads,
            "ffn": args.ffn,
            "seq_len": args.seq_len,
            "micro_batch": args.micro_batch,
            "sequence_parallel": args.sequence_parallel,
            "dtype": str(dtype),
        },  # fmt: skip
        "plan": {"slots": args.slots, "sm_count": args.sm_count},
        "per_layer_pass": {
            "stock": {"time_s": stock_t, "energy_j": stock_e, "energy_rel_error": worst("stock")},
            "nanobatch": {
                "time_s": nano_t,
                "energy_j": nano_e,
                "energy_rel_error": worst("nanobatch"),
            },
            "time_ratio": nano_t / stock_t if stock_t else None,
            "energy_ratio": nano_e / stock_e if stock_e else None,
            "energy_ratio_rel_error": worst("stock") + worst("nanobatch"),
        },
        "rounds": rounds,
        "overlap": {
            "paths": report.paths,
            "enforced": report.enforced,
            "disabled": report.disabled,
        },  # fmt: skip
        "note": None
        if cuda
        else "CPU smoke run: times are CPU times, energy is the simulated "
        "GPU's (it does not run torch); neither says anything about a GPU",
    }
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
    if rank == 0:
        text = json.dumps(_finite(result), indent=2)
        print(text)
        if args.out:
            args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
