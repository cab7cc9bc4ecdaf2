"""``ft-ddp``: data parallel over replica groups that train through each other's failures.

The job is ``R`` replica groups, each its own ``torchrun`` (one or more ranks holding a full
replica). Per optimizer step:

1. **Quorum.** At the step's first training forward (or at ``engine.resume``) the group's torchft
   ``Manager`` asks the lighthouse which groups are alive; a group that (re)joins takes the live
   state of a healthy peer there, before computing anything (model, optimizers, the loaders'
   positions, the plain values of ``engine.resume``'s ``state``), served over HTTP and read as
   tensors and plain values only (`transport`). Every training forward then hands every rank the
   first group's rank 0's buffers, as DDP hands rank 0's.
2. **Gradients.** After ``backward`` (the last micro-batch of an accumulation group) the gradients
   are averaged inside the group (torch.distributed) and then over the groups of the quorum
   (torchft's managed process group): the mean over every rank alive at this step, as ``ddp``'s.
3. **Commit.** ``optimizer.step()`` updates only when every group of the quorum agrees
   (``should_commit``); otherwise the step is given up (``step_was_skipped``): no group updates,
   and the buffers go back to where the step found them (its forwards' BatchNorm updates undone).

Data (`torchplug_torchft.data`): a loader from ``engine.setup_dataloader`` (a map-style dataset,
the default sampler) deals each step's samples among the ranks of that step's quorum: the step
takes the next ``batch_size`` samples per rank alive of the epoch's order, a committed step moves
on past them, a step given up deals them again. Within an epoch no sample is lost or trained on
twice, whichever groups were down (the others take their share; the epoch lasts more steps);
with every group alive it is ``ddp``'s dealing on ``R * group_size`` ranks. A group that rejoins
continues from its healthy peer's position. Nothing else changes in the user's script.
"""

from __future__ import annotations

import contextlib
import os
import time
import weakref
from collections.abc import Callable, Generator, Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from torchplug.plugin import (
    ClusterInfo,
    ConfigurationError,
    DistributedStrategy,
    HookContext,
    Option,
    Runtime,
    StrategyInfo,
    hookimpl,
)
from torchplug_torchft.data import QuorumBatches

TORCHPLUG_API = ">=1.5,<2"  # torchplug_batch_sampler (1.4), torchplug_gather(replicas)

#: This replica group's index (0 to ``REPLICAS_ENV - 1``), set by the launcher.
REPLICA_ENV = "TORCHPLUG_FT_REPLICA"
#: How many replica groups the job has.
REPLICAS_ENV = "TORCHPLUG_FT_REPLICAS"
#: The lighthouse's address (torchft's own variable).
LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"

HOW_TO_START = (
    "Start the job with `torchplug launch --strategy ft-ddp --replicas R -n N SCRIPT` (it starts "
    "the lighthouse and each replica group), or set TORCHPLUG_FT_REPLICA, TORCHPLUG_FT_REPLICAS "
    "and TORCHFT_LIGHTHOUSE for each group's torchrun yourself (docs/fault-tolerance.md)."
)


def _positive(value: float) -> str | None:
    return None if value > 0 else f"must be a positive number, got {value}"


def _from_env(value: Any, name: str, what: str) -> int:
    if value is not None:
        return int(value)
    raw = os.environ.get(name)
    if raw is None or not raw.strip().isdigit():
        raise ConfigurationError(
            f"ft-ddp needs {what} ({name} "
            f"{'is not set' if raw is None else f'is {raw!r}, not a number'} in the environment, "
            f"and no option gives it). " + HOW_TO_START
        )
    return int(raw)


class FaultTolerantDDP(DistributedStrategy):
    """Data parallel over replica groups coordinated by a torchft ``Manager`` per group.

    Args:
        replicas: How many replica groups (``None``: ``TORCHPLUG_FT_REPLICAS``).
        replica: This group's index (``None``: ``TORCHPLUG_FT_REPLICA``).
        min_replicas: The fewest groups a step may commit with.
        lighthouse: The lighthouse's address (``None``: ``TORCHFT_LIGHTHOUSE``).
        replica_timeout: Seconds a quorum, an average over the groups, a commit or a recovery
            waits before it fails with an error (a dead lighthouse, too few groups).
        **kwargs: `DistributedStrategy`'s options (``timeout``, ``process_group_backend``).
    """

    def __init__(
        self,
        replicas: int | None = None,
        replica: int | None = None,
        min_replicas: int = 1,
        lighthouse: str | None = None,
        replica_timeout: float = 60.0,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.replicas, self.replica = replicas, replica
        self.min_replicas, self.lighthouse = min_replicas, lighthouse
        self.replica_timeout = replica_timeout
        self.manager: Any = None
        self.models: list[torch.nn.Module] = []
        #: ``engine.resume``'s state: what a rejoining group takes from a peer.
        self.state: dict[str, Any] | None = None
        #: Each loader's position at the last committed step (a step in progress has already
        #: read its batches: a group that joins now must read them again).
        self.positions: dict[str, dict[str, Any]] = {}
        self.quorum_open = False  # this step's quorum has formed
        self.buffers_before: list[torch.Tensor] = []
        self.replica_count = 0
        self.store: Any = None
        self.syncing = True  # False inside engine.no_sync
        self.hooks: list[Any] = []
        #: The loaders' samplers dealing each step among its quorum (`torchplug_batch_sampler`).
        self.dealers: list[weakref.ref[QuorumBatches]] = []
        self.group = (0, 1)  # this rank in its group, the group's size

    # -- setup ------------------------------------------------------------------------------------

    @hookimpl
    def torchplug_setup(self, engine: HookContext, cluster: ClusterInfo) -> Runtime:
        from torchft import Manager, ProcessGroupGloo

        runtime = super().torchplug_setup(engine, cluster)
        replicas = _from_env(self.replicas, REPLICAS_ENV, "the number of replica groups")
        replica = _from_env(self.replica, REPLICA_ENV, "this replica group's index")
        if not 0 <= replica < replicas or self.min_replicas > replicas:
            raise ConfigurationError(
                f"ft-ddp: replica group {replica} of {replicas} with min_replicas="
                f"{self.min_replicas}: expected 0 <= replica < replicas and min_replicas <= "
                f"replicas. " + HOW_TO_START
            )
        lighthouse = self.lighthouse or os.environ.get(LIGHTHOUSE_ENV)
        if not lighthouse:
            raise ConfigurationError("ft-ddp needs the lighthouse's address. " + HOW_TO_START)
        self.replica_count = replicas
        self.lighthouse = lighthouse
        self.group = (runtime.rank, runtime.world_size)
        try:
            self.manager = self._manager(Manager, ProcessGroupGloo, runtime, replica, lighthouse)
        except Exception as error:  # torchft's own (RuntimeError, TimeoutError, OSError)
            raise _unreachable(lighthouse, "starting the group's manager", error) from error
        return Runtime(
            rank=runtime.rank,
            world_size=runtime.world_size,
            local_rank=runtime.local_rank,
            device=runtime.device,
            node_rank=runtime.node_rank,
            data_parallel_rank=replica * runtime.world_size + runtime.rank,
            data_parallel_size=replicas * runtime.world_size,
        )

    def _manager(
        self, manager: Any, process_group: Any, runtime: Runtime, replica: int, lighthouse: str
    ) -> Any:
        """The group's torchft ``Manager`` (its rank 0 serves the group's manager server)."""
        from torchplug_torchft.transport import TensorsOnlyHTTPTransport

        wait = timedelta(seconds=self.replica_timeout)
        host, port = self._group_store(runtime)
        return manager(
            pg=process_group(timeout=wait),
            load_state_dict=self._take,
            state_dict=self._serve,
            min_replica_size=self.min_replicas,
            use_async_quorum=False,  # a group that heals does so before its step starts
            timeout=wait,
            quorum_timeout=wait,
            connect_timeout=wait,
            rank=runtime.rank,
            world_size=runtime.world_size,
            store_addr=host,
            store_port=port,
            lighthouse_addr=lighthouse,
            replica_id=f"torchplug_ft_{replica:05d}",  # the quorum orders groups by it
            checkpoint_transport=TensorsOnlyHTTPTransport(timeout=wait, num_chunks=0),
            init_sync=False,  # every group starts (or resumes from disk) the same way
        )

    def _group_store(self, runtime: Runtime) -> tuple[str, int]:
        """A store of this Engine's own, on the group's rank 0, for its ``Manager``: torchft
        writes fixed keys (the manager's address), so a store an earlier Engine of the same
        processes used could hand rank 1 a stale address."""
        from torch.distributed import TCPStore

        host = os.environ.get("MASTER_ADDR", "127.0.0.1") if runtime.world_size > 1 else "127.0.0.1"
        port = [0]
        if runtime.rank == 0:
            self.store = TCPStore(host, 0, is_master=True, wait_for_workers=False)
            port = [self.store.port]
        if runtime.world_size > 1:
            dist.broadcast_object_list(port, src=0)
        return host, int(port[0])

    @hookimpl
    def torchplug_wrap(
        self, engine: HookContext, model: torch.nn.Module, optimizers: list[torch.optim.Optimizer]
    ) -> tuple[torch.nn.Module, list[torch.optim.Optimizer]]:
        """A full replica on this rank's device (the Engine broadcast rank 0's weights)."""
        model = model.to(engine.device)
        self.models.append(model)
        hook = model.register_forward_pre_hook(lambda m, args: self._before_forward(engine))
        self.hooks.append(hook)  # removed at teardown: the model outlives this Engine
        return model, optimizers

    def _before_forward(self, engine: HookContext) -> None:
        """A training forward (gradients on): this step's quorum (a group behind the others
        heals here, before computing anything), then every rank takes the first group's rank
        0's buffers, as DDP hands every rank rank 0's at each forward."""
        if torch.is_grad_enabled():
            self._quorum()
            self._share_buffers(engine.world_size > 1)

    # -- the live state ---------------------------------------------------------------------------

    @hookimpl
    def torchplug_resume(self, engine: HookContext, state: dict[str, Any]) -> bool | None:
        """Join the quorum now; a group behind the others takes ``state`` from a peer (True).
        A job's first quorum (every group at step 0) takes nothing: each resumes from disk."""
        self.state = state
        self.positions = {k: v.state_dict() for k, v in state.items() if _is_loader(v)}
        before = self.manager.current_step()
        self._quorum()
        return True if self.manager.current_step() != before else None

    def _serve(self) -> dict[str, Any]:
        """What a joining group takes: tensors and plain values (see `transport`)."""
        served: dict[str, Any] = {}
        entries = self.state if self.state is not None else {}
        for key, value in entries.items():
            if key in self.positions:
                served[key] = ("loader", _next_pass_if_done(self.positions[key], value))
            elif hasattr(value, "state_dict") and hasattr(value, "load_state_dict"):
                served[key] = ("state_dict", value.state_dict())
            else:
                served[key] = ("value", value)
        if self.state is None:  # no engine.resume: the models and optimizers set up
            for i, model in enumerate(self.models):
                served[f"model{i}"] = ("state_dict", model.state_dict())
        return served

    def _take(self, served: dict[str, Any]) -> None:
        """Load what a peer served into this group's objects, in place."""
        entries = self.state if self.state is not None else {}
        for key, (kind, value) in served.items():
            if kind == "value":
                entries[key] = value
            elif key in entries:
                entries[key].load_state_dict(value)
                if kind == "loader":
                    self.positions[key] = value
            elif key.startswith("model") and self.state is None:
                self.models[int(key[5:])].load_state_dict(value)

    # -- the data ---------------------------------------------------------------------------------

    @hookimpl
    def torchplug_batch_sampler(self, engine: HookContext, loader: Any, seed: int) -> Any:
        """Each step's samples dealt among the ranks of its quorum (`torchplug_torchft.data`)."""
        from torch.utils.data import RandomSampler

        dealer = QuorumBatches(
            self._deal,
            loader.dataset,
            loader.batch_size,
            shuffle=isinstance(loader.sampler, RandomSampler),
            drop_last=loader.drop_last,
            seed=seed,
            ranks=engine.data_parallel_size,
        )
        self.dealers.append(weakref.ref(dealer))
        return dealer

    def _deal(self) -> tuple[int, int]:
        """This step's quorum (started here, before its batches are read); this rank's place
        among the ranks of the quorum's groups, and how many they are."""
        self._quorum()
        place = self.manager.participating_rank()
        if place is None:  # torchft's spare replicas (not used by ft-ddp)
            raise ConfigurationError(
                "ft-ddp: this group is not taking part in the step's quorum, so no samples can be "
                "dealt to it; expected every group that joins to take part (min_replicas "
                f"{self.min_replicas}, {self.replica_count} groups)."
            )
        rank, size = self.group
        return place * size + rank, self.manager.num_participants() * size

    def _step_ended(self, committed: bool) -> None:
        """Tell the loaders' dealers whether the step's samples were trained on."""
        alive = [ref for ref in self.dealers if ref() is not None]
        for ref in alive:
            dealer = ref()
            if dealer is not None:
                dealer.commit(committed)
        self.dealers = alive

    # -- a step -----------------------------------------------------------------------------------

    def _quorum(self) -> bool:
        """This step's quorum (once per step); whether this group healed in it."""
        if self.quorum_open:
            return False
        before = self.manager.current_step()
        try:
            self.manager.start_quorum()
            if before == 0:  # the job's first step: every group starts it (or replica_timeout)
                deadline = time.monotonic() + self.replica_timeout
                while (
                    self.manager.current_step() == 0
                    and self.manager.num_participants() < self.replica_count
                    and time.monotonic() < deadline
                ):
                    time.sleep(0.1)
                    self.manager.start_quorum()
        except Exception as error:  # the lighthouse is gone, or too few groups for too long
            raise _unreachable(self.lighthouse, "forming the step's quorum", error) from error
        self.quorum_open = True
        # the buffers as the step found them: a step given up leaves none of its forwards'
        # updates (BatchNorm's statistics), as it leaves no parameter update
        self.buffers_before = [b.detach().clone() for m in self.models for b in m.buffers()]
        _raise_if_errored(self.manager, "forming the quorum")
        return self.manager.current_step() != before

    @hookimpl
    def torchplug_backward(
        self, engine: HookContext, loss: torch.Tensor, model: torch.nn.Module | None
    ) -> bool:
        """``loss.backward()``; at the last micro-batch, the gradients averaged over every rank of
        the quorum (before clipping, as DDP's are)."""
        loss.backward()
        accumulating = engine.accumulating
        if self.syncing and (accumulating is None or accumulating[1]):
            self._average(engine)
        return True

    @hookimpl
    def torchplug_no_sync(
        self, engine: HookContext, model: torch.nn.Module
    ) -> contextlib.AbstractContextManager[None]:
        """Inside, ``backward`` leaves the gradients local (accumulation micro-batches)."""
        return self._local_gradients()

    @contextlib.contextmanager
    def _local_gradients(self) -> Iterator[None]:
        before, self.syncing = self.syncing, False
        try:
            yield
        finally:
            self.syncing = before

    def _average(self, engine: HookContext) -> None:
        if self._quorum():
            # Joined after computing gradients on the weights it had (a forward without
            # gradients, then backward): the step is given up by every group (should_commit
            # says no), never applied half-wrong.
            self.manager.report_error(RuntimeError("a group healed in the middle of a step"))
        params = [p for m in self.models for p in m.parameters() if p.requires_grad]
        if not params:
            return
        for p in params:  # a parameter this rank did not use: its share of the mean is zero
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        grads = [p.grad for p in params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        if engine.world_size > 1:
            dist.all_reduce(flat)
            flat.div_(engine.world_size)
        self.manager.allreduce(flat).wait()  # a lost peer: should_commit gives the step up
        _unflatten(flat, grads)

    @hookimpl
    def torchplug_gather(
        self, engine: HookContext, tensor: torch.Tensor, replicas: bool
    ) -> torch.Tensor:
        """The group's ranks' ``tensor``; with ``replicas`` (``gather_for_metrics``, whose
        evaluation batches were dealt over the quorum), every rank of every group in the
        quorum: each group's rows in its own slot of a zero tensor, summed over the groups
        (torchft's managed all-reduce), so each row arrives unchanged."""
        from torch.distributed import ReduceOp

        rows = super().torchplug_gather(engine, tensor)
        if not replicas or self.replica_count < 2:
            return rows
        self._quorum()
        place = self.manager.participating_rank()
        # a sum gloo takes for every dtype; integers go as int64 (exact above 2**53)
        floats = rows.is_floating_point() or rows.dtype == torch.bool
        exact = torch.float64 if floats else torch.int64
        slots = torch.zeros((self.manager.num_participants(), *rows.shape), dtype=exact)
        slots[place] = rows
        self.manager.allreduce(slots, reduce_op=ReduceOp.SUM).wait()
        _raise_if_errored(self.manager, "gathering over the replica groups")
        return slots.flatten(0, 1).to(rows.dtype)

    def _share_buffers(self, in_group: bool) -> None:
        """Every rank takes the buffers (BatchNorm's running statistics) of the first group's
        rank 0."""
        from torch.distributed import ReduceOp

        buffers = [b for m in self.models for b in m.buffers()]
        if not buffers:
            return
        lead = self.manager.participating_rank() == 0
        for dtype in sorted({b.dtype for b in buffers}, key=str):
            same = [b for b in buffers if b.dtype == dtype]
            flat = torch.cat([b.detach().reshape(-1) for b in same])
            if in_group:
                dist.broadcast(flat, 0)
            if not lead:
                flat.zero_()
            self.manager.allreduce(flat, reduce_op=ReduceOp.SUM).wait()
            with torch.no_grad():
                _unflatten(flat, same)

    @hookimpl(wrapper=True)
    def torchplug_optimizer_step(
        self,
        engine: HookContext,
        optimizer: torch.optim.Optimizer,
        closure: Callable[[], Any] | None,
    ) -> Generator[None, bool, bool]:
        """Update only when the quorum commits the step; then the loaders' positions are
        recorded as the committed ones."""
        if not self.quorum_open:  # no backward this step (or it synced nothing): join anyway
            self._average(engine)
        commit = self.manager.should_commit()
        self.quorum_open = False
        self._step_ended(commit)
        if not commit:
            with torch.no_grad():
                buffers = [b for m in self.models for b in m.buffers()]
                if len(buffers) == len(self.buffers_before):
                    for buffer, before in zip(buffers, self.buffers_before, strict=True):
                        buffer.copy_(before)
            with engine.skipping_updates(optimizer):
                yield
            return False
        stepped = yield
        if self.state is not None:
            for key, loader in self.state.items():
                if key in self.positions:
                    self.positions[key] = loader.state_dict()
        return stepped

    @hookimpl
    def torchplug_teardown(self, engine: HookContext) -> None:
        """Leave the quorum (the lighthouse forms the next one without this group), then
        release the group's process group."""
        if self.manager is not None:
            self.manager.shutdown(wait=False)
            self.manager = None
        self.store = None
        for hook in self.hooks:
            hook.remove()
        self.hooks, self.models, self.dealers = [], [], []
        super().torchplug_teardown(engine)


def _unflatten(flat: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    """Copy consecutive parts of ``flat`` back into ``tensors``."""
    offset = 0
    for tensor in tensors:
        tensor.copy_(flat[offset : offset + tensor.numel()].view_as(tensor))
        offset += tensor.numel()


def _is_loader(value: Any) -> bool:
    """A loader from ``engine.setup_dataloader`` (it knows where its pass stands)."""
    return hasattr(value, "resumes_at") and hasattr(value, "state_dict")


def _next_pass_if_done(position: dict[str, Any], loader: Any) -> dict[str, Any]:
    """A position at the end of a pass, as the start of the next one (resuming there would run
    an empty pass, and the script's epoch loop would count it)."""
    dealer = getattr(loader, "batch_sampler", None)
    if isinstance(dealer, QuorumBatches) and "sampler" in position:
        if not dealer.done(position["sampler"]):
            return position
        epoch = int(position["epoch"]) + 1
        start = {"epoch": epoch, "committed": 0, "size": dealer.size}
        return {"epoch": epoch, "batches": 0, "sampler": start}
    try:
        length = len(loader)
    except TypeError:
        return position
    if position.get("batches", 0) >= length > 0:
        return {"epoch": int(position["epoch"]) + 1, "batches": 0}
    return position


def _unreachable(lighthouse: Any, doing: str, error: BaseException) -> ConfigurationError:
    return ConfigurationError(
        f"ft-ddp: {doing} failed ({type(error).__name__}: {str(error)[:300]}). Expected the "
        f"lighthouse at {lighthouse} to answer and at least min_replicas groups to join within "
        f"replica_timeout seconds. Check that the lighthouse runs (torchplug launch --strategy "
        f"ft-ddp --replicas R starts one) and that the groups can reach it."
    )


def _raise_if_errored(manager: Any, doing: str) -> None:
    """A failure torchft recorded: a lost peer only gives up this step (``should_commit`` says
    no); a quorum that cannot form is an error naming the fix."""
    error = manager.errored()
    if error is None:
        return
    cause = getattr(error, "original_exception", error)
    raise ConfigurationError(
        f"ft-ddp: {doing} failed: {cause}. "
        "Check that the lighthouse is running (TORCHFT_LIGHTHOUSE) and that at least "
        "min_replicas groups are up; the wait is replica_timeout seconds."
    )


@hookimpl
def torchplug_register_strategies(register: Callable[[StrategyInfo], None]) -> None:
    register(
        StrategyInfo(
            name="ft-ddp",
            factory=FaultTolerantDDP,
            description="Fault-tolerant data parallel (torchft): replica groups train through "
            "a dead group, which rejoins live.",
            options=(
                *DistributedStrategy.strategy_options(),
                Option("replicas", (int, type(None)), None, "replica groups (env default)"),
                Option("replica", (int, type(None)), None, "this group's index (env default)"),
                Option("min_replicas", int, 1, "fewest groups a step commits with"),
                Option("lighthouse", (str, type(None)), None, "lighthouse address (env)"),
                Option(
                    "replica_timeout",
                    float,
                    60.0,
                    "seconds a quorum, average or recovery waits",
                    validate=_positive,
                ),
            ),
            requires=("torchft",),
            install_hint="pip install torchplug-torchft (it installs torchft)",
            launcher="torchplug_torchft.launch:launch",  # --replicas R: lighthouse + R groups
        )
    )
