"""The job shapes SLURM and Open MPI users write, under the real programs (``tox -e cluster``):
a one-node slurmctld/slurmd on localhost and ``mpirun``. Each route trains the same script and
is compared with a plain-PyTorch run on the global batch.

These tests start daemons; they run where ``TORCHPLUG_REAL_CLUSTER=1`` (``tox -e cluster`` sets
it and installs slurm-wlm, munge, openmpi-bin and mpich when they are missing) and skip, saying why,
elsewhere."""

from __future__ import annotations

import os
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from support.real_cluster import (
    GLOBAL_BATCH,
    STEPS,
    Slurm,
    assert_matches_reference,
    clean_env,
    missing,
    mpirun_env,
    slurm_cluster,
)

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        os.environ.get("TORCHPLUG_REAL_CLUSTER") != "1",
        reason="real SLURM/MPI routes run in tox -e cluster (or set TORCHPLUG_REAL_CLUSTER=1)",
    ),
]

#: The user's script: its own loop, ``Engine()`` choosing from the environment. Each rank builds
#: the model from its own seed (the Engine makes rank 0's the start of every rank) and trains on
#: its slice of the global batch. Rank 0 writes what it saw to argv[1] (``{tag}`` in the name:
#: the step id, so concurrent steps write apart).
TRAIN = textwrap.dedent(
    f"""
    import os, sys, torch, torchplug as tp

    def model():
        return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.LayerNorm(16),
                                   torch.nn.ReLU(), torch.nn.Linear(16, 2))

    def batch(step):
        g = torch.Generator().manual_seed(100 + step)
        x = torch.randn({GLOBAL_BATCH}, 6, generator=g)
        return x, torch.randn({GLOBAL_BATCH}, 2, generator=g)

    with tp.Engine() as engine:
        torch.manual_seed(engine.rank)
        net = model()
        net, opt = engine.setup(net, torch.optim.AdamW(net.parameters(), lr=0.05))
        share = {GLOBAL_BATCH} // engine.world_size
        losses = []
        for step in range({STEPS}):
            x, y = batch(step)
            rows = slice(engine.rank * share, (engine.rank + 1) * share)
            loss = torch.nn.functional.mse_loss(net(x[rows]), y[rows])
            engine.backward(loss)
            opt.step()
            opt.zero_grad()
            losses.append(engine.reduce(loss.detach(), "mean").item())
        state = {{k: v.detach().clone() for k, v in engine.unwrap(net).state_dict().items()}}
        tag = os.environ.get("SLURM_STEP_ID", "mpi")
        # one write per line: torchrun's workers are unbuffered, and two ranks' prints (text,
        # then newline) could interleave in a shared log
        sys.stdout.write(f"world={{engine.world_size}} rank={{engine.rank}} "
                         f"strategy={{engine.strategy}} step={{tag}}\\n")
        sys.stdout.flush()
        if engine.rank == 0:
            torch.save({{"state": state, "losses": losses, "world": engine.world_size,
                        "strategy": str(engine.strategy)}}, sys.argv[1].format(tag=tag))
    """
)


@pytest.fixture(scope="module")
def slurm() -> Iterator[Slurm]:
    absent = missing("munged", "slurmctld", "slurmd", "srun", "sbatch")
    if absent:
        pytest.skip(f"not installed: {', '.join(absent)} (tox -e cluster installs them)")
    with slurm_cluster() as cluster:
        yield cluster


@pytest.fixture
def script(tmp_path: Path) -> Path:
    path = tmp_path / "train.py"
    path.write_text(TRAIN)
    return path


def ok(run, cluster: Slurm | None = None) -> str:
    detail = f"{run.stdout[-3000:]}\n{run.stderr[-3000:]}" + (
        f"\n{cluster.logs()}" if cluster else ""
    )
    assert run.returncode == 0, detail
    return run.stdout


def worlds(stdout: str) -> list[str]:
    return sorted(line for line in stdout.splitlines() if line.startswith("world="))


def test_srun_starts_every_rank_of_a_plain_script(slurm, script, tmp_path):
    out = tmp_path / "result-{tag}.pt"
    stdout = ok(slurm.run("srun", "-n", "2", "python", str(script), str(out)), slurm)
    assert worlds(stdout) == [
        "world=2 rank=0 strategy=ddp step=0",
        "world=2 rank=1 strategy=ddp step=0",
    ]
    assert_matches_reference(tmp_path / "result-0.pt")


#: What a shell that once ran torchrun still exports (issue 36 item 7): every task got them.
LEFT_OVER = {"TORCHELASTIC_RUN_ID": "stale", "RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"}


def test_srun_tasks_with_torchrun_variables_left_in_the_shell_are_the_schedulers_ranks(
    slurm, script, tmp_path
):
    """Both tasks used to become "rank 1 of 2" and wait 30 minutes for a rank 0."""
    out = tmp_path / "result-{tag}.pt"
    run = slurm.run(
        "srun", "-n", "2", "python", str(script), str(out), env={**slurm.env, **LEFT_OVER}
    )
    stdout = ok(run, slurm)
    assert worlds(stdout) == [
        "world=2 rank=0 strategy=ddp step=0",
        "world=2 rank=1 strategy=ddp step=0",
    ]
    assert "started by slurmstepd, not by torchrun" in run.stderr, run.stderr
    assert "TORCHELASTIC_RUN_ID=stale, RANK=1, WORLD_SIZE=2" in run.stderr
    assert_matches_reference(tmp_path / "result-0.pt")


def test_srun_tasks_given_a_master_addr_that_does_not_resolve_fail_at_once_naming_it(
    slurm, script, tmp_path
):
    """Issue 36 item 7: a mistyped or leftover MASTER_ADDR used to wait 30 minutes silently."""
    env = {**slurm.env, "MASTER_ADDR": "no-such-host.invalid"}
    run = slurm.run("srun", "-n", "2", "python", str(script), str(tmp_path / "x"), env=env)
    assert run.returncode != 0 and "world=" not in run.stdout
    assert "MASTER_ADDR='no-such-host.invalid' (as SLURM gave it) does not resolve" in run.stderr
    assert run.stderr.count("does not resolve") == 2, run.stderr  # each task says it


def test_srun_tasks_waiting_for_an_unreachable_master_addr_say_what_they_wait_for(
    slurm, script, tmp_path
):
    """An address that resolves but never answers (192.0.2.1, TEST-NET-1): each rank says,
    after 30 s, the address, where it came from and the timeout, long before torch gives up."""
    import subprocess

    env = {**slurm.env, "MASTER_ADDR": "192.0.2.1"}
    job = subprocess.Popen(
        ["srun", "-n", "2", "python", str(script), str(tmp_path / "x")], env=env,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    lines: list[str] = []
    try:
        for line in job.stderr:  # read until both ranks have said it (or the job ended)
            lines.append(line)
            if sum("for the other ranks at 192.0.2.1:" in seen for seen in lines) == 2:
                break
    finally:
        job.kill()
        slurm.run("scancel", "--user", "root")
        job.wait(timeout=120)
    said = [line for line in lines if "for the other ranks at 192.0.2.1:" in line]
    assert len(said) == 2, "".join(lines)[-3000:]
    assert all("from SLURM" in line and "gives up after 1800 s" in line for line in said), said


def test_srun_two_tasks_of_torchplug_launch_are_one_world(slurm, script, tmp_path):
    """``srun -n 2 torchplug launch train.py``: each task is one rank of one world of 2."""
    out = tmp_path / "result-{tag}.pt"
    run = slurm.run("srun", "-n", "2", "torchplug", "launch", str(script), str(out))
    stdout = ok(run, slurm)
    assert len(worlds(stdout)) == 2 and all(w.startswith("world=2 ") for w in worlds(stdout))
    assert_matches_reference(tmp_path / f"result-{worlds(stdout)[0].split('step=')[1]}.pt")


def test_srun_two_tasks_with_n_two_is_refused_before_starting(slurm, script, tmp_path):
    run = slurm.run("srun", "-n", "2", "torchplug", "launch", "-n", "2", str(script), "x")
    assert run.returncode != 0 and "world=" not in run.stdout
    assert "SLURM started 2 tasks on this node" in run.stderr, run.stderr
    assert "srun --ntasks-per-node=1 torchplug launch -n 2 SCRIPT" in run.stderr


def test_sbatch_with_one_task_and_torchplug_launch_n_two(slurm, script, tmp_path):
    out = tmp_path / "result-{tag}.pt"
    batch = tmp_path / "job.sh"
    batch.write_text(
        "#!/bin/bash\n#SBATCH -N 1\n#SBATCH --ntasks-per-node=1\n#SBATCH --cpus-per-task=2\n"
        f"srun torchplug launch -n 2 {script} {out}\n"
    )
    log = tmp_path / "job.out"
    run = slurm.run("sbatch", "--wait", "-o", str(log), str(batch))
    ok(run, slurm)
    text = log.read_text()
    assert worlds(text) == [
        "world=2 rank=0 strategy=ddp step=0",
        "world=2 rank=1 strategy=ddp step=0",
    ], text
    assert_matches_reference(tmp_path / "result-0.pt")


@pytest.mark.parametrize("attempt", range(5))
def test_two_concurrent_steps_of_one_allocation_are_two_worlds(slurm, script, tmp_path, attempt):
    """A sweep: two ``srun -n 2 --exact`` at once in one allocation; each is its own world of 2
    (steps 0 and 1), both match the reference."""
    out = tmp_path / "result-{tag}.pt"
    body = (
        f"srun -n 2 --exact python {script} {out} > {tmp_path}/a.log 2>&1 & a=$!\n"
        f"srun -n 2 --exact python {script} {out} > {tmp_path}/b.log 2>&1 & b=$!\n"
        "wait $a; ra=$?; wait $b; rb=$?; exit $((ra | rb))\n"
    )
    run = slurm.run("salloc", "-n", "4", "bash", "-c", body)
    logs = (tmp_path / "a.log").read_text() + (tmp_path / "b.log").read_text()
    assert run.returncode == 0, logs + run.stderr + slurm.logs()
    lines = worlds(logs)
    steps = sorted({line.split("step=")[1] for line in lines})
    assert len(steps) == 2 and len(lines) == 4, logs
    for step in steps:
        assert sorted(x.split()[1] for x in lines if x.endswith(f"step={step}")) == [
            "rank=0",
            "rank=1",
        ]
        assert_matches_reference(tmp_path / f"result-{step}.pt")


@pytest.fixture
def mpirun() -> list[str]:
    absent = missing("mpirun")
    if absent:
        pytest.skip(f"not installed: {', '.join(absent)} (tox -e cluster installs it)")
    return ["mpirun", "-np", "2", "--oversubscribe", "--mca", "btl", "self,tcp"]


def _mpi(argv: list[str]) -> object:
    import subprocess

    return subprocess.run(argv, env=mpirun_env(), capture_output=True, text=True, timeout=600)


def test_mpirun_starts_every_rank_of_a_plain_script(mpirun, script, tmp_path):
    out = tmp_path / "result-{tag}.pt"
    stdout = ok(_mpi([*mpirun, "python", str(script), str(out)]))
    assert worlds(stdout) == [
        "world=2 rank=0 strategy=ddp step=mpi",
        "world=2 rank=1 strategy=ddp step=mpi",
    ]
    assert_matches_reference(tmp_path / "result-mpi.pt")


def test_mpirun_ranks_with_torchrun_variables_left_in_the_shell_are_mpis_ranks(
    mpirun, script, tmp_path
):
    import subprocess

    out = tmp_path / "result-{tag}.pt"
    run = subprocess.run(
        [*mpirun, "python", str(script), str(out)], env={**mpirun_env(), **LEFT_OVER},
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    stdout = ok(run)
    assert worlds(stdout) == [
        "world=2 rank=0 strategy=ddp step=mpi",
        "world=2 rank=1 strategy=ddp step=mpi",
    ]
    assert "not by torchrun, yet torchrun's variables are set" in run.stderr, run.stderr
    assert_matches_reference(tmp_path / "result-mpi.pt")


def test_mpirun_ranks_given_a_master_addr_that_does_not_resolve_fail_at_once_naming_it(
    mpirun, script, tmp_path
):
    import subprocess

    run = subprocess.run(
        [*mpirun, "python", str(script), str(tmp_path / "x")],
        env={**mpirun_env(), "MASTER_ADDR": "no-such-host.invalid"},
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert run.returncode != 0 and "world=" not in run.stdout
    assert "MASTER_ADDR='no-such-host.invalid' (as mpirun (Open MPI) gave it)" in run.stderr, (
        run.stderr[-3000:]
    )


def test_mpirun_two_tasks_of_torchplug_launch_are_one_world(mpirun, script, tmp_path):
    out = tmp_path / "result-{tag}.pt"
    stdout = ok(_mpi([*mpirun, "torchplug", "launch", str(script), str(out)]))
    assert worlds(stdout) == [
        "world=2 rank=0 strategy=ddp step=mpi",
        "world=2 rank=1 strategy=ddp step=mpi",
    ]
    assert_matches_reference(tmp_path / "result-mpi.pt")


@pytest.fixture
def mpich() -> list[str]:
    absent = missing("mpirun.mpich")
    if absent:
        pytest.skip(f"not installed: {', '.join(absent)} (tox -e cluster installs it)")
    return ["mpirun.mpich", "-np", "2"]


#: What one rank of an MPICH job derives its port from, and the port.
PORT = (
    "import os, sys, torchplug.plugins.mpi as m; "
    "port = m.torchplug_cluster_environment(os.environ).master_port; "
    "sys.stdout.write(f'{m.hydra_job()} {port}\\n')"  # one write: the ranks share the pipe
)


@pytest.mark.parametrize("attempt", range(3))
def test_two_concurrent_mpich_jobs_on_one_node_are_two_worlds(mpich, script, tmp_path, attempt):
    """Issue 36 item 6: Debian's MPICH (Hydra) exports no job variable, so both jobs once took
    port 29500 and one job's rank joined the other's store. Two ``mpirun.mpich -np 2`` at once:
    each is its own world of 2 matching the reference, and their ports differ."""
    import subprocess

    env = mpirun_env()
    jobs = {
        name: subprocess.Popen(
            [*mpich, "python", str(script), str(tmp_path / f"result-{name}-{{tag}}.pt")],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )  # fmt: skip
        for name in ("a", "b")
    }
    logs = {name: job.communicate(timeout=600)[0] for name, job in jobs.items()}
    for name, job in jobs.items():
        assert job.returncode == 0, logs
        assert worlds(logs[name]) == [
            "world=2 rank=0 strategy=ddp step=mpi",
            "world=2 rank=1 strategy=ddp step=mpi",
        ], logs
        assert_matches_reference(tmp_path / f"result-{name}-mpi.pt")
    infos = [
        subprocess.run(
            [*mpich, "python", "-c", PORT], env=env, capture_output=True, text=True, timeout=600
        ).stdout
        for _ in range(2)
    ]
    seen = [set(out.split("\n")) - {""} for out in infos]
    assert all(len(lines) == 1 for lines in seen), infos  # one job id and port on every rank
    (first,), (second,) = seen
    assert first.startswith("hydra:") and first.split()[0] != second.split()[0], infos


def test_the_cluster_tests_run_without_an_outer_scheduler():
    """The jobs above start from a clean environment (no SLURM/MPI variables of whatever runs
    the tests), so a CI inside a SLURM job does not hand its own identity to them."""
    assert not [k for k in clean_env() if k.startswith(("SLURM_", "OMPI_", "PMI"))]
