"""The records of the Engine's settings (each with where it came from) and the precision
names users write (Accelerate's and Fabric's spellings included), apart from `config`, which
resolves them from code, launcher, environment and config file."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torchplug.contract.errors import ConfigurationError
from torchplug.util.records import Record
from torchplug.util.text import did_you_mean

#: Accelerate's ``"no"`` / ``"bf16"`` / ``"fp16"`` and Fabric's ``"32-true"`` / ``"bf16-mixed"`` /
#: ``"16-mixed"`` are spellings of these; Fabric's ``"*-true"`` low-precision modes (weights held in
#: bf16/fp16) are a different thing and are not accepted as aliases.
PRECISIONS: dict[str, tuple[str, ...]] = {
    "32": ("32", "fp32", "32-true", "float32", "no", "full"),
    "bf16": ("bf16", "bf16-mixed", "bfloat16"),
    "fp16": ("fp16", "16", "16-mixed", "float16"),
}
#: Precisions users ask for that no built-in backend runs (yet).
UNSUPPORTED_PRECISIONS = ("fp8", "8", "8-mixed", "transformer-engine", "bf16-true", "16-true")


def normalize_precision(value: str | int | None) -> str:
    """Map a user's precision spelling to ``"32"``, ``"bf16"`` or ``"fp16"``."""
    if value is None:
        return "32"
    text = str(value).strip().lower()
    for canonical, spellings in PRECISIONS.items():
        if text in spellings:
            return canonical
    if text in UNSUPPORTED_PRECISIONS:
        raise ConfigurationError(
            f"Precision {value!r} is not supported by the active backends: torchplug runs 32 "
            f"(alias 'no', '32-true'), bf16 (mixed, 'bf16-mixed') and fp16 (mixed, '16-mixed'). "
            f"Use precision='bf16' for the closest supported mode."
        )
    accepted = ", ".join(repr(s) for spellings in PRECISIONS.values() for s in spellings)
    raise ConfigurationError(
        f"Unknown precision {value!r}."
        f"{did_you_mean(text, [s for v in PRECISIONS.values() for s in v])}"
        f" Expected one of {accepted} (or None for full precision)."
    )


@dataclasses.dataclass(frozen=True, eq=False, repr=False)
class Setting(Record):
    value: Any
    source: str


#: What `Settings.rows` says of a shared file option the chosen strategy does not know.
UNUSED_NOTE = "(not an option of this strategy: unused)"


@dataclasses.dataclass(eq=False, repr=False)
class Settings(Record):
    strategy: Setting
    precision: Setting
    #: Strategy options: the config file's shared ``[options]``, overlaid by the launcher's
    #: ``--option`` flags and the code's keyword arguments. `for_strategy` adds the
    #: chosen strategy's own table and drops shared file options that strategy does not know.
    options: dict[str, Setting] = dataclasses.field(default_factory=dict)
    config_file: Path | None = None
    #: ``[strategies.NAME]`` tables of the config file: name as written -> option -> setting.
    strategy_tables: dict[str, dict[str, Setting]] = dataclasses.field(default_factory=dict)
    #: Shared ``[options]`` from the file that the chosen strategy does not know (not applied).
    ignored: dict[str, Setting] = dataclasses.field(default_factory=dict)
    #: The config file's ``loggers`` (used when the code, the launcher and the environment
    #: name none), or ``None``.
    file_loggers: Setting | None = None
    #: The config file's ``processes`` and ``nodes`` (read by ``torchplug launch`` for ``-n`` and
    #: ``--nnodes`` when its command line leaves them out), by key.
    file_sizes: dict[str, Setting] = dataclasses.field(default_factory=dict)

    def rows(self) -> list[tuple[str, Any, str]]:
        """``(name, value, source)`` for every setting, for ``torchplug doctor``."""
        rows = [
            ("strategy", self.strategy.value, self.strategy.source),
            ("precision", self.precision.value, self.precision.source),
        ]
        rows += [(f"options.{k}", s.value, s.source) for k, s in sorted(self.options.items())]
        rows += [
            (f"options.{k}", s.value, f"{s.source} {UNUSED_NOTE}")
            for k, s in sorted(self.ignored.items())
        ]
        for table, values in sorted(self.strategy_tables.items()):
            rows += [(f"strategies.{table}.{k}", s.value, s.source) for k, s in values.items()]
        return rows

    def for_strategy(self, info: Any, canonical: Callable[[str], str | None]) -> dict[str, Setting]:
        """The options in effect for strategy ``info``, each with its source; sets
        `options` to them.

        Highest first: code argument > ``torchplug launch --option`` > the file's
        ``[strategies.NAME]`` table for this strategy (by name or alias) > the file's shared
        ``[options]`` > the strategy's default. A shared ``[options]`` entry this strategy does
        not know is left out (recorded in `ignored`) unless no installed strategy knows it
        (then it is a typo, checked by `problems` and the Engine); a name in the strategy's
        own table, the launcher's or the code's that it does not know is an error.
        """
        known = {o.name for o in info.options}
        chosen: dict[str, Setting] = {}
        self.ignored = {}
        for name, setting in self.options.items():
            if setting.source.startswith("config file") and name not in known:
                self.ignored[name] = setting
            elif setting.source.startswith("config file"):
                chosen[name] = setting
        for table, values in self.strategy_tables.items():
            if canonical(table) == info.name:
                chosen.update(values)
        chosen.update(
            {n: s for n, s in self.options.items() if not s.source.startswith("config file")}
        )
        self.options = chosen
        return chosen
