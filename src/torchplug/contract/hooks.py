"""`Hooks`: the one channel from torchplug to an Engine's active set.

As tox's typed façade over pluggy: one method per strategy hook, calling it with the Engine's
[`HookContext`][torchplug.plugin.HookContext] and checking the answer against the hook's
contract (read from the plugin manager's specifications, so this module sits below `spec`), so
no caller reaches pluggy's relay or forgets a check. Per-step hooks are the plain calls
`dispatch` resolved once for the Engine's fixed plugin set.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pluggy
import torch

from torchplug.contract import dispatch
from torchplug.contract.errors import PluginError

if TYPE_CHECKING:
    from torchplug.contract.types import ClusterInfo, Runtime

#: The answer types contracts name (`spec.Contract.answer`, a dotted name so that spec.py
#: imports no torch).
ANSWER_TYPES: dict[str | None, type] = {
    "bool": bool,
    "dict": dict,
    "tuple": tuple,
    "torch.Tensor": torch.Tensor,
    "torch.nn.Module": torch.nn.Module,
    "contextlib.AbstractContextManager": contextlib.AbstractContextManager,
}


class Hooks:
    """One Engine's active set, called hook by hook with its answers checked.

    Args:
        pm: The Engine's plugin manager, holding its active set.
        context: What every hook gets as its ``engine`` argument: the Engine's
            `torchplug.contract.context.HookContext` (which offers this façade as ``hooks``);
            ``None`` until `bind` gives it.
        strategy: The strategy's name, for errors.
        provider: The plugin that announced it, for errors.
    """

    def __init__(
        self, pm: pluggy.PluginManager, context: Any, strategy: str, provider: str
    ) -> None:
        self._relay = pm.hook
        self._pm = pm
        #: Each hook's contract, read from its specification once (answers are checked per step).
        self._contracts: dict[str, Any] = {}
        self._context = context
        self._strategy = strategy
        self._provider = provider or "?"
        tracing = bool(getattr(pm, "tracing", False))
        for name in per_step_hooks(pm):  # self._backward, ...: plain calls, resolved once
            setattr(self, name.replace("torchplug", ""), dispatch.resolve(pm, name, tracing))

    def bind(self, context: Any) -> None:
        """Give every hook ``context`` as its ``engine`` argument (a context is built from its
        owners, this façade among them, so it comes after the façade)."""
        self._context = context

    def answer(
        self, hook: str, result: Any, expected: Any = None, what: str = "", optional: bool = False
    ) -> Any:
        """``result`` if it is what ``hook`` must return (its contract's answer type, unless
        ``expected`` narrows it; ``None`` too when ``optional``), else a `PluginError` naming the
        strategy and the hook.

        Args:
            hook: The hook that answered.
            result: Its answer.
            expected: A narrower type than the contract's.
            what: That type as the error names it.
            optional: ``None`` (no plugin answered) is an answer too.
        """
        if optional and result is None:
            return None
        if expected is None:
            declared = self._contracts.get(hook)
            if declared is None:
                declared = self._contracts[hook] = contract_of(self._pm, hook)
            expected, what = ANSWER_TYPES[declared.answer], declared.answer_text
        if not isinstance(result, expected):
            shown = repr(result)
            shown = shown if len(shown) < 60 else shown[:57] + "..."
            raise PluginError(
                f"Strategy '{self._strategy}' (plugin '{self._provider}') answered "
                f"{hook} with {shown}; it must return {what}. Fix that hook in the plugin."
            )
        return result

    def implementations(self, hook: str) -> list[Any]:
        """pluggy's implementations of ``hook`` in the active set (the contract check)."""
        return getattr(self._relay, hook).get_hookimpls()

    # -- the job ----------------------------------------------------------------------------------

    def setup(self, cluster: ClusterInfo) -> Runtime:
        """``torchplug_setup``: its answer must be a torchplug `Runtime`."""
        from torchplug.contract.types import Runtime

        answer = self._relay.torchplug_setup(engine=self._context, cluster=cluster)
        return self.answer("torchplug_setup", answer, Runtime, "a torchplug Runtime")

    @property
    def relay(self) -> Any:
        """pluggy's raw relay, for the deprecated API 1.x ``hook`` members only (nothing
        checks its answers)."""
        return self._relay

    def teardown(self) -> None:
        """``torchplug_teardown``: every plugin's, in order."""
        self._relay.torchplug_teardown(engine=self._context)

    def init_module(self) -> contextlib.AbstractContextManager[None] | None:
        """``torchplug_init_module``: a backend's own way to build a model, or ``None``."""
        return self._relay.torchplug_init_module(engine=self._context)

    def wrap(
        self, model: torch.nn.Module, optimizers: list[torch.optim.Optimizer]
    ) -> tuple[torch.nn.Module, list[torch.optim.Optimizer]]:
        """``torchplug_wrap``: ``(model, optimizers)``, the model an ``nn.Module``."""
        result = self.answer(
            "torchplug_wrap",
            self._relay.torchplug_wrap(engine=self._context, model=model, optimizers=optimizers),
        )
        self.answer("torchplug_wrap", result[0], torch.nn.Module, "an nn.Module first")
        return result

    def compile(self, model: torch.nn.Module, options: dict[str, Any]) -> torch.nn.Module | None:
        """``torchplug_compile``: the compiled model, or ``None`` when no plugin answers."""
        compiled = self._relay.torchplug_compile(engine=self._context, model=model, options=options)
        return self.answer("torchplug_compile", compiled, optional=True)

    def batch_sampler(self, loader: Any, seed: int) -> Any:
        """``torchplug_batch_sampler``: a sampler dealing ``loader`` per step, or ``None``."""
        return self._relay.torchplug_batch_sampler(engine=self._context, loader=loader, seed=seed)

    # -- every step -------------------------------------------------------------------------------

    def place_batch(self, batch: Any) -> Any:
        """``torchplug_place_batch``: the batch where the model is."""
        return self._place_batch(self._context, batch)

    def backward(self, loss: torch.Tensor, model: torch.nn.Module | None) -> None:
        """``torchplug_backward``, which must answer ``True``."""
        done = self._backward(self._context, loss, model)
        if done is not True:  # the answer expected, checked without a call
            self.answer("torchplug_backward", done)

    def forward_backward(self, model: Any, inputs: Any, kwargs: Any, target: Any, fn: Any) -> Any:
        """``torchplug_forward_backward``: the loss, or ``None`` when no backend answers."""
        loss = self._relay.torchplug_forward_backward(
            engine=self._context, model=model, inputs=inputs, kwargs=kwargs, target=target,
            loss_fn=fn,
        )  # fmt: skip
        return self.answer("torchplug_forward_backward", loss, optional=True)

    def optimizer_step(self, optimizer: torch.optim.Optimizer, closure: Any) -> bool:
        """``torchplug_optimizer_step``: whether the update was made."""
        stepped = self._optimizer_step(self._context, optimizer, closure)
        if stepped is not True:
            self.answer("torchplug_optimizer_step", stepped)
        return stepped

    def clip_grad_norm(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None,
        max_norm: float,
        norm_type: float,
    ) -> torch.Tensor:
        """``torchplug_clip_grad_norm``: the total norm before clipping."""
        norm = self._clip_grad_norm(self._context, model, optimizer, max_norm, norm_type)
        return self.answer("torchplug_clip_grad_norm", norm)

    def no_sync(self, model: torch.nn.Module) -> contextlib.AbstractContextManager[None]:
        """``torchplug_no_sync``: a context in which backward does not synchronize."""
        return self.answer("torchplug_no_sync", self._no_sync(self._context, model))

    def autocast(self) -> contextlib.AbstractContextManager[None]:
        """``torchplug_autocast``: the precision's context for code outside the forward."""
        return self.answer("torchplug_autocast", self._autocast(self._context))

    def reduce(self, tensor: torch.Tensor, op: str) -> torch.Tensor:
        """``torchplug_reduce``: the reduced tensor."""
        return self.answer("torchplug_reduce", self._reduce(self._context, tensor, op))

    def gather(self, tensor: torch.Tensor, replicas: bool = False) -> torch.Tensor:
        """``torchplug_gather``: every rank's tensor, stacked."""
        return self.answer("torchplug_gather", self._gather(self._context, tensor, replicas))

    def barrier(self) -> None:
        """``torchplug_barrier``, which must answer ``True``."""
        self.answer("torchplug_barrier", self._barrier(self._context))

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        """``torchplug_broadcast``: rank ``src``'s ``tensor``, written into it on every rank."""
        result = self._relay.torchplug_broadcast(engine=self._context, tensor=tensor, src=src)
        return self.answer("torchplug_broadcast", result)

    # -- checkpoints and the state protocol -------------------------------------------------------

    def save(self, path: str, state: dict[str, Any], metadata: dict[str, Any]) -> Any:
        """``torchplug_save``'s answer, which the caller checks with `answer` once it has
        recorded the asynchronous save the hook may have started (a wrong answer must not lose
        track of a save in flight)."""
        return self._relay.torchplug_save(
            engine=self._context, path=path, state=state, metadata=metadata
        )

    def load(self, path: str, state: dict[str, Any] | None, strict: bool) -> dict[str, Any]:
        """``torchplug_load``: the plain values (or everything, without ``state``)."""
        result = self._relay.torchplug_load(
            engine=self._context, path=path, state=state, strict=strict
        )
        return self.answer("torchplug_load", result)

    def resume(self, state: dict[str, Any]) -> bool:
        """``torchplug_resume``: whether a backend restored ``state`` from live peers."""
        result = self._relay.torchplug_resume(engine=self._context, state=state)
        return self.answer("torchplug_resume", result, optional=True) is True

    def checkpoint_state(self) -> list[dict[str, Any]]:
        """``torchplug_checkpoint_state``: each plugin's answer (a dict of stateful objects)."""
        answers = self._relay.torchplug_checkpoint_state(engine=self._context)
        return [self.answer("torchplug_checkpoint_state", a) for a in answers]

    def model_state(self, model: torch.nn.Module) -> dict[str, Any]:
        """``torchplug_model_state``: the model's state by parameter name."""
        return self._relay.torchplug_model_state(engine=self._context, model=model)

    def optimizer_state(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer
    ) -> dict[str, Any]:
        """``torchplug_optimizer_state``: the optimizer's state by parameter name."""
        return self._relay.torchplug_optimizer_state(
            engine=self._context, model=model, optimizer=optimizer
        )

    def load_model_state(self, model: torch.nn.Module, state: dict[str, Any], strict: bool) -> None:
        """``torchplug_load_model_state``."""
        self._relay.torchplug_load_model_state(
            engine=self._context, model=model, state=state, strict=strict
        )

    def load_optimizer_state(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]
    ) -> None:
        """``torchplug_load_optimizer_state``."""
        self._relay.torchplug_load_optimizer_state(
            engine=self._context, model=model, optimizer=optimizer, state=state
        )

    def reads_in_place(self, kind: str) -> bool:
        """``torchplug_reads_in_place``: load straight into the live tensors, or not."""
        return bool(self._relay.torchplug_reads_in_place(engine=self._context, kind=kind))

    def checkpoint_metadata(self, path: Path) -> dict[str, Any] | None:
        """``torchplug_checkpoint_metadata``: a checkpoint's metadata, ``None`` unanswered."""
        metadata = self._relay.torchplug_checkpoint_metadata(engine=self._context, path=path)
        return self.answer("torchplug_checkpoint_metadata", metadata, dict, "a dict", True)

    def load_pretrained(
        self, model: torch.nn.Module, path: Any, strict: bool
    ) -> dict[str, list[str]] | None:
        """``torchplug_load_pretrained``: what was loaded, ``None`` unanswered."""
        result = self._relay.torchplug_load_pretrained(
            engine=self._context, model=model, path=path, strict=strict
        )
        return self.answer("torchplug_load_pretrained", result, dict, "a dict", True)


def contract_of(pm: pluggy.PluginManager, hook: str) -> Any:
    """The `Contract` that `torchplug.contract.spec` attached to ``hook``'s specification."""
    caller = getattr(pm.hook, hook)
    return caller.spec.function.torchplug_contract


def per_step_hooks(pm: pluggy.PluginManager) -> list[str]:
    """The hooks whose contract says ``per_step`` (called every step: resolved once)."""
    specs = [caller.spec for caller in vars(pm.hook).values() if caller.spec is not None]
    declared = {s.name: getattr(s.function, "torchplug_contract", None) for s in specs}
    return sorted(name for name, c in declared.items() if c is not None and c.per_step)
