"""Backend selection: explicit > POWERLIB_BACKEND > auto; no silent fallback; plug-ins."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest

from powerlib import BackendUnavailableError, ConfigError, Settings
from powerlib.registry import AUTO_ORDER, backend_names, open_backend, probe_backends


@pytest.fixture
def no_vendor_libs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make pynvml and amdsmi unimportable, whatever is installed."""
    monkeypatch.setitem(sys.modules, "pynvml", None)
    monkeypatch.setitem(sys.modules, "amdsmi", None)


def test_auto_never_picks_simulated_and_explains_every_skip(
    settings: Settings, no_vendor_libs: None
) -> None:
    with pytest.raises(BackendUnavailableError) as info:
        open_backend(settings=settings)
    message = str(info.value)
    for name in AUTO_ORDER:
        assert f"{name}:" in message
    assert "nvidia-ml-py" in message and "POWERLIB_BACKEND=simulated" in message
    assert "\n" not in message


def test_auto_picks_sysfs_when_a_tree_exists(settings: Settings, no_vendor_libs: None) -> None:
    from powerlib.testing.sysfs import make_cpufreq_tree, make_powercap_tree

    make_powercap_tree(settings.sysfs_root, packages=1)
    make_cpufreq_tree(settings.sysfs_root, packages=1)
    with open_backend(settings=settings) as backend:
        assert backend.name == "sysfs"
        assert len(backend.devices()) == 1
    probes = {p.backend: p for p in probe_backends(settings)}
    assert probes["sysfs"].is_available and probes["sysfs"].num_devices == 1
    assert not probes["nvidia"].is_available


def test_explicit_backend_that_cannot_start_is_an_error_not_a_fallback(
    settings: Settings, no_vendor_libs: None
) -> None:
    with pytest.raises(BackendUnavailableError, match=r"powerlib\[nvidia\]"):
        open_backend("nvidia", settings)
    with pytest.raises(BackendUnavailableError, match="amdsmi"):
        open_backend(settings=settings.replace(backend="amd"))
    with pytest.raises(BackendUnavailableError, match="sysfs|powercap"):
        open_backend("sysfs", settings)


def test_explicit_name_beats_the_setting(settings: Settings) -> None:
    with open_backend("simulated", settings.replace(backend="nvidia", sim_gpus=3)) as backend:
        assert backend.name == "simulated" and len(backend.devices()) == 3


def test_unknown_backend_lists_the_valid_names(settings: Settings) -> None:
    with pytest.raises(ConfigError, match="auto, nvidia, amd, sysfs, simulated"):
        open_backend("cuda", settings)


def test_backend_setting_is_validated() -> None:
    with pytest.raises(ConfigError):
        Settings(backend="")
    with pytest.raises(ConfigError, match="POWERLIB_SIM_CLOCK"):
        Settings.from_env({"POWERLIB_SIM_CLOCK": "fast"})
    s = Settings.from_env(
        {"POWERLIB_BACKEND": "Simulated", "POWERLIB_SYSFS_ROOT": "/x", "POWERLIB_STATE_DIR": "/y"}
    )
    assert (s.backend, str(s.sysfs_root), str(s.state_dir)) == ("simulated", "/x", "/y")
    assert str(Settings.from_env({}).sysfs_root) == "/sys"


def _install_plugin(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str, target: str
) -> None:
    site = tmp_path / f"site-{name}"
    dist = site / f"powerlib_plugin_{name}-1.0.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: powerlib-plugin-{name}\nVersion: 1.0\n"
    )
    (dist / "entry_points.txt").write_text(f"[powerlib.backends]\n{name} = {target}\n")
    (site / f"plugin_{name}.py").write_text(
        textwrap.dedent(
            """
        from powerlib.backends.simulated import SimulatedBackend

        class PluginBackend(SimulatedBackend):
            name = "PLUGIN"

        class Broken(SimulatedBackend):
            @classmethod
            def probe(cls, settings):
                raise RuntimeError("boom")
        """
        ).replace("PLUGIN", name)
    )
    monkeypatch.syspath_prepend(str(site))


def test_plugins_register_through_entry_points(
    settings: Settings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _install_plugin(tmp_path, monkeypatch, "mygpu", "plugin_mygpu:PluginBackend")
    assert backend_names()["mygpu"] == "plugin_mygpu:PluginBackend"
    with open_backend("mygpu", settings.replace(sim_gpus=2)) as backend:
        assert backend.name == "mygpu" and len(backend.devices()) == 2


def test_plugins_cannot_shadow_builtins_and_broken_probes_are_reported(
    settings: Settings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _install_plugin(tmp_path, monkeypatch, "simulated", "plugin_simulated:PluginBackend")
    _install_plugin(tmp_path, monkeypatch, "broken", "plugin_broken:Broken")
    assert backend_names()["simulated"] == "powerlib.backends.simulated:SimulatedBackend"
    (probe,) = probe_backends(settings, ["broken"])
    assert not probe.is_available and "boom" in probe.reason
