"""Result records to a Markdown table (with PASS/FAIL per target) and a PNG chart."""

from __future__ import annotations

import contextlib
import importlib.metadata
import statistics
from pathlib import Path
from typing import Any

from benchmarks.common import record


def versions() -> str:
    found = []
    for dist in ("torch", "torchplug", "accelerate", "lightning-fabric", "deepspeed", "fairscale"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            found.append(f"{dist} {importlib.metadata.version(dist)}")
    return ", ".join(found)


def memory_records(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per-strategy bytes (one row per memory job) as records relative to ``ddp``."""
    ddp = next((r for r in rows if r["strategy"] == "ddp"), None)
    records = []
    for row in rows:
        total = row["params"] + row["grads"] + row["optimizer"]
        group = "per-rank bytes, 2 ranks, fraction of ddp's"
        if ddp is not None:
            ddp_total = ddp["params"] + ddp["grads"] + ddp["optimizer"]
            target = {"max": 0.55} if row["strategy"] in ("fsdp", "deepspeed-zero3") else None
            rec = record(
                "memory",
                group,
                f"{row['strategy']}: params+grads+optimizer state",
                "MB",
                [total / 1e6],
                [ddp_total / 1e6],
                "ddp",
                target,
            )
            rec["detail"] = (
                f"params {row['params'] / 1e6:.1f} MB, grads {row['grads'] / 1e6:.1f} MB, "
                f"optimizer state {row['optimizer'] / 1e6:.1f} MB, fp32 masters "
                f"{row.get('masters', 0) / 1e6:.1f} MB, other buffers "
                f"{row['other'] / 1e6:.1f} MB, peak RSS {row['rss']:.0f} MiB"
            )
            records.append(rec)
            target = (
                {"max": 0.55} if row["strategy"] in ("deepspeed-zero1", "fairscale-oss") else None
            )
            if row["strategy"] != "ddp":
                records.append(
                    record(
                        "memory",
                        group,
                        f"{row['strategy']}: optimizer state",
                        "MB",
                        [row["optimizer"] / 1e6],
                        [ddp["optimizer"] / 1e6],
                        "ddp",
                        target,
                    )
                )
    return records


def summary(rec: dict[str, Any]) -> tuple[float, float, float] | None:
    """Median, min and max of a record's per-round ratios (or differences)."""
    ratios = rec.get("ratios")
    if not ratios:
        return None
    return statistics.median(ratios), min(ratios), max(ratios)


def verdict(rec: dict[str, Any]) -> str:
    target = rec.get("target")
    stats = summary(rec)
    if not target or stats is None:
        return ""
    ok = True
    if "max" in target:
        ok = ok and stats[0] <= target["max"]
    if "min" in target:
        ok = ok and stats[0] >= target["min"]
    if rec.get("heavy_loaded"):
        ok = False
    return "PASS" if ok else "FAIL"


def _target_text(rec: dict[str, Any]) -> str:
    target = rec.get("target")
    if not target:
        return ""
    unit = "" if rec.get("mode") == "ratio" else f" {rec['unit']}"
    sign = "+" if rec.get("mode") == "diff" else ""
    parts = []
    if "max" in target:
        parts.append(f"≤ {sign}{target['max']:g}{unit}")
    if "min" in target:
        parts.append(f"≥ {target['min']:g}")
    if target.get("note"):
        parts.append(target["note"])
    return ", ".join(parts)


def markdown(records: list[dict[str, Any]], header: str) -> str:
    lines = [
        header,
        "",
        "| group | contestant | median | vs baseline: median [min–max] | target | |",
        "|---|---|---|---|---|---|",
    ]
    for rec in records:
        value = statistics.median(rec["values"])
        stats = summary(rec)
        if stats is None:
            versus = ""
        elif rec.get("mode") == "diff":
            versus = (
                f"{stats[0]:+.3g} {rec['unit']} [{stats[1]:+.3g}, {stats[2]:+.3g}] "
                f"vs {rec['baseline']}"
            )
        else:  # step targets are 1-2 %: their ratios get a third decimal
            d = 3 if rec["section"] == "step" else 2
            versus = f"{stats[0]:.{d}f} [{stats[1]:.{d}f}–{stats[2]:.{d}f}] × {rec['baseline']}"
        name = rec["name"]
        if rec.get("heavy_loaded"):
            name += f" (loaded {', '.join(rec['heavy_loaded'])}!)"
        if rec.get("detail"):
            name += f" — {rec['detail']}"
        lines.append(
            f"| {rec['group']} | {name} | {value:.4g} {rec['unit']} | {versus} | "
            f"{_target_text(rec)} | {verdict(rec)} |"
        )
    return "\n".join(lines) + "\n"


def chart(records: list[dict[str, Any]], path: Path) -> None:
    """Ratios to each baseline (step, checkpoint, memory) and differences (dispatch, import,
    launch), median with min-max whiskers, one panel per kind."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [
        ("ratio", "step time / raw (lower is better)", ("step",)),
        ("ratio", "MB/s / plain DCP (higher is better)", ("checkpoint",)),
        ("ratio", "per-rank bytes / ddp", ("memory",)),
        ("diff", "µs per call over the raw call", ("dispatch",)),
        ("diff", "ms (import) or s (launch) over the baseline", ("import", "launch")),
    ]
    used = []
    for mode, title, sections in panels:
        rows = [
            r
            for r in records
            if r["section"] in sections and summary(r) and r["name"] != r.get("baseline")
        ]
        rows = [r for r in rows if not r["name"].startswith(str(r.get("baseline")) + " ")]
        if rows:
            used.append((mode, title, rows))
    if not used:
        return
    height = sum(0.8 + 0.28 * len(rows) for _, _, rows in used)
    fig, axes = plt.subplots(len(used), 1, figsize=(10, height), squeeze=False)
    for ax, (mode, title, rows) in zip(axes[:, 0], used, strict=True):
        labels, mids, lows, highs, colors = [], [], [], [], []
        for r in rows:
            med, lo, hi = summary(r)  # type: ignore[misc]
            labels.append(f"{r['group'][:28]}: {r['name'][:40]}")
            mids.append(med)
            lows.append(med - lo)
            highs.append(hi - med)
            v = verdict(r)
            colors.append({"PASS": "tab:green", "FAIL": "tab:red"}.get(v, "tab:gray"))
        ys = range(len(rows))
        ax.barh(ys, mids, xerr=[lows, highs], color=colors, capsize=2)
        ax.set_yticks(list(ys), labels, fontsize=7)
        ax.invert_yaxis()
        ax.axvline(1.0 if mode == "ratio" else 0.0, color="black", linewidth=0.8)
        ax.set_title(title, fontsize=9)
        ax.tick_params(axis="x", labelsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
