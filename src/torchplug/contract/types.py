"""The contract's records: what plugins announce (strategies, precision plugins, loggers, their
options and capabilities), who a process is (`ClusterInfo`), where it runs (`Runtime`) and the
resolved settings (`Setting`, `Settings`). Plain data, so that announcing a strategy imports
nothing heavy: the ``factory`` that builds the backend is called once a user selects it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from torchplug.contract.errors import ConfigurationError
from torchplug.util.installed import missing_package
from torchplug.util.records import Record
from torchplug.util.text import did_you_mean, positive_number  # noqa: F401 - API 1.x name

if TYPE_CHECKING:
    import torch

#: The reduce ops of ``engine.reduce`` and ``torchplug_reduce`` (``mean``: sum / world size).
REDUCE_OPS = ("sum", "mean", "max", "min")

DEFAULT_TIMEOUT = 1800.0
"""Seconds a collective or a checkpoint phase waits, unless a strategy's ``timeout`` says."""


@dataclass(frozen=True, eq=False, repr=False)
class Option(Record):
    """One option of a strategy (``Engine(strategy=..., **options)``) or precision plugin.

    Args:
        name: The option's name, as passed to ``Engine(...)``, ``torchplug launch --option
            name=value`` or the config file.
        type: The accepted type, or a tuple of them (``type(None)`` for an optional value); an
            ``int`` is accepted where ``float`` is.
        default: The value used when the option is not given.
        help: One line shown by ``torchplug plugins --verbose`` and in error messages.
        choices: The only values accepted, or ``None`` for any value of ``type``.
        validate: Checks a value of the right type; returns what is wrong and what is expected (e.g.
            "must be a positive number of seconds, got -1"), or ``None`` when the value is fine.
            Runs wherever options are resolved, so ``torchplug launch`` and ``doctor`` catch it too.
    """

    name: str
    type: type | tuple[type, ...]
    default: Any
    help: str = ""
    choices: tuple[Any, ...] | None = None
    validate: Callable[[Any], str | None] | None = None

    def type_name(self) -> str:
        """The accepted type(s) as shown to users, e.g. ``"float | None"``."""
        types = self.type if isinstance(self.type, tuple) else (self.type,)
        return " | ".join("None" if t is type(None) else t.__name__ for t in types)

    def check(self, owner: str, value: Any) -> Any:
        """Return ``value`` if it fits this option, else raise an error naming the fix.

        Args:
            owner: What the option belongs to, for the message (e.g. ``"strategy 'ddp'"``).
            value: The value given.

        Raises:
            ConfigurationError: The value has the wrong type, is not one of ``choices``, or
                ``validate`` refuses it.
        """
        types = self.type if isinstance(self.type, tuple) else (self.type,)
        ok = isinstance(value, types) and not (isinstance(value, bool) and bool not in types)
        if not ok and float in types and isinstance(value, int) and not isinstance(value, bool):
            value, ok = float(value), True
        if not ok:
            raise ConfigurationError(
                f"Option '{self.name}' of {owner} expects {self.type_name()}, "
                f"got {type(value).__name__} {value!r}. Pass e.g. {self.name}={self.default!r}"
                f" ({self.help or 'see torchplug plugins --verbose'})."
            )
        if self.choices is not None and value not in self.choices:
            raise ConfigurationError(
                f"Option '{self.name}' of {owner} must be one of "
                f"{', '.join(repr(c) for c in self.choices)}, got {value!r}."
                f"{did_you_mean(str(value), [str(c) for c in self.choices])}"
            )
        problem = self.validate(value) if self.validate is not None else None
        if problem:
            raise ConfigurationError(
                f"Option '{self.name}' of {owner} {problem}. Pass a valid value, e.g. "
                f"{self.name}={self.default!r}, or leave it out for the default."
            )
        return value


def resolve_options(
    owner: str, options: tuple[Option, ...], given: Mapping[str, Any]
) -> dict[str, Any]:
    """Defaults overlaid with ``given``, each checked against its declared type."""
    known = {o.name: o for o in options}
    resolved = {name: opt.default for name, opt in known.items()}
    for name, value in given.items():
        if name not in known:
            listing = ", ".join(f"{o.name}: {o.type_name()}" for o in options) or "none"
            raise ConfigurationError(
                f"Unknown option '{name}' for {owner}.{did_you_mean(name, known)} "
                f"Options of {owner}: {listing}. Remove it or use one of those."
            )
        resolved[name] = known[name].check(owner, value)
    return resolved


@dataclass(frozen=True, kw_only=True, eq=False, repr=False)
class Announced(Record):
    """What the plugin manager fills in on every record a plugin announces (strategies,
    precision plugins, loggers), so that listings and errors name where a name came from.

    Args:
        provider: The plugin's registered name.
        distribution: The installed distribution that holds it.
        version: That distribution's version.
    """

    provider: str = ""
    distribution: str = ""
    version: str = ""

    def with_provider(self, provider: str, distribution: str, version: str) -> Any:
        """A copy naming the plugin that announced it (the plugin manager calls this).

        Args:
            provider: The plugin's registered name.
            distribution: The installed distribution that holds it.
            version: That distribution's version.
        """
        return dataclasses.replace(
            self, provider=provider, distribution=distribution, version=version
        )


@dataclass(frozen=True, eq=False, repr=False)
class StrategyInfo(Announced):
    """A backend as announced by its plugin through ``torchplug_register_strategies``.

    Args:
        name: The name users select it by (``Engine(strategy=name)``, ``--strategy name``).
        factory: Called as ``factory(**options)`` when the strategy is selected; returns the plugin
            object holding the strategy hooks. Import the backend's heavy package inside it, not
            before.
        description: One line shown by ``torchplug plugins``.
        aliases: Other names that select it.
        requires: Importable module names the strategy needs; checked without importing them.
        install_hint: What to run when a required module is missing, e.g. ``pip install
            torchplug[deepspeed]``.
        options: The strategy's options (``Engine(strategy=..., **options)``), each checked by type.
        precisions: Precisions the strategy can run. ``owns_precision`` strategies implement them
            themselves; the others get them from a precision plugin (AMP).
        owns_precision: The backend implements the precisions itself (e.g. DeepSpeed) instead of
            composing with a precision plugin.
        shards_parameters: Informational (``torchplug plugins -v``) and checked by the kit's
            ``sharding``: no rank holds every parameter, and the ranks hold at most 3/4 of a
            copy each (pipeline stages count: they split the model unevenly).
        shards_optimizer: Each rank holds only its shard of the optimizer state (informational and
            checked as ``shards_parameters`` is).
        takes_meta_modules: The backend's ``torchplug_wrap`` takes a model still on the meta device
            (built under ``engine.init_module(empty=True)``) and the Engine materialises only each
            rank's shards after the wrap; ``False``: the Engine materialises the whole model on the
            CPU first.
        supports_cpu: Runs on a machine without CUDA (the core refuses it there when ``False``).
        supports_cuda: Runs on CUDA devices.
        distributed: Runs several processes (needs a launcher such as torchrun when world size > 1).
        launcher: ``"torchrun"``, ``"xla"``, or ``"module:function"``: its own, given the argv.
        tolerance: How far results may stray from the single-process reference (lossy communication
            such as gradient compression declares more); ``None``: check convergence instead; or
            a function of the run's options (defaults filled in) answering one, per option value.
        resume_exact: Whether a resumed run repeats the uninterrupted one exactly (the kit's
            ``resume``, to 1e-6 whatever ``tolerance`` says); ``False`` only where communication
            keeps state checkpoints do not carry (PowerSGD's); or a function, as ``tolerance``.
        refuses: What the strategy refuses by design with a ConfigurationError, by the kit's
            names: ``"compile"``, ``"clipping"``, ``"clip_norm_type"`` (a norm other than 2),
            ``"accumulation"``, ``"nan_skip"``, ``"no_sync"`` (outside accumulate), ``"backward"``
            (the kit then steps by ``forward_backward``), ``"reuse"``, ``"rank_dependent"`` (ranks
            using different parameters). The kit passes a declared refusal, fails an undeclared one.
        deviations: Conformance-kit properties the strategy fails by design, each with the reason,
            e.g. ``{"clipping": "local SGD clips each rank's gradients"}``: the kit still runs them
            and reports each as ``DEVIATES`` with the reason and what it measured, not as a PASS or
            a failure. Only what the design makes impossible belongs here; a wrong answer is a FAIL.
        precision_options: For a strategy that owns precision: the ``Engine(precision_options=...)``
            it understands (the backend reads the resolved values from ``engine.precision_options``
            in setup).
        check: Extra usability test; returns why the strategy cannot run here, or ``None``.
        precision_check: For a strategy that owns precision: ``precision_check(precision)`` returns
            why this machine cannot run that precision (e.g. no fp16 kernels on this CPU), or
            ``None``. Asked before anything starts, through
            `torchplug.util.capabilities.precision_unavailable`, so the launcher, ``check``, the kit
            and the Engine all give the same answer. Keep it cheap: it runs in ``torchplug plugins``
            and the launcher, never importing the backend.
        memory: Per-rank bytes of parameters, gradients, optimizer state and fp32 masters
            for a model's parameter shapes (``torchplug estimate-memory``): a function
            ``MemoryQuery -> MemoryEstimate`` (ready ones in `torchplug.features.memory`, e.g.
            ``memory.fsdp2``), raising ``NotEstimable`` where shapes alone cannot tell.
            ``None``: derived from ``shards_parameters`` / ``shards_optimizer`` (even sharding)
            and marked as derived, so plugins registered without it keep working.
        extends: The name of a registered strategy whose options, capabilities and defaults this one
            inherits: its own options are added to (or replace, by name) the parent's, and every
            field left at its default takes the parent's value. For a subclass of the parent's
            class. For a backend of its own on a process group (a subclass of
            [`DistributedStrategy`][torchplug.plugin.DistributedStrategy] that extends no
            registered strategy), the base class itself: ``extends=DistributedStrategy`` inherits
            its options (``process_group_backend``, ``timeout``). The one way to inherit options.
        api: The plugin API versions this strategy supports, e.g. ``">=1.0,<2"`` (see
            [`torchplug.contract.spec.API_VERSION`][torchplug.contract.spec.API_VERSION]); outside
            it the strategy is not registered.
        provider: Filled in by the plugin manager: which plugin announced it.
        distribution: Filled in by the plugin manager: the installed distribution of that plugin.
        version: Filled in by the plugin manager: that distribution's version.
        problem: Filled in by the plugin manager: why the strategy is broken (e.g. a misspelled hook
            on its class), so that it is listed as broken with the reason and never selected.
    """

    name: str
    factory: Callable[..., object]
    description: str
    aliases: tuple[str, ...] = ()
    requires: tuple[str, ...] = ()
    install_hint: str = ""
    options: tuple[Option, ...] = ()
    precisions: tuple[str, ...] = ("32", "bf16", "fp16")
    owns_precision: bool = False
    shards_parameters: bool = False
    shards_optimizer: bool = False
    takes_meta_modules: bool = False
    supports_cpu: bool = True
    supports_cuda: bool = True
    distributed: bool = True
    launcher: str = "torchrun"
    tolerance: float | None | Callable[[Mapping[str, Any]], float | None] = 1e-5
    resume_exact: bool | Callable[[Mapping[str, Any]], bool] = True
    refuses: tuple[str, ...] = ()
    deviations: Mapping[str, str] = field(default_factory=dict, hash=False)
    precision_options: tuple[Option, ...] = ()
    check: Callable[[], str | None] | None = None
    precision_check: Callable[[str], str | None] | None = None
    memory: Callable[[Any], Any] | None = None
    extends: str | type = ""
    api: str = ""
    problem: str = ""

    def __post_init__(self) -> None:
        # a base class, StrategyInfo(extends=DistributedStrategy): its options, then this one's
        if isinstance(self.extends, type):
            declared = getattr(self.extends, "strategy_options", None)
            if declared is None:
                raise TypeError(
                    f"StrategyInfo(name={self.name!r}): extends= takes the name of a registered "
                    f"strategy (e.g. 'ddp') or DistributedStrategy, not {self.extends!r}."
                )
            own = {o.name for o in self.options}
            inherited = (*(o for o in declared() if o.name not in own), *self.options)
            object.__setattr__(self, "options", inherited)
            object.__setattr__(self, "extends", "")

    def option(self, name: str) -> Option | None:
        """The option called ``name``, or ``None``.

        Args:
            name: The option's name.
        """
        return next((o for o in self.options if o.name == name), None)

    def unusable_reason(self) -> str | None:
        """Why this strategy cannot run on this machine, or ``None`` if it can (the machine's
        reason first: installing a package does not help where the device is missing)."""
        if self.problem:
            return f"broken: {self.problem}"
        device = self.device_reason()
        if device is not None:
            return device
        missing = missing_package(self.requires, self.install_hint)
        if missing is not None:
            return missing
        return self.check() if self.check is not None else None

    def device_reason(self) -> str | None:
        """Why ``supports_cpu`` / ``supports_cuda`` rule this machine out, or ``None``."""
        from torchplug.util.capabilities import device_unavailable

        return device_unavailable(self.supports_cpu, self.supports_cuda)

    def resolve_options(self, given: Mapping[str, Any]) -> dict[str, Any]:
        """The strategy's option defaults overlaid with ``given``, each checked.

        Args:
            given: Option values by name.

        Raises:
            ConfigurationError: An unknown option, or a value that does not fit.
        """
        return resolve_options(f"strategy '{self.name}'", self.options, given)

    def inheriting(self, parent: StrategyInfo) -> StrategyInfo:
        """This strategy with what it left at the defaults taken from ``parent`` (``extends``):
        the parent's options first, this one's added or replacing them by name.

        Args:
            parent: The strategy named by ``extends``.
        """
        own = {o.name for o in self.options}
        changes: dict[str, Any] = {
            "options": (*(o for o in parent.options if o.name not in own), *self.options)
        }
        for f in dataclasses.fields(self):
            if f.name not in _NOT_INHERITED and getattr(self, f.name) == f.default:
                changes[f.name] = getattr(parent, f.name)
        return dataclasses.replace(self, **changes)


#: What a strategy never takes from the one it ``extends``: who it is, its own refusals, and who
#: announced it (its options are merged by name); every capability it leaves at the default is.
_NOT_INHERITED = frozenset(
    ["name", "factory", "description", "aliases", "options", "refuses", "extends", "api", "problem"]
    + [f.name for f in dataclasses.fields(Announced)]
)


@dataclass(frozen=True, eq=False, repr=False)
class PrecisionInfo(Announced):
    """A precision plugin (e.g. AMP), composed with backends that do not own precision.

    Args:
        name: The precision plugin's name, shown by ``torchplug plugins``.
        factory: Called as ``factory(precision, **options)`` with ``"bf16"`` or ``"fp16"``; returns
            the plugin object.
        precisions: The precisions it provides (``"bf16"``, ``"fp16"``).
        description: One line shown by ``torchplug plugins``.
        options: Set with ``Engine(precision=..., precision_options={...})``.
        check: ``check(precision)`` returns why this machine cannot run that precision, or ``None``
            (see ``StrategyInfo.precision_check``); asked for every strategy it is composed with.
        provider: Filled in by the plugin manager: which plugin announced it.
        distribution: Filled in by the plugin manager: the installed distribution of that plugin.
        version: Filled in by the plugin manager: that distribution's version.
    """

    name: str
    factory: Callable[..., object]
    precisions: tuple[str, ...]
    description: str = ""
    options: tuple[Option, ...] = ()
    check: Callable[[str], str | None] | None = None


@dataclass(frozen=True, eq=False, repr=False)
class LoggerInfo(Announced):
    """A metric logger (experiment tracker) as announced through ``torchplug_register_loggers``.

    ``factory(log_dir)`` returns an object with ``log_metrics(metrics, step)`` and ``close()``
    (and optionally ``log_hyperparams(params)``), see `torchplug.loggers.Logger`. It is
    called only when a user selects the logger, on rank 0 unless ``all_ranks``.

    Args:
        name: The name users select it by (``Engine(loggers=[name])``, ``--logger name``).
        factory: Called as ``factory(log_dir)`` when the logger is selected; returns the logger
            object.
        description: One line shown by ``torchplug plugins``.
        requires: Importable module names the logger needs; checked without importing them.
        install_hint: What to run when a required module is missing, e.g. ``pip install
            torchplug[tensorboard]``.
        all_ranks: Log on every rank (each rank writes its own directory ``rank-N``), not rank 0
            only.
        provider: Filled in by the plugin manager: which plugin announced it.
        distribution: Filled in by the plugin manager: the installed distribution of that plugin.
        version: Filled in by the plugin manager: that distribution's version.
    """

    name: str
    factory: Callable[..., object]
    description: str = ""
    requires: tuple[str, ...] = ()
    install_hint: str = ""
    all_ranks: bool = False

    def unusable_reason(self) -> str | None:
        """Why this logger cannot run here (a missing package), or ``None``."""
        return missing_package(self.requires, self.install_hint)


@dataclass(frozen=True, eq=False, repr=False)
class ClusterInfo(Record):
    """The identity of this process within its job, as a cluster-environment plugin reads it.

    Returned by ``torchplug_cluster_environment``. For a process a scheduler started as one task
    of the job, describe that task; for a launcher process (``torchplug launch`` started once per
    node by ``mpirun``/``srun``), describe the node: ``num_nodes``, ``node_rank``,
    ``master_addr`` and ``master_port`` fill torchrun's multi-node flags.

    Args:
        rank: This process's rank in the whole job, 0 to ``world_size - 1``.
        world_size: How many processes the job has in all.
        local_rank: This process's index among the processes on its node (chooses its GPU).
        local_world_size: How many processes run on this node.
        node_rank: This node's index, 0 to ``num_nodes - 1``.
        num_nodes: How many nodes the job spans.
        master_addr: Host of rank 0, where the process group's store listens; every process must
            agree.
        master_port: That store's TCP port; ``None`` lets a single process pick a free one.
        source: Which environment answered, e.g. ``"torchrun"`` or ``"SLURM"`` (shown by
            ``doctor``).
    """

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    node_rank: int = 0
    num_nodes: int = 1
    master_addr: str = "127.0.0.1"
    master_port: int | None = None
    source: str = "single process"


@dataclass(frozen=True, eq=False, repr=False)
class Runtime(Record):
    """Where this process runs, as the backend's ``torchplug_setup`` decided.

    Args:
        rank: This process's rank, 0 to ``world_size - 1``.
        world_size: How many processes run the job.
        local_rank: This process's index among the processes on its node.
        device: The device this process computes on.
        node_rank: This node's index.
        data_parallel_rank: This rank's data-parallel replica, when not every rank is one
            (tensor parallelism: the ranks of a tensor-parallel group share their batches);
            ``None``: ``rank``.
        data_parallel_size: The number of data-parallel replicas; ``None``: ``world_size``.
        mesh: The job's ``DeviceMesh`` (``fsdp``: dim ``"dp"``; ``fsdp-tp``: ``("dp", "tp")``;
            ``pp``: ``("pp", "dp_replicate", "dp_shard", "tp")``), built once for every setup.
    """

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    node_rank: int = 0
    data_parallel_rank: int | None = None
    data_parallel_size: int | None = None
    mesh: Any = None
