"""One rank of the nanobatched-layer tests (launched by test_megatron_nanobatch.py).

``nanobatch_worker.py OUT numerics CASE...`` (TP=2, two ranks; ``CASE`` is
``PLAN:SP:RECOMPUTE[:MICRO_BATCH]``, micro-batch 4 by default)
builds two megatron-core ``GPTModel`` s (2 layers,
hidden 32, 4 heads, sequence 8, micro-batch 4, vocabulary 64, RoPE, fp32, dropout 0) on a
TP=2 group over gloo from the same seed: one from ``get_gpt_layer_local_spec()``, one from
``nanobatch_layer_spec()``. It runs the same M=4 microbatches through both (forward, then
backward, each microbatch inside its instruction of a Kareus plan: ``PLAN`` ``all`` nanobatches
every instruction, ``mixed`` nanobatches some and runs the others sequentially), with sequence
parallelism (``SP`` 1) or not, with full activation recompute (``RECOMPUTE`` 1) or not, and
writes ``rank<R>.json``: per-microbatch losses of both models, the largest gradient difference
of every parameter, and the launch control's launch records, per case. ``PLAN`` ``none`` is a
:class:`LaunchControl` without a schedule (the layer must be the stock one).

``nanobatch_worker.py OUT train PLAN_FILE`` (TP=2 x PP=2, four ranks) trains a GPT of the
nanobatched spec for :data:`ITERATIONS` iterations with megatron-core's 1F1B schedule inside
``powerlib.optimize(mode="apply", plan_path=PLAN_FILE)`` and ``attach``, on the simulated backend,
with the launch control Kareus registers, which the session adds for the plan: the layers take it from there. Writes the
launch control's report and launch records and whether the device came back to its clocks.
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from pathlib import Path

import megatron.core.transformer.multi_token_prediction  # noqa: F401  (warns at first import)
import megatron_shims as shims
import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
from megatron.core.transformer.transformer_config import TransformerConfig

import powerlib
from powerlib.integrations.megatron import attach
from powerlib.kareus import launch
from powerlib.kareus.evaluator import MeasureProtocol
from powerlib.kareus.launch import LaunchControl
from powerlib.kareus.launch_schedule import PartitionSchedule
from powerlib.kareus.megatron import nanobatch_layer_spec
from powerlib.kareus.megatron_measure import (
    gpt_compute_runner,
    group_agreement,
    group_measurement,
)
from powerlib.kareus.meter import DeviceEvaluator
from powerlib.kareus.partition import build_workload
from powerlib.kareus.partition_types import Config
from powerlib.kareus.shapes import MODEL_SHAPES, Parallelism
from powerlib.kareus.workflow import search_study
from powerlib.planning.pipeline import Instruction
from powerlib.planning.plan import PartitionSetting, PlannedInstruction

M, MBS, SEQ, VOCAB, HIDDEN = 4, 4, 8, 64, 32
_MASK = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), 1).view(1, 1, SEQ, SEQ)
SLOTS = {  # a different launch slot per partition type, none of them the first
    "fwd_attn": "rope_0",
    "fwd_mlp": "activation_0",
    "bwd_mlp": "linear_0",
    "bwd_attn": "attn_0",
    "recompute_fwd_attn": "attn_0",
    "recompute_fwd_mlp": "linear_0",
}


def plan(kind: str) -> list[PlannedInstruction]:
    """Stage 0's instructions, F then B per microbatch, as the worker runs them."""
    out = []
    for mb in range(M):
        for k in ("forward", "backward"):
            nano = kind == "all" or (mb, k) in {(0, "forward"), (0, "backward"), (1, "forward"),
                                                (2, "backward")}  # fmt: skip
            settings = {key: PartitionSetting(slot=s, sm_count=4 + mb) for key, s in SLOTS.items()}
            out.append(
                PlannedInstruction(
                    instruction=Instruction(stage=0, microbatch=mb, kind=k),
                    freq_mhz=1410.0,
                    execution="nanobatch" if nano else "sequential",
                    overlap=settings if nano else {},
                )
            )
    return out


def model(spec, sp: bool, recompute: bool) -> GPTModel:
    config = TransformerConfig(
        num_layers=2,
        hidden_size=HIDDEN,
        num_attention_heads=4,
        ffn_hidden_size=4 * HIDDEN,
        tensor_model_parallel_size=2,
        sequence_parallel=sp,
        use_cpu_initialization=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        recompute_granularity="full" if recompute else None,
        recompute_method="uniform" if recompute else None,
        recompute_num_layers=1 if recompute else None,
    )
    torch.manual_seed(3)
    model_parallel_cuda_manual_seed(3, inference_rng_tracker=True)
    return GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=VOCAB,
        max_sequence_length=SEQ,
        position_embedding_type="rope",
    )


def numerics(case: str) -> dict:
    fields = case.split(":")
    kind, sp, recompute = fields[0], fields[1] == "1", fields[2] == "1"
    mbs = int(fields[3]) if len(fields) > 3 else MBS  # PLAN:SP:RECOMPUTE[:MICRO_BATCH]
    control = LaunchControl(PartitionSchedule(plan(kind))) if kind != "none" else LaunchControl()
    stock = model(get_gpt_layer_local_spec(), sp, recompute)
    nano = model(nanobatch_layer_spec(control=control), sp, recompute)
    same_init = all(torch.equal(a, b) for a, b in zip(stock.parameters(), nano.parameters()))
    g = torch.Generator().manual_seed(7)
    batches = [torch.randint(0, VOCAB, (mbs, SEQ), generator=g) for _ in range(M)]
    positions = torch.arange(SEQ).unsqueeze(0).expand(mbs, SEQ)
    losses: dict[str, list[float]] = {"stock": [], "nano": []}
    with warnings.catch_warnings(record=True) as seen, shims.cuda_to_cpu():
        warnings.simplefilter("always")
        for name, gpt in (("stock", stock), ("nano", nano)):
            for mb, tokens in enumerate(batches):
                labels = torch.roll(tokens, -1, 1)
                live = control if name == "nano" else None
                if live:
                    live.begin("forward", mb)
                loss = gpt(tokens, positions, _MASK, labels=labels).float().mean()
                if live:
                    live.end()
                    live.begin("backward", mb)
                loss.backward()
                if live:
                    live.end()
                losses[name].append(loss.item())
        consistent = control.step()
    diffs = {}
    for (pname, a), b in zip(stock.named_parameters(), nano.parameters()):
        scale = float(a.grad.abs().max()) or 1.0
        diffs[pname] = float((a.grad - b.grad).abs().max()) / scale
    return {
        "same_init": same_init,
        "losses": losses,
        "grad_rel_diff": diffs,
        "consistent": consistent,
        "report": control.report().to_json(),
        "records": [r.to_json() for r in control.records],
        "warnings": [str(w.message) for w in seen if "powerlib" in str(w.message)],
    }


def one_layer_gpt() -> GPTModel:
    """A one-layer TP=2 GPT of the nanobatched spec (learned positions), for measuring its layer."""
    config = TransformerConfig(
        num_layers=1,
        hidden_size=HIDDEN,
        num_attention_heads=4,
        ffn_hidden_size=4 * HIDDEN,
        tensor_model_parallel_size=2,
        use_cpu_initialization=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    torch.manual_seed(3)
    model_parallel_cuda_manual_seed(3, inference_rng_tracker=True)
    gpt = GPTModel(
        config=config,
        transformer_layer_spec=nanobatch_layer_spec(),
        vocab_size=VOCAB,
        max_sequence_length=SEQ,
        position_embedding_type="learned_absolute",
    )
    return gpt


def device_evaluator(rank: int) -> dict:
    """``DeviceEvaluator`` driving the layer's partition runner on this rank's simulated GPU."""
    gpt = one_layer_gpt()
    layer = gpt.decoder.layers[0]
    x = torch.randn(SEQ, MBS, HIDDEN, generator=torch.Generator().manual_seed(5))
    runner = layer.partition_runner(x, attention_mask=_MASK)
    workload = build_workload(
        MODEL_SHAPES["qwen3-1.7b"], Parallelism(tp=2, micro_batch=MBS, seq_len=2048), [14, 14]
    )
    backend = powerlib.open_backend()
    device = backend.device(rank)
    before = device.read_state().locked_sm_freqs_mhz
    runs: list[list[dict]] = []

    def run(ptype, cfg) -> None:
        runs.append([r.to_json() for r in runner(ptype, cfg).records])

    protocol = MeasureProtocol(settle_s=0.0, warmup_s=0.01, window_s=0.05, cooldown_s=0.0)
    agree = group_agreement(parallel_state.get_tensor_model_parallel_group())
    out = []
    with DeviceEvaluator(
        backend, run, p_static_w=85.0, devices=[device], protocol=protocol, agree=agree
    ) as evaluator:
        freq = evaluator.freqs_mhz[-1]
        for ptype in workload.partitions:
            for slot in (ptype.slots[-1], None):
                start = len(runs)
                m = evaluator.evaluate(ptype, Config(freq_mhz=freq, sm_count=6, slot=slot))
                out.append(
                    {
                        "key": ptype.key,
                        "slot": slot,
                        "time_s": m.time_s,
                        "energy_j": m.energy_j,
                        "energy_rel_error": m.energy_rel_error,
                        "runs": runs[start:],
                    }  # fmt: skip
                )
    return {
        "evaluations": out,
        "restored": device.read_state().locked_sm_freqs_mhz == before,
        "grads_clear": all(p.grad is None for p in layer.parameters()),
    }


def device_search(out: Path, rank: int, partitions: list[str]) -> dict:
    """``search_study`` measuring on this rank's simulated GPU through the layer's runners."""
    gpt = one_layer_gpt()
    layer = gpt.decoder.layers[0]
    g = torch.Generator().manual_seed(5)
    x = torch.randn(SEQ, MBS, HIDDEN, generator=g)
    tokens = torch.randint(0, VOCAB, (MBS, SEQ), generator=g)
    positions = torch.arange(SEQ).unsqueeze(0).expand(MBS, SEQ)
    group = parallel_state.get_tensor_model_parallel_group()
    backend = powerlib.open_backend()
    device = backend.device(rank)
    before = device.read_state().locked_sm_freqs_mhz
    evaluator = DeviceEvaluator(
        backend,
        layer.partition_runner(x, attention_mask=_MASK),
        p_static_w=85.0,
        devices=[device],
        protocol=MeasureProtocol(settle_s=0.0, warmup_s=0.002, window_s=0.005, cooldown_s=0.0),
        freqs_mhz=[1005.0, 1410.0],
        run_sequential=layer.sequential_runner(x, attention_mask=_MASK),
        run_compute=gpt_compute_runner(gpt, tokens, positions, torch.roll(tokens, -1, 1)),
        agree=group_agreement(group),
        combine=group_measurement(group),
    )
    with evaluator:
        result = search_study(
            out / f"study{rank}",
            model="qwen3-1.7b",
            parallelism=Parallelism(tp=2, micro_batch=MBS, seq_len=2048, recompute=False),
            stage_layers=(14, 14),
            evaluator=evaluator,
            evaluator_info={"kind": "device", "backend": "simulated", "layer": "tiny megatron"},
            partitions=partitions,
            seed=0,
        )
    return {
        "study": str(result.study_path),
        "partitions": [r.partition for r in result.partitions],
        "evaluations": evaluator.evaluations,
        "restored": device.read_state().locked_sm_freqs_mhz == before,
    }


ITERATIONS = 3


def train(plan_file: str, rank: int) -> dict:
    config = TransformerConfig(
        num_layers=4,
        hidden_size=HIDDEN,
        num_attention_heads=4,
        ffn_hidden_size=4 * HIDDEN,
        tensor_model_parallel_size=2,
        pipeline_model_parallel_size=2,
        pipeline_dtype=torch.float32,
        use_cpu_initialization=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    torch.manual_seed(3)
    model_parallel_cuda_manual_seed(3, inference_rng_tracker=True)
    gpt = GPTModel(
        config=config,
        transformer_layer_spec=nanobatch_layer_spec(),
        vocab_size=VOCAB,
        max_sequence_length=SEQ,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        position_embedding_type="rope",
    )
    optimizer = torch.optim.SGD(gpt.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(7)

    def data():
        while True:
            tokens = torch.randint(0, VOCAB, (MBS, SEQ), generator=g)
            yield tokens, torch.roll(tokens, -1, 1)

    def forward_step(iterator, model):
        tokens, labels = next(iterator)
        positions = torch.arange(SEQ).unsqueeze(0).expand(MBS, SEQ)
        output = model(tokens, positions, _MASK, labels=labels)
        return output, lambda t: (t.float().mean(), {"lm loss": t.float().mean().detach()})

    device = powerlib.open_backend().device(rank)
    before = device.read_state().locked_sm_freqs_mhz
    stage = parallel_state.get_pipeline_model_parallel_rank()
    session = powerlib.optimize(
        num_stages=2, num_microbatches=M, stage=stage, mode="apply", plan_path=plan_file,
        device=rank, progress=False,
    )  # fmt: skip
    assert session.instruction_listeners == ()  # Kareus registers itself for the plan
    iterator = data()
    with warnings.catch_warnings(record=True) as seen, shims.cuda_to_cpu():
        warnings.simplefilter("always")
        with session, attach(session):
            (control,) = session.instruction_listeners
            assert launch.active_control() is control
            schedule = get_forward_backward_func()
            for _ in range(ITERATIONS):
                schedule(
                    forward_step_func=forward_step, data_iterator=iterator, model=gpt,
                    num_microbatches=M, seq_length=SEQ, micro_batch_size=MBS, forward_only=False,
                )  # fmt: skip
                optimizer.step()
                optimizer.zero_grad()
            report = control.report().to_json()
            records = [r.to_json() for r in control.records]
            planned = [
                {"kind": p.instruction.kind, "microbatch": p.instruction.microbatch,
                 "execution": p.execution, "overlap": {k: v.to_json() for k, v in p.overlap.items()}}
                for p in control.schedule.instructions
            ]  # fmt: skip
    return {
        "stage": stage,
        "tp_rank": parallel_state.get_tensor_model_parallel_rank(),
        "phase": session.phase,
        "group_ranks": control.loaded_group_ranks,
        "report": report,
        "records": records,
        "planned": planned,
        "warnings": [str(w.message) for w in seen if "powerlib" in str(w.message)],
        "restored": device.read_state().locked_sm_freqs_mhz == before,
    }


def main() -> int:
    out, mode = Path(sys.argv[1]), sys.argv[2]
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=world)
    shims.install()
    shims.sequence_parallel_norms()
    shims.checkpoint_rng()
    result: dict = {"rank": rank}
    if mode == "numerics":
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
        result["cases"] = {case: numerics(case) for case in sys.argv[3:]}
        result["evaluator"] = device_evaluator(rank)
    elif mode == "search":
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
        result.update(device_search(out, rank, sys.argv[3:]))
    else:
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=2, pipeline_model_parallel_size=2
        )
        result.update(train(sys.argv[3], rank))
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
