"""One rank of the end-to-end Megatron GPT run (launched by test_megatron.py).

``megatron_gpt_worker.py OUT MODE`` trains a megatron-core ``GPTModel`` (2 layers, hidden 16,
vocabulary 64, sequence 8) on a 2-stage pipeline over gloo with M=4 microbatches of 2, on the
simulated backend: profile three clocks, plan on rank 0, apply, and close the session (its phase
then reads ``closed``; powerlib's warnings are recorded, so a refused plan or an order mismatch
shows). ``MODE``:

- ``pretrain``: Megatron-LM's own loop. ``patch_training()`` is called, then
  ``megatron.training.training.train`` is called by name, as ``pretrain()`` calls it, after the
  arguments were parsed and validated by Megatron (``parse_args``/``validate_args``) and its
  globals set (``set_global_variables``). ``train()`` obtains ``forward_backward_func`` once
  before its loop, runs ``train_step`` for ``--train-iters`` iterations and ``evaluate()`` every
  ``--eval-interval`` (forward-only schedules). Needs ``megatron.training`` (megatron-core 0.17+).
- ``core``: megatron-core alone: ``attach`` and a hand-written loop around
  ``get_forward_backward_func()`` (every tested release).

What ``pretrain()`` itself does and CPU cannot: ``initialize_megatron`` asserts
``torch.cuda.is_available()`` and ``pretrain`` puts its start-up timestamps in CUDA tensors, so
this worker does the initialisation ``pretrain`` would (parallel state, arguments, globals, the
model) and hands ``train()`` stand-ins for Megatron's DDP wrapper (:class:`Chunk`) and optimizer
(:class:`Optimizer`): the parts of their interface ``train()`` and ``train_step`` call, on
plain torch SGD with DP=1. The model, the schedules, ``train``, ``train_step`` and
``evaluate`` are Megatron's. Each stage's output passes through ``clocked.Delay``, which sleeps
for the simulated clock in force (the simulated GPU does not run torch). Writes ``rank<R>.json``.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import warnings
from pathlib import Path

import megatron.core.transformer.multi_token_prediction  # noqa: F401  (warns at first import)
import megatron_shims as shims
import torch
import torch.distributed as dist
from clocked import APPLIED_ITERATIONS, MAX_PROFILE_ITERATIONS, SWEEP, Delay, drive, plan_rows
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
from megatron.core.transformer.transformer_config import TransformerConfig

import powerlib
from powerlib.integrations.megatron import attach

M, MBS, SEQ, VOCAB, HIDDEN, LAYERS = 4, 2, 8, 64, 16, 2
EVAL_INTERVAL = 3
TRAIN_ITERS = MAX_PROFILE_ITERATIONS + APPLIED_ITERATIONS
"""``--train-iters`` of Megatron's own loop, which cannot stop when the plan applies: the most
the sweep can take, then at least two applied iterations."""


class Chunk(torch.nn.Module):
    """Stand-in for Megatron's DDP wrapper of a model chunk (DP=1: no gradient to reduce)."""

    def __init__(self, module: torch.nn.Module) -> None:
        from megatron.core.distributed import DistributedDataParallelConfig
        from megatron.core.process_groups_config import ProcessGroupCollection

        super().__init__()
        self.module = module
        self.config = module.config
        self.ddp_config = DistributedDataParallelConfig()
        self.pg_collection = ProcessGroupCollection.use_mpu_process_groups()
        self.force_all_reduce = False

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def set_input_tensor(self, tensor) -> None:
        self.module.set_input_tensor(tensor)

    def zero_grad_buffer(self) -> None:
        for p in self.parameters():
            p.grad = None

    def start_grad_sync(self, *args, **kwargs) -> None:
        pass

    def finish_grad_sync(self, force_all_reduce: bool = False) -> None:
        pass

    def no_sync(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()


class Optimizer:
    """Stand-in for a ``MegatronOptimizer``: SGD, no loss scaling, every update successful."""

    is_stub_optimizer = False

    def __init__(self, params) -> None:
        self.opt = torch.optim.SGD(params, lr=0.01)

    @property
    def param_groups(self) -> list:
        return self.opt.param_groups

    def zero_grad(self) -> None:
        self.opt.zero_grad()

    def step(self) -> tuple[bool, float, int]:
        self.opt.step()
        return True, 0.0, 0

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss

    def get_loss_scale(self) -> torch.Tensor:
        return torch.tensor(1.0)


class Scheduler:
    """Stand-in for the learning-rate scheduler (constant rate)."""

    def step(self, increment: int) -> None:
        pass


def _data():
    g = torch.Generator().manual_seed(1)
    while True:
        tokens = torch.randint(0, VOCAB, (MBS, SEQ), generator=g)
        yield tokens, torch.roll(tokens, -1, 1)


_MASK = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), 1).view(1, 1, SEQ, SEQ)


def _forward_step(data_iterator, model):
    tokens, labels = next(data_iterator)
    positions = torch.arange(SEQ).unsqueeze(0).expand(MBS, SEQ)
    output = model(tokens, positions, _MASK, labels=labels)

    def loss_func(output_tensor: torch.Tensor):
        loss = output_tensor.float().mean()
        return loss, {"lm loss": loss.detach()}

    return output, loss_func


def _megatron_args(world: int):
    """Megatron-LM's arguments, parsed and validated by Megatron, and its globals set."""
    from megatron.training import arguments, global_vars

    sys.argv = [
        "pretrain_gpt.py",
        *("--pipeline-model-parallel-size", str(world)),
        *("--num-layers", str(LAYERS), "--hidden-size", str(HIDDEN)),
        *("--num-attention-heads", "2", "--seq-length", str(SEQ)),
        *("--max-position-embeddings", str(SEQ)),
        *("--micro-batch-size", str(MBS), "--global-batch-size", str(MBS * M)),
        *("--train-iters", str(TRAIN_ITERS), "--eval-interval", str(EVAL_INTERVAL)),
        *("--eval-iters", "1", "--lr", "0.01", "--log-interval", str(10**6)),
        *("--transformer-impl", "local", "--no-gradient-accumulation-fusion"),
        *("--no-bias-swiglu-fusion", "--no-bias-dropout-fusion", "--no-masked-softmax-fusion"),
        *("--no-persist-layer-norm", "--no-rope-fusion"),
    ]
    args = arguments.parse_args()
    arguments.validate_args(args, {})
    global_vars.set_global_variables(args, build_tokenizer=False)
    # what pretrain() sets from the tokenizer, the checkpoint and the data provider
    args.padded_vocab_size = VOCAB
    args.iteration = args.consumed_train_samples = args.consumed_valid_samples = 0
    args.skipped_train_samples = args.num_floating_point_operations_so_far = 0
    args.do_train, args.do_valid, args.do_test = True, True, False
    return args


def _model(world: int) -> Chunk:
    config = TransformerConfig(
        num_layers=LAYERS,
        hidden_size=HIDDEN,
        num_attention_heads=2,
        pipeline_model_parallel_size=world,
        pipeline_dtype=torch.float32,
        use_cpu_initialization=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    gpt = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(),
        vocab_size=VOCAB,
        max_sequence_length=SEQ,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        position_embedding_type="learned_absolute",
    )
    gpt.register_forward_hook(lambda module, args, output: Delay.apply(output))
    return Chunk(gpt)


def _summary(session: powerlib.Session) -> dict:
    plan = session.plan
    return {
        "phase": session.phase,
        "iterations": session.iteration,
        "applied_from": session.apply_started_iteration,
        "profiled_freqs_mhz": list(session.report().profiled_freqs_mhz),
        "order_source": plan.workload.get("order_source") if plan else None,
        **plan_rows(session),
        "spec": {
            "num_stages": session.config.workload.num_stages,
            "num_microbatches": session.config.workload.num_microbatches,
            "stage": session.stage,
        },
    }


def _pretrain(chunk: Chunk, optimizer: Optimizer, options: dict, result: dict):
    """Megatron-LM's ``train()``, called by name as ``pretrain()`` calls it, while patched."""
    from megatron.training import training

    from powerlib.integrations.megatron import patch_training

    with patch_training(**options) as patch:
        iteration, _ = training.train(
            _forward_step, [chunk], optimizer, Scheduler(), _data(), _data(), None,
            chunk.config, {}, None,
        )  # fmt: skip
        result["patched"] = patch.active
    result["train_iterations"] = iteration
    result["sessions"] = len(patch.sessions)
    result["unpatched"] = not hasattr(training.train, "__powerlib_original__")
    return patch.sessions[-1]


def _core(chunk: Chunk, optimizer: Optimizer, options: dict, world: int, result: dict):
    """megatron-core's schedule in a hand-written loop, with ``attach``: until the plan applies,
    then two more iterations (``clocked.drive``)."""
    session = powerlib.optimize(
        num_stages=world,
        num_microbatches=M,
        stage=parallel_state.get_pipeline_model_parallel_rank(),
        **options,
    )
    data = _data()
    with session, attach(session):
        forward_backward_func = get_forward_backward_func()

        def iteration(i: int) -> None:
            forward_backward_func(
                forward_step_func=_forward_step,
                data_iterator=data,
                model=chunk,
                num_microbatches=M,
                seq_length=SEQ,
                micro_batch_size=MBS,
                forward_only=False,
            )
            optimizer.step()
            optimizer.zero_grad()

        result["phases"] = drive(session, iteration)["phases"]
    return session


def main() -> int:
    out, mode = Path(sys.argv[1]), sys.argv[2]
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=world)
    shims.install()
    device = powerlib.open_backend().device(rank)
    Delay.device = device
    before = device.read_state().locked_sm_freqs_mhz
    options = {**SWEEP, "out_dir": out / mode, "device": rank, "progress": rank == 0}
    result: dict = {"rank": rank}
    if mode == "pretrain":
        result["megatron_args"] = {"train_iters": _megatron_args(world).train_iters}
    parallel_state.initialize_model_parallel(pipeline_model_parallel_size=world)
    torch.manual_seed(0)
    # the tensor-parallel RNG tracker the attention forks; the inference tracker's fork is a
    # no-op on CPU (dropout is 0: no random stream is needed)
    model_parallel_cuda_manual_seed(0, inference_rng_tracker=True)
    chunk = _model(world)
    optimizer = Optimizer(chunk.parameters())
    with warnings.catch_warnings(record=True) as seen, shims.cuda_to_cpu():
        warnings.simplefilter("always")
        if mode == "pretrain":
            session = _pretrain(chunk, optimizer, options, result)
        else:
            session = _core(chunk, optimizer, options, world, result)
    # powerlib's own (an order mismatch, a refused plan); Megatron's notices are not checked
    result["warnings"] = [str(w.message) for w in seen if "powerlib" in str(w.message)]
    result.update(_summary(session))
    result["restored"] = device.read_state().locked_sm_freqs_mhz == before
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
