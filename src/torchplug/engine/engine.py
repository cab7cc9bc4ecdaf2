"""The Engine: the one object a training script talks to, whatever the backend.

A façade over objects that own their state, split as Fabric splits Fabric: settings become a
strategy, precision, options and active set in `torchplug.engine.connector`; what a backend
changes on the user's objects is `torchplug.engine.backend.BackendState` (``setup`` itself is
`torchplug.engine.wrappers`, undone by ``close()``); collectives are
`torchplug.engine.collectives.Collectives`; checkpoints `torchplug.engine.checkpointing`; every
hook call goes through the typed façade `torchplug.contract.hooks` with a `HookContext` built
from those owners. What remains here is the public surface and the delegation.

Why this module is over 500 lines: it is the public API, ~50 members' docstrings (docs/api.md
renders them) around one-line delegations.
"""

from __future__ import annotations

import builtins
import contextlib
import os
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, Literal

import torch

from torchplug._deprecated import EngineFallThrough
from torchplug.checkpoint.settings import key_from, timeout_from
from torchplug.contract.context import HookContext, RuntimeFacts
from torchplug.contract.hooks import Hooks
from torchplug.contract.types import Runtime
from torchplug.engine import checkpointing, connector, scaling, wrappers
from torchplug.engine.backend import BACKEND_ONLY, BackendState  # noqa: F401 - API 1.x name
from torchplug.engine.collectives import Collectives
from torchplug.engine.resume import CheckpointPolicy
from torchplug.features import faults, profiling, sharing, syncbn
from torchplug.features.metrics import LoggerSet, call_callbacks
from torchplug.features.preemption import Preemption


class Engine(RuntimeFacts):
    """Runs a plain PyTorch training loop on the backend chosen by name.

    Every argument may be left out: the launcher, the environment (``TORCHPLUG_*``) or a
    ``torchplug.toml`` config file fill in what the code does not say. ``with Engine(...) as
    engine:`` calls [`close`][torchplug.Engine.close] at the end.

    Args:
        strategy: A registered strategy name or alias, or ``"auto"`` (the launcher's,
            environment's or config file's choice, else ``ddp`` under a multi-process launcher,
            else ``single``).
        precision: ``None``/``"32"``, ``"bf16"`` or ``"fp16"`` (Accelerate's and Fabric's
            spellings, such as ``"bf16-mixed"``, are accepted).
        plugins: Extension plugins added to this Engine only: objects, or module names
            imported as ``python -m`` would (from the current directory too).
        precision_options: Options of the precision plugin (AMP's, e.g. the fp16 loss scaler's),
            or of a strategy that owns precision; checked by name and type (``torchplug plugins
            --verbose`` lists them). Refused when the run is in full precision.
        seed: The seed every rank shares for the data order (0 to 2**64 - 1): each rank's share
            of the same permutation. Seed the model: `seed_everything`.
        checkpoint_key: A secret of at least 16 bytes (else ``TORCHPLUG_CHECKPOINT_KEY``):
            checkpoints are signed on save and must carry a valid signature on load.
        checkpoint_timeout: Seconds a save or load waits for every rank to arrive before
            naming the absent ones (else ``TORCHPLUG_CHECKPOINT_TIMEOUT``, else 300).
        checkpoint_dir: The directory [`save_checkpoint`][torchplug.Engine.save_checkpoint] writes
            the numbered checkpoints ``step-N`` to, and [`resume`][torchplug.Engine.resume] reads
            them from.
        resume: ``"latest"``: [`resume`][torchplug.Engine.resume] loads the newest complete
            checkpoint in ``checkpoint_dir`` (a restarted job carries on); ``None``: never.
        keep_last: Keep only this many numbered checkpoints in ``checkpoint_dir`` (the newest
            complete one is never deleted); ``None``: keep all.
        compile: ``True`` (torch's defaults) or a dict of ``torch.compile`` arguments (``mode``,
            ``backend``, ``fullgraph``, ``dynamic``, ``options``, ``disable``): the model is
            compiled after the backend's wrap in `setup`; ``None``/``False``: not compiled.
        activation_checkpointing: Module classes or class names whose activations are
            recomputed in backward instead of stored (applied in `setup`, before the wrap).
        sync_batchnorm: ``True`` (``torchplug launch --sync-batchnorm``): BatchNorm statistics
            over the global batch (CPU included); ``None``: the environment's setting.
        loggers: The metric loggers [`log`][torchplug.Engine.log] writes to on rank 0, by name
            (``"csv"``, ``"jsonl"``, ``"tensorboard"``, a plugin's) or as logger objects.
        log_dir: The directory the loggers (and the profiler's traces) write under.
        callbacks: Objects whose methods [`call`][torchplug.Engine.call] runs by name (your own
            loop's events, Fabric's ``callbacks``).
        profile: ``True``, or a dict (``wait``, ``warmup``, ``active`` optimizer steps, ``dir``,
            ``record_shapes``, ``profile_memory``, ``with_stack``): torch.profiler over them.
        **strategy_options: The strategy's options, e.g. ``Engine("ddp", timeout=600)``
            (``torchplug plugins --verbose`` lists them).

    Raises:
        ConfigurationError: An argument, setting or option is invalid, or the strategy cannot
            run here (the message says what to change).

    Attributes:
        info: The selected strategy's record ([`StrategyInfo`][torchplug.StrategyInfo]).
        options: The strategy's resolved options, by name.
        precision: The precision in use: ``"32"``, ``"bf16"`` or ``"fp16"``.
        precision_options: The precision plugin's resolved options.
        backend: The object holding the strategy's hooks, made by ``info.factory(**options)``.
        plugins: The active set: the backend, the precision plugin and the extensions, in order.
        hook: pluggy's relay of the active set's hooks (torchplug calls them typed).
        settings: Every setting with where it came from (code, launcher, environment, config file).
        cluster: Who this process is in its job ([`ClusterInfo`][torchplug.ClusterInfo]).
        checkpoint_key: The key checkpoints are signed and verified with (``None``: no signatures).
        checkpoints: ``checkpoint_dir``, ``resume`` and ``keep_last``, checked.
        seed, compile_options, activation_checkpointing, sync_batchnorm, loggers, callbacks: given.
    """

    def __init__(
        self,
        strategy: str = "auto",
        precision: str | int | None = None,
        *,
        plugins: Iterable[object] = (),
        precision_options: Mapping[str, Any] | None = None,
        seed: int = 0,
        checkpoint_key: str | bytes | None = None,
        checkpoint_timeout: float | None = None,
        checkpoint_dir: str | os.PathLike[str] | None = None,
        resume: str | None = None,
        keep_last: int | None = None,
        compile: bool | dict[str, Any] | None = None,  # noqa: A002 - Fabric's/Accelerate's name
        activation_checkpointing: Iterable[type | str] | None = None,
        sync_batchnorm: bool | None = None,
        loggers: Iterable[str | object] | str | None = None,
        log_dir: str | os.PathLike[str] | None = None,
        callbacks: Iterable[object] = (),
        profile: bool | Mapping[str, Any] | None = None,
        **strategy_options: Any,
    ) -> None:
        faults.install_error_recorder()
        self.callbacks = connector.checked_callbacks(callbacks)
        #: HMAC key: checkpoints are signed on save and must carry a valid signature on load.
        self.checkpoint_key = key_from(checkpoint_key)
        chosen = connector.connect(
            strategy, precision, strategy_options, precision_options, plugins
        )
        self.settings, self.cluster, self.info = chosen.settings, chosen.cluster, chosen.info
        self.precision, self.options = chosen.precision, chosen.options
        self.backend, self.precision_options = chosen.backend, chosen.precision_options
        self.seed = connector.checked_seed(seed)
        self.compile_options = scaling.compile_options(compile)
        self.activation_checkpointing = scaling.block_classes(activation_checkpointing)
        self.sync_batchnorm = syncbn.setting(sync_batchnorm)
        self.checkpoints = CheckpointPolicy.checked(checkpoint_dir, resume, keep_last)
        self.loggers = LoggerSet(loggers, log_dir, chosen.registry, self.settings.file_loggers)
        profile_settings = profiling.options(profile, self.loggers.log_dir)  # checked early
        # the owners of the Engine's state; the hooks' context is built from them
        self._selection = chosen.selection(self.checkpoint_key, timeout_from(checkpoint_timeout))
        self._pm, missing = chosen.plugin_manager()
        #: Every call to a strategy hook goes through this typed façade (answers checked).
        self._hooks = hooks = Hooks(self._pm, None, self.info.name, self.info.provider or "?")
        self._backend = BackendState(self._selection, hooks)
        self._collectives = Collectives(hooks, self._selection)
        self._saves = checkpointing.Saves()
        self._meta = scaling.MetaBuild()
        self._originals: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()
        self._profiler: profiling.StepProfiler | None = None
        self._closed = False
        owners = {"collectives": self._collectives, "backend": self._backend, "hooks": hooks}
        self._context = HookContext(self._selection, **owners, api1=EngineFallThrough(self))
        hooks.bind(self._context)
        self.plugins = tuple(chosen.active)
        self.hook = self._pm.hook
        connector.check_contract(self._hooks, self.info, self.backend, missing)
        self._preemption = Preemption.armed(self._backend.undo, self)  # a notice in setup waits
        try:
            self._selection.runtime = self._hooks.setup(self.cluster)
        except BaseException:
            self._backend.left_by_error = True  # no teardown barrier: the others may be absent
            self._hooks.teardown()  # release what setup got before failing
            self._preemption.disarm()
            raise
        if profile_settings is not None:
            self._profiler = profiling.StepProfiler(profile_settings, self.rank, self.device)
        self._collectives.start_checker()

    # -- identity ---------------------------------------------------------------------------------

    def __getattr__(self, name: str) -> Any:
        """Plugin API 1.x: the members only a backend calls moved to the hook's context."""
        if "_backend" in self.__dict__:
            return self._backend.deprecated_alias(name)
        raise AttributeError(f"'Engine' object has no attribute {name!r}")

    @property
    def failing(self) -> bool:
        """Whether this Engine, or the process, is going down with an exception: teardown then
        skips its barrier (the other ranks may sit in a collective that never completes)."""
        return self._backend.failing

    @property
    def runtime(self) -> Runtime:
        """Where this process runs ([`Runtime`][torchplug.Runtime]): setup's answer."""
        runtime = self._selection.runtime
        if runtime is None:
            raise AttributeError("the runtime is known once the backend's setup answered")
        return runtime

    @property
    def strategy(self) -> str:
        """The selected strategy's canonical name."""
        return self.info.name

    def __repr__(self) -> str:
        facts = f"rank={self.rank}, world_size={self.world_size}, device={str(self.device)!r}"
        return f"Engine(strategy={self.strategy!r}, precision={self.precision!r}, {facts})"

    # -- setup ------------------------------------------------------------------------------------

    def setup(self, model: torch.nn.Module, *optimizers: torch.optim.Optimizer) -> Any:
        """Wrap ``model`` (and its optimizers) for the backend and precision.

        Returns the model if no optimizer is given, else ``(model, *optimizers)``. Create the
        optimizers on the plain model's parameters before calling this, as with plain PyTorch.

        Args:
            model: The plain model (or one built under
                [`init_module`][torchplug.Engine.init_module]).
            *optimizers: Optimizers made on ``model``'s parameters.
        """
        return wrappers.setup(self, model, optimizers)

    @contextlib.contextmanager
    def init_module(self, empty: bool = False) -> Iterator[None]:
        """Build the model inside: on this rank's device, or with ``empty=True`` on the meta
        device (no memory), to be materialised by [`setup`][torchplug.Engine.setup]: only each
        rank's shard under sharding backends (fsdp, fsdp-tp, tp), the whole model elsewhere,
        initialised by each module's ``reset_parameters()`` to the numbers an eager build would
        have. DeepSpeed ZeRO-3 partitions the model as it is built instead (its ``zero.Init``).

        Args:
            empty: Build on the meta device (no memory), materialised by
                [`setup`][torchplug.Engine.setup]; ``False``: on this rank's device.
        """
        if not empty:
            block = torch.device(self.device)
        else:  # the backend may partition as the model is built (DeepSpeed ZeRO-3)
            block = self._hooks.init_module() or self._meta.building()
        with block:
            yield

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        """The optimizers set up so far, in order."""
        return list(self._backend.optimizers)

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """``obj`` (JSON values: names, paths, flags) from rank ``src`` on every rank.

        Sent as UTF-8 bytes in a tensor: unlike ``broadcast_object_list`` it needs neither pickle
        nor numpy (which an install made as the README says does not have).

        Args:
            obj: A JSON-serialisable value (read on rank ``src`` only).
            src: The rank whose ``obj`` every rank receives.
        """
        return self._collectives.broadcast_object(obj, src)

    def unwrap(self, obj: Any) -> Any:
        """The user's original module behind a module this Engine returned (else ``obj``).

        Args:
            obj: A module [`setup`][torchplug.Engine.setup] returned, or anything else (returned as
                it is).
        """
        try:
            return self._originals.get(obj, obj)
        except TypeError:  # not weakly referable: not a module this Engine returned
            return obj

    def setup_dataloader(
        self,
        loader: Iterable[Any],
        *,
        use_distributed_sampler: bool = True,
        move_to_device: bool = True,
        split_batches: bool = False,
        shard_by: Literal["sample", "batch"] = "sample",
    ) -> Any:
        """Give each rank its own share of ``loader``'s batches, moved to the device (a backend
        whose ranks change per step, ``ft-ddp``, deals each step's: `torchplug_batch_sampler`).

        Args:
            loader: a DataLoader (or any iterable of batches).
            use_distributed_sampler: shard as ``shard_by`` says (``False``: shard by batch).
            move_to_device: put each batch on [`device`][torchplug.Engine.device] (``place_batch``).
            split_batches: ``batch_size`` is the global batch, each rank taking its share
                (must divide evenly); ``False`` (default): ``batch_size`` is per rank.
            shard_by: ``"sample"``: rank ``r`` takes samples ``r, r+N, ...`` (a
                ``DistributedSampler``, as Fabric); ``"batch"``: whole batches ``r, r+N, ...``
                of the loader as it is, as Accelerate's ``prepare``.
        """
        from torchplug.features.data import EngineDataLoader

        return EngineDataLoader(
            loader,  # type: ignore[arg-type]
            self.place_batch if move_to_device else None,
            num_replicas=self.data_parallel_size,
            rank=self.data_parallel_rank,
            seed=self.seed,
            use_distributed_sampler=use_distributed_sampler,
            gather=self.gather if self.world_size > 1 else None,
            on_batch=self._collectives.note_loader,
            split_batches=split_batches,
            shard_by=shard_by,
            deal=self._hooks.batch_sampler,
        )

    def place_batch(self, batch: Any) -> Any:
        """Put a batch where the backend wants it (device, and sharding for SPMD backends).

        Args:
            batch: Tensors, possibly nested in lists, tuples and dicts.
        """
        return self._hooks.place_batch(batch)

    # -- training step ----------------------------------------------------------------------------

    def backward(self, loss: torch.Tensor, model: torch.nn.Module | None = None) -> None:
        """``loss.backward()`` as the backend and precision need it (scaling, sharding).

        Inside [`accumulate`][torchplug.Engine.accumulate] the loss is divided by the number of
        accumulated steps, so the accumulated gradient is the mean over the micro-batches, as one
        large batch would give.

        Args:
            loss: The scalar loss of this rank's batch.
            model: The model the loss came from, when several were set up (some backends need it).
        """
        if self._backend.accumulating is not None:
            loss = loss / self._backend.accumulating[0]
        self._hooks.backward(loss, model)

    def forward_backward(
        self, model: torch.nn.Module, *inputs: Any, target: Any, loss_fn: Callable, **kwargs: Any
    ) -> torch.Tensor:
        """``loss_fn(model(*inputs, **kwargs), target)`` and its backward; returns the loss,
        detached: the one training step every strategy runs (``pp``'s schedule interleaves the
        micro-batches' forwards and backwards; elsewhere it is the forward and `backward`).

        Args:
            model: What [`setup`][torchplug.Engine.setup] returned.
            *inputs: The model's inputs (the whole batch).
            target: ``loss_fn``'s second argument.
            loss_fn: ``loss_fn(output, target)``, a mean over the batch.
            **kwargs: The model's keyword inputs.
        """
        return wrappers.forward_backward(self, model, inputs, kwargs, target, loss_fn)

    def clip_grad_norm_(
        self,
        model: torch.nn.Module,
        max_norm: float,
        norm_type: float = 2.0,
        optimizer: torch.optim.Optimizer | None = None,
        error_if_nonfinite: bool = False,
    ) -> torch.Tensor:
        """Clip gradients to ``max_norm`` (unscaled, across shards); return the total norm.

        Args:
            model: The model [`setup`][torchplug.Engine.setup] returned.
            max_norm: The largest total norm the gradients may have.
            norm_type: The norm's order (``2.0``: Euclidean; ``float("inf")``: the largest value).
            optimizer: The model's optimizer, which a precision plugin needs to unscale fp16
                gradients first.
            error_if_nonfinite: Raise ``RuntimeError`` on every rank when the total norm is nan
                or inf, as torch's (the backend has scaled the gradients by then).

        Returns:
            The total norm of the gradients before clipping.
        """
        norm = self._hooks.clip_grad_norm(model, optimizer, max_norm, norm_type)
        return wrappers.finite_norm(norm, norm_type) if error_if_nonfinite else norm

    @contextlib.contextmanager
    def no_sync(self, model: torch.nn.Module, enabled: bool = True) -> Iterator[None]:
        """Skip gradient synchronization in backward (gradient accumulation steps).

        Args:
            model: The model [`setup`][torchplug.Engine.setup] returned.
            enabled: ``False`` makes it a no-op (synchronize as usual).
        """
        with self._hooks.no_sync(model) if enabled else contextlib.nullcontext():
            yield

    @contextlib.contextmanager
    def accumulate(self, model: torch.nn.Module, steps: int) -> Iterator[None]:
        """Accumulate gradients over ``steps`` micro-batches; wrap each micro-batch's step in it.

        The loop stays as it was:

        ```python
        for x, y in loader:
            with engine.accumulate(model, steps=4):
                engine.backward(loss_fn(model(x), y))
                optimizer.step()
                optimizer.zero_grad()
        ```

        The first ``steps - 1`` calls skip gradient synchronization (the backend's ``no_sync``)
        and make ``optimizer.step()`` and ``zero_grad()`` do nothing; every ``steps``-th call,
        and the last batch of a pass of a [`setup_dataloader`][torchplug.Engine.setup_dataloader]
        loader (the count then starts again: Accelerate's ``sync_with_dataloader``), runs all
        three. Each loss is divided by ``steps`` (a short last group's too, as Accelerate's), so
        a full group updates as the ``steps`` times larger batch would. After an accumulation
        step ``optimizer.step_was_skipped`` is ``True`` (step a scheduler only when it is
        ``False``). The count is kept per model.

        Args:
            model: The model [`setup`][torchplug.Engine.setup] returned (the count is kept per
                model).
            steps: Micro-batches per optimizer update (1: every step updates).
        """
        batch = self._collectives.loader_position()
        with self._backend.accumulate(model, steps, batch) as sync, self.no_sync(model, not sync):
            yield

    def autocast(self) -> contextlib.AbstractContextManager[None]:
        """Apply the active precision to code outside the model's forward (e.g. the loss)."""
        return self._hooks.autocast()

    # -- collectives ------------------------------------------------------------------------------

    def reduce(self, tensor: Any, op: str = "mean") -> Any:
        """Reduce over all ranks with ``op`` (sum, mean, max, min): a new tensor on every rank,
        in the input's dtype (an integer mean: a true mean, as floats); the input is unchanged.

        Args:
            tensor: This rank's tensor or number, or tensors nested in tuples, lists and dicts
                (each reduced; the same structure returned).
            op: ``"sum"``, ``"mean"``, ``"max"`` or ``"min"``.
        """
        return self._collectives.reduce_all(tensor, op)

    def gather(self, tensor: Any, *, concat: bool = False) -> Any:
        """Every rank's ``tensor``: stacked, shape ``(world_size, *tensor.shape)`` (Fabric's
        ``all_gather``); with ``concat=True`` joined along the first dimension,
        ``(world_size * B, ...)`` (Accelerate's ``gather``; a number gives ``(world_size,)``).
        Tensors nested in tuples, lists and dicts are each gathered, in the same structure.

        Args:
            tensor: This rank's tensor or number (the same shape on every rank), or a nesting.
            concat: Join along the first dimension instead of stacking.
        """
        return self._collectives.gather_all(tensor, concat)

    def gather_object(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` (JSON values: no pickle), in rank order; lists are joined into
        one list, as Accelerate's ``gather_object`` does. A collective.

        Args:
            obj: This rank's JSON value (a list, to get one joined list).
        """
        return self._collectives.gather_object(obj)

    @contextlib.contextmanager
    def split_between_processes(self, items: Any, apply_padding: bool = False) -> Iterator[Any]:
        """This process's contiguous part of ``items`` (a list, tuple, tensor along dimension
        0, or a dict of those), as Accelerate's: 5 prompts on 2 ranks are ``[0, 1, 2]`` and
        ``[3, 4]``, by data-parallel rank. ``apply_padding=True`` repeats each part's last item
        up to the longest, so a later [`gather`][torchplug.Engine.gather] lines up.

        ``with engine.split_between_processes(prompts) as mine: outputs = generate(mine)``

        Args:
            items: A list, tuple, tensor, or dict of those, the same on every rank.
            apply_padding: Make every part as long as the longest.
        """
        yield sharing.split(items, self.data_parallel_rank, self.data_parallel_size, apply_padding)

    def pad_across_processes(
        self, tensor: torch.Tensor, dim: int = 0, pad_index: Any = 0, pad_first: bool = False
    ) -> torch.Tensor:
        """``tensor`` padded with ``pad_index`` along ``dim`` to the largest size any rank has
        there (a collective: every rank calls it), so tensors of different lengths (generated
        tokens) can be gathered. ``pad_first``: pad before the data (left padding).

        Args:
            tensor: This rank's tensor.
            dim: The dimension to pad.
            pad_index: The value padded with.
            pad_first: Pad before the data instead of after it.
        """
        return self._collectives.pad_across_processes(tensor, dim, pad_index, pad_first)

    def call(self, hook_name: str, *args: Any, **kwargs: Any) -> list[Any]:
        """Run ``hook_name(*args, **kwargs)`` on every object of ``Engine(callbacks=...)`` that
        has that method, in the order given, and return what each returned (Fabric's
        ``fabric.call``), e.g. ``engine.call("on_validation_end", metrics=metrics)``. A callback
        without the method is skipped; a non-callable attribute of that name is an error.

        Args:
            hook_name: The method name to call on each callback.
            *args: Passed to each callback's method.
            **kwargs: Passed to each callback's method.
        """
        return call_callbacks(self.callbacks, hook_name, args, kwargs)

    def any(self, flag: bool | torch.Tensor) -> bool:
        """True on every rank if ``flag`` is true on any rank (``if engine.any(stop): break``).

        Args:
            flag: This rank's flag (a bool or a one-element tensor).
        """
        return self._collectives.agree(flag, "max")

    def all(self, flag: bool | torch.Tensor) -> bool:
        """True on every rank if ``flag`` is true on every rank.

        Args:
            flag: This rank's flag (a bool or a one-element tensor).
        """
        return self._collectives.agree(flag, "min")

    def gather_for_metrics(self, data: Any, padding: int | None = None) -> Any:
        """Every rank's ``data`` joined along the first dimension, without the padding.

        A distributed sampler repeats a few samples so that every rank gets as many (a 7-item
        eval set on 2 ranks gathers 8 with [`gather`][torchplug.Engine.gather]). This drops the
        repeats in the batch last handed out by a loader from
        [`setup_dataloader`][torchplug.Engine.setup_dataloader] (or the last ``padding`` rows),
        then gathers (first dimensions may differ; a number gives one row per rank; each
        tensor-parallel replica's values appear once). Call it on every rank.

        Args:
            data: This rank's tensor, or tensors nested in tuples, lists and dicts.
            padding: How many of this rank's last rows are padding; ``None``: what the last loader's
                sampler added.
        """
        return self._collectives.gather_for_metrics(data, padding)

    def log(self, metrics: Mapping[str, Any], step: int | None = None) -> None:
        """Send ``metrics`` (name -> number or one-element tensor) to the loggers at ``step``.

        Rank 0 writes (loggers that declare ``all_ranks`` write on every rank); other ranks
        return at once, so reduce values first (``engine.reduce``) if they differ per rank.
        Without ``step``, the step after the last one logged. Call it on any rank: it is not a
        collective.

        Args:
            metrics: Metric names and values (numbers or one-element tensors).
            step: The step the values belong to; ``None``: the step after the last one logged.
        """
        self.loggers.log(self.rank, metrics, step)

    def log_hyperparams(self, params: Mapping[str, Any]) -> None:
        """Record the run's hyperparameters with every logger (rank 0's, and loggers that log
        on every rank): csv/jsonl write them beside the metrics, TensorBoard in its hparams
        tab, MLflow as the run's params. Nested mappings are flattened to ``"a.b"`` keys.

        Args:
            params: Hyperparameter names and values (nested mappings are flattened).
        """
        self.loggers.log_hyperparams(self.rank, params)

    @property
    def preempted(self) -> bool:
        """``True`` on every rank once any rank has been sent SIGTERM or SIGUSR1 (a scheduler's
        notice: preemption, ``scancel``, ``srun --signal=USR1@90``, ``torchplug launch`` passing
        on its own SIGTERM): time to save a checkpoint and leave the loop. Armed when the
        Engine is made (chained to a handler the script set; removed at close); a SIGTERM never
        asked about keeps its default effect, two steps or 10 s late. A collective: read it at
        the same point on every rank (e.g. once per step)."""
        return self._preemption.seen(self.any if self.world_size > 1 else None)

    def barrier(self) -> None:
        """Wait until every rank arrives here."""
        self._collectives.barrier()

    @property
    def collective_timeout(self) -> float:
        """Seconds anything waiting on the other ranks waits: the ``timeout`` option, else
        `DEFAULT_TIMEOUT`."""
        return self._selection.collective_timeout

    @property
    def accumulating(self) -> tuple[int, bool] | None:
        """``(steps, whether this micro-batch synchronizes)`` inside `accumulate`, else None."""
        return self._backend.accumulating

    def print(self, *args: Any, **kwargs: Any) -> None:
        """``print`` on rank 0 only.

        Args:
            *args: As ``print``'s.
            **kwargs: As ``print``'s.
        """
        if self.is_main:
            builtins.print(*args, **kwargs)

    def profile(self, **settings: Any) -> contextlib.AbstractContextManager[Any]:
        """``with engine.profile() as prof:`` torch's profiler over the block, as Accelerate's
        ``accelerator.profile()`` (``Engine(profile=...)`` profiles chosen steps instead).

        Args:
            **settings: ``dir`` (each rank's Chrome trace is written there), else
                ``torch.profiler.profile``'s keywords (``schedule`` may be a dict).
        """
        return profiling.block(settings, self.rank, self.device, self.barrier)

    @contextlib.contextmanager
    def main_process_first(self) -> Iterator[None]:
        """Run the block on rank 0 first, then on the others (downloads, cache building)."""
        self.barrier() if not self.is_main else None
        yield
        self.barrier() if self.is_main else None

    # -- checkpoints ------------------------------------------------------------------------------

    def full_state(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None
    ) -> dict[str, Any]:
        """Unsharded model (and optimizer) state by parameter name, on every rank, on the CPU:
        ``{"model": {name: tensor}, "optimizer": {"state": {name: {"exp_avg": ..., "step": ...}},
        "param_groups": [{..., "params": [names]}]}}`` (``"optimizer"`` only when given). The
        same under every strategy, so two runs compare with ``torch.equal`` key by key. A
        collective under sharding strategies: call it on every rank.

        Args:
            model: The model [`setup`][torchplug.Engine.setup] returned.
            optimizer: Its optimizer, to include its state too.
        """
        return self._backend.full_state(model, optimizer)

    def save(
        self,
        path: str | os.PathLike[str],
        state: dict[str, Any],
        metadata: dict[str, Any] | None = None,
        *,
        async_: bool = False,
    ) -> None:
        """Write ``state`` (modules, optimizers, tensors, JSON values) as a checkpoint at ``path``.

        Call it on every rank; the previous checkpoint at ``path`` stays intact until the new
        one is complete. A failure on any rank raises a CheckpointError on every rank naming it;
        a save some ranks never call fails after ``checkpoint_timeout`` seconds. ``async_=True``
        returns once the state is copied to memory (a CUDA tensor's copy queued on the current
        stream) and writes in the background: the checkpoint holds the state at the call, however
        the tensors change afterwards (``.data`` included); the next save, load, resume or
        [`close`][torchplug.Engine.close] waits for it and raises its failure, on every rank. A
        backend with a format of its own (DeepSpeed's ``native_checkpoint``) saves synchronously.

        Args:
            path: The checkpoint directory to write (replaced once the new one is complete).
            state: What to save, by name: modules, optimizers, tensors, JSON values.
            metadata: JSON values recorded in the manifest for your own use.
            async_: Return once every tensor is staged in memory; the write goes on in the
                background.

        Raises:
            CheckpointError: The save failed on any rank (on every rank), or some rank did not call
                it within ``checkpoint_timeout``.
        """
        checkpointing.save(self, path, state, metadata, async_)

    def wait_for_save(self) -> None:
        """Wait until an asynchronous save (``save(..., async_=True)``) has committed; raise its
        failure as a CheckpointError (on every rank). Nothing to do without one in flight."""
        self._saves.wait()

    def after_save(self, step: Callable[[], None]) -> None:
        """Run ``step`` once the last save has committed: now for a synchronous one, in the
        background after the commit for an asynchronous one (used for checkpoint rotation).

        Args:
            step: A function of no arguments.
        """
        self._saves.after(step)

    def load(
        self,
        path: str | os.PathLike[str],
        state: dict[str, Any] | None = None,
        *,
        strict: bool = True,
    ) -> dict[str, Any]:
        """Load a checkpoint into ``state``'s objects in place; call it on every rank.

        Returns the plain values of entries not restored into an object (and replaces them in
        ``state``). Without ``state``: every plain value, and a summary of modules and
        optimizers. An entry that cannot be restored into the object given for it (a module's
        state into a dict, another backend's optimizer format) is an error unless
        ``strict=False``, which also loads the common part of a module whose keys differ.

        Args:
            path: The checkpoint directory [`save`][torchplug.Engine.save] wrote.
            state: The objects to restore in place, by the names they were saved under; ``None``:
                return what the checkpoint holds.
            strict: Refuse entries that cannot be restored into the objects given, and module keys
                that differ.

        Returns:
            The plain values of entries not restored into an object.

        Raises:
            CheckpointError: The checkpoint is missing, incomplete, fails verification, or does not
                fit ``state``.
        """
        return checkpointing.load(self, path, state, strict)

    def load_pretrained(
        self, model: torch.nn.Module, path: str | os.PathLike[str], *, strict: bool = True
    ) -> dict[str, list[str]]:
        """Copy safetensors weights (a file, or a directory with ``model.safetensors`` or the
        shards of ``model.safetensors.index.json``, as ``save_pretrained`` writes them) into a
        model this Engine set up, under any strategy whose parameters are plain tensors or
        DTensors; no collective. Each rank reads only the block of its own shards, so a model
        built with ``init_module(empty=True)`` and set up sharded is never whole on a rank.
        Call it after [`setup`][torchplug.Engine.setup].

        Args:
            model: A model this Engine set up.
            path: A ``.safetensors`` file, or a directory as ``save_pretrained`` writes it.
            strict: Refuse a model tensor the files lack.

        Returns:
            The names of the tensors loaded, missing and unexpected: ``{"loaded", "missing",
                "unexpected"}``.
        """
        return checkpointing.load_pretrained(self, model, path, strict)

    @property
    def checkpoint_timeout(self) -> float:
        """Seconds a save or load waits for every rank to arrive before naming the absent ones."""
        return self._selection.checkpoint_timeout

    # -- fault tolerance --------------------------------------------------------------------------

    def save_checkpoint(
        self, state: dict[str, Any], step: int | None = None, *, async_: bool = False
    ) -> Path:
        """Save ``state`` and every rank's RNG state as ``checkpoint_dir/step-N``.

        ``N`` is ``step`` or ``state["step"]``. With ``keep_last`` the oldest numbered
        checkpoints beyond that count are deleted, never the newest complete one. Put the
        loader from [`setup_dataloader`][torchplug.Engine.setup_dataloader] in ``state`` to resume
        mid-epoch. ``async_=True`` returns once the state is staged in memory (see
        [`save`][torchplug.Engine.save]).

        Args:
            state: What to save, as for [`save`][torchplug.Engine.save]; its ``"step"`` names the
                checkpoint when ``step`` is not given.
            step: The step number ``N`` of ``checkpoint_dir/step-N``.
            async_: Return once the state is staged in memory (see [`save`][torchplug.Engine.save]).

        Returns:
            The path of the checkpoint written.
        """
        from torchplug.engine import resume

        return resume.save_checkpoint(self, state, step, async_)

    def resume(self, state: dict[str, Any]) -> int | None:
        """With ``resume="latest"``: load the newest complete checkpoint in ``checkpoint_dir``
        into ``state`` (RNG states included); return its step, or ``None`` if there is none.

        Call it once after setup; a job restarted by ``torchplug launch --max-restarts`` then
        carries on where its last checkpoint left it.

        Args:
            state: The objects to restore in place, as for [`load`][torchplug.Engine.load].

        Returns:
            The checkpoint's step, or ``None`` when there is none (or ``resume`` is not
                ``"latest"``).
        """
        from torchplug.engine import resume

        return resume.resume(self, state)

    # -- lifetime ---------------------------------------------------------------------------------

    def close(self) -> None:
        """Release the backend (process group and the like). Called by ``with Engine(...)``."""
        if not self._closed:
            self._closed = True
            failed_save = None
            try:
                failed_save = self._saves.finish(self.failing)
                if self._profiler is not None:
                    self._profiler.stop()
                self.loggers.close()
                self._hooks.teardown()
            finally:
                while self._backend.undo:  # what setup patched on user objects, newest first
                    self._backend.undo.pop()()
            if failed_save is not None:
                raise failed_save

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, kind: object, *exc: object) -> None:
        if kind is not None:
            self._backend.left_by_error = True  # others may sit in a collective: no barrier
            if isinstance(exc[0], BaseException):
                faults.note(exc[0])
        self.close()
