"""Shared fixtures: every test starts with a clean POWERLIB_* environment and its own state dir."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from powerlib.config import Settings


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for key in list(os.environ):
        if key.startswith("POWERLIB_"):
            monkeypatch.delenv(key)
    monkeypatch.setenv("POWERLIB_STATE_DIR", str(tmp_path / "state"))


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    return Settings(state_dir=tmp_path / "state", sysfs_root=tmp_path / "sys")


@pytest.fixture
def hardware_check(monkeypatch: pytest.MonkeyPatch):
    """tests/hardware/test_real_gpu.py as a module, with sleeps skipped, for dry runs on fakes."""
    import importlib.util

    path = Path(__file__).parent / "hardware" / "test_real_gpu.py"
    spec = importlib.util.spec_from_file_location("_hardware_check", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(module.time, "sleep", lambda seconds: None)
    return module


@pytest.fixture
def shared() -> Iterator[Path]:
    """A folder in /tmp that every uid may enter and write in (sticky, as /tmp is), for attacks
    made as another uid: pytest's tmp_path lies under a folder only root may enter."""
    folder = Path(tempfile.mkdtemp(prefix="powerlib-shared-"))
    os.chmod(folder, 0o1777)
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)
