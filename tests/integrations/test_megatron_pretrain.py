"""Megatron-LM's real ``pretrain()`` under powerlib's launcher, as its users launch it (issue 36).

The Python 3.12 lane (``.ci/megatron-latest``: megatron-core 0.19, which ships
``megatron.training``). ``megatron_pretrain_gpt.py`` is a ``pretrain_gpt.py`` of powerlib's own
(a tiny GPT, mock data) that calls ``pretrain(...)`` as Megatron-LM 0.19's does; Megatron does the
rest: initialisation on gloo, its DDP and optimizer, its data loaders, ``train()`` and
``evaluate()``, on CPU through torch-level shims (``megatron_shims.pretrain_on_cpu``). Two ranks,
PP=2, launched from a folder that is not the script's (its sibling imports need the launcher to
put the script's folder on ``sys.path``)::

    POWERLIB_MEGATRON=1|0 python -m powerlib.integrations.megatron megatron_pretrain_gpt.py ARGS

- with the profile sweep of the other integration tests, the session profiles, plans on the 1F1B
  order the hooks recorded, applies the plan and restores the devices, and every loss equals
  that of the same launch with ``POWERLIB_MEGATRON=0``;
- with the default sweep, a run shorter than its plan says so in one line for the job, and
  writes ``summary.json``;
- a refused plan (an energy counter too coarse for the instructions) is one line for the job
  under Megatron's logging (its root logger prints INFO records of every module to stdout).

Each launch takes 10-20 s on two CPU cores.
"""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
from multiproc import free_port

torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core")
try:
    with warnings.catch_warnings():  # "Transformer Engine and Apex are not installed"
        warnings.simplefilter("ignore")
        from megatron.training import training as megatron_training  # megatron-core 0.17+
except ImportError:
    pytest.skip("megatron.training ships with megatron-core 0.17+ only", allow_module_level=True)
_CALL = ["cfg_container", "train_valid_test_dataset_provider", "model_type", "forward_step_func"]
if list(inspect.signature(megatron_training.pretrain).parameters)[:4] != _CALL:
    pytest.skip(  # 0.17 takes no config container, 0.18 a model provider before the model type
        f"the script calls pretrain({', '.join(_CALL)}) as Megatron-LM 0.19's pretrain_gpt.py "
        "does: megatron-core 0.19+",
        allow_module_level=True,
    )
if not torch.distributed.is_gloo_available():
    pytest.skip("gloo is not available", allow_module_level=True)

from clocked import APPLIED_ITERATIONS, FREQS, MAX_PROFILE_ITERATIONS, SWEEP  # noqa: E402

from powerlib.planning.schedules import build_schedule  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.megatron]

SCRIPT = Path(__file__).with_name("megatron_pretrain_gpt.py")
WORLD = 2
M = 4
TRAIN_ITERS = MAX_PROFILE_ITERATIONS + APPLIED_ITERATIONS
"""Megatron's loop runs --train-iters: the most the sweep can take, then two applied."""
ARGS = [
    *("--distributed-backend", "gloo", "--pipeline-model-parallel-size", str(WORLD)),
    *("--num-layers", "2", "--hidden-size", "16", "--num-attention-heads", "2"),
    *("--seq-length", "8", "--max-position-embeddings", "8"),
    *("--micro-batch-size", "2", "--global-batch-size", str(2 * M)),
    *("--eval-interval", "5", "--eval-iters", "1", "--lr", "0.01", "--log-interval", "1000000"),
    *("--mock-data", "--num-workers", "0", "--tokenizer-type", "NullTokenizer"),
    *("--vocab-size", "64", "--hidden-dropout", "0", "--attention-dropout", "0"),
    *("--transformer-impl", "local", "--no-gradient-accumulation-fusion"),
    *("--no-bias-swiglu-fusion", "--no-bias-dropout-fusion", "--no-masked-softmax-fusion"),
    *("--no-persist-layer-norm", "--no-rope-fusion"),
]


def _launch(
    tmp: Path, switch: str, options: dict | None, train_iters: int, period_s: float = 0.001
) -> tuple[list[dict], str]:
    """Both ranks of one launch; each rank's ``rank<R>.json`` and their output, joined.

    Retries once with a new port if the rendezvous port was taken meanwhile.
    """
    out = tmp / "out"
    out.mkdir(parents=True)
    elsewhere = tmp / "cwd"  # not the script's folder
    elsewhere.mkdir()
    base = {k: v for k, v in os.environ.items() if not k.startswith("POWERLIB_")} | {
        "POWERLIB_BACKEND": "simulated",
        "POWERLIB_SIM_GPUS": str(WORLD),
        "POWERLIB_STATE_DIR": str(tmp / "state"),
        "POWERLIB_SIM_ENERGY_PERIOD_S": str(period_s),
        "POWERLIB_MEGATRON": switch,
        "POWERLIB_MEGATRON_OPTIONS": json.dumps({**(options or {}), "out_dir": str(out)}),
        "PRETRAIN_OUT": str(out),
        "MASTER_ADDR": "127.0.0.1",
        "WORLD_SIZE": str(WORLD),
        "TORCHDYNAMO_DISABLE": "1",  # Megatron's fused-kernel warm-up would compile C++ on CPU
    }
    command = [sys.executable, "-m", "powerlib.integrations.megatron", str(SCRIPT), *ARGS]
    command += ["--train-iters", str(train_iters)]
    for attempt in range(2):
        env = base | {"MASTER_PORT": str(free_port())}
        procs = [
            subprocess.Popen(
                command,
                cwd=elsewhere,
                env=env | {"RANK": str(r), "LOCAL_RANK": str(r)},
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
            )
            for r in range(WORLD)
        ]
        logs = []
        try:
            for p in procs:
                logs.append(p.communicate(timeout=300)[0].decode(errors="replace"))
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
        taken = any("EADDRINUSE" in log or "address already in use" in log.lower() for log in logs)
        if taken and attempt == 0:
            continue
        for r, p in enumerate(procs):
            assert p.returncode == 0, f"rank {r} failed:\n{logs[r][-6000:]}"
        ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]
        return ranks, "\n".join(logs)
    raise AssertionError("unreachable")


def _lines(logs: str, text: str) -> list[str]:
    return [line for line in logs.splitlines() if text in line]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[list[dict], str]]:
    """The same launch without powerlib and with it (the integration tests' sweep)."""
    tmp = tmp_path_factory.mktemp("pretrain")
    return {
        "off": _launch(tmp / "off", "0", None, TRAIN_ITERS),
        "on": _launch(tmp / "on", "1", SWEEP, TRAIN_ITERS),
    }


def test_the_losses_under_the_launcher_equal_a_run_without_powerlib(runs: dict) -> None:
    (off, _), (on, _) = runs["off"], runs["on"]
    last = WORLD - 1
    assert [r["pp_rank"] for r in on] == list(range(WORLD))
    # train() ran --train-iters iterations of M microbatches, evaluate() some more
    assert len(off[last]["losses"]) > TRAIN_ITERS * M
    assert on[last]["losses"] == off[last]["losses"]  # bit for bit
    assert all(r["session"] is None and r["restored"] for r in off)


def test_the_launched_session_profiled_planned_and_applied(runs: dict) -> None:
    on, logs = runs["on"]
    assert _lines(logs, "RuntimeWarning: powerlib") == []  # no refused plan, no order mismatch
    for rank, res in enumerate(on):
        session = res["session"]
        assert session is not None, "the script did not see the launcher's session"
        assert session["sessions"] == 1 and session["phase"] == "closed"
        assert (session["stage"], session["num_microbatches"]) == (rank, M)
        assert session["iterations"] == res["train_iters"] == TRAIN_ITERS  # eval is not a step
        first = session["applied_from"]
        assert SWEEP["warmup_iterations"] + len(FREQS) <= first <= MAX_PROFILE_ITERATIONS
        assert session["profiled_freqs_mhz"] == FREQS
        assert session["order_source"] == "recorded"
        generated = build_schedule("1f1b", WORLD, M, 1)[rank]
        assert [(k, mb) for k, mb, _ in session["plan_stage"]] == [
            (i.kind, i.microbatch) for i in generated
        ]
        assert res["restored"]


def test_a_run_shorter_than_its_plan_says_so_once_and_writes_its_summary(
    tmp_path: Path,
) -> None:
    ranks, logs = _launch(tmp_path, "1", {"check_rounds": 0}, 4)  # the default sweep
    [line] = _lines(logs, "the run ended after")
    assert "RuntimeWarning: powerlib: the run ended after 4 iterations, before its plan: " in line
    assert "a plan needs up to " in line and line.endswith(f"in {tmp_path / 'out'}")
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["plan"] is None and summary["iterations"] == 4
    assert summary["ended_before_plan"] in line
    assert all(r["session"]["phase"] == "closed" and r["restored"] for r in ranks)


def test_a_refused_plan_is_one_line_for_the_job_under_megatron_logging(tmp_path: Path) -> None:
    """An energy counter that updates every 0.5 s cannot resolve one iteration's instructions."""
    options = {**SWEEP, "target_error": 0.02, "max_iterations_per_freq": 1}
    ranks, logs = _launch(tmp_path, "1", options, 6, period_s=0.5)
    assert _lines(logs, "INFO:powerlib.registry")  # Megatron's root logger prints INFO records
    [line] = _lines(logs, "powerlib: the energy counter cannot resolve per-instruction energy")
    assert line.endswith("running at the baseline clocks, no plan applied")
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["plan"] is None and summary["refused"] in line
    # the losses of a refused run are the script's, too
    assert all(r["session"]["phase"] == "closed" and r["restored"] for r in ranks)
