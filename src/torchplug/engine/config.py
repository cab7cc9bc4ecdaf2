"""Settings and where each came from.

One order, highest first: the code's argument > a ``torchplug launch`` flag > a ``TORCHPLUG_*``
environment variable > the config file (``torchplug.toml``, or ``[tool.torchplug]`` in
``pyproject.toml``, in the working directory; or the file named by ``TORCHPLUG_CONFIG``) > default.

``torchplug launch --strategy S`` hands its flags to the processes it starts as
``TORCHPLUG_LAUNCH_STRATEGY`` / ``TORCHPLUG_LAUNCH_PRECISION`` so the two sources stay apart: when
the code and the launcher name different strategies, that is an error naming both.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from torchplug.checkpoint.settings import problems as checkpoint_problems
from torchplug.contract.errors import ConfigurationError
from torchplug.engine.settings import (  # noqa: F401 - re-exported: the records of settings
    PRECISIONS,
    UNUSED_NOTE,
    Setting,
    Settings,
    normalize_precision,
)
from torchplug.util.text import did_you_mean

CONFIG_KEYS = ("strategy", "precision", "options", "strategies", "processes", "nodes", "loggers")

LAUNCH_ENV = {"strategy": "TORCHPLUG_LAUNCH_STRATEGY", "precision": "TORCHPLUG_LAUNCH_PRECISION"}
#: ``torchplug launch --option NAME=VALUE`` as a JSON object, for the processes it starts.
LAUNCH_OPTIONS_ENV = "TORCHPLUG_LAUNCH_OPTIONS"
USER_ENV = {"strategy": "TORCHPLUG_STRATEGY", "precision": "TORCHPLUG_PRECISION"}


def _load_toml(path: Path) -> dict[str, Any]:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        try:
            import tomli as tomllib  # type: ignore[no-redef]
        except ModuleNotFoundError:
            raise ConfigurationError(
                f"Found config file {path}, but reading TOML on this Python needs 'tomli'. "
                f"Run `pip install tomli`, or move the settings to TORCHPLUG_* variables."
            ) from None
    try:
        with path.open("rb") as handle:
            return tomllib.load(handle)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigurationError(f"Config file {path} is not valid TOML: {exc}. Fix it.") from None
    except UnicodeDecodeError as exc:  # a binary file under the config file's name
        raise ConfigurationError(
            f"Config file {path} is not text (UTF-8 TOML): {exc.reason} at byte {exc.start}. "
            f"Replace it with a TOML file, or remove it."
        ) from None
    except RecursionError:
        raise ConfigurationError(
            f"Config file {path} nests tables or arrays too deeply to read. Flatten it: "
            f"torchplug's settings are one table of values and an [options] table."
        ) from None
    except OSError as exc:
        raise ConfigurationError(
            f"Cannot read config file {path}: {exc.strerror or exc}. Fix its permissions, or "
            f"remove it."
        ) from None


def _tool_table(data: dict[str, Any], path: Path) -> Any:
    """``[tool.torchplug]`` of a pyproject.toml (``None`` when absent); a ``tool`` that is not
    a table is an error naming the file."""
    tool = data.get("tool", {})
    if not isinstance(tool, dict):
        raise ConfigurationError(
            f"{path} sets tool = {tool!r} ({type(tool).__name__}); `tool` must be a table of "
            f"tools' settings, e.g. [tool.torchplug]. Fix the file."
        )
    return tool.get("torchplug")


def find_config(
    cwd: Path | None = None, env: Mapping[str, str] | None = None
) -> tuple[dict[str, Any], Path | None]:
    """The ``[tool.torchplug]`` settings in effect, and the file they came from."""
    env = os.environ if env is None else env
    cwd = Path.cwd() if cwd is None else cwd
    explicit = env.get("TORCHPLUG_CONFIG")
    if explicit:
        path = Path(explicit)
        if not path.is_file():  # a directory, or nothing at all
            raise ConfigurationError(
                f"TORCHPLUG_CONFIG={explicit} names no file. Point it at a torchplug.toml or "
                f"unset it."
            )
        data = _load_toml(path)
        if path.name == "pyproject.toml":
            table = _tool_table(data, path)
            table = data if table is None else table
        else:
            table = data
        return _checked(table, path), path
    own = cwd / "torchplug.toml"
    if own.is_symlink() and not own.exists():
        raise ConfigurationError(
            f"{own} is a link to {os.readlink(own)}, which does not exist: its settings would "
            f"be silently missing. Point the link at the file, or remove it."
        )
    if own.exists() and not own.is_file():
        raise ConfigurationError(
            f"{own} is not a file (a {'directory' if own.is_dir() else 'special file'}); "
            f"torchplug reads its settings from a torchplug.toml file there. Rename or remove it."
        )
    if own.is_file():
        return _checked(_load_toml(own), own), own
    pyproject = cwd / "pyproject.toml"
    if pyproject.is_file():
        table = _tool_table(_load_toml(pyproject), pyproject)
        if table is not None:
            return _checked(table, pyproject), pyproject
    return {}, None


def _checked(table: Any, path: Path) -> dict[str, Any]:
    if not isinstance(table, dict):
        where = "[tool.torchplug]" if path.name == "pyproject.toml" else "the file"
        raise ConfigurationError(
            f"The torchplug settings in {path} are {type(table).__name__} {table!r}; expected a "
            f"table. Write {where} as a table of keys, e.g.\n[tool.torchplug]\nstrategy = "
            f'"ddp"'
            + (
                ""
                if path.name == "pyproject.toml"
                else ' (in torchplug.toml: strategy = "ddp" at the top level)'
            )
        )
    for key in table:
        if key not in CONFIG_KEYS:
            raise ConfigurationError(
                f"Unknown key '{key}' in {path}.{did_you_mean(key, CONFIG_KEYS)} "
                f"Valid keys: {', '.join(CONFIG_KEYS)} (options is a table of strategy options)."
            )
    for key in ("strategy", "precision"):
        value = table.get(key, "")
        if not isinstance(value, (str, int)) or isinstance(value, bool):
            raise ConfigurationError(
                f"'{key}' in {path} is {type(table[key]).__name__} {table[key]!r}; expected a "
                f'name, e.g. {key} = "{"ddp" if key == "strategy" else "bf16"}".'
            )
    for key in ("processes", "nodes"):  # read by torchplug launch (-n, --nnodes)
        value = table.get(key, 1)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigurationError(
                f"'{key}' in {path} is {type(value).__name__} {value!r}; expected a whole "
                f"number >= 1, e.g. {key} = 2."
            )
    loggers = table.get("loggers", [])
    if not isinstance(loggers, list) or not all(isinstance(n, str) and n for n in loggers):
        raise ConfigurationError(
            f"'loggers' in {path} must be a list of logger names, e.g. loggers = [\"csv\"]; "
            f"got {loggers!r}."
        )
    if "options" in table and not isinstance(table["options"], dict):
        raise ConfigurationError(
            f"'options' in {path} must be a table, e.g. [tool.torchplug.options] "
            f"find_unused_parameters = true."
        )
    strategies = table.get("strategies", {})
    example = (
        "[tool.torchplug.strategies.deepspeed]"
        if path.name == "pyproject.toml"
        else "[strategies.deepspeed]"
    )
    if not isinstance(strategies, dict) or not all(
        isinstance(v, dict) for v in strategies.values()
    ):
        raise ConfigurationError(
            f"'strategies' in {path} must hold one table of options per strategy, e.g. "
            f'{example}\nconfig = "ds_config.json"; got {strategies!r}.'
        )
    return table


def _same_precision(a: str, b: str) -> bool:
    try:
        return normalize_precision(a) == normalize_precision(b)
    except ConfigurationError:
        return a.strip().lower() == b.strip().lower()


def _same_strategy(canonical: Callable[[str], str]) -> Callable[[str, str], bool]:
    return lambda a, b: canonical(a) == canonical(b)


def resolve(
    strategy: str | None = None,
    precision: str | None = None,
    options: Mapping[str, Any] | None = None,
    *,
    env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
    canonical: Callable[[str], str] = lambda name: name.strip().lower(),
) -> Settings:
    """Resolve the settings by the documented order; ``canonical`` maps aliases to names."""
    env = os.environ if env is None else env
    file_settings, file_path = find_config(cwd, env)
    file_source = f"config file {file_path}"

    def pick(key: str, code_value: Any, default: Any) -> Setting:
        launched = env.get(LAUNCH_ENV[key]) or None
        in_code = code_value is not None and not (key == "strategy" and code_value == "auto")
        if in_code:
            same = _same_precision if key == "precision" else _same_strategy(canonical)
            if launched is not None and not same(str(code_value), launched):
                unset = "strategy='auto'" if key == "strategy" else "precision=None"
                raise ConfigurationError(
                    f"Conflicting {key}: the code passes {key}={code_value!r} but "
                    f"`torchplug launch --{key} {launched}` asks for {launched!r}. Remove one of "
                    f"them: drop the --{key} flag, or pass {unset} (or nothing) in the code."
                )
            return Setting(code_value, "code argument")
        if launched is not None:
            return Setting(launched, f"torchplug launch --{key}")
        if env.get(USER_ENV[key]):
            return Setting(env[USER_ENV[key]], f"environment {USER_ENV[key]}")
        if key in file_settings:
            return Setting(file_settings[key], file_source)
        return Setting(default, "default")

    in_pyproject = file_path is not None and file_path.name == "pyproject.toml"
    prefix = "tool.torchplug." if in_pyproject else ""
    resolved_options = {
        name: Setting(value, f"{file_source} [{prefix}options]")
        for name, value in file_settings.get("options", {}).items()
    }
    tables = {
        table: {
            name: Setting(value, f"{file_source} [{prefix}strategies.{table}]")
            for name, value in values.items()
        }
        for table, values in file_settings.get("strategies", {}).items()
    }
    resolved_options.update(
        {
            name: Setting(value, f"torchplug launch --option {name}")
            for name, value in launch_options(env).items()
        }
    )
    resolved_options.update(
        {name: Setting(value, "code argument") for name, value in (options or {}).items()}
    )
    return Settings(
        strategy=pick("strategy", strategy, "auto"),
        precision=pick("precision", precision, "32"),
        options=resolved_options,
        config_file=file_path,
        strategy_tables=tables,
        file_loggers=Setting(file_settings["loggers"], file_source)
        if file_settings.get("loggers")
        else None,
        file_sizes={
            key: Setting(file_settings[key], f"{file_source} (read by torchplug launch)")
            for key in ("processes", "nodes")
            if key in file_settings
        },
    )


def launch_options(env: Mapping[str, str]) -> dict[str, Any]:
    """The strategy options ``torchplug launch --option NAME=VALUE`` handed to its processes."""
    text = env.get(LAUNCH_OPTIONS_ENV, "").strip()
    if not text:
        return {}
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if not isinstance(value, dict):
        raise ConfigurationError(
            f"{LAUNCH_OPTIONS_ENV}={text!r} is not a JSON object of strategy options; "
            f"`torchplug launch --option NAME=VALUE` sets it. Unset it, or relaunch."
        )
    return value


def parse_option(text: str) -> tuple[str, Any]:
    """``NAME=VALUE`` from the command line; VALUE as JSON if it parses (``true``, ``25``,
    ``1.5``, ``null``), else as a string (``gloo``)."""
    name, sep, raw = text.partition("=")
    if not sep or not name.strip():
        raise ConfigurationError(
            f"--option {text!r} is not NAME=VALUE; expected e.g. --option timeout=60 or "
            f"--option find_unused_parameters=true."
        )
    try:
        value = json.loads(raw)
    except ValueError:
        value = raw
    return name.strip(), value


def is_auto(value: Any) -> bool:
    """Whether a strategy setting leaves the choice to `auto_strategy`."""
    return str(value).strip().lower() == "auto"


def auto_strategy(world_size: int) -> str:
    """What ``strategy="auto"`` selects: ``ddp`` under a multi-process launcher, else
    ``single``."""
    return "ddp" if world_size > 1 else "single"


def problems(settings: Settings, registry: Any, world_size: int = 1) -> list[str]:
    """What is wrong with resolved ``settings`` before any process starts (empty: nothing).

    Used by ``torchplug launch`` (before it spawns) and ``torchplug doctor``. A strategy left at
    ``auto`` may still be chosen by the code, so its options are checked only when a source
    other than the code named the strategy.
    """

    found: list[str] = checkpoint_problems()
    value = str(settings.strategy.value)
    named = not is_auto(value)
    info = None
    try:
        info = registry.strategy(value if named else auto_strategy(world_size))
    except ConfigurationError as exc:
        found.append(f"strategy {value!r} (from {settings.strategy.source}): {exc}")
    if info is not None and world_size > 1 and not info.distributed:
        found.append(
            f"strategy {value!r} (from {settings.strategy.source}) runs in one process, but "
            f"{world_size} processes are asked for. Choose a multi-process strategy such as "
            f"'ddp', or run one process."
        )
    precision = None
    try:
        precision = normalize_precision(settings.precision.value)
    except ConfigurationError as exc:
        found.append(
            f"precision {settings.precision.value!r} (from {settings.precision.source}): {exc}"
        )
    if info is not None and precision is not None and precision not in info.precisions:
        found.append(
            f"strategy '{info.name}' (from {settings.strategy.source}) cannot run precision "
            f"'{precision}' (from {settings.precision.source}); it supports "
            f"{', '.join(info.precisions)}. Choose one of those, or a strategy that supports "
            f"'{precision}'."
        )
    elif info is not None and precision is not None:
        unavailable = registry.precision_unavailable(info, precision)
        if unavailable is not None:
            found.append(
                f"strategy '{info.name}' (from {settings.strategy.source}) cannot run precision "
                f"'{precision}' (from {settings.precision.source}) here: {unavailable}. Use "
                f"another precision, or a machine that has it."
            )
    if info is not None and named:
        chosen = dataclasses.replace(settings).for_strategy(info, registry.canonical)
        # each option alone first, so a problem names its own source; a [strategies.NAME]
        # table's are checked (and reported) with their table below
        checked = {n: s for n, s in chosen.items() if "[strategies." not in s.source}
        alone = []
        for name, setting in checked.items():
            try:
                info.resolve_options({name: setting.value})
            except ConfigurationError as exc:
                alone.append(f"option {name!r} (from {setting.source}): {exc}")
        found += alone
        if not alone:
            try:
                info.resolve_options({n: s.value for n, s in checked.items()})
            except ConfigurationError as exc:
                sources = sorted({s.source for s in checked.values()})
                found.append(f"options (from {', '.join(sources)}): {exc}")
    # The code may name another strategy: only names no strategy has are wrong.
    found += unknown_shared_options(settings, registry, every_source=info is None or not named)
    found += unknown_strategy_tables(settings, registry)
    for table, values in sorted(settings.strategy_tables.items()):
        canonical = registry.canonical(table)
        if canonical is None:
            continue
        try:
            registry.strategies[canonical].resolve_options({n: s.value for n, s in values.items()})
        except ConfigurationError as exc:
            found.append(f"[strategies.{table}] (in {settings.config_file}): {exc}")
    return found


def unknown_strategy_tables(settings: Settings, registry: Any) -> list[str]:
    """``[strategies.NAME]`` tables of the config file that name no installed strategy (a
    misspelled ``[strategies.dpp]`` would otherwise be ignored, its options with it)."""
    names = sorted(registry.strategies)
    return [
        f"[strategies.{table}] (in {settings.config_file}) names no installed strategy."
        f"{did_you_mean(table, names)} Installed: {', '.join(names) or 'none'}. Rename "
        f"the table, or install the plugin that provides '{table}'."
        for table in sorted(settings.strategy_tables)
        if registry.canonical(table) is None
    ]


def unknown_shared_options(
    settings: Settings, registry: Any, every_source: bool = False
) -> list[str]:
    """Shared ``[options]`` from the config file (with ``every_source``: options from anywhere)
    that no installed strategy knows (typos)."""
    known = {o.name for i in registry.strategies.values() for o in i.options}
    return [
        f"option {name!r} (from {setting.source}) is an option of no installed strategy."
        f"{did_you_mean(name, known)} Fix or remove it; `torchplug plugins --verbose` lists "
        f"every strategy's options."
        for name, setting in sorted({**settings.options, **settings.ignored}.items())
        if (every_source or setting.source.startswith("config file")) and name not in known
    ]
