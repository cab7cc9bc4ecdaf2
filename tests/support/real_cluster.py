"""A real one-node SLURM cluster (munged + slurmctld + slurmd from Debian's slurm-wlm) and Open
MPI's mpirun, for ``tox -e cluster``: the daemons run in the foreground as our children, with
every file under one temporary directory, and are stopped by PID."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from torchplug.plugin import free_port

#: What each route needs, and the Debian package that has it.
PROGRAMS = {
    "munged": "munge",
    "slurmctld": "slurm-wlm",
    "slurmd": "slurm-wlm",
    "srun": "slurm-wlm",
    "sbatch": "slurm-wlm",
    "mpirun": "openmpi-bin",
    "mpirun.mpich": "mpich",
}

#: Variables of an outer scheduler or launcher that must not reach the jobs started here.
OUTER = ("SLURM_", "OMPI_", "PMI", "PMIX_", "TORCHPLUG_", "MASTER_", "RANK", "WORLD_", "LOCAL_")


def missing(*programs: str) -> list[str]:
    """The programs (with their Debian package) that are not on PATH."""
    return [f"{p} ({PROGRAMS[p]})" for p in programs if shutil.which(p) is None]


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(OUTER)}
    # One thread per rank: two cores serve up to four ranks.
    env.update(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", **extra)
    bindir = str(Path(sys.executable).parent)  # the test env's python and torchplug first
    env["PATH"] = bindir + os.pathsep + env.get("PATH", "")
    return env


def _conf(root: Path, host: str, socket_path: Path) -> str:
    return f"""\
ClusterName=torchplug
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={free_port()}
SlurmdPort={free_port()}
AuthType=auth/munge
AuthInfo=socket={socket_path}
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/builtin
ReturnToService=2
MpiDefault=none
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
SlurmdParameters=config_overrides
NodeName={host} NodeAddr=127.0.0.1 CPUs=8 State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
"""


class Slurm:
    """A running one-node cluster; ``env`` reaches it (SLURM_CONF)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.env = clean_env(SLURM_CONF=str(root / "slurm.conf"))
        self.daemons: list[subprocess.Popen] = []

    def run(self, *argv: str, timeout: float = 600, **kw) -> subprocess.CompletedProcess:
        return subprocess.run(
            list(argv), env=kw.pop("env", self.env), capture_output=True, text=True,
            timeout=timeout, **kw,
        )  # fmt: skip

    def logs(self) -> str:
        parts = []
        for name in ("slurmctld.log", "slurmd.log"):
            path = self.root / name
            if path.exists():
                parts.append(f"--- {name}\n" + path.read_text(errors="replace")[-3000:])
        return "\n".join(parts)

    def _start(self, *argv: str) -> None:
        log = open(self.root / f"{Path(argv[0]).name}.out", "w")  # noqa: SIM115
        self.daemons.append(
            subprocess.Popen(list(argv), env=self.env, stdout=log, stderr=subprocess.STDOUT)
        )

    def start(self) -> None:
        host = socket.gethostname().split(".")[0]
        munge = self.root / "munge"
        munge.mkdir(mode=0o700)
        key = munge / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        sock = munge / "munge.socket"
        for name in ("state", "spool"):
            (self.root / name).mkdir()
        (self.root / "slurm.conf").write_text(_conf(self.root, host, sock))
        self._start(
            "munged", "--foreground", "--force", f"--socket={sock}", f"--key-file={key}",
            f"--pid-file={munge}/munged.pid", f"--log-file={munge}/munged.log",
            f"--seed-file={munge}/munged.seed",
        )  # fmt: skip
        self._wait(lambda: sock.exists(), "munged's socket")
        conf = str(self.root / "slurm.conf")
        self._start("slurmctld", "-D", "-f", conf)
        self._start("slurmd", "-D", "-f", conf, "-N", host)
        self._wait(self._idle, "the node to be idle (sinfo)")

    def _idle(self) -> bool:
        out = subprocess.run(
            ["sinfo", "-h", "-o", "%t"], env=self.env, capture_output=True, text=True, timeout=60
        )
        return out.stdout.strip() == "idle"

    def _wait(self, ready, what: str, timeout: float = 180) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            dead = [d.args[0] for d in self.daemons if d.poll() is not None]
            if dead:
                raise RuntimeError(f"{dead} exited while waiting for {what}:\n{self.logs()}")
            if ready():
                return
            time.sleep(0.5)
        raise RuntimeError(f"timed out waiting for {what}:\n{self.logs()}")

    def stop(self) -> None:
        for daemon in reversed(self.daemons):
            if daemon.poll() is None:
                daemon.send_signal(signal.SIGTERM)
        for daemon in reversed(self.daemons):
            try:
                daemon.wait(timeout=60)
            except subprocess.TimeoutExpired:
                daemon.kill()
                daemon.wait()


@contextmanager
def slurm_cluster() -> Iterator[Slurm]:
    root = Path(tempfile.mkdtemp(prefix="torchplug-slurm-"))
    root.chmod(0o700)
    cluster = Slurm(root)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
        shutil.rmtree(root, ignore_errors=True)


def mpirun_env() -> dict[str, str]:
    """Open MPI refuses root unless told twice; ``--oversubscribe`` lets 2 ranks share cores."""
    return clean_env(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")


STEPS = 4

GLOBAL_BATCH = 8


def reference() -> dict:
    """The same training in plain PyTorch: rank 0's model on the whole global batch."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Linear(6, 16), torch.nn.LayerNorm(16), torch.nn.ReLU(), torch.nn.Linear(16, 2)
    )
    opt = torch.optim.AdamW(net.parameters(), lr=0.05)
    losses = []
    for step in range(STEPS):
        g = torch.Generator().manual_seed(100 + step)
        x, y = torch.randn(GLOBAL_BATCH, 6, generator=g), torch.randn(GLOBAL_BATCH, 2, generator=g)
        loss = torch.nn.functional.mse_loss(net(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"state": net.state_dict(), "losses": losses}


def assert_matches_reference(path: Path, world: int = 2) -> None:
    result = torch.load(path, weights_only=True)
    assert (result["world"], result["strategy"]) == (world, "ddp")
    expected = reference()
    assert result["losses"] == pytest.approx(expected["losses"], abs=1e-6)
    for name, value in expected["state"].items():
        torch.testing.assert_close(result["state"][name], value, atol=1e-6, rtol=1e-5)
