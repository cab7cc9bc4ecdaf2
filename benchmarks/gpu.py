"""The GPU section: one command, one GPU, a few minutes (run by ``python -m benchmarks`` too,
when CUDA is present).

    python benchmarks/gpu.py --out R.jsonl     # on the GPU machine; installs nothing
    python benchmarks/gpu.py --dry-run         # on any CPU: tiny sizes, checks it starts (CI)

1. Single-rank FSDP2 bf16 on a GPT-style decoder: torchplug ``fsdp`` against ``fully_shard``
   written by hand (one unit per block, bf16 params, fp32 reduce), interleaved; step time, the
   ratio, and MFU (6 x params x tokens + attention FLOPs over the GPU's dense bf16 peak).
2. Checkpoints of that model: torchplug's save and verified load against plain DCP on the same
   sharded state (GB/s), and the time an asynchronous save blocks the loop against a
   synchronous one.
3. DeepSpeed ZeRO-2 bf16 against ``ddp`` bf16 on the same MLP (step-time ratio), when installed.

Why it starts its own one-rank process group: a lent GPU machine is held by the minute, and the
run should be one command that needs neither torchrun nor a second shell. Under torchrun (``RANK``
set) it uses torchrun's group instead. ``--dry-run`` (or ``--cpu-dry-run``) runs the same code
with tiny sizes on the CPU (fp32 only) to check it before spending GPU time.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import shutil
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a file (python benchmarks/gpu.py): the repository root
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.distributed as dist

import torchplug as tp
from benchmarks.common import interleaved, per_second, record, write_records
from torchplug.plugin import free_port

#: Dense bf16 peak TFLOP/s by device name fragment (vendor data sheets, no sparsity).
PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "A10": 125.0}


class Block(torch.nn.Module):
    """A pre-norm GPT block: causal self-attention and a 4x MLP."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = torch.nn.LayerNorm(dim)
        self.qkv = torch.nn.Linear(dim, 3 * dim)
        self.proj = torch.nn.Linear(dim, dim)
        self.norm2 = torch.nn.LayerNorm(dim)
        self.mlp = torch.nn.Sequential(
            torch.nn.Linear(dim, 4 * dim), torch.nn.GELU(), torch.nn.Linear(4 * dim, dim)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        y = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.norm2(x))


class GPT(torch.nn.Module):
    def __init__(self, vocab: int, dim: int, layers: int, heads: int, seq: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(vocab, dim)
        self.pos = torch.nn.Parameter(torch.zeros(seq, dim))
        self.blocks = torch.nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.norm = torch.nn.LayerNorm(dim)
        self.head = torch.nn.Linear(dim, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx) + self.pos[: idx.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def fsdp_gpt(
    args: argparse.Namespace, device: torch.device, records: list[dict[str, Any]]
) -> tuple[tp.Engine, torch.nn.Module, torch.nn.Module]:
    """Step time and MFU; returns the Engine, its model and the hand-written FSDP2 model, both
    trained a few steps (their sharded state is what the checkpoint section saves)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    def model() -> GPT:
        return GPT(args.vocab, args.dim, args.layers, args.heads, args.seq).to(device)

    idx = torch.randint(0, args.vocab, (args.batch, args.seq), device=device)
    target = torch.randint(0, args.vocab, (args.batch, args.seq), device=device)
    bf16 = device.type == "cuda"

    def loss_of(m: torch.nn.Module) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(
            m(idx).float().view(-1, args.vocab), target.view(-1)
        )

    policy = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if bf16
        else MixedPrecisionPolicy()
    )
    raw = model()
    for block in raw.blocks:
        fully_shard(block, mp_policy=policy)
    fully_shard(raw, mp_policy=policy)
    raw_opt = torch.optim.AdamW(raw.parameters(), lr=1e-4, fused=bf16)

    engine = tp.Engine("fsdp", precision="bf16" if bf16 else None, shard_classes=["Block"])
    m = model()
    m, opt = engine.setup(m, torch.optim.AdamW(m.parameters(), lr=1e-4, fused=bf16))

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    def timed(step: Any) -> float:
        for _ in range(3):
            step()
        sync()
        start = time.perf_counter()
        for _ in range(args.steps):
            step()
        sync()
        return (time.perf_counter() - start) / args.steps * 1e3

    def raw_step() -> None:
        loss_of(raw).backward()
        raw_opt.step()
        raw_opt.zero_grad()

    def engine_step() -> None:
        engine.backward(loss_of(m))
        opt.step()
        opt.zero_grad()

    results = interleaved(
        {
            "raw FSDP2 bf16": lambda: timed(raw_step),
            "torchplug fsdp bf16": lambda: timed(engine_step),
        },
        args.rounds,
        sync,
    )
    params = sum(p.numel() for p in model().parameters())
    tokens = args.batch * args.seq
    flops = 6 * params * tokens + 12 * args.layers * args.dim * args.seq * tokens
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    peak = next((v for k, v in PEAK_TFLOPS.items() if k in name), None)
    group = f"GPT {params / 1e6:.0f}M params, seq {args.seq}, batch {args.batch}, {name}"
    for contestant, values in results.items():
        rec = record(
            "gpu",
            group,
            contestant,
            "ms/step",
            values,
            results["raw FSDP2 bf16"],
            "raw FSDP2 bf16",
            {"max": 1.01} if contestant.startswith("torchplug") else None,
        )
        step_s = sorted(values)[len(values) // 2] / 1e3
        achieved = flops / step_s / 1e12
        mfu = f", MFU {achieved / peak:.1%}" if peak else ""
        rec["detail"] = f"{achieved:.0f} TFLOP/s{mfu}"
        records.append(rec)
    return engine, m, raw


def checkpoints(
    args: argparse.Namespace,
    engine: tp.Engine,
    model: torch.nn.Module,
    raw: torch.nn.Module,
    records: list[dict[str, Any]],
) -> None:
    """torchplug save / verified load against plain DCP of the same sharded state (GB/s), and
    the seconds an async save blocks the loop against a synchronous one."""
    import torch.distributed.checkpoint as dcp

    base = Path(args.dir or tempfile.gettempdir()) / f"torchplug-gpu-ckpt-{os.getpid()}"
    base.mkdir(parents=True, exist_ok=True)
    gigabytes = sum(p.numel() * p.element_size() for p in raw.state_dict().values()) / 1e9

    def rate(fn: Callable[[], Any]) -> Callable[[], float]:
        return per_second(gigabytes, fn, dist.barrier)

    def blocked(background: bool) -> Callable[[], float]:
        def run() -> float:
            dist.barrier()
            start = time.perf_counter()
            engine.save(base / "async", {"model": model}, async_=background)
            took = time.perf_counter() - start
            engine.wait_for_save()  # the rest of an async save, outside the timing
            return took

        return run

    try:
        saves = interleaved(
            {
                "plain DCP save": rate(
                    lambda: dcp.save(raw.state_dict(), checkpoint_id=base / "dcp")
                ),
                "torchplug save": rate(lambda: engine.save(base / "tp", {"model": model})),
            },
            args.rounds,
            dist.barrier,
        )
        loads = interleaved(
            {
                "plain DCP load": rate(
                    lambda: dcp.load(raw.state_dict(), checkpoint_id=base / "dcp")
                ),
                "torchplug load (verified)": rate(
                    lambda: engine.load(base / "tp", {"model": model})
                ),
            },
            args.rounds,
            dist.barrier,
        )
        waits = interleaved(
            {"torchplug save: loop blocked": blocked(False),
             "torchplug async save: loop blocked": blocked(True)},
            args.rounds,
            dist.barrier,
        )  # fmt: skip
    finally:
        shutil.rmtree(base, ignore_errors=True)
    group = f"checkpoint of the GPT above, {gigabytes:.2f} GB"
    for results, baseline in ((saves, "plain DCP save"), (loads, "plain DCP load")):
        for name, values in results.items():
            target = None if name == baseline else {"min": 1.0}
            records.append(
                record("gpu", group, name, "GB/s", values, results[baseline], baseline, target)
            )
    sync_name = "torchplug save: loop blocked"
    for name, values in waits.items():
        target = {"max": 0.1} if "async" in name else None
        records.append(record("gpu", group, name, "s", values, waits[sync_name], sync_name, target))


def zero2(args: argparse.Namespace, records: list[dict[str, Any]]) -> None:
    if importlib.util.find_spec("deepspeed") is None:
        print("ZeRO-2: deepspeed not installed, skipped", flush=True)
        return
    from benchmarks.zero2_vs_ddp import step_times

    precision = "bf16" if torch.cuda.is_available() else None
    width, steps = (args.mlp_width, args.steps) if torch.cuda.is_available() else (64, 3)
    ddp: list[float] = []
    ds: list[float] = []
    for _ in range(max(args.rounds // 2, 1)):  # alternating, each its own Engine
        ddp.append(sorted(step_times("ddp", precision, steps, width, 64))[steps // 2] * 1e3)
        ds.append(
            sorted(step_times("deepspeed-zero2", precision, steps, width, 64))[steps // 2] * 1e3
        )
    group = f"MLP width {width}, {precision or 'fp32'}, one rank"
    records.append(record("gpu", group, "ddp", "ms/step", ddp, ddp, "ddp"))
    records.append(record("gpu", group, "deepspeed-zero2", "ms/step", ds, ddp, "ddp"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    parser.add_argument(
        "--dry-run",
        "--cpu-dry-run",
        dest="dry_run",
        action="store_true",
        help="tiny sizes on the CPU: checks that the run starts and finishes",
    )
    parser.add_argument("--dir", default=None, help="where checkpoints go (default: a temp dir)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--dim", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--mlp-width", type=int, default=4096)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    if args.dry_run:
        args.vocab, args.dim, args.layers, args.heads, args.seq, args.batch = 64, 32, 2, 2, 16, 2
        args.rounds, args.steps = 2, 2
    elif not torch.cuda.is_available():
        print("no CUDA device: the GPU section does not run here (try --dry-run)")
        return
    device = torch.device("cuda", 0) if not args.dry_run else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if "RANK" not in os.environ:  # one command, no torchrun: a one-rank group of its own
        os.environ.update(
            RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
            MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
        )  # fmt: skip
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    records: list[dict[str, Any]] = []
    engine, model, raw = fsdp_gpt(args, device, records)
    checkpoints(args, engine, model, raw, records)
    engine.close()
    zero2(args, records)
    for rec in records:
        print(rec["group"], rec["name"], [round(v, 2) for v in rec["values"]], rec.get("detail"))
    if args.out and dist.get_rank() == 0:
        write_records(args.out, records)
    with contextlib.suppress(Exception):
        dist.destroy_process_group()
    os._exit(0)


if __name__ == "__main__":
    main()
