"""A real one-node Slurm (the distribution's 22.05 daemons) in a temporary folder, for tests.

munged (its own key and socket), MariaDB (a fresh data folder on a 127.0.0.1 port), slurmdbd,
slurmctld and slurmd, all as root in the foreground, children of the test process, with free
ports and every file under one folder: nothing of the system's /etc/slurm or /run/munge is used.
The node has simulated GPUs served by a ``powerlib agent`` of its own; slurm.conf's Prolog and
Epilog are wrappers that set the node's powerlib environment and run contrib/slurm's scripts.

Slurm wants a GPU's ``File=`` to be a character device: the folder holds ``nvidia<N>`` made with
mknod (major 195, as NVIDIA's), listed in minor order, so Slurm's GPU index, the minor number and
the simulated GPU's index (its ``minor_number``) are one number.

Jobs run as other uids, which cannot enter /root where this interpreter may live: when ``nobody``
cannot run it, the jobs use the system's python3 of the same version, with a copy of psutil (the
one dependency a client of the agent imports) in the folder.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import pwd
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CONTRIB = ROOT / "contrib" / "slurm"
DAEMONS = ("munged", "mariadbd", "mariadb-install-db", "slurmdbd", "slurmctld", "slurmd")
CLIENTS = ("mariadb", "sbatch", "scancel", "squeue", "sinfo", "sacct", "sacctmgr")
GPUS = 3
NOBODY = 65534


def missing_tools() -> list[str]:
    """The Slurm, munge and MariaDB programs this machine lacks."""
    return [t for t in DAEMONS + CLIENTS if shutil.which(t) is None]


def free_ports(count: int) -> list[int]:
    """``count`` distinct TCP ports free on 127.0.0.1 now."""
    socks = []
    try:
        for _ in range(count):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def wait_for(predicate: Callable[[], bool], what: str, timeout_s: float = 30.0) -> None:
    """Poll ``predicate`` until true; an AssertionError naming ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    if not predicate():
        raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}")


_FINDER = '''"""Imports the checkout's powerlib (written by tests/slurm)."""
import importlib.util
import sys

PACKAGES = {packages!r}


class _Finder:
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        where = PACKAGES.get(name)
        if where is None:
            return None
        return importlib.util.spec_from_file_location(
            name, where + "/__init__.py", submodule_search_locations=[where]
        )


sys.meta_path.insert(0, _Finder)
'''

_LAUNCHER = """#!{python}
import runpy, sys
sys.path.insert(0, {site!r})
import powerlib_checkout
sys.argv[0] = "powerlib"
runpy.run_module("powerlib", run_name="__main__", alter_sys=True)
"""

_WRAPPER = """#!/bin/sh
# The node's powerlib environment, then contrib/slurm's {name}; the times bracket it.
{exports}
echo "$SLURM_JOB_ID {tag} start $(date +%s.%N)" >> {times}
{script}
rc=$?
echo "$SLURM_JOB_ID {tag} end $(date +%s.%N) $rc" >> {times}
exit $rc
"""


class SlurmCluster:
    """The daemons, their folder, and how to submit, wait for and read jobs."""

    def __init__(self) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="powerlib-slurm-"))
        self.dir.chmod(0o755)
        self.procs: list[tuple[str, subprocess.Popen[bytes]]] = []
        self.node = socket.gethostname().split(".")[0]
        self.conf = self.dir / "etc" / "slurm.conf"
        self.state = self.dir / "powerlib-state"  # the node's root state folder (/run/powerlib)
        self.sock = self.dir / "agent" / "agent.sock"
        self.site = self.dir / "site"
        self.work = self.dir / "work"  # the jobs' folder, every uid's (sticky)
        self.times = self.dir / "log" / "prolog-epilog.times"
        self.powerlib_log = self.dir / "log" / "powerlib.log"
        self.job_python = sys.executable
        self.started_s = 0.0

    # -- bring-up ---------------------------------------------------------------------------

    def start(self) -> SlurmCluster:
        t0 = time.monotonic()
        for sub in ("etc", "log", "run", "munge", "msock", "db", "spool", "ctld", "dev", "agent"):
            (self.dir / sub).mkdir(mode=0o700 if sub == "munge" else 0o755)
        self.work.mkdir(mode=0o755)
        self.work.chmod(0o1777)
        self._python_for_jobs()
        self._start_munge()
        ports = free_ports(4)
        self._start_mariadb(ports[0])
        self._write_configs(ports[1:])
        self._start_slurmdbd()
        self._start_agent()
        self._start_slurm()
        self.started_s = time.monotonic() - t0
        return self

    def _spawn(self, name: str, args: Sequence[str], env: dict[str, str] | None = None) -> None:
        log = open(self.dir / "log" / f"{name}.out", "ab")  # noqa: SIM115 - the child owns it
        with log:
            proc = subprocess.Popen(
                list(args), stdout=log, stderr=subprocess.STDOUT, env=env or self.env(),
                start_new_session=True, cwd=self.dir,
            )  # fmt: skip
        self.procs.append((name, proc))

    def _up(self, name: str) -> bool:
        """True while the daemon runs; an AssertionError with its output once it exited."""
        for n, proc in self.procs:
            if n == name and proc.poll() is not None:
                out = (self.dir / "log" / f"{name}.out").read_text(errors="replace")
                raise AssertionError(f"{name} exited {proc.returncode}: {out[-2000:]}")
        return True

    def env(self, **extra: str) -> dict[str, str]:
        """The environment of Slurm's commands: no POWERLIB_*, SLURM_CONF to this cluster."""
        env = {k: v for k, v in os.environ.items() if not k.startswith(("POWERLIB_", "SLURM_"))}
        return {**env, "SLURM_CONF": str(self.conf), **extra}

    def _python_for_jobs(self) -> None:
        """``site/`` with the checkout's finder; the interpreter other uids can run."""
        self.site.mkdir(mode=0o755)
        packages = {}
        for name in ("powerlib", "powerlib.backends", "powerlib.integrations"):
            spec = importlib.util.find_spec(name)  # where this interpreter imports them from
            assert spec is not None and spec.submodule_search_locations
            packages[name] = str(list(spec.submodule_search_locations)[0])
        (self.site / "powerlib_checkout.py").write_text(_FINDER.format(packages=packages))
        launcher = self.dir / "powerlib"
        launcher.write_text(_LAUNCHER.format(python=sys.executable, site=str(self.site)))
        launcher.chmod(0o755)
        probe = "import sys; sys.path.insert(0, sys.argv[1]); import powerlib_checkout, psutil"
        if self._runs_as_nobody([sys.executable, "-c", probe, str(self.site)]):
            return
        system = shutil.which("python3", path="/usr/bin:/bin")
        if system is None:
            raise RuntimeError("no interpreter that uid 65534 may run (this one is not)")
        import psutil

        shutil.copytree(Path(psutil.__file__).parent, self.site / "psutil")
        subprocess.run(["chmod", "-R", "a+rX", str(self.site)], check=True)
        if not self._runs_as_nobody([system, "-c", probe, str(self.site)]):
            raise RuntimeError(f"{system} (as uid 65534) cannot import powerlib's agent client")
        self.job_python = system

    def _runs_as_nobody(self, args: list[str]) -> bool:
        try:
            done = subprocess.run(
                args, user=NOBODY, group=NOBODY, extra_groups=[], cwd="/", timeout=60,
                capture_output=True, check=False,
            )  # fmt: skip
        except (OSError, subprocess.SubprocessError):
            return False
        return done.returncode == 0

    def _start_munge(self) -> None:
        key = self.dir / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        self.munge_sock = self.dir / "msock" / "munge.sock"
        m = self.dir / "munge"
        self._spawn("munged", [
            "munged", "-F", f"--socket={self.munge_sock}", f"--key-file={key}",
            f"--pid-file={m / 'munged.pid'}", f"--log-file={m / 'munged.log'}",
            f"--seed-file={m / 'munged.seed'}",
        ])  # fmt: skip
        wait_for(lambda: self._up("munged") and self.munge_sock.exists(), "munged")

    def _start_mariadb(self, port: int) -> None:
        db = self.dir / "db"
        subprocess.run(
            ["mariadb-install-db", "--user=root", f"--datadir={db}", "--skip-test-db",
             "--auth-root-authentication-method=normal"],
            check=True, capture_output=True, timeout=120,
        )  # fmt: skip
        self.db_sock = self.dir / "run" / "mysql.sock"
        self._spawn("mariadbd", [
            "mariadbd", "--no-defaults", "--user=root", f"--datadir={db}", f"--port={port}",
            f"--socket={self.db_sock}", "--bind-address=127.0.0.1", "--skip-name-resolve",
            f"--pid-file={self.dir / 'run' / 'mysqld.pid'}", "--innodb-buffer-pool-size=64M",
            "--innodb-lock-wait-timeout=900", "--skip-log-bin",
        ])  # fmt: skip
        wait_for(lambda: self._up("mariadbd") and self.db_sock.exists(), "mariadbd")
        sql = (
            "CREATE USER 'slurm'@'127.0.0.1' IDENTIFIED BY 'slurm';"
            " GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1';"
        )
        subprocess.run(
            ["mariadb", "--no-defaults", f"--socket={self.db_sock}", "-uroot", "-e", sql],
            check=True, capture_output=True, timeout=60,
        )  # fmt: skip
        self.db_port = port

    def _write_configs(self, ports: Sequence[int]) -> None:
        ctld, slurmd, dbd = ports
        etc, log, run = self.dir / "etc", self.dir / "log", self.dir / "run"
        dbd_conf = etc / "slurmdbd.conf"  # slurmdbd reads it beside $SLURM_CONF
        dbd_conf.write_text(
            f"AuthType=auth/munge\nAuthInfo=socket={self.munge_sock}\nDbdHost=localhost\n"
            f"DbdAddr=127.0.0.1\nDbdPort={dbd}\nSlurmUser=root\nLogFile={log / 'slurmdbd.log'}\n"
            f"PidFile={run / 'slurmdbd.pid'}\nStorageType=accounting_storage/mysql\n"
            f"StorageHost=127.0.0.1\nStoragePort={self.db_port}\nStorageUser=slurm\n"
            "StoragePass=slurm\nStorageLoc=slurm_acct_db\n"
        )
        dbd_conf.chmod(0o600)
        for i in range(GPUS):
            os.mknod(self.dir / "dev" / f"nvidia{i}", 0o666 | 0o020000, os.makedev(195, i))
        (etc / "gres.conf").write_text(
            f"AutoDetect=off\nName=gpu File={self.dir / 'dev'}/nvidia[0-{GPUS - 1}]\n"
        )
        (etc / "plugstack.conf").write_text("")
        for name in ("prolog", "epilog"):
            self._write_wrapper(name)
        # AccountingStoragePass: the munge socket for the slurmdbd connections (slurm.conf(5))
        self.conf.write_text(
            f"ClusterName=powerlibtest\nSlurmctldHost={self.node}(127.0.0.1)\n"
            f"SlurmctldPort={ctld}\nSlurmdPort={slurmd}\nSlurmUser=root\nSlurmdUser=root\n"
            f"AuthType=auth/munge\nCredType=cred/munge\nAuthInfo=socket={self.munge_sock}\n"
            f"StateSaveLocation={self.dir / 'ctld'}\nSlurmdSpoolDir={self.dir / 'spool'}\n"
            f"SlurmctldPidFile={run / 'slurmctld.pid'}\nSlurmdPidFile={run / 'slurmd.pid'}\n"
            f"SlurmctldLogFile={log / 'slurmctld.log'}\nSlurmdLogFile={log / 'slurmd.log'}\n"
            "ProctrackType=proctrack/linuxproc\nTaskPlugin=task/none\n"
            "SelectType=select/cons_tres\nSelectTypeParameters=CR_Core\n"
            "JobAcctGatherType=jobacct_gather/none\nJobCompType=jobcomp/none\nMpiDefault=none\n"
            "AccountingStorageType=accounting_storage/slurmdbd\n"
            f"AccountingStorageHost=127.0.0.1\nAccountingStoragePort={dbd}\n"
            f"AccountingStoragePass={self.munge_sock}\nAccountingStorageTRES=gres/gpu\n"
            f"GresTypes=gpu\nReturnToService=2\nKillWait=2\nMinJobAge=600\n"
            f"Prolog={etc / 'prolog'}\nEpilog={etc / 'epilog'}\n"
            f"PlugStackConfig={etc / 'plugstack.conf'}\nSlurmctldDebug=info\nSlurmdDebug=info\n"
            f"NodeName={self.node} NodeAddr=127.0.0.1 CPUs=2 RealMemory=500 Gres=gpu:{GPUS} "
            "State=UNKNOWN\n"
            f"PartitionName=main Nodes={self.node} Default=YES MaxTime=10 State=UP "
            "OverSubscribe=YES\n"
        )

    def powerlib_env(self) -> dict[str, str]:
        """The node's powerlib settings (the agent's, the prolog's and the epilog's): simulated
        GPUs whose counters tick every 10 ms, so a read is never more than 10 ms stale."""
        return {
            "POWERLIB_BACKEND": "simulated",
            "POWERLIB_SIM_GPUS": str(GPUS),
            "POWERLIB_SIM_ENERGY_PERIOD_S": "0.01",
            "POWERLIB_STATE_DIR": str(self.state),
            "POWERLIB_AGENT_SOCKET": str(self.sock),
        }

    def _write_wrapper(self, name: str) -> None:
        """slurm.conf's Prolog/Epilog: the node's powerlib settings, then contrib/slurm's."""
        node_env = {
            "POWERLIB": str(self.dir / "powerlib"),
            "POWERLIB_LOG": str(self.powerlib_log),
            **self.powerlib_env(),
            "SLURM_CONF": str(self.conf),
            "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        }
        exports = "\n".join(f"export {k}='{v}'" for k, v in node_env.items())
        path = self.dir / "etc" / name
        path.write_text(
            _WRAPPER.format(
                name=f"{name}.sh",
                tag=name,
                exports=exports,
                times=self.times,
                script=CONTRIB / f"{name}.sh",
            )
        )
        path.chmod(0o755)

    def _start_slurmdbd(self) -> None:
        self._spawn("slurmdbd", ["slurmdbd", "-D"])
        add = ["sacctmgr", "-i", "add", "cluster", "powerlibtest"]
        wait_for(
            lambda: self._up("slurmdbd") and self.run(add, check=False).returncode == 0,
            "slurmdbd to take the cluster",
        )

    def _start_agent(self) -> None:
        args = [str(self.dir / "powerlib"), "agent", "serve", "--socket", str(self.sock)]
        # the jobs' users are in nogroup: nobody and the second user (_apt on Debian)
        self._spawn("agent", [*args, "--group", str(NOBODY)], env=self.env(**self.powerlib_env()))
        wait_for(lambda: self._up("agent") and self.sock.exists(), "the powerlib agent")

    def _start_slurm(self) -> None:
        self._spawn("slurmctld", ["slurmctld", "-D", "-i"])
        self._spawn("slurmd", ["slurmd", "-D", "-f", str(self.conf)])
        sinfo = ["sinfo", "-h", "-N", "-o", "%T"]

        def idle() -> bool:
            self._up("slurmctld")
            self._up("slurmd")
            return self.run(sinfo, check=False).stdout.strip() == "idle"

        wait_for(idle, "the node to be idle", timeout_s=60)

    # -- use --------------------------------------------------------------------------------

    def run(
        self, args: Sequence[str], *, check: bool = True, timeout_s: float = 30.0
    ) -> subprocess.CompletedProcess[str]:
        """A Slurm command as root on this cluster."""
        return subprocess.run(
            list(args), env=self.env(), capture_output=True, text=True, check=check,
            timeout=timeout_s,
        )  # fmt: skip

    def submit(self, uid: int, script: str, *opts: str, env: dict[str, str] | None = None) -> str:
        """sbatch ``script`` (a shell script's text) as ``uid``; the job id."""
        gid = pwd.getpwuid(uid).pw_gid
        done = subprocess.run(
            ["sbatch", "--parsable", f"--chdir={self.work}", "--time=2", *opts],
            input=script, env=self.env(HOME=str(self.work), **(env or {})), user=uid, group=gid,
            extra_groups=[], cwd=self.work, capture_output=True, text=True, timeout=30,
            check=False,
        )  # fmt: skip
        if done.returncode != 0:
            raise AssertionError(f"sbatch as uid {uid} failed: {done.stderr}")
        return done.stdout.strip().split(";")[0]

    def run_as(self, uid: int, args: Sequence[str]) -> subprocess.CompletedProcess[str]:
        """A Slurm command as ``uid`` (gid nogroup) on this cluster."""
        return subprocess.run(
            list(args), env=self.env(HOME=str(self.work)), user=uid, group=NOBODY,
            extra_groups=[], cwd=self.work, capture_output=True, text=True, check=True,
            timeout=30,
        )  # fmt: skip

    def job_state(self, job: str) -> str:
        """squeue's state of a job, or ``""`` once it left the queue."""
        return self.run(["squeue", "-h", "-j", job, "-o", "%T"], check=False).stdout.strip()

    def wait_gone(self, job: str, timeout_s: float = 60.0) -> None:
        """Until the job left the queue: ended, and its epilog ran."""
        wait_for(lambda: self.job_state(job) == "", f"job {job} to end", timeout_s)

    def sacct(self, job: str, fields: str) -> list[list[str]]:
        """The job's own line (not its steps') in sacct: the ``fields``' values."""
        out = self.run(["sacct", "-j", job, "-X", "-n", "-P", "-o", fields]).stdout
        return [line.split("|") for line in out.splitlines() if line]

    def script_times(self, job: str) -> dict[str, float | int]:
        """When the job's prolog and epilog started and ended, and their exit statuses:
        ``{"prolog start": t, "prolog end": t, "prolog rc": 0, "epilog start": ...}``."""
        text = self.times.read_text() if self.times.exists() else ""
        out: dict[str, float | int] = {}
        for line in text.splitlines():
            fields = line.split()
            if fields[0] == job:
                out[f"{fields[1]} {fields[2]}"] = float(fields[3])
                if fields[2] == "end":
                    out[f"{fields[1]} rc"] = int(fields[4])
        return out

    def log(self, name: str) -> str:
        path = self.dir / "log" / name
        return path.read_text(errors="replace") if path.exists() else ""

    # -- teardown ---------------------------------------------------------------------------

    def stop(self) -> None:
        """Jobs cancelled, every daemon ended (SIGTERM, then SIGKILL), the folder removed."""
        with contextlib.suppress(Exception):  # best effort: the daemons go in any case
            left = self.run(["squeue", "-h", "-o", "%i"], timeout_s=10).stdout.split()
            if left:
                self.run(["scancel", *left], timeout_s=10)
                wait_for(lambda: self.run(["squeue", "-h"]).stdout.strip() == "", "jobs", 20)
        for _, proc in reversed(self.procs):
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait(timeout=10)
        self._kill_job_leftovers()
        shutil.rmtree(self.dir, ignore_errors=True)

    def _kill_job_leftovers(self) -> None:
        """slurmstepd and job processes outlive slurmd in their own sessions: those whose
        command line or working folder lies in this cluster's folder are killed."""
        import psutil

        for p in psutil.process_iter(["pid", "cmdline", "cwd"]):
            with contextlib.suppress(psutil.Error):
                text = " ".join(p.info["cmdline"] or []) + " " + (p.info["cwd"] or "")
                if str(self.dir) in text and p.pid != os.getpid():
                    p.kill()
