"""The benchmark runner still works: ``python -m benchmarks --smoke`` with tiny sizes.

Timings from a smoke run mean nothing (2 rounds, tiny models, a shared CI machine), so only the
table's shape is checked, never PASS/FAIL. Accelerate and Fabric join only where installed (the
``bench`` tox env); the launch section is left out here to keep this under a minute.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest

from support.paths import ROOT


@pytest.mark.slow
def test_smoke_run_writes_the_table(tmp_path):
    sections = "step,dispatch,import,cli,memory,checkpoint,validation,gpu,pipeline"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks", "--smoke", "--only", sections, "--no-chart"]
        + ["--out", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,  # a hang guard, far above the ~3 minutes it takes
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    table = (tmp_path / "results.md").read_text()
    records = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    names = {r["name"] for r in records}
    for expected in (
        "raw DDP",
        "torchplug ddp",
        "torchplug fsdp",
        "torchplug ddp bf16",
        "torchplug ddp fp16",
        "engine.backward",
        "optimizer.step",
        "engine.reduce",
        "engine.place_batch",
        "torchplug --help",
        "fsdp: params+grads+optimizer state",
        "torchplug load (verified)",
        "pp, 2 stages",
        "interleaved-1f1b",
    ):
        assert expected in names, (expected, sorted(names))
    assert "| torchplug ddp |" in table or "| tiny MLP | torchplug ddp |" in table
    assert all(r["values"] for r in records)
    # fsdp's Engine rows are judged against the raw loop doing the same work, in wall time and
    # in the CPU work added
    fsdp = [r for r in records if r["name"].startswith("torchplug fsdp")]
    judged = {(r["unit"], r["name"]): r["baseline"] for r in fsdp}
    check = "raw FSDP2 + the check's all-reduce, by hand"
    assert judged["ms/step", "torchplug fsdp"] == check, judged
    assert judged["ms/step", "torchplug fsdp, reduce_scatter_unused_params"] == "raw FSDP2"
    assert judged["ms CPU/step", "torchplug fsdp"].startswith(check + ": "), judged
    # every step target sits on a CPU-work row, one per Engine row, none on the wall rows
    steps = [r for r in records if r["section"] == "step"]
    targeted = sorted((r["group"], r["name"]) for r in steps if r["target"])
    assert all(r["unit"] == "ms CPU/step" for r in steps if r["target"]), targeted
    engine_cpu_rows = sorted(
        (r["group"], r["name"])
        for r in steps
        if r["name"].startswith("torchplug") and r["unit"] == "ms CPU/step"
    )
    assert targeted == engine_cpu_rows and len(targeted) == 6, targeted
    for r in steps:  # each wall row has its CPU-work row, every round in both
        group = r["group"].removesuffix(", CPU work")
        twin = [
            t
            for t in steps
            if t["name"] == r["name"]
            and t["unit"] != r["unit"]
            and t["group"].removesuffix(", CPU work") == group
        ]
        assert len(twin) == 1 and len(twin[0]["ratios"]) == len(r["ratios"]), r["name"]
    # the import probe found no heavy backend package loaded by `import torchplug`
    assert not any(r.get("heavy_loaded") for r in records)


def test_the_cpu_rows_read_the_added_work_as_a_share_of_the_baselines_wall_step():
    """A contestant 50 µs of CPU over a 1.0 ms-CPU, 4 ms-wall baseline reads 1.0125 that round;
    one doing less reads below 1: the ratio the step targets are judged on."""
    spec = importlib.util.spec_from_file_location("bench_common", ROOT / "benchmarks" / "common.py")
    assert spec is not None and spec.loader is not None
    common = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(common)
    added_cpu = common.added_cpu
    ratios = added_cpu([1.05, 0.99], [1.0, 1.0], [4.0, 2.0])
    assert ratios == pytest.approx([1.0125, 0.995])
    with pytest.raises(ValueError):  # a round missing on one side is an error, not dropped
        added_cpu([1.0], [1.0, 1.0], [4.0, 4.0])


def test_the_gpu_run_starts_from_one_command_with_dry_run(tmp_path):
    """`python benchmarks/gpu.py --dry-run`: the GPU script as a lent machine would run it (a file,
    no torchrun, no package installed), on the CPU with tiny sizes, every row it reports."""
    out = tmp_path / "gpu.jsonl"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu.py"), "--dry-run", "--out", str(out)]
        + ["--dir", str(tmp_path)],
        cwd=tmp_path,  # not the checkout: the script finds its own modules
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    records = [json.loads(line) for line in out.read_text().splitlines()]
    names = {r["name"] for r in records}
    assert {
        "raw FSDP2 bf16",
        "torchplug fsdp bf16",
        "plain DCP save",
        "torchplug save",
        "plain DCP load",
        "torchplug load (verified)",
        "torchplug save: loop blocked",
        "torchplug async save: loop blocked",
    } <= names, sorted(names)
    assert all(len(r["values"]) == 2 and all(v >= 0 for v in r["values"]) for r in records)
    assert list(tmp_path.glob("torchplug-gpu-ckpt-*")) == []  # its checkpoints are removed
    assert "TFLOP/s" in next(r for r in records if r["name"] == "torchplug fsdp bf16")["detail"]
