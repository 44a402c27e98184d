"""The Hugging Face and Lightning callbacks on the simulated backend (wall clock, sampler thread).

The measured simulated GPUs run no simulated work, so each draws its constant idle power the
whole run: the exact energy of any window is ``P_idle x its length``. The tolerances below are
the measurement's own accuracy on a wall clock (docs/measurement.md §3): about 2 % for a window
of a second or more, a few percent for a sum of steps shorter than the counter's 100 ms update
period (each boundary is placed from reads that, on a 2-core CI runner, wait for the GIL the
training thread holds), more for one provisional interval of two such steps.
"""

from __future__ import annotations

import math
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import powerlib
from powerlib.errors import InvalidArgumentError

LEAFSPEC = "ignore:.*LeafSpec.* is deprecated:FutureWarning"
"""lightning 2.6.6's own _pytree helper on torch 2.13 (not ours, harmless)."""


@pytest.fixture
def sim(monkeypatch: pytest.MonkeyPatch) -> float:
    """Two simulated GPUs; returns their total idle power (what every window draws), W."""
    monkeypatch.setenv("POWERLIB_BACKEND", "simulated")
    monkeypatch.setenv("POWERLIB_SIM_GPUS", "2")
    backend = powerlib.open_backend()
    try:
        return math.fsum(d.model.power_w(d.model.min_freq_mhz) for d in backend.devices())
    finally:
        backend.close()


@pytest.fixture
def fine_counter(monkeypatch: pytest.MonkeyPatch) -> None:
    """A 1 ms energy counter: profiling needs per-instruction energy (tests/multiproc.py too)."""
    monkeypatch.setenv("POWERLIB_SIM_ENERGY_PERIOD_S", "0.001")


APPLIED_STEPS = 3
"""Optimizer steps the optimize tests train once the plan applies (the first one is checked)."""


def _powerlib_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("powerlib-")]


def _unlocked() -> bool:
    backend = powerlib.open_backend()
    try:
        return all(d.read_state().locked_sm_freqs_mhz is None for d in backend.devices())
    finally:
        backend.close()


@pytest.fixture
def delay_device(sim: float):
    """``clocked.Delay`` sleeps for the clock locked on simulated GPU 0 (the session's device)."""
    from clocked import Delay

    backend = powerlib.open_backend()
    Delay.device = backend.device(0)
    yield Delay
    backend.close()


def test_importing_the_integrations_package_imports_no_framework() -> None:
    code = (
        "import sys, powerlib.integrations; "
        "bad = [m for m in ('transformers', 'lightning', 'pytorch_lightning', 'torch') "
        "if m in sys.modules]; print(bad); sys.exit(1 if bad else 0)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


# -- Hugging Face ----------------------------------------------------------------------------------

SEQ = 16
BATCH = 2
GAS = 2
TOKENS_PER_STEP = BATCH * GAS * SEQ


def _hf_trainer(tmp_path: Path, callbacks: list, *, max_steps: int, **overrides):
    pytest.importorskip("accelerate")  # the Trainer needs it
    transformers = pytest.importorskip("transformers")
    import torch

    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=1,
        n_head=2,
        n_embd=32,
        vocab_size=64,
        n_positions=32,
        bos_token_id=0,
        eos_token_id=0,
    )
    model = transformers.GPT2LMHeadModel(config)

    class Tokens(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return 64

        def __getitem__(self, i: int) -> dict:
            ids = torch.randint(0, 64, (SEQ,), generator=torch.Generator().manual_seed(i))
            return {"input_ids": ids, "labels": ids}

    options = {
        "output_dir": str(tmp_path / "hf"),
        "use_cpu": True,
        "report_to": [],
        "max_steps": max_steps,
        "per_device_train_batch_size": BATCH,
        "per_device_eval_batch_size": 16,
        "gradient_accumulation_steps": GAS,
        "logging_steps": 2,
        "save_strategy": "no",
        "disable_tqdm": True,
        "dataloader_num_workers": 0,
    }
    options.update(overrides)
    args = transformers.TrainingArguments(**options)
    trainer = transformers.Trainer(
        model=model, args=args, train_dataset=Tokens(), eval_dataset=Tokens(), callbacks=callbacks
    )
    return trainer, model


def test_hf_logs_energy_per_step_into_log_history(tmp_path: Path, sim: float) -> None:
    from powerlib.integrations.huggingface import PowerlibCallback

    cb = PowerlibCallback()
    trainer, _ = _hf_trainer(
        tmp_path,
        [cb],
        max_steps=6,
        include_num_input_tokens_seen=True,
        eval_strategy="steps",
        eval_steps=3,
    )
    cb.install(trainer)  # right after DefaultFlowCallback: the reporters see the keys too
    names = [type(c).__name__ for c in trainer.callback_handler.callbacks]
    assert names.index("PowerlibCallback") == names.index("DefaultFlowCallback") + 1
    out = trainer.train()
    assert _powerlib_threads() == []  # the sampler thread is gone

    res = cb.result
    assert not res.provisional
    assert res.num_steps == trainer.state.global_step == 6
    assert res.tokens == 6 * TOKENS_PER_STEP  # from num_input_tokens_seen
    steps_j = math.fsum(res.step_energy_j)
    assert all(e > 0 for e in res.step_energy_j)
    assert steps_j <= res.energy_j  # disjoint windows inside the measurement
    assert steps_j == pytest.approx(sim * math.fsum(res.step_time_s), rel=0.1)
    assert res.energy_j == pytest.approx(sim * res.time_s, rel=0.03)
    assert res.energy_per_token_j == pytest.approx(steps_j / res.tokens, rel=1e-12)

    train_logs = [e for e in trainer.state.log_history if "loss" in e]
    assert [e["step"] for e in train_logs] == [2, 4, 6]
    for e in train_logs:
        assert {"energy_j", "energy_per_step_j", "energy_per_token_j", "power_w"} <= set(e)
        assert e["energy_per_step_j"] == pytest.approx(e["energy_j"] / 2, rel=1e-12)
        assert e["energy_per_token_j"] == pytest.approx(
            e["energy_j"] / (2 * TOKENS_PER_STEP), rel=1e-12
        )
        assert e["power_w"] == pytest.approx(sim, rel=0.25)
        assert e["energy_j"] > 0
    # each log reports the steps since the previous one: together, every step (provisional
    # at log time, so within the steps' own tolerance of the closed figures)
    assert math.fsum(e["energy_j"] for e in train_logs) == pytest.approx(steps_j, rel=0.1)
    assert train_logs[-1]["energy_total_j"] < res.energy_j

    # the evaluations the trainer scheduled are windows "eval", reported with their metrics
    evals = [e for e in trainer.state.log_history if "eval_loss" in e]
    assert [e["step"] for e in evals] == [3, 6]
    assert len(res.window("eval")) == 2
    for e, w in zip(evals, res.window("eval")):
        assert e["eval_energy_j"] > 0
        assert e["eval_power_w"] == pytest.approx(sim, rel=0.25)
        assert e["eval_energy_j"] == pytest.approx(w.energy_j, rel=0.25)

    # the final summary carries the closed totals, and so does TrainOutput.metrics
    final = trainer.state.log_history[-1]
    assert "train_runtime" in final
    assert final["train_energy_j"] == out.metrics["train_energy_j"] == res.energy_j
    assert final["train_steps_energy_j"] == pytest.approx(steps_j)
    assert final["train_energy_per_step_j"] == pytest.approx(steps_j / 6)
    assert final["train_energy_per_token_j"] == pytest.approx(res.energy_per_token_j)
    assert final["train_power_w"] == pytest.approx(sim, rel=0.03)

    # outside train() nothing is measured (and nothing fails)
    metrics = trainer.evaluate()
    assert "eval_energy_j" not in metrics


def test_hf_tokens_per_step_and_callable(tmp_path: Path, sim: float) -> None:
    from powerlib.integrations.huggingface import PowerlibCallback

    fixed = PowerlibCallback(tokens_per_step=1000)
    calls = []

    def tokens(args, state) -> float:
        calls.append(state.global_step)
        return 10.0 * state.global_step

    called = PowerlibCallback(tokens_per_step=tokens, devices=[1])
    trainer, _ = _hf_trainer(tmp_path, [fixed, called], max_steps=2, gradient_accumulation_steps=1)
    trainer.train()
    assert fixed.result.tokens == 2000
    assert calls == [1, 2]  # at each step's end, after global_step advanced
    assert called.result.tokens == 10 + 20
    assert [d.index for d in called.result.devices] == [1]
    assert len(fixed.result.devices) == 2  # "auto" in one process: every device
    assert called.result.energy_per_token_j == pytest.approx(
        math.fsum(called.result.step_energy_j) / 30, rel=1e-12
    )


def test_hf_optimize_runs_a_session_and_restores_the_clocks(
    tmp_path: Path, fine_counter: None, delay_device
) -> None:
    from clocked import FREQS, MAX_PROFILE_ITERATIONS, SWEEP
    from transformers import TrainerCallback

    from powerlib.integrations.huggingface import PowerlibCallback

    cb = PowerlibCallback(optimize={**SWEEP, "progress": False})

    class StopAfterPlan(TrainerCallback):
        """Ends training once the plan ran APPLIED_STEPS optimizer steps."""

        def on_step_end(self, args, state, control, **kwargs):
            first = cb.session.apply_started_iteration
            if first is not None and state.global_step >= first + APPLIED_STEPS:
                control.should_training_stop = True

    trainer, model = _hf_trainer(
        tmp_path,
        [cb, StopAfterPlan()],
        max_steps=MAX_PROFILE_ITERATIONS + APPLIED_STEPS,
        eval_strategy="steps",
        eval_steps=3,
    )
    # the simulated GPU runs no torch: the last layer norm sleeps for the clock in force
    model.transformer.ln_f.register_forward_hook(lambda m, a, out: delay_device.apply(out))
    trainer.train()

    session = cb.session
    assert session.phase == "closed"
    first = session.apply_started_iteration
    assert session.plan is not None and first is not None
    # warm-up and every clock profiled (an evaluation among them), then the plan
    assert SWEEP["warmup_iterations"] + len(FREQS) <= first <= MAX_PROFILE_ITERATIONS
    assert (
        session.iteration == trainer.state.global_step == first + APPLIED_STEPS
    )  # optimizer steps
    assert list(session.report().profiled_freqs_mhz) == FREQS
    # the applied iteration ran the plan's order: F0 B0 F1 B1 (the evaluations' forwards,
    # in eval mode without gradients, are not instructions: they would break the order)
    assert [(k[2], k[3]) for k, _ in session.first_apply_requests] == [
        (0, "forward"),
        (0, "backward"),
        (1, "forward"),
        (1, "backward"),
    ]
    assert (tmp_path / "hf" / "powerlib" / "plan.json").exists()  # out_dir under output_dir
    assert _unlocked()
    assert _powerlib_threads() == []
    assert cb.result.num_steps == session.iteration
    assert all("energy_j" in e for e in trainer.state.log_history if "loss" in e)


def test_hf_a_failed_train_is_closed_by_the_context_manager(
    tmp_path: Path, fine_counter: None, delay_device
) -> None:
    from clocked import SWEEP
    from transformers import TrainerCallback

    from powerlib.integrations.huggingface import PowerlibCallback

    class Boom(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 2:
                raise RuntimeError("boom")

    with PowerlibCallback(optimize={**SWEEP, "progress": False}) as cb:
        trainer, model = _hf_trainer(tmp_path, [cb, Boom()], max_steps=6)
        model.transformer.ln_f.register_forward_hook(lambda m, a, out: delay_device.apply(out))
        with pytest.raises(RuntimeError, match="boom"):
            trainer.train()
        # transformers has no exception hook: still open here, clocks locked by the sweep
        assert cb.running and "powerlib-measure" in _powerlib_threads()
        assert not _unlocked()
    assert not cb.running
    assert _powerlib_threads() == []
    assert _unlocked()
    assert cb.session.phase == "closed"


def test_hf_bad_arguments_fail_at_construction() -> None:
    pytest.importorskip("transformers")
    from powerlib.integrations.huggingface import PowerlibCallback

    for kwargs, match in (
        ({"reduce": "node"}, "reduce must be"),
        ({"tokens_per_step": "many"}, "tokens_per_step must be"),
        ({"tokens_per_step": -1}, "tokens_per_step must be"),
        ({"devices": "all"}, "devices must be"),
        ({"sample_period_s": 0}, "sample_period_s"),
        ({"optimize": {"num_stages": 2}}, "set by the callback"),
        ({"optimize": {"polcy": "fastest"}}, "unknown powerlib.optimize option"),
        ({"optimize": "yes"}, "optimize must be"),
    ):
        with pytest.raises(InvalidArgumentError, match=match):
            PowerlibCallback(**kwargs)


# -- Lightning -------------------------------------------------------------------------------------


def _lightning_module(pl, *, delay=None, fail_at: int | None = None, sleep_s: float = 0.0):
    import torch

    class Tiny(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            if delay is not None:
                from clocked import Block

                self.net = Block(8)
            else:
                self.net = torch.nn.Linear(8, 8)
            self.batches = 0

        def training_step(self, batch, batch_idx):
            self.batches += 1
            if fail_at is not None and self.batches == fail_at:
                raise RuntimeError("boom")
            if sleep_s:
                time.sleep(sleep_s)  # steps long enough to span several counter updates
            x, y = batch
            loss = ((self.net(x) - y) ** 2).mean()
            self.log("loss", loss)
            return loss

        def validation_step(self, batch, batch_idx):
            x, y = batch
            self.log("val_loss", ((self.net(x) - y) ** 2).mean())

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    return Tiny()


def _loaders(batch: int = 4):
    import torch

    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(
        torch.randn(64, 8, generator=g), torch.randn(64, 8, generator=g)
    )
    return (
        torch.utils.data.DataLoader(data, batch_size=batch),
        torch.utils.data.DataLoader(data, batch_size=32),
    )


def _recording_logger(pl):
    class Recording(pl.loggers.Logger):
        def __init__(self) -> None:
            super().__init__()
            self.rows: list[tuple[int | None, dict]] = []

        @property
        def name(self) -> str:
            return "recording"

        @property
        def version(self) -> int:
            return 0

        def log_hyperparams(self, params, *args, **kwargs) -> None:
            pass

        def log_metrics(self, metrics, step=None) -> None:
            self.rows.append((step, dict(metrics)))

    return Recording()


def _lightning_trainer(pl, tmp_path: Path, callbacks: list, logger, **overrides):
    options = {
        "accelerator": "cpu",
        "devices": 1,
        "max_steps": 8,
        "log_every_n_steps": 2,
        "accumulate_grad_batches": 2,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "enable_checkpointing": False,
        "val_check_interval": 8,  # batches: after steps 4 and 8
        "num_sanity_val_steps": 1,
        "default_root_dir": str(tmp_path / "pl"),
    }
    options.update(overrides)
    return pl.Trainer(callbacks=callbacks, logger=logger, **options)


@pytest.mark.filterwarnings(LEAFSPEC)
def test_lightning_logs_energy_into_callback_metrics_and_loggers(
    tmp_path: Path, sim: float
) -> None:
    pl = pytest.importorskip("lightning.pytorch")
    from powerlib.integrations.lightning import PowerlibCallback

    cb = PowerlibCallback(tokens_per_batch=lambda batch: batch[0].shape[0] * 8)
    logger = _recording_logger(pl)
    trainer = _lightning_trainer(pl, tmp_path, [cb], logger)
    train, val = _loaders()
    trainer.fit(_lightning_module(pl, sleep_s=0.08), train, val)
    assert _powerlib_threads() == []

    res = cb.result
    assert not res.provisional
    assert res.num_steps == trainer.global_step == 8  # optimizer steps, two batches each
    assert res.tokens == 8 * 2 * 4 * 8
    steps_j = math.fsum(res.step_energy_j)
    assert steps_j <= res.energy_j
    assert steps_j == pytest.approx(sim * math.fsum(res.step_time_s), rel=0.1)
    assert res.energy_j == pytest.approx(sim * res.time_s, rel=0.03)
    assert [w.name for w in res.windows if w.kind == "window"] == [
        "sanity_check",
        "validation",
        "validation",
    ]

    # every log_every_n_steps optimizer steps, through pl_module.log
    energy_rows = [m for _, m in logger.rows if "energy_per_step_j" in m]
    assert len(energy_rows) == 4
    for m in energy_rows:
        assert m["energy_per_step_j"] == pytest.approx(m["energy_j"] / 2, rel=1e-5)  # float32
        assert m["energy_per_token_j"] == pytest.approx(m["energy_j"] / (2 * 64), rel=1e-5)
        assert m["power_w"] == pytest.approx(sim, rel=0.25)
    assert math.fsum(m["energy_j"] for m in energy_rows) == pytest.approx(steps_j, rel=0.1)
    for key in ("energy_j", "energy_per_step_j", "energy_per_token_j", "power_w", "energy_total_j"):
        assert key in trainer.callback_metrics
    validation_rows = [m for _, m in logger.rows if "validation_energy_j" in m]
    assert len(validation_rows) == 2 and all("val_loss" in m for m in validation_rows)
    assert all(m["validation_power_w"] == pytest.approx(sim, rel=0.25) for m in validation_rows)
    assert "validation_energy_j" in trainer.callback_metrics

    # the closed totals go to the loggers at train end
    step, final = logger.rows[-1]
    assert step == 8
    assert final["train_energy_j"] == res.energy_j
    assert final["train_steps_energy_j"] == pytest.approx(steps_j)
    assert final["train_energy_per_token_j"] == pytest.approx(steps_j / res.tokens)
    assert final["train_power_w"] == pytest.approx(sim, rel=0.03)


@pytest.mark.filterwarnings(LEAFSPEC)
def test_lightning_optimize_runs_a_session_and_restores_the_clocks(
    tmp_path: Path, fine_counter: None, delay_device
) -> None:
    pl = pytest.importorskip("lightning.pytorch")
    from clocked import FREQS, MAX_PROFILE_ITERATIONS, SWEEP

    from powerlib.integrations.lightning import PowerlibCallback

    cb = PowerlibCallback(optimize={**SWEEP, "progress": False})

    class StopAfterPlan(pl.Callback):
        """Ends training once the plan ran APPLIED_STEPS optimizer steps."""

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            first = cb.session.apply_started_iteration
            if first is not None and trainer.global_step >= first + APPLIED_STEPS:
                trainer.should_stop = True

    trainer = _lightning_trainer(
        pl,
        tmp_path,
        [cb, StopAfterPlan()],
        _recording_logger(pl),
        max_steps=MAX_PROFILE_ITERATIONS + APPLIED_STEPS,
    )
    train, val = _loaders()
    trainer.fit(_lightning_module(pl, delay=delay_device), train, val)

    session = cb.session
    assert session.phase == "closed"
    first = session.apply_started_iteration
    assert session.plan is not None and first is not None
    # warm-up and every clock profiled, then the plan
    assert SWEEP["warmup_iterations"] + len(FREQS) <= first <= MAX_PROFILE_ITERATIONS
    assert session.iteration == trainer.global_step == first + APPLIED_STEPS
    assert list(session.report().profiled_freqs_mhz) == FREQS
    # validation forwards (sanity check, val_check_interval) are not instructions
    assert [(k[2], k[3]) for k, _ in session.first_apply_requests] == [
        (0, "forward"),
        (0, "backward"),
        (1, "forward"),
        (1, "backward"),
    ]
    assert (tmp_path / "pl" / "powerlib" / "plan.json").exists()
    assert _unlocked()
    assert _powerlib_threads() == []
    assert cb.result.num_steps == session.iteration


@pytest.mark.filterwarnings(LEAFSPEC)
def test_lightning_an_exception_closes_the_measurement_and_the_session(
    tmp_path: Path, fine_counter: None, delay_device
) -> None:
    pl = pytest.importorskip("lightning.pytorch")
    from clocked import SWEEP

    from powerlib.integrations.lightning import PowerlibCallback

    cb = PowerlibCallback(optimize={**SWEEP, "progress": False})
    trainer = _lightning_trainer(pl, tmp_path, [cb], _recording_logger(pl), num_sanity_val_steps=0)
    train, val = _loaders()
    with pytest.raises(RuntimeError, match="boom"):  # mid-sweep: clocks locked
        trainer.fit(_lightning_module(pl, delay=delay_device, fail_at=6), train, val)
    assert not cb.running
    assert _powerlib_threads() == []
    assert _unlocked()
    assert cb.session.phase == "closed"
    assert cb.result is None  # no totals from an interrupted run
    # batches 1-4 are steps 1 and 2; step 3 (batches 5, 6) was open when batch 6 failed: closing
    # the measurement closes it too, so its energy is counted, as `with m.step()` would
    assert cb.measurement.result().num_steps == 3


@pytest.mark.filterwarnings(LEAFSPEC)
def test_lightning_refuses_optimize_with_manual_optimization(tmp_path: Path, sim: float) -> None:
    pl = pytest.importorskip("lightning.pytorch")
    from powerlib.errors import NotSupportedError
    from powerlib.integrations.lightning import PowerlibCallback

    module = _lightning_module(pl)
    module.automatic_optimization = False
    cb = PowerlibCallback(optimize=True)
    trainer = _lightning_trainer(
        pl, tmp_path, [cb], _recording_logger(pl), accumulate_grad_batches=1
    )
    train, val = _loaders()
    with pytest.raises(NotSupportedError, match="automatic optimization"):
        trainer.fit(module, train, val)
    assert _powerlib_threads() == [] and not cb.running


def test_lightning_bad_arguments_fail_at_construction() -> None:
    pytest.importorskip("lightning.pytorch")
    from powerlib.integrations.lightning import PowerlibCallback

    for kwargs, match in (
        ({"reduce": "node"}, "reduce must be"),
        ({"tokens_per_batch": [1]}, "tokens_per_batch must be"),
        ({"log_every_n_steps": 0}, "log_every_n_steps"),
        ({"optimize": {"num_microbatches": 4}}, "set by the callback"),
    ):
        with pytest.raises(InvalidArgumentError, match=match):
            PowerlibCallback(**kwargs)


@pytest.mark.filterwarnings(LEAFSPEC)
def test_pytorch_lightning_package_gets_its_own_class(tmp_path: Path, sim: float) -> None:
    ptl = pytest.importorskip("pytorch_lightning")
    from powerlib.integrations import lightning as integration

    cls = integration.PLPowerlibCallback
    assert integration.PLPowerlibCallback is cls
    cb = cls()
    assert isinstance(cb, ptl.Callback)
    logger = _recording_logger(ptl)
    # 8 of the epoch's 16 batches: no validation comes, the loader only keeps the warning away
    trainer = _lightning_trainer(
        ptl, tmp_path, [cb], logger, max_steps=4, val_check_interval=None, num_sanity_val_steps=0
    )
    train, val = _loaders()
    trainer.fit(_lightning_module(ptl), train, val)
    assert cb.result.num_steps == trainer.global_step == 4
    assert "energy_j" in trainer.callback_metrics
    assert _powerlib_threads() == []
