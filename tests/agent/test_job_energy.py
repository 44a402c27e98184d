"""A Slurm job's GPU energy (issue 47 item 2): ``powerlib job-energy begin`` / ``end`` on simulated
GPUs whose counters run on the wall clock, a fake ``scontrol``, dcgm-exporter's mapping files,
and what another uid plants on the way (the suite runs as root; attackers are forked children)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner, Result
from uid_helpers import NOBODY, NOGROUP, as_uid

from powerlib.agent.job_energy import merge_admin_comment, parse_admin_comment
from powerlib.backends.simulated import SimulatedBackend
from powerlib.cli import cli
from powerlib.config import Settings

REPO = Path(__file__).resolve().parents[2]
SHOW_JOB = """JobId={job} JobName=train
   UserId=alice(1000) GroupId=alice(1000) MCS_label=N/A
   WorkDir=/home/alice
   AdminComment=site=abc queue=gpu{extra} 
   Comment=mine 
"""  # noqa: W291 - Slurm ends the comment lines with a space


@pytest.fixture
def node(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Four simulated GPUs on the wall clock, their state in the test's state folder."""
    monkeypatch.setenv("POWERLIB_BACKEND", "simulated")
    monkeypatch.setenv("POWERLIB_SIM_GPUS", "4")
    monkeypatch.setenv("POWERLIB_SIM_ENERGY_PERIOD_S", "0.01")  # the counter moves within a test
    return tmp_path / "state"


@pytest.fixture
def scontrol(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fake scontrol and sacctmgr (one script): appends its argv (one per line, then ``--``)
    to ``calls``; ``show job`` prints a job with an AdminComment (plus ``$EXTRA``), ``modify``
    what sacctmgr says when it changed a job (``$NOTHING``: when it found none); exits
    ``$FAIL`` (default 0)."""
    calls = tmp_path / "calls"
    script = tmp_path / "slurm"
    show = SHOW_JOB.replace("{job}", "$3").replace("{extra}", "$EXTRA")
    script.write_text(
        "#!/bin/sh\n"
        f'for a in "$@"; do printf "%s\\n" "$a"; done >>{calls}; echo -- >>{calls}\n'
        f'[ -n "$FAIL" ] && {{ echo "slurm_update error: Access/permission denied" >&2; '
        'exit "$FAIL"; }\n'
        f'[ "$1" = show ] && cat <<EOF\n{show}EOF\n'
        '[ "$2" = modify ] && [ -n "$NOTHING" ] && echo " Nothing modified"\n'
        '[ "$2" = modify ] && [ -z "$NOTHING" ] && printf " Modified jobs...\\n  1 submitted\\n"\n'
        "exit 0\n"
    )
    script.chmod(0o755)
    monkeypatch.setenv("POWERLIB_SCONTROL", str(script))
    monkeypatch.setenv("POWERLIB_SACCTMGR", str(script))
    return calls


def _calls(path: Path) -> list[list[str]]:
    if not path.exists():
        return []
    out, cur = [], []
    for line in path.read_text().splitlines():
        if line == "--":
            out.append(cur)
            cur = []
        else:
            cur.append(line)
    return out


def _run(*args: str) -> Result:
    return CliRunner().invoke(cli, ["job-energy", *args])


def _counters(state: Path, gpus: int = 4) -> list[float]:
    """The simulated counters, read independently of powerlib job-energy."""
    settings = Settings(
        backend="simulated", sim_gpus=gpus, state_dir=state, sim_energy_period_s=0.01
    )
    with SimulatedBackend(settings) as backend:
        return [float(d.read_state().energy_j or 0.0) for d in backend.devices()]


def test_end_reports_each_gpus_counter_delta_and_keeps_the_admin_comment(
    node: Path, scontrol: Path
) -> None:
    before_begin = _counters(node)
    begun = _run("begin", "--job", "301", "--slurm-gpus", "1,2", "--uid", "1000", "--json")
    assert begun.exit_code == 0, begun.output
    after_begin = _counters(node)
    record = json.loads((node / "jobs" / "301.json").read_text())
    st = (node / "jobs" / "301.json").stat()
    assert (st.st_uid, st.st_mode & 0o777) == (0, 0o600)
    assert (node / "jobs").stat().st_mode & 0o777 == 0o700
    assert [g["index"] for g in record["gpus"]] == [1, 2] and record["uid"] == 1000
    time.sleep(0.2)
    before_end = _counters(node)
    ended = _run("end", "--job", "301", "--sacct", "--json")
    after_end = _counters(node)
    assert ended.exit_code == 0, ended.output
    result = json.loads(ended.stdout)
    for gpu, i in zip(result["gpus"], (1, 2), strict=True):
        assert gpu["index"] == i
        assert before_end[i] - after_begin[i] <= gpu["energy_j"] <= after_end[i] - before_begin[i]
        assert gpu["energy_j"] > 0  # idle GPUs draw tens of watts
    assert result["energy_j"] == pytest.approx(sum(g["energy_j"] for g in result["gpus"]))
    assert result["duration_s"] > 0
    assert not (node / "jobs" / "301.json").exists()
    show, update = _calls(scontrol)
    assert show == ["show", "job", "301"]
    assert update == [  # sacctmgr: scontrol update refuses a completing job (docs/cluster.md)
        "-i",
        "modify",
        "job",
        "where",
        "jobid=301",
        "set",
        f"AdminComment=site=abc queue=gpu powerlib_gpu_energy_j={result['energy_j']:.1f}",
    ]
    assert result["admin_comment"] == update[-1].removeprefix("AdminComment=")


def test_mapping_files_for_jobs_sharing_a_gpu_and_jobs_on_other_gpus(
    node: Path, tmp_path: Path
) -> None:
    folder = tmp_path / "dcgm-job-map"
    for job, minors in (("101", "1"), ("102", "1,2"), ("103", "0"), ("104", "3")):
        done = _run("begin", "--job", job, "--slurm-gpus", minors, "--mapping-dir", str(folder))
        assert done.exit_code == 0, done.output
    files = {p.name: p.read_text() for p in folder.iterdir()}
    assert files == {"0": "103\n", "1": "101\n102\n", "2": "102\n", "3": "104\n"}
    st = folder.stat()
    assert (st.st_uid, st.st_mode & 0o777) == (0, 0o755)
    assert all(p.stat().st_mode & 0o777 == 0o644 for p in folder.iterdir())
    assert _run("end", "--job", "101", "--mapping-dir", str(folder)).exit_code == 0
    assert {p.name: p.read_text() for p in folder.iterdir()} == {
        "0": "103\n",
        "1": "102\n",
        "2": "102\n",
        "3": "104\n",
    }
    for job in ("102", "103"):
        assert _run("end", "--job", job, "--mapping-dir", str(folder)).exit_code == 0
    assert {p.name: p.read_text() for p in folder.iterdir()} == {"3": "104\n"}
    # the two jobs on different GPUs each got their own GPU's energy
    last = _run("end", "--job", "104", "--mapping-dir", str(folder), "--json")
    assert [g["index"] for g in json.loads(last.stdout)["gpus"]] == [3]
    assert list(folder.iterdir()) == []


def test_a_gpu_gone_is_unknown_never_a_number(
    node: Path, scontrol: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert _run("begin", "--job", "401", "--gpus", "0,3").exit_code == 0
    time.sleep(0.2)
    monkeypatch.setenv("POWERLIB_SIM_GPUS", "2")  # GPU 3 is gone by the epilog
    ended = _run("end", "--job", "401", "--sacct", "--json")
    assert ended.exit_code == 0, ended.output
    result = json.loads(ended.stdout)
    assert result["gpus"][0]["energy_j"] > 0
    assert result["gpus"][1]["energy_j"] is None
    assert result["gpus"][1]["unknown_reason"] == "the GPU is gone"
    assert result["energy_j"] is None
    assert (
        _calls(scontrol)[1][-1] == "AdminComment=site=abc queue=gpu powerlib_gpu_energy_j=unknown"
    )


def test_a_missing_record_is_a_line_and_exit_0(node: Path, scontrol: Path) -> None:
    ended = _run("end", "--job", "999", "--sacct")
    assert ended.exit_code == 0
    assert "job 999: no job-energy record on this node" in ended.output
    assert _calls(scontrol) == []  # nothing is written to Slurm


def test_slurm_unreachable_is_a_warning_and_the_record_still_goes(
    node: Path, scontrol: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert _run("begin", "--job", "501", "--gpus", "0").exit_code == 0
    monkeypatch.setenv("FAIL", "1")
    ended = _run("end", "--job", "501", "--sacct")
    assert ended.exit_code == 0, ended.output
    assert "warning: job 501: energy not written to Slurm: " in ended.output
    assert "Access/permission denied" in ended.output
    assert not (node / "jobs" / "501.json").exists()


def test_a_job_the_accounting_database_does_not_hold_is_a_warning(
    node: Path, scontrol: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """sacctmgr exits 0 when no job matched: " Nothing modified" must not read as written."""
    assert _run("begin", "--job", "502", "--gpus", "0").exit_code == 0
    monkeypatch.setenv("NOTHING", "1")
    ended = _run("end", "--job", "502", "--sacct", "--json")
    assert ended.exit_code == 0, ended.output
    assert "warning: job 502: energy not written to Slurm: sacctmgr modify job 502: Nothing" in (
        ended.stderr
    )
    assert json.loads(ended.stdout)["admin_comment"] is None


def test_the_admin_comment_keeps_everything_but_powerlibs_key() -> None:
    shown = SHOW_JOB.format(job=7, extra=" powerlib_gpu_energy_j=5.0 note=x")
    existing = parse_admin_comment(shown)
    assert existing == "site=abc queue=gpu powerlib_gpu_energy_j=5.0 note=x"
    merged = merge_admin_comment(existing, 1234.56)
    assert merged == "site=abc queue=gpu note=x powerlib_gpu_energy_j=1234.6"
    assert parse_admin_comment("JobId=7 JobName=x\n   WorkDir=/\n") == ""
    assert merge_admin_comment("", None) == "powerlib_gpu_energy_j=unknown"


def test_a_non_root_caller_is_refused(node: Path) -> None:
    def attempt() -> tuple[int, str]:
        done = _run("begin", "--job", "601", "--gpus", "0")
        return done.exit_code, done.output

    code, output = as_uid(NOBODY, attempt)["value"]
    assert code == 4 and "runs as root (a Slurm prolog)" in output
    assert not (node / "jobs").exists()


def test_bad_job_ids_are_refused(node: Path) -> None:
    for job in ("../x", "1.json", "12 3", "", "a1"):
        assert _run("begin", "--job", job, "--gpus", "0").exit_code == 7
    assert _run("begin", "--job", "123_4", "--gpus", "0").exit_code == 0  # an array task
    assert (node / "jobs" / "123_4.json").exists()


def test_a_link_planted_at_the_record_path_is_refused(node: Path, tmp_path: Path) -> None:
    assert _run("begin", "--job", "700", "--gpus", "0").exit_code == 0  # makes jobs/
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    link = node / "jobs" / "701.json"
    os.symlink(victim, link)
    os.lchown(link, NOBODY, NOGROUP)
    begun = _run("begin", "--job", "701", "--gpus", "0")
    assert begun.exit_code == 12 and "it is a symlink" in begun.output
    ended = _run("end", "--job", "701")
    assert ended.exit_code == 12 and "it is a symlink" in ended.output
    assert victim.read_text() == "precious\n" and link.is_symlink()


def test_a_mapping_folder_another_uid_planted_is_refused(
    node: Path, shared: Path, tmp_path: Path
) -> None:
    victim = tmp_path / "victim"
    victim.mkdir()
    planted = shared / "map"
    assert as_uid(NOBODY, lambda: os.symlink(victim, planted))["ok"]
    begun = _run("begin", "--job", "801", "--gpus", "0", "--mapping-dir", str(planted))
    assert begun.exit_code == 12 and "symlink" in begun.output, begun.output
    assert list(victim.iterdir()) == []
    assert not (node / "jobs" / "801.json").exists()  # nothing written when refused
    theirs = shared / "theirs"
    assert as_uid(NOBODY, lambda: os.mkdir(theirs, 0o755))["ok"]
    begun = _run("begin", "--job", "802", "--gpus", "0", "--mapping-dir", str(theirs))
    assert begun.exit_code == 12 and "not owned by uid 0" in begun.output, begun.output
    assert list(theirs.iterdir()) == []


def test_the_contrib_prolog_and_epilog_record_the_jobs_energy(
    node: Path, scontrol: Path, tmp_path: Path
) -> None:
    """contrib/slurm/prolog.sh and epilog.sh as written: the grant and the energy record, then
    the energy in the AdminComment and the mapping line gone; the epilog exits 0."""
    wrapper = tmp_path / "powerlib.sh"
    wrapper.write_text(f'#!/bin/sh\nexec {sys.executable} -m powerlib "$@"\n')
    wrapper.chmod(0o755)
    folder = tmp_path / "dcgm-job-map"
    log = tmp_path / "powerlib.log"
    env = {
        **os.environ,
        "POWERLIB": str(wrapper),
        "POWERLIB_LOG": str(log),
        "POWERLIB_AGENT_SOCKET": str(tmp_path / "no-agent.sock"),
        "POWERLIB_DCGM_JOB_MAP_DIR": str(folder),
        "SLURM_JOB_ID": "901",
        "SLURM_JOB_UID": str(NOBODY),
        "SLURM_JOB_GPUS": "2",
    }
    prolog = subprocess.run(["sh", str(REPO / "contrib/slurm/prolog.sh")], env=env,
                            capture_output=True, text=True, timeout=120)  # fmt: skip
    assert prolog.returncode == 0, prolog.stderr + log.read_text()
    assert (folder / "2").read_text() == "901\n"
    assert json.loads((node / "grants" / "job-901.json").read_text())["uid"] == NOBODY
    assert (node / "jobs" / "901.json").exists()
    epilog = subprocess.run(["sh", str(REPO / "contrib/slurm/epilog.sh")], env=env,
                            capture_output=True, text=True, timeout=120)  # fmt: skip
    assert epilog.returncode == 0, epilog.stderr + log.read_text()
    assert not (folder / "2").exists() and not (node / "jobs" / "901.json").exists()
    update = _calls(scontrol)[1]
    assert update[:6] == ["-i", "modify", "job", "where", "jobid=901", "set"]
    assert update[-1].startswith("AdminComment=site=abc queue=gpu powerlib_gpu_energy_j=")
    value = float(update[-1].rsplit("=", 1)[1])
    assert value > 0
    assert f'"admin_comment": "{update[-1].removeprefix("AdminComment=")}"' in log.read_text()
