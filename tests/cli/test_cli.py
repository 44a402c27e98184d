"""The CLI through click's runner, on the simulated backend and on fake sysfs trees."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from powerlib.cli import cli


@pytest.fixture
def run(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)
    monkeypatch.setitem(sys.modules, "amdsmi", None)
    runner = CliRunner()

    def invoke(*args: str, env: dict[str, str] | None = None):
        return runner.invoke(cli, list(args), env=env, catch_exceptions=False)

    return invoke


SIM = {"POWERLIB_BACKEND": "simulated", "POWERLIB_SIM_GPUS": "2"}


def test_devices_json_lists_simulated_gpus_with_numbers(run) -> None:
    result = run("devices", "--json", env=SIM)
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["schema"] == "powerlib.devices.v1" and data["backend"] == "simulated"
    assert len(data["devices"]) == 2
    for dev in data["devices"]:
        for key in ("power_w", "energy_j", "sm_freq_mhz", "power_limit_w", "temperature_c"):
            assert isinstance(dev[key], float), key
        assert dev["is_simulated"] is True


def test_set_is_seen_by_the_next_status_and_reset_restores(run) -> None:
    assert run("set", "--device", "0", "--freq-mhz", "1200", env=SIM).exit_code == 0
    status = json.loads(run("status", "--device", "0", "--json", env=SIM).stdout)["devices"][0]
    assert status["locked_sm_freqs_mhz"] == [1200.0, 1200.0]
    assert status["capabilities"]["can_lock_sm_clocks"] is True
    assert 1200.0 in status["supported_sm_freqs_mhz"]
    other = json.loads(run("status", "--device", "1", "--json", env=SIM).stdout)["devices"][0]
    assert other["locked_sm_freqs_mhz"] is None
    result = run("reset", "--device", "0", env=SIM)
    assert result.exit_code == 0 and "SM clocks reset" in result.stdout
    status = json.loads(run("status", "--device", "0", "--json", env=SIM).stdout)["devices"][0]
    assert status["locked_sm_freqs_mhz"] is None and status["sm_freq_mhz"] == 210.0


def test_set_range_and_power_limit_by_device_id(run) -> None:
    dev_id = json.loads(run("devices", "--json", env=SIM).stdout)["devices"][1]["device_id"]
    result = run(
        "set",
        "--device",
        dev_id[:12],
        "--freq-range-mhz",
        "900",
        "1300",
        "--power-limit-w",
        "250",
        "--json",
        env=SIM,
    )
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["applied"] == {"locked_sm_freqs_mhz": [900.0, 1305.0], "power_limit_w": 250.0}
    assert data["device"]["power_limit_w"] == 250.0
    assert run("reset", "--all", "--json", env=SIM).exit_code == 0
    assert (
        json.loads(run("status", "--device", "1", "--json", env=SIM).stdout)["devices"][0][
            "power_limit_w"
        ]
        == 400.0
    )


@pytest.mark.parametrize(
    ("args", "code"),
    [
        (["set", "--device", "0", "--freq-mhz", "1200", "--power-limit-w", "900"], 7),
        (["set", "--device", "0", "--freq-mhz", "5000"], 7),
        (["set", "--device", "0", "--freq-range-mhz", "1400", "900"], 7),
        (["set", "--device", "7", "--freq-mhz", "1200"], 6),
        (["set", "--device", "0"], 2),
        (["set", "--device", "0", "--freq-mhz", "1200", "--freq-range-mhz", "900", "1000"], 2),
        (["reset"], 2),
        (["status", "--device", "GPU-nope"], 6),
    ],
)
def test_bad_input_is_one_line_with_its_exit_code_and_changes_nothing(
    run, args: list[str], code: int
) -> None:
    before = json.loads(run("status", "--json", env=SIM).stdout)
    result = run(*args, env=SIM)
    assert result.exit_code == code
    lines = result.stderr.strip().splitlines()
    if code == 2:  # click's usage error: usage line, hint, then one "Error:" line
        assert lines[-1].startswith("Error: ")
    else:
        assert len(lines) == 1 and lines[0].startswith("powerlib: error: ")
    assert "Traceback" not in result.stderr
    after = json.loads(run("status", "--json", env=SIM).stdout)
    for b, a in zip(before["devices"], after["devices"]):
        assert (b["locked_sm_freqs_mhz"], b["power_limit_w"]) == (
            a["locked_sm_freqs_mhz"],
            a["power_limit_w"],
        )


def test_explicit_nvidia_without_a_gpu_fails_with_one_line(run) -> None:
    result = run("devices", env={"POWERLIB_BACKEND": "nvidia"})
    assert result.exit_code == 3
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "pynvml" in lines[0] and "powerlib[nvidia]" in lines[0]
    assert result.stdout == ""


def test_verbose_shows_the_traceback(run) -> None:
    result = run("-v", "devices", env={"POWERLIB_BACKEND": "nvidia"})
    assert result.exit_code == 3 and "Traceback" in result.stderr


def test_env_explains_every_probe(run, tmp_path: Path) -> None:
    result = run("env", env={"POWERLIB_SYSFS_ROOT": str(tmp_path / "empty")})
    assert result.exit_code == 0
    for name in ("nvidia", "amd", "sysfs", "simulated"):
        assert name in result.stdout
    assert "chosen backend:    none" in result.stdout
    data = json.loads(
        run("env", "--json", env={"POWERLIB_SYSFS_ROOT": str(tmp_path / "empty")}).stdout
    )
    probes = {p["backend"]: p for p in data["probes"]}
    assert set(probes) >= {"nvidia", "amd", "sysfs", "simulated"}
    assert not probes["nvidia"]["is_available"] and "nvidia-ml-py" in probes["nvidia"]["reason"]
    assert probes["simulated"]["is_available"] and not probes["simulated"]["in_auto_order"]
    assert data["chosen_backend"] is None
    explicit = json.loads(run("env", "--json", env=SIM).stdout)
    assert explicit["chosen_backend"] == "simulated"


def test_watch_prints_count_samples_and_average_power(run) -> None:
    result = run("watch", "--interval-s", "0.05", "--count", "3", "--json", env=SIM)
    assert result.exit_code == 0
    rows = [json.loads(line) for line in result.stdout.splitlines()]
    assert [r["sample"] for r in rows] == [0, 0, 1, 1, 2, 2]
    assert rows[0]["avg_power_w"] is None
    table = run("watch", "--interval-s", "0.05", "--count", "2", "--device", "1", env=SIM)
    assert table.exit_code == 0 and len(table.stdout.splitlines()) == 3


def test_plain_output_has_no_colour_codes_off_a_terminal(run) -> None:
    for args in (["devices"], ["status"], ["env"]):
        result = run(*args, env=SIM)
        assert result.exit_code == 0 and "\x1b[" not in result.stdout


# -- sysfs over a fake tree laid out as the kernel documents it ---------------------------------


@pytest.fixture
def sysfs_env(tmp_path: Path) -> tuple[dict[str, str], Path]:
    from powerlib.testing.sysfs import make_cpufreq_tree, make_powercap_tree

    root = tmp_path / "sys"
    make_powercap_tree(root, packages=2, vendor="intel", subzones=("dram",))
    make_cpufreq_tree(root, packages=2, cpus_per_package=2, cpus_per_policy=2)
    return {"POWERLIB_BACKEND": "sysfs", "POWERLIB_SYSFS_ROOT": str(root)}, root


def _long_term_file(root: Path, zone: str) -> Path:
    zone_dir = root / "class" / "powercap" / zone
    for name_file in zone_dir.glob("constraint_*_name"):
        if name_file.read_text().strip() == "long_term":
            return zone_dir / name_file.name.replace("_name", "_power_limit_uw")
    raise AssertionError("no long_term constraint")


def test_sysfs_devices_lists_both_packages_with_energy_and_limits(run, sysfs_env) -> None:
    env, _ = sysfs_env
    result = run("devices", "--json", env=env)
    assert result.exit_code == 0, result.output
    devices = json.loads(result.stdout)["devices"]
    assert [d["device_id"] for d in devices] == ["intel-rapl:0", "intel-rapl:1"]
    for d in devices:
        assert d["kind"] == "cpu" and d["backend"] == "sysfs"
        assert isinstance(d["energy_j"], float) and isinstance(d["memory_energy_j"], float)
        assert d["power_limit_w"] == 150.0


def test_sysfs_set_power_limit_writes_the_long_term_constraint_in_microwatts(
    run, sysfs_env
) -> None:
    env, root = sysfs_env
    result = run("set", "--device", "1", "--power-limit-w", "95.5", env=env)
    assert result.exit_code == 0, result.output
    assert _long_term_file(root, "intel-rapl:1").read_text().strip() == "95500000"
    assert _long_term_file(root, "intel-rapl:0").read_text().strip() == "150000000"
    status = json.loads(run("status", "--device", "intel-rapl:1", "--json", env=env).stdout)[
        "devices"
    ][0]
    assert status["power_limit_w"] == 95.5


def test_sysfs_counter_that_wraps_between_two_readings_still_increases(
    run, sysfs_env, monkeypatch: pytest.MonkeyPatch
) -> None:
    env, root = sysfs_env
    zone = root / "class" / "powercap" / "intel-rapl:0"
    span = int((zone / "max_energy_range_uj").read_text())
    (zone / "energy_uj").write_text(str(span - 1_000_000))

    import powerlib.inspection as watch_module

    def wrap_instead_of_sleeping(_: float) -> None:
        (zone / "energy_uj").write_text("2000000")  # 3 J after the previous reading, wrapped

    monkeypatch.setattr(watch_module.time, "sleep", wrap_instead_of_sleeping)
    result = run("watch", "--interval-s", "10", "--count", "2", "--device", "0", "--json", env=env)
    assert result.exit_code == 0, result.output
    first, second = (json.loads(line) for line in result.stdout.splitlines())
    assert second["energy_j"] - first["energy_j"] == pytest.approx(3.0)
