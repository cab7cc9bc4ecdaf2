"""ft-ddp on real replica groups (each its own ``torchplug launch``, gloo on loopback, a real
torchft lighthouse), against ``ddp`` and against a plain-PyTorch reference of the committed
steps. The script is `scripts/train.py`: the same one for ``ddp`` and ``ft-ddp``."""

from __future__ import annotations

import copy
import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("torchft")
pytest.importorskip("torchplug_torchft")

SCRIPT = Path(__file__).parent / "scripts" / "train.py"


def _job():
    """The scripts' model, optimizer and data (`scripts/ft_job.py`), imported by path."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("ft_job", SCRIPT.parent / "ft_job.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


JOB = _job()
#: A hang guard for one run (each takes seconds to a minute); never a budget.
TIMEOUT = 900
TOLERANCE = 1e-6


def run(command: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    merged = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    merged.pop("MASTER_PORT", None)
    return subprocess.run(
        command, env=merged, capture_output=True, text=True, timeout=TIMEOUT, check=False
    )


#: The two spellings of one launch: torchplug's own (ft-ddp brings its launcher), the package's.
SPELLINGS = {
    "torchplug": ("torchplug", "launch", "--strategy", "ft-ddp"),
    "package": ("torchplug_torchft", "launch"),
}


def ft(
    out: Path,
    replicas: int,
    per_group: int = 1,
    launcher: tuple = (),
    script: tuple = (),
    spelling: str = "package",
):
    out.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", *SPELLINGS[spelling], "--replicas", str(replicas)]
    command += [*launcher, "-n", str(per_group), str(SCRIPT), "--out", str(out), *script]
    done = run(command)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-8000:]
    return done


def ddp(out: Path, ranks: int, *script: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "torchplug", "launch", "-n", str(ranks), "--strategy"]
    done = run([*command, "ddp", str(SCRIPT), "--out", str(out), *script])
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-8000:]


def entries(out: Path, who: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / f"{who}.jsonl").read_text().splitlines()]


def steps(out: Path, who: str) -> dict[int, dict[str, Any]]:
    return {e["step"]: e for e in entries(out, who) if "step" in e}


def final(out: Path, who: str) -> dict[str, torch.Tensor]:
    found = json.loads((out / f"{who}_final.json").read_text())
    return {name: torch.tensor(value) for name, value in found.items()}


def parameters(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The weights, without BatchNorm's running statistics (each rank's own, as under DDP)."""
    return {k: v for k, v in state.items() if "running" not in k and "num_batches" not in k}


def largest_gap(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


@pytest.mark.parametrize(
    ("replicas", "per_group", "spelling"),
    [(2, 1, "torchplug"), (3, 1, "package"), (2, 2, "package")],
)
def test_without_a_failure_it_trains_as_ddp_on_the_same_global_batch(
    tmp_path, replicas, per_group, spelling
):
    """R groups of N ranks against ``ddp`` on R*N ranks: the same batches on the same data-
    parallel ranks, every step's loss and the final parameters and buffers within 1e-6
    (``torchplug launch --strategy ft-ddp --replicas 2``: the spelling torchplug gives)."""
    done = ft(tmp_path / "ft", replicas, per_group, spelling=spelling)
    assert done.stdout.count("lighthouse at") == 1, done.stdout[-2000:]
    ddp(tmp_path / "ddp", replicas * per_group)
    for group in range(replicas):
        for rank in range(per_group):
            who = f"group{group}_rank{rank}"
            ddp_rank = f"group0_rank{group * per_group + rank}"
            ours, theirs = steps(tmp_path / "ft", who), steps(tmp_path / "ddp", ddp_rank)
            assert sorted(ours) == sorted(theirs) == list(range(12))
            for s in ours:
                assert ours[s]["idx"] == theirs[s]["idx"]
                assert abs(ours[s]["loss"] - theirs[s]["loss"]) <= TOLERANCE
            # the same weights, and the same buffers as ddp's rank (rank 0's before each
            # forward, then its own batch's update)
            gap = largest_gap(final(tmp_path / "ft", who), final(tmp_path / "ddp", ddp_rank))
            assert gap <= TOLERANCE, (who, gap)


@pytest.mark.parametrize("per_group", [1, 2])
def test_gather_for_metrics_gathers_every_group_without_the_padding_as_ddp(tmp_path, per_group):
    """An evaluation pass over 13 samples on 2 groups of N ranks and on ``ddp`` with 2N ranks:
    every step's samples are dealt over the quorum, the last padded to a multiple of its ranks,
    and ``gather_for_metrics`` hands every rank each sample once, in ``ddp``'s order (it had
    handed each group its own share only, padding included)."""
    ft(tmp_path / "ft", 2, per_group, script=("--steps", "2", "--eval-size", "13"))
    ddp(tmp_path / "ddp", 2 * per_group, "--steps", "2", "--eval-size", "13")
    theirs = json.loads((tmp_path / "ddp" / "group0_rank0_eval.json").read_text())
    assert sorted(i for batch in theirs for i in batch) == list(range(13))
    for group in (0, 1):
        for rank in range(per_group):
            found = tmp_path / "ft" / f"group{group}_rank{rank}_eval.json"
            assert json.loads(found.read_text()) == theirs, (group, rank)


def reference(logs: dict[int, dict[int, dict[str, Any]]], last: int) -> dict[str, torch.Tensor]:
    """Plain PyTorch: the script's model, optimizer and scheduler, stepped once per committed
    step with the mean of the gradients of the ranks (``logs``' keys, the first group's rank 0
    first) that took part in it, each on its own logged batch, its BatchNorm on that batch: the
    buffers are the first rank's, updated by its own batches (every forward starts from them)."""
    import torchplug as tp

    tp.seed_everything(0)
    model = JOB.make_model()
    optimizer, scheduler = JOB.make_optimizer(model)
    x_all, y_all, _ = JOB.make_data().tensors
    for step in range(last):
        groups = sorted(group for group, log in logs.items() if step in log)
        grads, buffers = [], None
        for group in groups:
            idx = torch.tensor(logs[group][step]["idx"])
            replica = copy.deepcopy(model)
            loss = torch.nn.functional.cross_entropy(replica(x_all[idx]), y_all[idx])
            loss.backward()
            grads.append([p.grad for p in replica.parameters()])
            if buffers is None:
                buffers = [b.clone() for b in replica.buffers()]
        for param, *each in zip(model.parameters(), *grads, strict=True):
            param.grad = torch.stack(each).mean(0)
        with torch.no_grad():
            for mine, lead in zip(model.buffers(), buffers, strict=True):
                mine.copy_(lead)
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
    return {k: v.detach() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("per_group", [1, 2])
def test_a_killed_group_rejoins_live_and_the_others_never_stop(tmp_path, per_group):
    """Group 1's last rank is SIGKILLed before its step 6; group 0 keeps stepping alone (at most
    the step group 1 died in is given up and dealt again, no restart); group 1's launcher
    restarts it, it takes the live state of group 0 (the log says "healing is required") and
    both end equal, and equal to the reference of the steps committed, each with the gradients
    of the ranks that took part in it. The data rule: every epoch trains on each sample once,
    whoever was alive (group 0 takes the whole of each step's samples while alone). Groups of 1
    rank, then of 2 (the whole group restarts)."""
    out = tmp_path / "ft"
    die = ("--die-at", "6", "--die-group", "1", "--die-rank", str(per_group - 1))
    done = ft(
        out,
        2,
        per_group,
        launcher=("--heartbeat-timeout", "1", "--max-restarts", "2"),
        script=("--steps", "40", "--slow", "0.3", *die),
    )
    healing = [line for line in done.stderr.splitlines() if "healing is required" in line]
    print("\n".join(healing))  # the recorded recovery, in the test output
    assert healing, done.stderr[-8000:]
    ranks = [(g, r) for g in (0, 1) for r in range(per_group)]
    logs = {(g, r): steps(out, f"group{g}_rank{r}") for g, r in ranks}
    for rank in range(per_group):
        zero, one = entries(out, f"group0_rank{rank}"), entries(out, f"group1_rank{rank}")
        assert [e for e in zero if "start" in e] == [{"start": 0}]  # never restarted
        given_up = [e["skipped"] for e in zero if "skipped" in e]
        print("steps given up on group 0 (dealt again):", given_up)
        assert len(given_up) <= 1  # the step group 1 died in, at most
        assert sorted(logs[0, rank]) == list(range(40))
        starts = [e["start"] for e in one if "start" in e]
        assert starts[0] == 0 and len(starts) == 2 and starts[1] > 6  # rejoined later, live
        assert sorted(logs[1, rank]) == [*range(6), *range(starts[1], 40)]
    finals = [final(out, f"group{g}_rank{r}") for g, r in ranks]
    for other in finals[1:]:
        assert largest_gap(parameters(finals[0]), parameters(other)) == 0.0  # one model
    replicas = {i: logs[who] for i, who in enumerate(ranks)}  # group 0's rank 0 first
    assert largest_gap(finals[0], reference(replicas, 40)) <= 1e-5

    # The data rule: per epoch, the samples of every committed step of every rank
    alone = [s for s in logs[0, 0] if s not in logs[1, 0]]  # group 0 took whole steps
    assert alone and all(len(logs[0, r][s]["idx"]) == 8 for s in alone for r in range(per_group))
    by_epoch: dict[int, list[int]] = {}
    for log in logs.values():
        for entry in log.values():
            by_epoch.setdefault(entry["epoch"], []).extend(entry["idx"])
    epochs = sorted(by_epoch)
    assert len(epochs) >= 3, epochs
    for epoch in epochs[:-1]:  # complete epochs: each of the 96 samples once
        assert sorted(by_epoch[epoch]) == list(range(96)), epoch
    assert len(by_epoch[epochs[-1]]) == len(set(by_epoch[epochs[-1]]))


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_no_lighthouse_is_an_error_naming_it_not_a_wait(tmp_path):
    """No lighthouse at the address: the group fails within replica_timeout, saying so."""
    command = [sys.executable, "-m", "torchplug", "launch", "-n", "1", "--strategy", "ft-ddp"]
    command += ["--option", "replica_timeout=3", str(SCRIPT), "--out", str(tmp_path)]
    env = {
        "TORCHFT_LIGHTHOUSE": f"http://127.0.0.1:{free_port()}",
        "TORCHPLUG_FT_REPLICA": "0",
        "TORCHPLUG_FT_REPLICAS": "1",
    }
    done = run(command, env)
    assert done.returncode != 0
    assert "ft-ddp: starting the group's manager failed" in done.stderr
    assert "Check that the lighthouse runs" in done.stderr


def test_a_lighthouse_that_dies_mid_run_is_an_error_not_a_hang(tmp_path):
    """The lighthouse goes away while the groups train: each group's next quorum fails within
    replica_timeout with an error naming the lighthouse."""
    import shutil

    port = free_port()
    binary = shutil.which("torchft_lighthouse") or str(
        Path(sys.executable).parent / "torchft_lighthouse"
    )
    lighthouse = subprocess.Popen(
        [binary, "--min_replicas", "1", "--bind", f"[::]:{port}", "--join_timeout_ms", "500"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    command = [sys.executable, "-m", "torchplug", "launch", "-n", "1", "--strategy", "ft-ddp"]
    command += ["--option", "replica_timeout=5", str(SCRIPT), "--out", str(tmp_path)]
    command += ["--steps", "400", "--slow", "0.05"]
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "TORCHFT_LIGHTHOUSE": f"http://127.0.0.1:{port}",
        "TORCHPLUG_FT_REPLICA": "0",
        "TORCHPLUG_FT_REPLICAS": "1",
    }
    env.pop("MASTER_PORT", None)
    group = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    log = tmp_path / "group0_rank0.jsonl"
    try:
        while not (log.exists() and log.read_text().count('"step"') >= 3):
            assert group.poll() is None, group.communicate()[1][-4000:]
            subprocess.run(["sleep", "0.2"], check=True)
        lighthouse.kill()  # SIGKILL: gone without a word
        _, stderr = group.communicate(timeout=TIMEOUT)
    finally:
        for process in (group, lighthouse):
            if process.poll() is None:
                process.kill()
        lighthouse.wait()
    assert group.returncode != 0
    text = stderr.decode(errors="replace")
    assert "ft-ddp: forming the step's quorum failed" in text, text[-4000:]


def test_an_ft_ddp_checkpoint_loads_into_single_and_fsdp(tmp_path):
    """Checkpoints from ft-ddp are the portable format: a group's loads into ``single`` (in
    process) and into ``fsdp`` on 2 ranks, every weight equal to the group's own final ones and
    the optimizer's moments equal between the two loads, bit for bit."""
    import torchplug as tp

    ft(tmp_path / "ft", 2)
    checkpoint = tmp_path / "ft" / "checkpoint_group1"
    model = JOB.make_model()
    optimizer, _ = JOB.make_optimizer(model)
    with tp.Engine("single") as engine:
        model, optimizer = engine.setup(model, optimizer)
        engine.load(checkpoint, {"model": model, "optimizer": optimizer})
        state = engine.full_state(model, optimizer)
    loaded = {k: v.detach() for k, v in state["model"].items()}
    assert largest_gap(loaded, final(tmp_path / "ft", "group1_rank0")) == 0.0

    out = tmp_path / "fsdp.json"
    command = [sys.executable, "-m", "torchplug", "launch", "-n", "2", "--strategy", "fsdp"]
    command += [str(SCRIPT.parent / "load.py"), "--checkpoint", str(checkpoint), "--out", str(out)]
    done = run(command)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-8000:]
    sharded = json.loads(out.read_text())
    on_fsdp = {name: torch.tensor(value) for name, value in sharded["model"].items()}
    assert largest_gap(on_fsdp, loaded) == 0.0
    moments = {
        f"{name}.{key}": value
        for name, entry in state["optimizer"]["state"].items()
        for key, value in entry.items()
        if torch.is_tensor(value) and value.dim() > 0
    }
    assert moments and moments.keys() == sharded["moments"].keys()
    for key, value in moments.items():
        assert torch.equal(torch.tensor(sharded["moments"][key]), value), key


def test_the_plugin_is_listed_and_usable():
    done = run([sys.executable, "-m", "torchplug", "plugins"])
    line = next(line for line in done.stdout.splitlines() if line.startswith("ft-ddp"))
    assert "torchplug-torchft" in line and "usable" in line
