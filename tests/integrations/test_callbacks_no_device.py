"""The trainer callbacks on a node without a device: training goes on (docs/real-gpu.md §7).

No GPU library, an empty sysfs and no ``POWERLIB_BACKEND``: ``auto`` finds nothing. Measuring
(the callbacks' default, and ``optimize={"enabled": False}``) warns once and logs no energy;
``optimize=True`` is a request to change clocks, and fails.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from powerlib.errors import BackendUnavailableError

LEAFSPEC = "ignore:.*LeafSpec.* is deprecated:FutureWarning"
"""lightning 2.6.6's own _pytree helper on torch 2.13 (not ours, harmless)."""

ENERGY_KEYS = ("energy_j", "power_w", "energy_per_step_j", "train_energy_j", "eval_energy_j")


@pytest.fixture
def no_device(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)
    monkeypatch.setitem(sys.modules, "amdsmi", None)
    (tmp_path / "empty-sys").mkdir()
    monkeypatch.setenv("POWERLIB_SYSFS_ROOT", str(tmp_path / "empty-sys"))
    reader = importlib.import_module("powerlib.measurement.reader")
    monkeypatch.setattr(reader, "_NO_DEVICE_WARNED", False)


def _hf_trainer(tmp_path: Path, callbacks: list, max_steps: int = 4):
    pytest.importorskip("accelerate")
    transformers = pytest.importorskip("transformers")
    import torch

    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=1, n_head=2, n_embd=16, vocab_size=32, n_positions=16, bos_token_id=0,
        eos_token_id=0,
    )  # fmt: skip
    model = transformers.GPT2LMHeadModel(config)

    class Tokens(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return 32

        def __getitem__(self, i: int) -> dict:
            ids = torch.randint(0, 32, (8,), generator=torch.Generator().manual_seed(i))
            return {"input_ids": ids, "labels": ids}

    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "hf"), use_cpu=True, report_to=[], max_steps=max_steps,
        per_device_train_batch_size=2, per_device_eval_batch_size=8, logging_steps=2,
        eval_strategy="steps", eval_steps=2, save_strategy="no", disable_tqdm=True,
        dataloader_num_workers=0,
    )  # fmt: skip
    return transformers.Trainer(
        model=model, args=args, train_dataset=Tokens(), eval_dataset=Tokens(), callbacks=callbacks
    )


def _no_energy(entries: list[dict]) -> bool:
    return all(not any(key in e for key in ENERGY_KEYS) for e in entries)


@pytest.mark.parametrize("optimize", [False, {"enabled": False, "progress": False}])
def test_hf_measuring_without_a_device_trains_and_warns_once(
    tmp_path: Path, no_device: None, optimize
) -> None:
    from powerlib.integrations.huggingface import PowerlibCallback

    cb = PowerlibCallback(optimize=optimize)
    trainer = _hf_trainer(tmp_path, [cb])
    with pytest.warns(RuntimeWarning, match="measuring time only") as caught:
        out = trainer.train()
    assert len([w for w in caught if "measuring time only" in str(w.message)]) == 1
    assert trainer.state.global_step == 4
    assert [e["step"] for e in trainer.state.log_history if "loss" in e] == [2, 4]
    assert _no_energy(trainer.state.log_history) and _no_energy([out.metrics])
    assert cb.result.num_steps == 4 and cb.result.devices == ()
    if optimize:
        assert cb.session.report().to_json()["disabled"]["iterations"] == 4


def test_hf_optimize_without_a_device_fails_in_train(tmp_path: Path, no_device: None) -> None:
    from powerlib.integrations.huggingface import PowerlibCallback

    cb = PowerlibCallback(optimize={"progress": False})
    trainer = _hf_trainer(tmp_path, [cb])
    # a request to change clocks: it fails (the measurement opened before it warned)
    with pytest.warns(RuntimeWarning, match="measuring time only"):
        with pytest.raises(BackendUnavailableError, match="no power backend available"):
            trainer.train()
    assert not cb.running


@pytest.mark.filterwarnings(LEAFSPEC)
def test_lightning_measuring_without_a_device_trains_and_warns_once(
    tmp_path: Path, no_device: None
) -> None:
    pl = pytest.importorskip("lightning.pytorch")
    import torch

    from powerlib.integrations.lightning import PowerlibCallback

    class Tiny(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Linear(4, 4)

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = ((self.net(x) - y) ** 2).mean()
            self.log("loss", loss)
            return loss

        def validation_step(self, batch, batch_idx):
            x, y = batch
            self.log("val_loss", ((self.net(x) - y) ** 2).mean())

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(16, 4, generator=g), torch.randn(16, 4))
    loader = torch.utils.data.DataLoader(data, batch_size=4)
    cb = PowerlibCallback(log_every_n_steps=1)
    trainer = pl.Trainer(
        callbacks=[cb], logger=False, accelerator="cpu", devices=1, max_steps=4,
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
        val_check_interval=2, num_sanity_val_steps=0, default_root_dir=str(tmp_path / "pl"),
    )  # fmt: skip
    with pytest.warns(RuntimeWarning, match="measuring time only") as caught:
        trainer.fit(Tiny(), loader, loader)
    assert len([w for w in caught if "measuring time only" in str(w.message)]) == 1
    assert trainer.global_step == 4
    assert "loss" in trainer.callback_metrics and "val_loss" in trainer.callback_metrics
    assert not any(k.startswith(("energy", "validation_energy")) for k in trainer.callback_metrics)
    assert cb.result.num_steps == 4 and cb.result.devices == ()


def test_auto_devices_in_a_multi_process_job_are_this_process_device() -> None:
    # one GPU per process (CUDA_VISIBLE_DEVICES): index local_process_index may not exist
    from powerlib.integrations import huggingface, lightning

    hf = huggingface._PowerlibCallbackImpl()
    assert hf._devices(SimpleNamespace(world_size=2, local_process_index=1)) == "local"
    assert hf._devices(SimpleNamespace(world_size=1, local_process_index=0)) is None
    pl = lightning._PowerlibCallbackImpl()
    assert pl._devices(SimpleNamespace(world_size=2, local_rank=1)) == "local"
    assert pl._devices(SimpleNamespace(world_size=1, local_rank=0)) is None
