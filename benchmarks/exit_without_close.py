"""Run a 2-rank DDP script that never calls ``engine.close()`` many times; count unclean exits.

    python benchmarks/exit_without_close.py [--runs 50]

torchplug destroys the process group at interpreter exit, so the gloo abort at exit
("terminate called without an active exception") must never appear. Prints one line per run
and a final tally; exits 1 if any run failed.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

SCRIPT = textwrap.dedent(
    """
    import torch, torchplug as tp
    engine = tp.Engine("ddp")
    model = torch.nn.Linear(4, 2)
    model, optimizer = engine.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    for _ in range(3):
        engine.backward(model(torch.randn(8, 4)).sum())
        optimizer.step()
        optimizer.zero_grad()
    engine.print("loss", engine.reduce(torch.tensor(1.0), "sum").item())
    # no engine.close(): the process group is torchplug's to release at exit
    """
)


def run_once(script: Path, timeout: float = 120.0) -> tuple[bool, str]:
    """One 2-rank launch; (clean, why not)."""
    proc = subprocess.run(
        [sys.executable, "-m", "torchplug", "launch", "-n", "2", str(script)],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    output = proc.stdout + proc.stderr
    if proc.returncode != 0:
        return False, f"exit code {proc.returncode}: {output[-400:]}"
    if "terminate called" in output or "Aborted" in output:
        return False, f"abort at exit: {output[-400:]}"
    return True, ""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=50)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "no_close.py"
        script.write_text(SCRIPT)
        failures = 0
        start = time.perf_counter()
        for i in range(args.runs):
            clean, why = run_once(script)
            failures += not clean
            print(f"run {i + 1:3d}: {'clean' if clean else 'FAILED ' + why}", flush=True)
    elapsed = time.perf_counter() - start
    print(f"{args.runs - failures} of {args.runs} runs exited cleanly ({elapsed:.0f} s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
