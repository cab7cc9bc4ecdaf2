"""Who am I: torchrun's variables, SLURM's (built in), through one firstresult hook."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

import torchplug as tp
import torchplug.plugin as tpp
from support.commands import doctor, identity
from torchplug.contract.errors import ConfigurationError
from torchplug.contract.spec import hookimpl
from torchplug.engine import connector as cluster
from torchplug.plugins.slurm import expand_nodelist, tasks_per_node

SLURM = {
    "SLURM_PROCID": "5",
    "SLURM_NTASKS": "8",
    "SLURM_LOCALID": "1",
    "SLURM_NODEID": "2",
    "SLURM_JOB_NODELIST": "gpu[07-09,12],login1",
    "SLURM_TASKS_PER_NODE": "2(x4)",
    "SLURM_JOB_ID": "123456",
}


@pytest.mark.parametrize(
    ("nodelist", "hosts"),
    [
        ("node[01-03,7],gpu5", ["node01", "node02", "node03", "node7", "gpu5"]),
        ("a1", ["a1"]),
        ("x[9-11]", ["x9", "x10", "x11"]),
        ("r[001-002],s[1,3]", ["r001", "r002", "s1", "s3"]),
    ],
)
def test_nodelist_bracket_ranges_expand(nodelist, hosts):
    assert expand_nodelist(nodelist) == hosts


def test_tasks_per_node_with_repeats():
    assert [tasks_per_node("2(x3),1", n) for n in range(4)] == [2, 2, 2, 1]


def test_slurm_task_identity():
    info = cluster.detect(SLURM)
    assert (info.rank, info.world_size, info.local_rank, info.node_rank) == (5, 8, 1, 2)
    assert (info.num_nodes, info.local_world_size, info.master_addr) == (5, 2, "gpu07")
    assert info.master_port == tpp.job_port("slurm", SLURM["SLURM_JOB_ID"], "")
    assert info.source == "SLURM"


def test_each_slurm_step_gets_its_own_port_and_its_own_nodes():
    """Two concurrent steps of one allocation (a sweep) never share a rendezvous, and a step on
    the job's second node takes its master from the step, not the job."""
    a = cluster.detect({**SLURM, "SLURM_STEP_ID": "0"})
    b = cluster.detect({**SLURM, "SLURM_STEP_ID": "1"})
    assert a.master_port != b.master_port
    assert a.master_port == cluster.detect({**SLURM, "SLURM_STEP_ID": "0"}).master_port
    step = {
        **SLURM,
        "SLURM_STEP_ID": "2",
        "SLURM_STEP_NODELIST": "gpu09",
        "SLURM_STEP_NUM_NODES": "1",
        "SLURM_STEP_NUM_TASKS": "2",
        "SLURM_STEP_TASKS_PER_NODE": "2",
        "SLURM_PROCID": "1",
        "SLURMD_NODENAME": "gpu09",
    }
    step.pop("SLURM_NTASKS_PER_NODE", None)
    info = cluster.detect(step)
    assert (info.master_addr, info.num_nodes, info.world_size, info.node_rank) == (
        "gpu09", 1, 2, 0,
    )  # fmt: skip


def test_two_mpi_jobs_on_a_node_get_different_ports():
    env = {k: v for k, v in OPEN_MPI.items() if k != "MASTER_PORT"}
    a = cluster.detect({**env, "PMIX_NAMESPACE": "prterun-node1-1111@1"})
    b = cluster.detect({**env, "PMIX_NAMESPACE": "prterun-node1-2222@1"})
    assert a.master_port != b.master_port


def test_derived_ports_stay_below_the_ephemeral_range():
    """A port a scheduler's ids give lies where no outgoing connection takes one (Linux's
    ephemeral ports start at 32768; a derived port in that range was once taken by another
    step's gloo connection: EADDRINUSE at the rendezvous)."""
    ports = {tpp.job_port("slurm", str(job), str(step)) for job in range(500) for step in range(8)}
    assert min(ports) >= 20000 and max(ports) < 32768
    assert len(ports) > 3000  # spread over the range, not a few values
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as handle:
            first = int(handle.read().split()[0])
    except OSError:
        return
    assert max(ports) < first, f"this machine's ephemeral ports start at {first}"


def test_torchrun_inside_slurm_wins():
    env = {**SLURM, "RANK": "3", "WORLD_SIZE": "4", "TORCHELASTIC_RUN_ID": "x"}
    assert cluster.detect(env).source == "torchrun" and cluster.detect(env).rank == 3


def test_plain_process_is_rank_zero_of_one():
    info = cluster.detect({})
    assert (info.rank, info.world_size, info.source) == (0, 1, "single process")


def test_doctor_reports_the_slurm_identity(tmp_path):
    lines = identity(doctor(SLURM, tmp_path))
    assert lines["detected"] == "SLURM"
    assert (lines["rank"], lines["world_size"], lines["node_rank"]) == ("5", "8", "2")
    assert lines["master_addr"] == "gpu07"


# -- the environments each scheduler really sets ------------------------------------------------

#: What the Kubeflow training operator sets in worker pod 2 of a PyTorchJob with 1 master and
#: 3 workers (plus what Kubernetes sets in every pod).
KUBEFLOW = {
    "KUBERNETES_PORT": "tcp://10.96.0.1:443",
    "KUBERNETES_SERVICE_HOST": "10.96.0.1",
    "MASTER_ADDR": "mnist-master-0",
    "MASTER_PORT": "23456",
    "WORLD_SIZE": "4",
    "RANK": "2",
    "PYTHONUNBUFFERED": "0",
}

#: jsrun task 5 of 8 in an LSF job on two compute hosts (4 tasks each) behind a launch node.
LSF = {
    "LSB_JOBID": "4321",
    "LSB_MCPU_HOSTS": "batch1 1 c01n01 4 c01n02 4",
    "JSM_NAMESPACE_RANK": "5",
    "JSM_NAMESPACE_SIZE": "8",
    "JSM_NAMESPACE_LOCAL_RANK": "1",
    "JSM_NAMESPACE_LOCAL_SIZE": "4",
}

#: `mpirun -np 4 --map-by slot -x MASTER_ADDR=node1` on two nodes of 2 slots, rank 3 (Open MPI).
OPEN_MPI = {
    "OMPI_COMM_WORLD_RANK": "3",
    "OMPI_COMM_WORLD_SIZE": "4",
    "OMPI_COMM_WORLD_LOCAL_RANK": "1",
    "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
    "OMPI_COMM_WORLD_NODE_RANK": "1",
    "OMPI_MCA_ess_base_jobid": "3405643777",
    "MASTER_ADDR": "node1",
}

#: `mpiexec -n 4 -ppn 2` (MPICH Hydra / Intel MPI), rank 2, on one host pair.
MPICH = {
    "PMI_RANK": "2",
    "PMI_SIZE": "4",
    "PMI_FD": "6",
    "MPI_LOCALRANKID": "0",
    "MPI_LOCALNRANKS": "2",
    "MASTER_ADDR": "10.0.0.7",
    "MASTER_PORT": "31000",
}


def fields(info: cluster.ClusterInfo) -> tuple:
    return (info.rank, info.world_size, info.local_rank, info.local_world_size, info.node_rank,
            info.num_nodes, info.master_addr, info.master_port, info.source)  # fmt: skip


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        (KUBEFLOW, (2, 4, 0, 1, 2, 4, "mnist-master-0", 23456, "Kubeflow PyTorchJob")),
        (LSF, (5, 8, 1, 4, 1, 2, "c01n01", 14321, "LSF")),
        (
            OPEN_MPI,
            (3, 4, 1, 2, 1, 2, "node1", tpp.job_port("mpi", "3405643777"), "mpirun (Open MPI)"),
        ),
        (MPICH, (2, 4, 0, 2, 1, 2, "10.0.0.7", 31000, "mpirun (MPICH/Intel MPI)")),
    ],
    ids=["kubeflow", "lsf", "open-mpi", "mpich"],
)
def test_each_scheduler_is_read_from_the_variables_it_sets(env, expected):
    assert fields(cluster.detect(env)) == expected


def test_lsf_hosts_from_the_rankfile_skip_the_launch_node(tmp_path):
    rankfile = tmp_path / "rankfile"
    rankfile.write_text("batch1\n" + "c01n01\n" * 4 + "c01n02\n" * 4)
    env = {**LSF, "LSB_DJOB_RANKFILE": str(rankfile)}
    del env["LSB_MCPU_HOSTS"]
    info = cluster.detect(env)
    assert (info.num_nodes, info.master_addr, info.node_rank) == (2, "c01n01", 1)


def test_kubeflow_with_nproc_per_node_reads_torchruns_pet_variables():
    env = {**KUBEFLOW, "PET_NNODES": "4", "PET_NPROC_PER_NODE": "8", "PET_NODE_RANK": "2",
           "PET_MASTER_ADDR": "mnist-master-0", "PET_MASTER_PORT": "23456"}  # fmt: skip
    info = cluster.detect(env)
    assert (info.rank, info.world_size, info.node_rank, info.num_nodes) == (16, 32, 2, 4)
    assert info.local_world_size == 8 and info.master_addr == "mnist-master-0"


def test_kubeflow_is_not_claimed_outside_kubernetes():
    env = {k: v for k, v in KUBEFLOW.items() if not k.startswith("KUBERNETES")}
    assert cluster.detect(env).source == "environment (RANK/WORLD_SIZE)"


def test_mpi_across_nodes_without_master_addr_says_how_to_pass_it():
    env = {k: v for k, v in OPEN_MPI.items() if k != "MASTER_ADDR"}
    with pytest.raises(ConfigurationError, match=r"MASTER_ADDR is not set.*mpirun -x MASTER_ADDR"):
        cluster.detect(env)
    one_node = {**env, "OMPI_COMM_WORLD_LOCAL_SIZE": "4"}
    assert cluster.detect(one_node).master_addr == "127.0.0.1"


@pytest.mark.parametrize("scheduler", [SLURM, KUBEFLOW, LSF, OPEN_MPI, MPICH])
def test_inside_torchrun_workers_torchrun_answers_whatever_the_scheduler_set(scheduler):
    worker = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "TORCHELASTIC_RUN_ID": "r"}
    info = cluster.detect({**scheduler, **worker, "MASTER_ADDR": "h", "MASTER_PORT": "29400"})
    assert (info.rank, info.world_size, info.source) == (1, 2, "torchrun")


def test_a_third_party_scheduler_plugin_never_answers_in_torchrun_workers():
    """A plugin written as the docs say, without stepping aside under torchrun."""

    class Greedy:
        @hookimpl
        def torchplug_cluster_environment(self, env):
            return cluster.ClusterInfo(source="greedy") if "GREEDY" in env else None

    tp.register(Greedy())
    assert cluster.detect({"GREEDY": "1"}).source == "greedy"  # the launcher process
    worker = {"GREEDY": "1", "RANK": "0", "WORLD_SIZE": "2", "TORCHELASTIC_RUN_ID": "r"}
    assert cluster.detect(worker).source == "torchrun"


@pytest.mark.slow
def test_mpirun_style_plugin_from_the_docs_works_under_torchplug_launch(tmp_path):
    """`mpirun -np 1 torchplug launch -n 2`: the launcher process is MPI rank 0 of 1; its two
    torchrun workers must be ranks 0 and 1 of 2, not two ranks 0 of 1 running `single`."""
    (tmp_path / "my_mpi_env.py").write_text(
        textwrap.dedent(
            """
            import torchplug.plugin as tpp

            @tpp.hookimpl
            def torchplug_cluster_environment(env):
                if "OMPI_COMM_WORLD_RANK" not in env:
                    return None
                size = int(env["OMPI_COMM_WORLD_SIZE"])
                return tpp.ClusterInfo(
                    rank=int(env["OMPI_COMM_WORLD_RANK"]), world_size=size,
                    local_rank=int(env.get("OMPI_COMM_WORLD_LOCAL_RANK", 0)),
                    local_world_size=int(env.get("OMPI_COMM_WORLD_LOCAL_SIZE", size)),
                    source="my mpi",
                )
            """
        )
    )
    (tmp_path / "script.py").write_text(
        "import os, torchplug as tp\n"
        "with tp.Engine() as engine:\n"
        "    line = f'RANK {engine.rank}/{engine.world_size} {engine.strategy} "
        "{engine.cluster.source}\\n'\n"
        "    os.write(1, line.encode())\n"
    )
    mpi = {"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "1",
           "OMPI_COMM_WORLD_LOCAL_RANK": "0", "OMPI_COMM_WORLD_LOCAL_SIZE": "1"}  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHPLUG_")}
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "torchplug",
            "launch",
            "-n",
            "2",
            "--plugin",
            "my_mpi_env",
            "script.py",
        ],  # fmt: skip
        env={**env, **mpi},
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    lines = sorted(line for line in run.stdout.splitlines() if line.startswith("RANK"))
    assert lines == ["RANK 0/2 ddp torchrun", "RANK 1/2 ddp torchrun"], run.stdout


# -- several tasks per node: the scheduler starts every rank ---------------------------------------

ONE_WORLD = """
import torch, torchplug as tp
with tp.Engine() as engine:
    total = engine.reduce(torch.tensor([float(engine.rank + 1)]), "sum").item()
    print(f"world={engine.world_size} rank={engine.rank} strategy={engine.strategy} sum={total}")
"""


def _tasks(kind: str, rank: int, port: int, step: str = "0") -> dict[str, str]:
    if kind == "srun":
        return {
            "SLURM_PROCID": str(rank), "SLURM_NTASKS": "2", "SLURM_LOCALID": str(rank),
            "SLURM_NODEID": "0", "SLURM_JOB_NODELIST": "localhost", "SLURM_TASKS_PER_NODE": "2",
            "SLURM_JOB_ID": "4242", "SLURM_STEP_ID": step, "MASTER_PORT": str(port),
        }  # fmt: skip
    return {
        "OMPI_COMM_WORLD_RANK": str(rank), "OMPI_COMM_WORLD_SIZE": "2",
        "OMPI_COMM_WORLD_LOCAL_RANK": str(rank), "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
        "MASTER_PORT": str(port),
    }  # fmt: skip


def _start_tasks(kind: str, script, *flags: str) -> list[subprocess.CompletedProcess]:
    """What ``srun -n 2`` / ``mpirun -np 2`` do to ``torchplug launch``: two processes on one
    node, each with the scheduler's variables for its task."""
    port = tpp.free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "torchplug", "launch", *flags, str(script)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**CLEAN_ENV, **_tasks(kind, rank, port), "PYTHONWARNINGS": "ignore"},
        )  # fmt: skip
        for rank in range(2)
    ]
    done = []
    for proc in procs:
        out, err = proc.communicate(timeout=600)
        done.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
    return done


CLEAN_ENV = {
    k: v
    for k, v in os.environ.items()
    if not k.startswith(("SLURM_", "OMPI_", "PMI", "TORCHPLUG_", "MASTER_", "RANK", "WORLD_"))
}


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["srun", "mpirun"])
def test_several_tasks_per_node_under_torchplug_launch_form_one_world(tmp_path, kind):
    script = tmp_path / "one_world.py"
    script.write_text(ONE_WORLD)
    runs = _start_tasks(kind, script)
    for rank, run in enumerate(runs):
        assert run.returncode == 0, run.stderr[-3000:]
        assert f"world=2 rank={rank} strategy=ddp sum=3.0" in run.stdout, run.stdout


@pytest.mark.slow
def test_several_tasks_per_node_with_n_above_one_is_refused_naming_both_ways(tmp_path):
    script = tmp_path / "one_world.py"
    script.write_text(ONE_WORLD)
    for run in _start_tasks("srun", script, "-n", "2"):
        assert run.returncode == 2 and "world=" not in run.stdout
        assert "SLURM started 2 tasks on this node" in run.stderr
        assert "srun -n 2 torchplug launch SCRIPT, without -n" in run.stderr
        assert "srun --ntasks-per-node=1 torchplug launch -n 2 SCRIPT" in run.stderr


def test_a_multi_node_run_on_a_host_named_as_loopback_names_the_interface_variables(
    monkeypatch, capsys
):
    import socket

    from torchplug.cli.launch import warn_loopback

    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    monkeypatch.delenv("NCCL_SOCKET_IFNAME", raising=False)
    answers = {"nodea": "127.0.1.1", "10.1.2.3": "10.1.2.3"}
    monkeypatch.setattr(socket, "gethostname", lambda: "nodea")
    monkeypatch.setattr(socket, "gethostbyname", lambda name: answers.get(name, "127.0.0.1"))
    warn_loopback(2, "10.1.2.3")
    err = capsys.readouterr().err
    assert "resolves to 127.0.1.1, a loopback address, on a 2-node run" in err
    assert "GLOO_SOCKET_IFNAME" in err and "NCCL_SOCKET_IFNAME" in err
    for quiet in [(1, "10.1.2.3"), (2, "127.0.0.1")]:  # one node; every node on this host
        warn_loopback(*quiet)
        assert capsys.readouterr().err == ""
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth0")
    warn_loopback(2, "10.1.2.3")
    assert capsys.readouterr().err == ""


def test_a_master_addr_that_does_not_resolve_fails_at_once_naming_it(tmp_path):
    """Issue 36 item 7: a leftover MASTER_ADDR that names no host used to wait for torch's
    1800 s default without a word; now the Engine refuses at once, naming the variable, its
    value and where the identity came from."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "OMPI_", "PMI_"))}
    env.pop("TORCHELASTIC_RUN_ID", None)
    env.update(
        RANK="1", WORLD_SIZE="2", MASTER_ADDR="no-such-host.invalid",
        MASTER_PORT=str(tpp.free_port()),
    )  # fmt: skip
    done = subprocess.run(
        [sys.executable, "-c", "import torchplug as tp; tp.Engine('ddp')"],
        capture_output=True, text=True, env=env, timeout=600, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode != 0
    assert "MASTER_ADDR='no-such-host.invalid'" in done.stderr, done.stderr[-2000:]
    assert "environment (RANK/WORLD_SIZE)" in done.stderr and "does not resolve" in done.stderr
