"""A user's own 2-rank CPU pipeline on the simulated backend, under default powerlib settings.

Issue 44 ("Done when", second point): a new user wrote a 2-rank gloo
``torch.distributed.pipelining`` script from docs/torch.md (``Schedule1F1B``, one stage per
rank, as ``examples/torch_pipeline.py``) and ran it on simulated GPUs. This benchmark runs such a
job and records what powerlib told that user::

    python3 benchmarks/cpu_pipeline.py --case default
    python3 benchmarks/cpu_pipeline.py --case all-max --out benchmarks/results/cpu_pipeline.json
    python3 benchmarks/cpu_pipeline.py --case default --time-follows-clock

Each case is one ``torchrun --standalone --nproc-per-node 2`` job (run by this interpreter,
``python -m torch.distributed.run``), in a fresh temporary folder: ``POWERLIB_BACKEND=simulated``,
``POWERLIB_SIM_GPUS=2``, ``POWERLIB_STATE_DIR`` and the session's ``powerlib-out`` there. Every
rank runs ``torch.set_num_threads(1)``; its stage is ``Linear(H, H) -> GELU -> Linear(H, H)``
on microbatches of ``--microbatch-size`` rows, sized (H = 2048, 168 rows) so that with both ranks
running on a 2-core box a forward takes about 40-50 ms and a backward 70-90 ms (the profile's
figures at the top clock are in the results; the first stage's backward has no input gradient).

Cases:

* ``default``: ``powerlib.optimize(num_stages=2, num_microbatches=M)`` and nothing else;
* ``all-max``: the same session told to apply a saved plan (``mode="apply"``,
  ``plan_path=``; docs/runtime.md) whose every instruction runs at the device's maximum clock:
  a plan identical to all-max, which should measure a saving of 0 within its interval (a saved
  plan comes without a profile, so only the interleaved windows measure it, unless ``--profile``
  gives one, or the ``default`` case ran first in the same call: its ``profile.csv``, copied to
  ``cpu_pipeline_profile.csv`` beside ``--out``, is then the saved plan's profile
  (``profile_path``) and the closed loop measures the plan paired).

``--time-follows-clock 0|1`` sets ``POWERLIB_SIM_TIME_FOLLOWS_CLOCK`` for the job (unset: the
default, 1 since issue 44). The job trains until the session leaves the check phase (its verdict arrived, or it
stopped managing the device), for at most ``--iterations`` iterations or ``--max-minutes``
minutes; the ranks agree on stopping in one tiny all-reduce per iteration.

Writes (merges, one key per case) ``--out``: per case rank 0's ``session.report().to_json()``
taken after the loop, ``summary.json`` if the session wrote one, the job's wall time, the
iterations run and their mean time, the phase reached, why the loop stopped, the profile's
instruction times at the top clock, the powerlib that ran (its path and version), the 1-minute
load average before and after (the box is shared: instruction times follow it), and the log lines
powerlib printed (stderr lines that are, or whose warning message is, ``powerlib: ...``).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "benchmarks" / "results" / "cpu_pipeline.json"
CASES = ("default", "all-max")
LOG_LINE = re.compile(r"(?:^|Warning: )(powerlib: .*)$")
"""A powerlib log line: printed as is, or as a warning's message (``...Warning: powerlib: ...``)."""


# -- the job, on each rank -----------------------------------------------------------------------


def _all_max_plan(path: Path, num_stages: int, num_microbatches: int) -> float:
    """Write a ``1f1b`` plan whose every instruction runs at the device's top clock; return it."""
    from powerlib.planning.plan import PLAN_SCHEMA
    from powerlib.planning.schedules import build_schedule
    from powerlib.registry import open_backend

    backend = open_backend()
    try:
        top_mhz = max(backend.devices()[0].info.supported_sm_freqs_mhz)
    finally:
        backend.close()
    stages = [
        {
            "stage": s,
            "instructions": [
                {"kind": i.kind, "microbatch": i.microbatch, "chunk": i.chunk, "freq_mhz": top_mhz}
                for i in order
            ],
        }
        for s, order in enumerate(build_schedule("1f1b", num_stages, num_microbatches))
    ]
    workload = {"num_stages": num_stages, "num_microbatches": num_microbatches, "schedule": "1f1b"}
    plan = {"schema": PLAN_SCHEMA, "workload": workload, "policy": "all-max", "stages": stages}
    path.write_text(json.dumps(plan, indent=1) + "\n", encoding="utf-8")
    return float(top_mhz)


def _profile_times(out_dir: Path) -> dict[str, float]:
    """Instruction time (ms) per stage and kind at the profile's top clock (``profile.csv``)."""
    path = out_dir / "profile.csv"
    if not path.is_file():
        return {}
    with path.open(newline="", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))  # stage,instruction,frequency,time,energy (seconds)
    if not rows:
        return {}
    top = max(float(r["frequency"]) for r in rows)
    return {
        f"stage {r['stage']} {r['instruction']}": round(1e3 * float(r["time"]), 2)
        for r in rows
        if float(r["frequency"]) == top
    }


def _train(args: argparse.Namespace, session: Any, schedule: Any, opt: Any) -> dict[str, Any]:
    """Train until the check is over, ``--iterations`` or ``--max-minutes``; every rank agrees."""
    import torch
    import torch.distributed as dist

    from powerlib.runtime import SessionPhase

    rank, world = dist.get_rank(), dist.get_world_size()
    waiting = (SessionPhase.NOT_STARTED, SessionPhase.PROFILE, SessionPhase.AWAITING_PLAN)
    rows = args.microbatch_size * args.microbatches
    start_s, iterations, stop = time.perf_counter(), 0, ""
    while not stop:
        x, y = torch.randn(rows, args.hidden), torch.randn(rows, args.hidden)
        if rank == 0:
            schedule.step(x)
        elif rank == world - 1:
            schedule.step(target=y, losses=[])
        else:
            schedule.step()
        opt.step()
        opt.zero_grad()
        iterations += 1
        phase = session.phase
        local = ""
        if phase not in waiting and phase is not SessionPhase.CHECK:
            local = f"phase {phase}"  # the verdict arrived, or the session stopped managing
        elif iterations >= args.iterations:
            local = "iterations"
        elif time.perf_counter() - start_s > 60 * args.max_minutes:
            local = "max-minutes"
        flag = torch.tensor([1.0 if local else 0.0])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        stop = (local or "another rank") if flag.item() else ""
    wall_s = time.perf_counter() - start_s
    return {
        "iterations": iterations,
        "train_wall_s": round(wall_s, 3),
        "mean_iteration_s": round(wall_s / iterations, 4),
        "phase": str(session.phase),
        "stopped_by": stop,
        "report": session.report().to_json(),
    }


def worker(args: argparse.Namespace) -> None:
    """One rank of the job (under torchrun): build the stage, run the session, report on rank 0."""
    import torch
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    import powerlib
    from powerlib.integrations.torch_distributed import attach_pipeline

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(rank)
    work = Path(args.workdir)
    keywords: dict[str, Any] = {}
    if args.case == "all-max":
        plan_path = work / "all-max-plan.json"
        if rank == 0:
            _all_max_plan(plan_path, world, args.microbatches)
        dist.barrier()
        keywords = {"mode": "apply", "plan_path": plan_path}
        if args.profile is not None:
            keywords["profile_path"] = args.profile
    block = torch.nn.Sequential(
        torch.nn.Linear(args.hidden, args.hidden),
        torch.nn.GELU(),
        torch.nn.Linear(args.hidden, args.hidden),
    )
    stage = PipelineStage(block, rank, world, torch.device("cpu"))
    schedule = Schedule1F1B(
        stage, n_microbatches=args.microbatches, loss_fn=torch.nn.functional.mse_loss
    )
    opt = torch.optim.AdamW(block.parameters(), lr=1e-4)
    with (
        powerlib.optimize(
            num_stages=world, num_microbatches=args.microbatches, **keywords
        ) as session,
        attach_pipeline(session, schedule),
    ):
        result = _train(args, session, schedule, opt)
    if rank == 0:
        result["report_after_exit"] = session.report().to_json()
        result["profile_ms_at_top_clock"] = _profile_times(work / "powerlib-out")
        Path(args.result).write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    dist.destroy_process_group()


# -- the driver: one torchrun job per case --------------------------------------------------------


def _log_lines(stderr: str) -> list[str]:
    """The lines powerlib printed: ``powerlib: ...`` as is, or as a warning's message."""
    return [m.group(1) for line in stderr.splitlines() if (m := LOG_LINE.search(line.strip()))]


def _job_env(state_dir: Path, time_follows_clock: str | None) -> dict[str, str]:
    """The job's environment: simulated backend, 2 GPUs, its own state folder."""
    env = dict(os.environ)
    for name in [n for n in env if n.startswith("POWERLIB_")]:
        del env[name]  # the user's defaults, not whatever this shell carries
    env.update(
        POWERLIB_BACKEND="simulated",
        POWERLIB_SIM_GPUS="2",
        POWERLIB_STATE_DIR=str(state_dir),
        OMP_NUM_THREADS="1",
        PYTHONWARNINGS="default",
    )
    if time_follows_clock is not None:
        env["POWERLIB_SIM_TIME_FOLLOWS_CLOCK"] = time_follows_clock
    return env


def _powerlib_used(env: dict[str, str], cwd: Path) -> dict[str, str]:
    """Which powerlib this interpreter imports in the job's folder (path and version)."""
    code = "import powerlib; print(powerlib.__file__); print(getattr(powerlib, '__version__', ''))"
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=cwd, capture_output=True, text=True, check=True
    ).stdout.split("\n")
    return {"path": out[0], "version": out[1]}


def run_case(args: argparse.Namespace, case: str) -> dict[str, Any]:
    """Run one case as a 2-rank torchrun job in a temporary folder; return its record."""
    with tempfile.TemporaryDirectory(prefix=f"cpu_pipeline-{case}-") as tmp:
        work = Path(tmp)
        (work / "state").mkdir()
        env = _job_env(work / "state", args.time_follows_clock)
        result_path = work / "rank0.json"
        command = [
            sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
            str(Path(__file__).resolve()), "--worker", "--case", case,
            "--workdir", str(work), "--result", str(result_path),
            "--iterations", str(args.iterations), "--max-minutes", str(args.max_minutes),
            "--microbatches", str(args.microbatches), "--hidden", str(args.hidden),
            "--microbatch-size", str(args.microbatch_size),
        ]  # fmt: skip
        if args.profile is not None:
            command += ["--profile", str(Path(args.profile).resolve())]
        load_before = os.getloadavg()
        start_s = time.perf_counter()
        proc = subprocess.Popen(
            command, cwd=work, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True, start_new_session=True,
        )  # fmt: skip
        try:
            stdout, stderr = proc.communicate(timeout=60 * args.max_minutes + 120)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the job this call started, and its ranks
            stdout, stderr = proc.communicate()
        wall_s = time.perf_counter() - start_s
        summary = work / "powerlib-out" / "summary.json"
        record: dict[str, Any] = {
            "case": case,
            "time_follows_clock": args.time_follows_clock,
            "powerlib": _powerlib_used(env, work),
            "returncode": proc.returncode,
            "wall_s": round(wall_s, 1),
            "loadavg_1min_before_after": [round(load_before[0], 2), round(os.getloadavg()[0], 2)],
            "log": _log_lines(stderr),
            "summary": json.loads(summary.read_text()) if summary.is_file() else None,
        }
        profile = work / "powerlib-out" / "profile.csv"
        if case == "default" and profile.is_file() and args.profile is None:
            kept = args.out.parent / "cpu_pipeline_profile.csv"
            kept.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(profile, kept)
            args.profile = kept  # the all-max case that follows is measured against it
        record["profile_path"] = None if args.profile is None else str(args.profile)
        if result_path.is_file():
            record.update(json.loads(result_path.read_text()))
        else:
            record["stderr_tail"] = stderr.splitlines()[-30:] + stdout.splitlines()[-10:]
        return record


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--case", action="append", choices=CASES, help="repeatable; default: default")
    p.add_argument(
        "--time-follows-clock",
        choices=("0", "1"),
        help="POWERLIB_SIM_TIME_FOLLOWS_CLOCK for the job (unset: the default, 1)",
    )
    p.add_argument("--iterations", type=int, default=1000, help="at most this many iterations")
    p.add_argument("--profile", type=Path, help="all-max: the saved plan's profile (profile_path)")
    p.add_argument("--max-minutes", type=float, default=15.0, help="a hard bound per case")
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--hidden", type=int, default=2048, help="the Linear layers' width")
    p.add_argument("--microbatch-size", type=int, default=168, help="rows per microbatch")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON file, merged per case")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--workdir", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    """Run the chosen cases one after another, merging each into ``--out``."""
    args = _parser().parse_args(argv)
    if args.worker:
        args.case = args.case[0]
        worker(args)
        return 0
    for case in args.case or ["default"]:
        record = run_case(args, case)
        record["machine"] = {"cpus": os.cpu_count(), "python": platform.python_version()}
        key = case + (
            ""
            if args.time_follows_clock is None
            else f"+time-follows-clock={args.time_follows_clock}"
        )
        results = json.loads(args.out.read_text()) if args.out.is_file() else {}
        results[key] = record
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=1) + "\n", encoding="utf-8")
        realized = (record.get("report") or {}).get("realized")
        print(
            f"{key}: {record.get('iterations')} iterations in {record['wall_s']} s, phase "
            f"{record.get('phase')}, realized {json.dumps(realized)}",
            flush=True,
        )
        for line in record["log"]:
            print(f"  {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
