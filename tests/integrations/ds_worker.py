"""One rank of the DeepSpeed integration tests (launched by test_deepspeed.py).

``ds_worker.py OUT CASE...`` runs each named case, in order, in this process on the simulated
backend (DeepSpeed on CPU, gloo): a session with the integration attached profiles three clocks,
rank 0 plans, every rank applies. Cases:

- ``pp``: ``PipelineEngine`` with one stage per rank (``TrainSchedule``), then a plan whose
  stage-1 order was tampered with, applied in ``apply`` mode;
- ``ppdp``: ``PipelineEngine`` with 2 stages and the rest data parallel (stage = ``stage_id``);
- ``dualpipev``: ``DualPipeVEngine`` (two chunks per rank, V placement);
- ``zero``: ZeRO-1 without pipelining, data parallel over every rank (``attach_engine``), each
  iteration using the three backward paths (``engine.backward``, ``engine.scale(loss).backward()``,
  plain ``loss.backward()``); run it before the pipeline cases (a pipeline engine leaves its grid
  as DeepSpeed's global mpu).

Each stage's module sleeps ``BASE_S * f_max / f`` (``clocked.py``) in forward and backward for the clock in force
(the simulated GPU does not run torch). Writes ``rank<R>.json``: ``{case: result}``.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
import warnings
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before deepspeed picks an accelerator

import deepspeed  # noqa: E402
import deepspeed.comm  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from clocked import FREQS, SWEEP, Block, Delay, drive, record, tampered_plan  # noqa: E402

import powerlib  # noqa: E402
from powerlib.integrations.deepspeed import attach_engine, attach_pipeline  # noqa: E402

# Skip the 80-100 s JIT build of the shared-memory op (``import deepspeed.comm.torch as m``
# binds the torch package, not the submodule).
sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None

M = 4
MICRO = 2


def _loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((out - target) ** 2).mean()


def _batches():
    while True:
        yield torch.randn(MICRO, 16), torch.randn(MICRO, 16)


_DATA = _batches()


def _config(zero_stage: int = 0) -> dict:
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": M,
        "steps_per_print": 10**9,
        "zero_optimization": {"stage": zero_stage},
        "zero_allow_untested_optimizer": True,
    }


def _engine(model: torch.nn.Module, zero_stage: int = 0):
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=_config(zero_stage))
    return engine


def _setup(case: str, world: int) -> dict:
    """The engine, one iteration, the attach function and the session arguments of ``case``."""
    from deepspeed.pipe import PipelineModule
    from deepspeed.runtime.pipe.dualpipev import DualPipeVModule

    if case == "zero":
        engine = _engine(Block(), zero_stage=1)

        def iteration() -> None:
            # every backward path DeepSpeed documents: engine.backward(loss) for microbatches
            # 0 and 1, then engine.scale(loss).backward(), then a plain loss.backward()
            for mb, (x, y) in enumerate(next(_DATA) for _ in range(M)):
                loss = _loss(engine(x), y)
                if mb < 2:
                    engine.backward(loss)
                elif mb == 2:
                    engine.scale(loss).backward()
                else:
                    loss.backward()
                engine.step()

        return {
            "engine": engine,
            "iteration": iteration,
            "attach": attach_engine,
            "common": {"num_stages": 1, "num_microbatches": M, "stage": 0},
        }
    stages = 2 if case == "ppdp" else world
    if case == "dualpipev":
        model = DualPipeVModule(
            layers=[Block() for _ in range(2 * stages)], num_stages=stages, loss_fn=_loss
        )
    else:
        model = PipelineModule(
            layers=[Block() for _ in range(stages)], num_stages=stages, loss_fn=_loss
        )
    engine = _engine(model)
    return {
        "engine": engine,
        "iteration": lambda: engine.train_batch(_DATA),
        "attach": attach_pipeline,
        "common": {"num_stages": stages, "num_microbatches": M, "stage": engine.stage_id},
    }


def _run_case(case: str, out: Path, rank: int, world: int, device: powerlib.Device) -> dict:
    started = time.perf_counter()
    setup = _setup(case, world)
    engine, iteration, attach = setup["engine"], setup["iteration"], setup["attach"]
    common = setup["common"] | {"device": rank, "progress": rank == 0}
    before = device.read_state().locked_sm_freqs_mhz
    table = type(engine).__dict__.get("_INSTRUCTION_MAP")
    result: dict = {"stage": common["stage"], "setup_s": time.perf_counter() - started}
    if case == "dualpipev":  # model layers of phase 0 and phase 1 (one layer per piece)
        result["phase_pieces"] = [start for start, _ in engine.module.phase_bounds]
    if case == "pp":  # a session of another stage is refused at attach, before any hook
        wrong = {**common, "stage": world - 1 - common["stage"]}
        with powerlib.optimize(freqs_mhz=FREQS, out_dir=None, **wrong) as session:
            try:
                with attach(session, engine):
                    pass
            except powerlib.InvalidArgumentError as err:
                result["wrong_stage_error"] = str(err)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with (
            powerlib.optimize(
                **SWEEP,
                out_dir=out / case,
                **common,
            ) as session,
            attach(session, engine),
        ):

            def run(i: int) -> None:
                # evaluation in every profiled iteration (the last one's order is planned on):
                # neither instructions nor a step
                if case == "pp" and session.phase == "profile":
                    engine.eval_batch(_DATA)
                iteration()

            result["auto"] = record(session, drive(session, run))
    # powerlib's own warnings only: DeepSpeed's deprecation notices are not this test's business
    result["auto"]["warnings"] = [str(w.message) for w in caught if "powerlib" in str(w.message)]
    for w in caught:
        print(f"rank {rank} {case} warning: {w.message}", file=sys.stderr, flush=True)
    result["restored"] = device.read_state().locked_sm_freqs_mhz == before

    if case == "pp":
        tampered = tampered_plan(out / case / "plan.json", out / "tampered.json", rank)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with (
                powerlib.optimize(
                    mode="apply", plan_path=tampered, out_dir=None, check_rounds=0, **common
                ) as session,
                attach(session, engine),
            ):
                for _ in range(2):
                    iteration()
                result["mismatch"] = {"phase": session.phase}
        result["mismatch"]["warnings"] = [
            str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)
        ]
    result["hooks_removed"] = type(engine).__dict__.get("_INSTRUCTION_MAP") is table and not (
        {"train_batch", "forward", "backward", "step", "scale"} & set(vars(engine))
    )
    return result


def main() -> int:
    out, cases = Path(sys.argv[1]), sys.argv[2:]
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    torch.manual_seed(0)
    backend = powerlib.open_backend()
    device = backend.device(rank)
    Delay.device = device
    results: dict = {"backend": dist.get_backend()}
    for case in cases:
        started = time.perf_counter()
        try:
            results[case] = _run_case(case, out, rank, world, device)
        except Exception:
            print(f"rank {rank} case {case} failed:\n{traceback.format_exc()}", flush=True)
            raise
        results[case]["wall_s"] = time.perf_counter() - started
    dist.barrier()
    (out / f"rank{rank}.json").write_text(json.dumps(results))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
