"""Settings and where each came from.

One order, highest first: the code's argument > a ``torchplug launch`` flag > a ``TORCHPLUG_*``
environment variable > the config file (``torchplug.toml``, or ``[tool.torchplug]`` in
``pyproject.toml``, in the working directory; or the file named by ``TORCHPLUG_CONFIG``) > default.

``torchplug launch --strategy S`` hands its flags to the processes it starts as
``TORCHPLUG_LAUNCH_STRATEGY`` / ``TORCHPLUG_LAUNCH_PRECISION`` so the two sources stay apart: when
the code and the launcher name different strategies, that is an error naming both.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torchplug.core.errors import ConfigurationError, did_you_mean

CONFIG_KEYS = ("strategy", "precision", "options")

LAUNCH_ENV = {"strategy": "TORCHPLUG_LAUNCH_STRATEGY", "precision": "TORCHPLUG_LAUNCH_PRECISION"}
USER_ENV = {"strategy": "TORCHPLUG_STRATEGY", "precision": "TORCHPLUG_PRECISION"}


@dataclass(frozen=True)
class Setting:
    value: Any
    source: str


@dataclass
class Settings:
    strategy: Setting
    precision: Setting
    options: dict[str, Setting] = field(default_factory=dict)
    config_file: Path | None = None

    def rows(self) -> list[tuple[str, Any, str]]:
        """``(name, value, source)`` for every setting, for ``torchplug doctor``."""
        rows = [
            ("strategy", self.strategy.value, self.strategy.source),
            ("precision", self.precision.value, self.precision.source),
        ]
        rows += [(f"options.{k}", s.value, s.source) for k, s in sorted(self.options.items())]
        return rows


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


def find_config(
    cwd: Path | None = None, env: Mapping[str, str] | None = None
) -> tuple[dict[str, Any], Path | None]:
    """The ``[tool.torchplug]`` settings in effect, and the file they came from."""
    env = os.environ if env is None else env
    cwd = Path.cwd() if cwd is None else cwd
    explicit = env.get("TORCHPLUG_CONFIG")
    if explicit:
        path = Path(explicit)
        if not path.is_file():
            raise ConfigurationError(
                f"TORCHPLUG_CONFIG={explicit} names no file. Point it at a torchplug.toml or "
                f"unset it."
            )
        data = _load_toml(path)
        table = (
            data.get("tool", {}).get("torchplug", data) if path.name == "pyproject.toml" else data
        )
        return _checked(table, path), path
    own = cwd / "torchplug.toml"
    if own.is_file():
        return _checked(_load_toml(own), own), own
    pyproject = cwd / "pyproject.toml"
    if pyproject.is_file():
        table = _load_toml(pyproject).get("tool", {}).get("torchplug")
        if table is not None:
            return _checked(table, pyproject), pyproject
    return {}, None


def _checked(table: dict[str, Any], path: Path) -> dict[str, Any]:
    for key in table:
        if key not in CONFIG_KEYS:
            raise ConfigurationError(
                f"Unknown key '{key}' in {path}.{did_you_mean(key, CONFIG_KEYS)} "
                f"Valid keys: {', '.join(CONFIG_KEYS)} (options is a table of strategy options)."
            )
    if "options" in table and not isinstance(table["options"], dict):
        raise ConfigurationError(
            f"'options' in {path} must be a table, e.g. [tool.torchplug.options] "
            f"find_unused_parameters = true."
        )
    return table


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
            if launched is not None and canonical(str(code_value)) != canonical(launched):
                raise ConfigurationError(
                    f"Conflicting {key}: the code passes {key}={code_value!r} but "
                    f"`torchplug launch --{key} {launched}` asks for {launched!r}. Remove one of "
                    f"them: drop the --{key} flag, or pass {key}='auto' (or nothing) in the code."
                )
            return Setting(code_value, "code argument")
        if launched is not None:
            return Setting(launched, f"torchplug launch --{key}")
        if env.get(USER_ENV[key]):
            return Setting(env[USER_ENV[key]], f"environment {USER_ENV[key]}")
        if key in file_settings:
            return Setting(file_settings[key], file_source)
        return Setting(default, "default")

    resolved_options = {
        name: Setting(value, file_source)
        for name, value in file_settings.get("options", {}).items()
    }
    resolved_options.update(
        {name: Setting(value, "code argument") for name, value in (options or {}).items()}
    )
    return Settings(
        strategy=pick("strategy", strategy, "auto"),
        precision=pick("precision", precision, "32"),
        options=resolved_options,
        config_file=file_path,
    )
