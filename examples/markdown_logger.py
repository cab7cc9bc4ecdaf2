"""A logger plugin module: announces the ``markdown`` logger (see examples/logger_plugin.py).

Register it with ``tp.register(markdown_logger)``, import it in every process with
``torchplug launch --plugin markdown_logger`` (run from this directory), or ship it in a package
under ``[project.entry-points.torchplug]``: then ``Engine(loggers=["markdown"])``,
``torchplug launch --logger markdown`` and ``TORCHPLUG_LOGGERS=markdown`` select it by name.
"""

from __future__ import annotations

from pathlib import Path

from torchplug.plugin import LoggerInfo, hookimpl


class MarkdownLogger:
    """Writes ``log_dir/metrics.md``: one table row per ``engine.log`` call."""

    def __init__(self, log_dir: Path) -> None:
        self.path = Path(log_dir) / "metrics.md"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.columns: list[str] | None = None

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        with self.path.open("a") as out:
            if self.columns is None:
                self.columns = list(metrics)
                out.write("| step | " + " | ".join(self.columns) + " |\n")
                out.write("|---" * (len(self.columns) + 1) + "|\n")
            cells = [f"{metrics.get(c, float('nan')):.4f}" for c in self.columns]
            out.write(f"| {step} | " + " | ".join(cells) + " |\n")

    def close(self) -> None:
        pass


@hookimpl
def torchplug_register_loggers(register):
    register(LoggerInfo("markdown", MarkdownLogger, "a Markdown table of the metrics"))
