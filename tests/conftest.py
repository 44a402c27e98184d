"""Shared fixtures: every test starts with a clean POWERLIB_* environment and its own state dir."""

from __future__ import annotations

import os
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
