"""A real single-node Slurm cluster for tests: munged, slurmctld and slurmd on free ports, all state in one
temporary directory, stopped (by pid) when the context ends.

Needs Debian's ``slurm-wlm`` and ``munge`` and root (slurmd runs jobs as their submitter; ``SlurmUser=root``).
:func:`unavailable` says why it cannot run here, for ``pytest.skip``.

The configuration is the smallest that runs job arrays (GUIDE.md §9): ``ProctrackType=proctrack/linuxproc``,
``TaskPlugin=task/none``, ``JobAcctGatherType=jobacct_gather/none``, ``SelectType=select/cons_tres``, one node
with ``CPUs=2``, and ``JobCompType=jobcomp/filetxt``: Slurm appends one line per finished job (array tasks
included) to :attr:`SlurmCluster.completion_file` — Slurm's own record of what ran.
"""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Optional

DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "squeue", "sacct", "scontrol")


def unavailable() -> Optional[str]:
    """Why a Slurm cluster cannot be started here (None when it can)."""
    missing = [d for d in DAEMONS if shutil.which(d) is None and not Path("/usr/sbin", d).exists()]
    if missing:
        return (f"Slurm is not installed ({', '.join(missing)} not found): "
                "apt-get install -y slurm-wlm munge (as root; .ci/run does this on CI)")
    if os.geteuid() != 0:
        return "a test Slurm cluster runs slurmd as root (it starts jobs as their submitter); not root here"
    try:
        pwd.getpwnam("munge")
    except KeyError:
        return "the munge user is missing (the munge package creates it)"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _exe(name: str) -> str:
    return shutil.which(name) or str(Path("/usr/sbin", name))


def parse_completion_line(line: str) -> dict[str, str]:
    """One jobcomp/filetxt line (``Key=Value`` words; values have no spaces) as a dict."""
    out = {}
    for word in line.split():
        key, sep, value = word.partition("=")
        if sep:
            out[key] = value
    return out


class SlurmCluster:
    def __init__(self, root: Path, cpus: int = 2):
        self.root = root
        self.cpus = cpus
        self.host = socket.gethostname()
        self.conf = root / "slurm.conf"
        self.completion_file = root / "jobcomp.txt"
        # munged runs as the munge user, which must reach its directory: not under a private test dir.
        self.munge_dir = Path(tempfile.mkdtemp(prefix="kiln-munge-"))
        self.munge_socket = self.munge_dir / "munge.socket.2"
        self._procs: list[tuple[str, int]] = []

    @property
    def env(self) -> dict[str, str]:
        """Environment for Slurm's commands (and kiln, which runs them) to talk to this cluster."""
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    def _start_munge(self) -> None:
        munge = pwd.getpwnam("munge")
        d = self.munge_dir
        d.chmod(0o711)  # munged: "execute permissions for all required" on the socket directory
        key = d / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        for p in (d, key):
            os.chown(p, munge.pw_uid, munge.pw_gid)
        pid_file = d / "munged.pid"
        # munged refuses to run as root: run it as the munge user (runuser from util-linux).
        subprocess.run(["runuser", "-u", "munge", "--", _exe("munged"), f"--key-file={key}",
                        f"--socket={self.munge_socket}", f"--pid-file={pid_file}", f"--log-file={d / 'munged.log'}",
                        f"--seed-file={d / 'munged.seed'}"], check=True, capture_output=True, timeout=30)
        self._procs.append(("munged", int(self._wait_file(pid_file).read_text().split()[0])))

    def _wait_file(self, path: Path, timeout: float = 30) -> Path:
        deadline = time.monotonic() + timeout
        while not (path.is_file() and path.read_text().strip()):
            if time.monotonic() > deadline:
                raise RuntimeError(f"{path} did not appear within {timeout:.0f}s")
            time.sleep(0.1)
        return path

    def _write_conf(self) -> None:
        for sub in ("state", "spool", "log"):
            (self.root / sub).mkdir()
        ctld, slurmd = _free_port(), _free_port()
        self.conf.write_text("\n".join([
            "ClusterName=kilntest",
            f"SlurmctldHost={self.host}",
            f"SlurmctldPort={ctld}",
            f"SlurmdPort={slurmd}",
            "SlurmUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={self.munge_socket}",
            f"StateSaveLocation={self.root / 'state'}",
            f"SlurmdSpoolDir={self.root / 'spool'}",
            f"SlurmctldPidFile={self.root / 'slurmctld.pid'}",
            f"SlurmdPidFile={self.root / 'slurmd.pid'}",
            f"SlurmctldLogFile={self.root / 'log' / 'slurmctld.log'}",
            f"SlurmdLogFile={self.root / 'log' / 'slurmd.log'}",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU",
            "JobCompType=jobcomp/filetxt",
            f"JobCompLoc={self.completion_file}",
            "MpiDefault=none",
            "ReturnToService=2",
            "SchedulerParameters=sched_interval=1",
            "MinJobAge=2",
            f"NodeName={self.host} CPUs={self.cpus} State=UNKNOWN",
            f"PartitionName=debug Nodes={self.host} Default=YES MaxTime=INFINITE State=UP",
            "",
        ]))

    def start(self) -> "SlurmCluster":
        self.root.mkdir(parents=True, exist_ok=True)
        self._start_munge()
        self._write_conf()
        env = self.env
        for daemon, pid_file in (("slurmctld", "slurmctld.pid"), ("slurmd", "slurmd.pid")):
            subprocess.run([_exe(daemon), "-f", str(self.conf)], check=True, capture_output=True, env=env,
                           timeout=60)
            self._procs.append((daemon, int(self._wait_file(self.root / pid_file).read_text().split()[0])))
        deadline = time.monotonic() + 60
        while True:
            state = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, env=env).stdout.strip()
            if state in ("idle", "mixed", "allocated"):
                return self
            if time.monotonic() > deadline:
                raise RuntimeError(f"the test Slurm node did not become idle (state {state!r}); logs in {self.root / 'log'}")
            time.sleep(0.3)

    def stop(self) -> None:
        for _name, pid in reversed(self._procs):
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                continue
        deadline = time.monotonic() + 15
        for _name, pid in reversed(self._procs):
            while time.monotonic() < deadline:
                try:
                    os.kill(pid, 0)
                except ProcessLookupError:
                    break
                time.sleep(0.1)
            else:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        self._procs.clear()
        shutil.rmtree(self.munge_dir, ignore_errors=True)

    def completions(self, array_job: Optional[str] = None, expect: int = 0, timeout: float = 20) -> list[dict[str, str]]:
        """Slurm's completion records (jobcomp/filetxt), one dict per finished job or array task; with
        `array_job`, that array's tasks only, waiting up to `timeout` seconds for `expect` of them (slurmctld
        appends a line as it retires each task)."""
        deadline = time.monotonic() + timeout
        while True:
            lines = self.completion_file.read_text().splitlines() if self.completion_file.is_file() else []
            found = [parse_completion_line(line) for line in lines if line.strip()]
            if array_job is not None:
                found = [c for c in found if c.get("ArrayJobId") == array_job]
            if len(found) >= expect or time.monotonic() > deadline:
                return found
            time.sleep(0.2)

    def run(self, *cmd: str) -> str:
        return subprocess.run(list(cmd), capture_output=True, text=True, env=self.env, check=True).stdout

    def __enter__(self) -> "SlurmCluster":
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc) -> None:
        self.stop()

