"""Issue 36's CLI rough edges, each through the real CLI.

Global options after the command; ``plan`` reading P_block and τ from the profile and checking
the file first; help without ``None`` bounds; Ctrl-C ending ``watch`` quietly; ``measure --json``
keeping stdout for its JSON; a bad profile row named by file, line and column.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from powerlib.cli import cli
from powerlib.errors import PlanError
from powerlib.planning.profile import Profile
from powerlib.planning.workflow import PlanRequest, default_unit_time_s, plan_profile

REPO = Path(__file__).resolve().parents[2]
GPT3_A100 = (
    REPO / "tests" / "data" / "lowtime_frontiers" / "profiles" / "profile_gpt3-175b_a100_sxm.csv"
)
HEADER = "stage,instruction,frequency,time,energy"


def _invoke(*args: str, env: dict[str, str] | None = None):
    return CliRunner().invoke(cli, list(args), env=env, catch_exceptions=False)


def _sim_env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("POWERLIB_")}
    return env | {
        "POWERLIB_BACKEND": "simulated",
        "POWERLIB_SIM_GPUS": "2",
        "POWERLIB_STATE_DIR": str(tmp_path / "state"),
        "PYTHONWARNINGS": "ignore",
    }


def _small_profile_lines() -> list[str]:
    """A valid two-stage profile: forward 10 ms, backward 20 ms at 1410 MHz (lines 2..9)."""
    lines = []
    for stage in range(2):
        for kind, base_s in (("forward", 0.010), ("backward", 0.020)):
            for freq in (1410, 1200):
                time_s = base_s * 1410 / freq
                lines.append(f"{stage},{kind},{freq},{time_s!r},{time_s * 200!r}")
    return lines


# --- 1. --backend and -v after the command -------------------------------------------------------


@pytest.mark.parametrize(
    "argv",
    [
        ["--backend", "simulated", "devices", "--json"],
        ["devices", "--json", "--backend", "simulated"],
        ["devices", "--backend=simulated", "--json"],
    ],
)
def test_backend_goes_before_or_after_the_command(argv: list[str]) -> None:
    # a bad POWERLIB_BACKEND: only the option can make this work, wherever it stands
    result = _invoke(*argv, env={"POWERLIB_BACKEND": "bogus", "POWERLIB_SIM_GPUS": "2"})
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["backend"] == "simulated"


@pytest.mark.parametrize("argv", [["--backend", "cuda", "env"], ["env", "--backend", "cuda"]])
def test_a_bad_backend_name_is_refused_in_either_place(argv: list[str]) -> None:
    result = _invoke(*argv)
    lines = result.stderr.splitlines()
    assert result.exit_code == 7 and len(lines) == 1, lines
    assert lines[0].startswith("powerlib: error: unknown backend 'cuda'")


@pytest.mark.parametrize("argv", [["-v", "devices"], ["devices", "-v"], ["devices", "--verbose"]])
def test_verbose_goes_before_or_after_the_command(
    argv: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)
    result = _invoke(*argv, env={"POWERLIB_BACKEND": "nvidia"})
    assert result.exit_code == 3 and "Traceback" in result.stderr
    quiet = _invoke("devices", env={"POWERLIB_BACKEND": "nvidia"})
    assert quiet.exit_code == 3 and "Traceback" not in quiet.stderr


def test_verbose_after_the_command_turns_on_info_logs(tmp_path: Path) -> None:
    run = subprocess.run(
        [sys.executable, "-m", "powerlib", "devices", "-v"],
        env=_sim_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    assert "INFO powerlib.registry: opened backend simulated" in run.stderr


def test_subcommands_of_groups_take_them_too() -> None:
    result = _invoke("kareus", "plan", "--help")
    assert (
        result.exit_code == 0
        and "--backend NAME" in result.stdout
        and "-v, --verbose" in result.stdout
    )


def test_options_after_measure_s_command_stay_the_command_s(tmp_path: Path) -> None:
    code = "import json, sys; print(json.dumps(sys.argv[1:]), file=sys.stderr)"
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "powerlib",
            "measure",
            "--json",
            "--",
            sys.executable,
            "-c",
            code,
            "-v",
            "--backend",
            "x",
        ],  # fmt: skip
        env=_sim_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    assert '["-v", "--backend", "x"]' in run.stderr
    assert json.loads(run.stdout)["exit_status"] == 0


# --- 2. plan: the file first, P_block and τ from the profile -------------------------------------


def test_plan_names_a_missing_profile_before_asking_for_options(tmp_path: Path) -> None:
    missing = tmp_path / "nope.csv"
    result = _invoke("plan", str(missing))
    assert result.exit_code == 7
    assert result.stderr.splitlines() == [
        f"powerlib: error: {missing}: cannot read the profile: No such file or directory"
    ]


def test_plan_needs_p_block_only_when_the_profile_lacks_it(tmp_path: Path) -> None:
    bare = tmp_path / "bare.csv"
    bare.write_text("\n".join([HEADER, *_small_profile_lines()]) + "\n")
    result = _invoke("plan", str(bare), "--stages", "2", "--microbatches", "4")
    assert result.exit_code == 2
    error = result.stderr.splitlines()[-1]
    assert error == (
        f"Error: {bare} does not carry the blocking power: give --p-block-w "
        "(A100: 83.64, A40: 70.38)"
    )
    given = _invoke("plan", str(bare), "--stages", "2", "--microbatches", "4", "--p-block-w", "60")
    assert given.exit_code == 0, given.output


def _summary(*args: str) -> dict:
    result = _invoke("plan", *args, "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    data.pop("solve_time_s", None)
    return data


def test_plan_reads_p_block_and_unit_time_from_the_profile(tmp_path: Path) -> None:
    rows = Profile.read(GPT3_A100).rows
    for name, tau in (("carried.csv", 0.002), ("carried.json", 0.002)):
        path = tmp_path / name
        profile = Profile(rows, p_block_w=83.64, unit_time_s=tau)
        (profile.write_csv if name.endswith(".csv") else profile.write_json)(path)
        mb = ("--stages", "8", "--microbatches", "12")
        explicit = _summary(str(GPT3_A100), *mb, "--p-block-w", "83.64", "--unit-time-s", str(tau))
        assert _summary(str(path), *mb) == explicit
        # a 1 ms quantum gives a different frontier: the 2 ms above came from the file
        assert _summary(str(path), *mb, "--unit-time-s", "0.001") != explicit
        # options override the profile
        assert _summary(str(path), *mb, "--p-block-w", "70") != explicit
        text = _invoke("plan", str(path), *mb)
        assert text.exit_code == 0, text.output
        assert text.stdout.splitlines()[0] == (
            "planned with P_block 83.64 W (the profile's) and τ 0.002 s (the profile's)"
        )


def test_plan_defaults_the_quantum(tmp_path: Path) -> None:
    # the Perseus artifact's τ for its A100 GPT-3 profile (instructions of 50 ms and more)
    assert default_unit_time_s(Profile.read(GPT3_A100)) == 0.001
    mb = ("--stages", "8", "--microbatches", "12", "--p-block-w", "83.64")
    assert _summary(str(GPT3_A100), *mb) == _summary(str(GPT3_A100), *mb, "--unit-time-s", "0.001")
    text = _invoke("plan", str(GPT3_A100), *mb)
    assert text.stdout.splitlines()[0] == (
        "planned with P_block 83.64 W (given) and τ 0.001 s "
        "(default: a power of ten at most 1/20 of the shortest instruction)"
    )
    # 10 ms instructions: 1/20 is 0.5 ms, so 0.1 ms
    small = Profile.from_csv_text("\n".join([HEADER, *_small_profile_lines()]))
    assert default_unit_time_s(small) == pytest.approx(1e-4)


def test_plan_profile_without_p_block_is_one_plan_error() -> None:
    small = Profile.from_csv_text("\n".join([HEADER, *_small_profile_lines()]), source="s.csv")
    request = PlanRequest(num_stages=2, num_microbatches=4, policy="fastest")
    with pytest.raises(PlanError, match=r"^s.csv: the profile does not carry the blocking power"):
        plan_profile(small, request)
    carried = Profile(small.rows, source="s.csv", p_block_w=60.0)
    result = plan_profile(carried, request)
    assert (result.p_block_w, result.unit_time_s) == (60.0, pytest.approx(1e-4))
    assert (result.p_block_source, result.unit_time_source) == ("profile", "default")
    assert result.frontier.settings.p_block_w == 60.0


# --- 3. help shows bounds, never None (nor a literal \b) -----------------------------------------


def _all_command_paths(group: click.Group, ctx: click.Context, path: tuple[str, ...] = ()):
    for name in group.list_commands(ctx):
        cmd = group.get_command(ctx, name)
        assert cmd is not None, name
        yield (*path, name)
        if isinstance(cmd, click.Group):
            yield from _all_command_paths(cmd, ctx, (*path, name))


def test_no_help_shows_a_none_bound() -> None:
    paths = [(), *_all_command_paths(cli, click.Context(cli))]
    assert ("plan",) in paths and ("kareus", "plan") in paths and ("measure",) in paths
    for path in paths:
        result = _invoke(*path, "--help")
        assert result.exit_code == 0, (path, result.output)
        assert "None]" not in result.stdout and "None;" not in result.stdout, (path, result.stdout)
        # click keeps example lines as written after a backspace line; a raw r"\b" shows up
        assert "\\b" not in result.stdout, (path, result.stdout)
    plan_help = _invoke("plan", "--help").stdout
    assert "[x>=0]" in plan_help and "[x>0]" in plan_help  # --p-block-w, --unit-time-s


# --- 4. Ctrl-C ends watch quietly ----------------------------------------------------------------


def _sigint_default() -> None:
    # A test runner started in the background ignores SIGINT, and children inherit that: give the
    # child the default, so that Python turns SIGINT into KeyboardInterrupt as in a terminal.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.parametrize("as_json", [True, False])
def test_ctrl_c_ends_watch_quietly_with_status_0(tmp_path: Path, as_json: bool) -> None:
    argv = [sys.executable, "-m", "powerlib", "watch", "--interval-s", "0.05"]
    proc = subprocess.Popen(
        [*argv, *(["--json"] if as_json else [])],
        env=_sim_env(tmp_path),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=_sigint_default,
    )
    try:
        assert proc.stdout is not None
        first = proc.stdout.readline()  # it is watching
        assert (json.loads(first)["sample"] == 0) if as_json else first.startswith("TIME"), first
        proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0 and stderr == ""


# --- 5. measure --json: stdout holds one JSON document -------------------------------------------


def test_measure_json_sends_the_command_s_stdout_to_stderr(tmp_path: Path) -> None:
    code = "print('hello from the job'); print('{not json')"
    run = subprocess.run(
        [sys.executable, "-m", "powerlib", "measure", "--json", "--", sys.executable, "-c", code],
        env=_sim_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    doc = json.loads(run.stdout)  # the whole of stdout: one document
    assert doc["exit_status"] == 0 and doc["schema"] == "powerlib.measurement/1"
    assert "hello from the job\n{not json\n" in run.stderr
    assert "the command's own stdout goes to stderr" in " ".join(
        _invoke("measure", "--help").stdout.split()
    )


# --- 6. a bad profile row: file, line, column ----------------------------------------------------


@pytest.mark.parametrize("suffix", [".csv", ".json"])
def test_a_zero_time_row_is_named_by_file_line_and_column(tmp_path: Path, suffix: str) -> None:
    lines = [HEADER, *_small_profile_lines()]
    lines[4] = "0,backward,1200,0.0,4.0"  # line 5 of the file, rows[3] of its JSON form
    path = tmp_path / f"zero{suffix}"
    if suffix == ".csv":
        path.write_text("\n".join(lines) + "\n")
        where = "line 5: column time"
    else:
        data = Profile.from_csv_text("\n".join([HEADER, *_small_profile_lines()])).to_json()
        data["rows"][3]["time_s"] = 0.0
        path.write_text(json.dumps(data))
        where = "rows[3]: time_s"
    result = _invoke("plan", str(path), "--stages", "2", "--microbatches", "4", "--p-block-w", "60")
    assert result.exit_code == 7
    assert result.stderr.splitlines() == [
        f"powerlib: error: {path}: {where} must be > 0, got 0.0 s"
    ]


def test_plot_without_matplotlib_is_refused_before_any_work(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A new user's first `plan --plot` on the minimal install: refused first, nothing written."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "matplotlib" else real(name, *a),
    )
    plan_out = tmp_path / "plan.json"
    result = CliRunner().invoke(
        cli,
        ["plan", str(GPT3_A100), "--stages", "8", "--microbatches", "4", "--p-block-w", "83.64",
         "--plan-out", str(plan_out), "--plot", str(tmp_path / "f.png")],
    )  # fmt: skip
    assert result.exit_code == 2
    assert "--plot needs matplotlib: pip install 'powerlib[plot]'" in result.output
    assert not plan_out.exists()
