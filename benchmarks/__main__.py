"""Run every benchmark side by side and write the Markdown table and the chart.

    python -m benchmarks                       # everything (tox -e bench), ~7 min on 2 cores
    python -m benchmarks --smoke               # tiny sizes, few rounds: does it still work?
    python -m benchmarks --only step,import    # some sections

Each section runs its contestants in the same job, interleaved round by round, so machine drift
hits all alike; the table shows the median over rounds of each round's ratio (or difference) to
the baseline, with the min-max range, and PASS/FAIL against the project's targets. Accelerate
and Lightning Fabric join when installed (``pip install -r benchmarks/requirements.txt``).
Output: ``benchmarks/results/results.md``, ``results.jsonl`` and ``results.png`` (a full run);
``--smoke`` and ``--only`` runs write under ``benchmarks/results/smoke`` or ``/partial``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks import failure, report, startup, validation

ROOT = Path(__file__).resolve().parent
SECTIONS = (
    "step", "dispatch", "import", "cli", "launch", "memory", "checkpoint", "validation", "gpu",
    "failure", "pipeline",
)  # fmt: skip
MEMORY_STRATEGIES = (
    "ddp",
    "fsdp",
    "fairscale-oss",
    "deepspeed-zero1",
    "deepspeed-zero2",
    "deepspeed-zero3",
)


def _torchrun(nprocs: int, module: str, args: list[str], timeout: float) -> None:
    """Run ``python -m module`` on ``nprocs`` ranks; a rank that fails or hangs ends it."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(nprocs),
        "--standalone",  # a free port of its own: other jobs on this machine use 29500
        "-m",
        module,
        *args,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    started = time.perf_counter()
    proc = subprocess.run(
        cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT.parent
    )
    if proc.returncode != 0:
        raise RuntimeError(
            f"{' '.join(cmd[2:])} failed with exit code {proc.returncode}:\n"
            f"{(proc.stdout + proc.stderr)[-3000:]}"
        )
    print(f"  {module} {' '.join(args[:4])}... {time.perf_counter() - started:.0f} s", flush=True)


def installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, few rounds (CI)")
    parser.add_argument("--rounds", type=int, default=None, help="rounds (default 9; smoke 2)")
    parser.add_argument("--only", default=None, help=f"comma list of {', '.join(SECTIONS)}")
    parser.add_argument(
        "--out",
        default=None,
        help="output directory (default: benchmarks/results for a full run, the table "
        "docs/benchmarks.md shows; benchmarks/results/smoke or /partial for --smoke or --only "
        "runs, which git ignores, so they never overwrite it)",
    )
    parser.add_argument("--no-chart", action="store_true", help="skip the PNG (no matplotlib)")
    args = parser.parse_args(argv)
    sections = args.only.split(",") if args.only else list(SECTIONS)
    unknown = [s for s in sections if s not in SECTIONS]
    if unknown:
        parser.error(f"unknown section(s) {unknown}; choose from {', '.join(SECTIONS)}")
    smoke = args.smoke
    rounds = args.rounds or (2 if smoke else 9)
    if args.out is not None:
        out = Path(args.out)
    else:
        out = ROOT / "results" / ("smoke" if smoke else "partial" if args.only else "")
    out.mkdir(parents=True, exist_ok=True)
    jsonl = out / "results.jsonl"
    jsonl.unlink(missing_ok=True)
    others = {"accelerate": "accelerate", "fabric": "lightning_fabric"}
    have = {name for name, module in others.items() if installed(module)}
    if set(others) - have and {"step", "import", "cli", "launch"} & set(sections):
        print(
            f"{', '.join(sorted(set(others) - have))} not installed: their rows are left out "
            f"(pip install -c constraints.txt -r benchmarks/requirements.txt adds them)",
            flush=True,
        )
    started = time.perf_counter()
    failures: list[str] = []
    # Imports are timed as a user's install runs them: with bytecode caches (a sandbox or CI
    # that sets PYTHONDONTWRITEBYTECODE would otherwise time the compiler instead).
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)

    def section(name: str, run: Any) -> None:
        if name not in sections:
            return
        print(f"[{name}]", flush=True)
        t0 = time.perf_counter()
        try:
            records = run()
        except Exception as exc:  # one broken section must not lose the others' results
            failures.append(f"{name}: {exc}")
            print(f"  FAILED: {exc}", flush=True)
            return
        if records:
            with jsonl.open("a") as handle:
                for rec in records:
                    handle.write(json.dumps(rec) + "\n")
        print(f"  {name} done in {time.perf_counter() - t0:.0f} s", flush=True)

    size = (
        ["--steps-tiny", "20", "--steps-medium", "2", "--width", "128", "--depth", "2"]
        if smoke
        else []
    )
    contestants = ["--contestants", ",".join(sorted(have))]

    def steps() -> None:
        _torchrun(
            2,
            "benchmarks.steps",
            ["--out", str(jsonl), "--rounds", str(rounds), "--sections", "step,fsdp,precision"]
            + size
            + contestants,
            timeout=900,
        )

    def dispatch() -> None:
        calls = ["--calls", "200"] if smoke else ["--calls", "5000"]
        _torchrun(
            1,
            "benchmarks.steps",
            ["--out", str(jsonl), "--rounds", str(max(rounds, 5)), "--sections", "dispatch"]
            + calls,
            timeout=300,
        )

    def memory() -> list[dict[str, Any]]:
        raw = out / "memory.jsonl"
        raw.unlink(missing_ok=True)
        strategies = ("ddp", "fsdp") if smoke else MEMORY_STRATEGIES
        for strategy in strategies:
            if strategy.startswith("deepspeed") and not installed("deepspeed"):
                continue
            if strategy.startswith("fairscale") and not installed("fairscale"):
                continue
            shape = ["--width", "128", "--depth", "2"] if smoke else []
            _torchrun(
                2,
                "benchmarks.memory",
                ["--strategy", strategy, "--out", str(raw)] + shape,
                timeout=300,
            )
        rows = [json.loads(line) for line in raw.read_text().splitlines()]
        raw.unlink()
        return report.memory_records(rows)

    def checkpoint() -> None:
        shape = ["--width", "256", "--depth", "2"] if smoke else []
        _torchrun(
            2,
            "benchmarks.checkpoint",
            ["--out", str(jsonl), "--rounds", str(rounds if not smoke else 2)] + shape,
            timeout=600,
        )
        if installed("deepspeed"):  # issue 25: a ZeRO-3 save holds its share, not the model
            small = ["--width", "256", "--depth", "4"] if smoke else []
            _torchrun(2, "benchmarks.save_memory", ["--out", str(jsonl)] + small, timeout=600)

    def gpu() -> None:
        import torch

        if not torch.cuda.is_available():
            print("  skipped: no CUDA device here", flush=True)
            return
        _torchrun(1, "benchmarks.gpu", ["--out", str(jsonl)], timeout=600)

    def pipeline() -> None:
        shape = ["--width", "64", "--depth", "4", "--rounds", "1"] if smoke else []
        _torchrun(2, "benchmarks.pipeline", ["--out", str(jsonl)] + shape, timeout=900)

    section("step", steps)
    section("dispatch", dispatch)
    section("import", lambda: startup.imports(max(rounds, 5) if not smoke else 2, have))
    section("cli", lambda: startup.cli(max(rounds, 5) if not smoke else 2, have))
    section("launch", lambda: startup.launch(5 if not smoke else 1, have))
    section("memory", memory)
    section("checkpoint", checkpoint)
    section("validation", lambda: validation.run(3 if not smoke else 1, smoke))
    section("gpu", gpu)
    section("failure", lambda: failure.run(3, smoke))
    section("pipeline", pipeline)

    records = (
        [json.loads(line) for line in jsonl.read_text().splitlines()] if jsonl.exists() else []
    )
    command = "python -m benchmarks" + (" --smoke" if smoke else "")
    if args.only:
        command += f" --only {args.only}"
    header = (
        f"`{command}` — {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
        f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at the end, "
        f"Python {platform.python_version()}, {report.versions()}, "
        f"{rounds} rounds, {time.perf_counter() - started:.0f} s"
    )
    table = report.markdown(records, header)
    (out / "results.md").write_text(table)
    print(table)
    if not args.no_chart:
        try:
            report.chart(records, out / "results.png")
        except ImportError:
            print("(no chart: matplotlib is not installed)")
    print(f"written to {out}{os.sep}")
    for broken in failures:
        print(f"section failed: {broken[:2000]}", file=sys.stderr)
    failed_targets = [r for r in records if report.verdict(r) == "FAIL"]
    if failed_targets:
        print(f"{len(failed_targets)} target(s) missed (see the table)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
