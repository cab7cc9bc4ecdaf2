"""Import time, CLI start and launch-to-first-step, each contestant in fresh processes,
interleaved round by round (run in the runner's own process; it starts the subprocesses).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

from benchmarks.common import interleaved, record

HEAVY = ("deepspeed", "fairscale", "torch_xla")


def user_env(**extra: str) -> dict[str, str]:
    """This environment as a user's Python sees it: bytecode caches written and read. A machine
    that sets ``PYTHONDONTWRITEBYTECODE`` (some containers do) would otherwise have every fresh
    interpreter compile whatever source has no cache yet (a clean clone: every torchplug module,
    +30 ms here), and the import and start rows would time the compiler. Same for every
    contestant."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    return {**env, **extra}


IMPORT_PROBE = textwrap.dedent(
    """
    import sys, time
    start = time.perf_counter()
    import torch
    torch_took = time.perf_counter() - start
    {statement}
    took = time.perf_counter() - start
    heavy = [m for m in {heavy!r} if m in sys.modules]
    print(took, took - torch_took, ",".join(heavy) or "-")
    """
)


#: What each contestant runs. torchplug imports torch lazily, so ``import torchplug`` alone
#: would hide its cost: it is timed with torch and with the lazy core resolved.
STATEMENTS = {
    "torch": "pass",
    "torchplug": "import torchplug; torchplug.Engine",
    "accelerate": "import accelerate",
    "lightning_fabric": "import lightning_fabric",
}


def _python_import(module: str) -> tuple[float, float, list[str]]:
    """Seconds ``import torch`` and then the module take in a fresh interpreter, the seconds of
    the module alone (after torch, in the same interpreter), and the heavy modules loaded."""
    probe = IMPORT_PROBE.format(statement=STATEMENTS[module], heavy=HEAVY)
    out = subprocess.run(
        [sys.executable, "-c", probe],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
        env=user_env(),
    ).stdout.split()
    return float(out[0]), float(out[1]), [m for m in out[2].split(",") if m != "-"]


def imports(rounds: int, have: set[str]) -> list[dict[str, Any]]:
    """``import torch`` against ``import torchplug`` (and the alternatives), fresh interpreters.

    Every probe imports torch first and times it, then the contestant: torchplug's own cost is
    the time after torch in the same interpreter (torch's import varies by hundreds of ms from
    one process to the next on a loaded machine, which would hide a few ms); the alternatives,
    whose import is mostly their own heavy dependencies, are shown as totals over torch's.
    """
    modules = ["torch", "torchplug"] + [
        m for m, c in (("accelerate", "accelerate"), ("lightning_fabric", "fabric")) if c in have
    ]
    loaded: dict[str, list[str]] = {}
    alone: dict[str, list[float]] = {m: [] for m in modules}

    def probe(module: str) -> float:
        took, after_torch, heavy = _python_import(module)
        loaded[module] = heavy
        alone[module].append(after_torch * 1e3)
        return took * 1e3

    for module in modules:  # not timed: the first import writes the bytecode caches
        _python_import(module)
    results = interleaved({m: (lambda m=m: probe(m)) for m in modules}, rounds, lambda: None)
    group = "import in a fresh interpreter (torch first), over import torch"
    records = []
    for module, values in results.items():
        name = "import torch" if module == "torch" else f"import torch; {STATEMENTS[module]}"
        rec = record(
            "import", group, name, "ms", values, results["torch"], "import torch", None, mode="diff"
        )
        rec["heavy_loaded"] = loaded.get(module, [])
        records.append(rec)
    rec = record(
        "import",
        group,
        f"{STATEMENTS['torchplug']} (after torch, same interpreter)",
        "ms",
        alone["torchplug"],
        [0.0] * len(alone["torchplug"]),
        "nothing",
        {"max": 30.0, "note": "no " + "/".join(HEAVY) + " loaded"},
        mode="diff",
    )
    rec["heavy_loaded"] = loaded.get("torchplug", [])
    records.append(rec)
    return records


def _wall(cmd: list[str], env: dict[str, str] | None = None, timeout: float = 180) -> float:
    start = time.perf_counter()
    proc = subprocess.run(
        cmd, capture_output=True, text=True, timeout=timeout, env=user_env() if env is None else env
    )
    took = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(
            f"benchmark command {' '.join(cmd)} failed with exit code {proc.returncode}:\n"
            f"{(proc.stdout + proc.stderr)[-2000:]}"
        )
    return took


def _bin(name: str) -> str:
    """A console script of this interpreter's environment (not whatever PATH finds first)."""
    here = Path(sys.executable).parent / name
    return str(here) if here.exists() else (shutil.which(name) or name)


def cli(rounds: int, have: set[str]) -> list[dict[str, Any]]:
    """Wall time of ``torchplug --help`` and ``torchplug plugins`` against Accelerate's CLI."""
    commands = {
        "torchplug --help": [_bin("torchplug"), "--help"],
        "torchplug plugins": [_bin("torchplug"), "plugins"],
    }
    if "accelerate" in have:
        commands["accelerate --help"] = [_bin("accelerate"), "--help"]
        commands["accelerate env"] = [_bin("accelerate"), "env"]
    for command in commands.values():  # not timed: the first start writes the bytecode caches
        _wall(command)
    results = interleaved(
        {name: (lambda c=c: _wall(c)) for name, c in commands.items()}, rounds, lambda: None
    )
    return [
        record("cli", "command wall time", name, "s", values, target=None)
        for name, values in results.items()
    ]


SCRIPTS = {
    "torchrun": """
        import os, sys, time, torch, torch.distributed as dist
        dist.init_process_group("gloo")
        model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 2))
        model(torch.randn(8, 4)).sum().backward()
        {report}
        dist.barrier()  # as the Engine's close: a rank leaving first may abort the other in gloo
        dist.destroy_process_group()
        """,
    "torchplug launch": """
        import os, sys, time, torch, torchplug as tp
        with tp.Engine() as engine:
            model = engine.setup(torch.nn.Linear(4, 2))
            engine.backward(model(torch.randn(8, 4)).sum())
            {report}
        """,
    "accelerate launch": """
        import os, sys, time, torch
        from accelerate import Accelerator
        accelerator = Accelerator(cpu=True)
        model = accelerator.prepare(torch.nn.Linear(4, 2))
        accelerator.backward(model(torch.randn(8, 4)).sum())
        {report}
        accelerator.wait_for_everyone()  # as the others: no rank leaves while gloo still talks
        torch.distributed.destroy_process_group()
        """,
    "fabric run": """
        import os, sys, time, torch
        from lightning_fabric import Fabric
        # no fabric.launch(): `fabric run` has started the processes already
        fabric = Fabric(accelerator="cpu", devices=2, strategy="ddp")
        model = fabric.setup(torch.nn.Linear(4, 2))
        fabric.backward(model(torch.randn(8, 4)).sum())
        {report}
        fabric.barrier()  # a rank leaving first aborted the other in gloo (SIGABRT) now and then
        torch.distributed.destroy_process_group()
        """,
}
REPORT = 'open(os.environ["BENCH_FIRST_STEP"] + str({rank}), "w").write(repr(time.time()))'
RANKS = {
    "torchrun": "dist.get_rank()",
    "torchplug launch": "engine.rank",
    "accelerate launch": "accelerator.process_index",
    "fabric run": "fabric.global_rank",
}


def launch(rounds: int, have: set[str]) -> list[dict[str, Any]]:
    """Seconds from starting the launcher to the first step done on the slower of 2 ranks."""
    tmp = Path(tempfile.mkdtemp(prefix="torchplug-bench-launch-"))
    commands: dict[str, list[str]] = {}
    for name, body in SCRIPTS.items():
        if (name == "accelerate launch" and "accelerate" not in have) or (
            name == "fabric run" and "fabric" not in have
        ):
            continue
        script = tmp / (name.replace(" ", "_") + ".py")
        script.write_text(textwrap.dedent(body).format(report=REPORT.format(rank=RANKS[name])))
        commands[name] = {
            "torchrun": [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"],
            "torchplug launch": [_bin("torchplug"), "launch", "-n", "2"],
            # --cpu alone starts one process (multi-CPU needs MPI there); --multi_gpu is its
            # torchrun launcher, and the script's Accelerator(cpu=True) then runs MULTI_CPU
            "accelerate launch": [
                _bin("accelerate"),
                "launch",
                "--multi_gpu",
                "--num_processes",
                "2",
                "--num_machines",
                "1",
                "--mixed_precision",
                "no",
                "--dynamo_backend",
                "no",
            ],
            "fabric run": [_bin("fabric"), "run", "--accelerator", "cpu", "--devices", "2"],
        }[name] + [str(script)]

    exit_failed = dict.fromkeys(commands, 0)

    def first_step(name: str) -> float:
        marker = tmp / f"{name.replace(' ', '_')}.first-"
        files = [tmp / f"{marker.name}{r}" for r in range(2)]
        for file in files:
            file.unlink(missing_ok=True)  # a failed run must not read the last run's stamps
        env = user_env(BENCH_FIRST_STEP=str(marker), OMP_NUM_THREADS="1")
        start = time.time()
        try:
            _wall(commands[name], env)
        except RuntimeError:
            # gloo now and then aborts rank 0 (SIGABRT) as the ranks tear down, after both
            # stamped their first step: seen for every contestant here, the raw torchrun script
            # included. What is timed is complete then, and the row says how often it happened;
            # a run that fails before both stamps still fails the section.
            if not all(file.exists() for file in files):
                raise
            exit_failed[name] += 1
        return max(float(file.read_text()) for file in files) - start

    for name in commands:  # not timed: the first start writes the bytecode caches
        first_step(name)
    results = interleaved(
        {name: (lambda n=name: first_step(n)) for name in commands}, rounds, lambda: None
    )
    shutil.rmtree(tmp, ignore_errors=True)
    records = []
    for name, values in results.items():
        rec = record(
            "launch",
            "launch 2 ranks to first step done, over torchrun",
            name,
            "s",
            values,
            results["torchrun"],
            "torchrun",
            {"max": 0.3} if name == "torchplug launch" else None,
            mode="diff",
        )
        if exit_failed[name]:
            rec["detail"] = (
                f"a rank aborted after both first steps in {exit_failed[name]} of {rounds + 1} "
                f"runs (gloo at teardown)"
            )
        records.append(rec)
    return records
