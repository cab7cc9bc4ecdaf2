"""Data and tensor parallel inside a pipeline stage (``dp_shard``, ``tp_size``): each stage's
parameters held by a `StageModule` that FSDP2 and DTensor placements apply to.

Why a module between the trace and the schedule: a traced stage is a graph specialised to one
input shape, and the model is traced again for another (a short last batch, evaluation), while
FSDP2 and tensor parallel replace a module's parameters once. So a stage's parameters live in one
`StageModule` (under the model's own names), FSDP2 is applied to it once, and whichever trace
runs is called with its tensors (``torch.func.functional_call``). It is also what torch's
schedules look for (``stage.submod`` an ``FSDPModule``) to hold gradient reduction until a
step's last micro-batch.

Tensor parallel here places each planned layer's weight as a DTensor over ``tp`` (colwise:
split by output features, rowwise: by input features), lets the stage's inputs enter as
replicated DTensors, and lets DTensor's sharding propagation run every op of the graph (the
all-reduce after a rowwise layer, where the sum is needed); the stage's outputs leave as whole
tensors, which is what the schedule sends to the next stage.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from torchplug.plugin import ConfigurationError, plan_matches, plan_split

#: Plan values that leave a layer whole (the others split its weight, `plan_split`).
WHOLE = ("replicate", "sequence", "sequence_parallel")


class StageModule(torch.nn.Module):
    """One stage's parameters and buffers under the model's names, calling the trace in use.

    Args:
        tensors: The stage's (name, tensor) pairs, tied names included (the same tensor).
        tp_mesh: The tensor-parallel mesh (``None``: inputs and outputs stay plain tensors).
    """

    def __init__(self, tensors: list[tuple[str, torch.Tensor]], tp_mesh: Any = None) -> None:
        super().__init__()
        self._trace: list[Any] = []  # a list: the graph module is not a submodule
        self._tp_mesh = [tp_mesh]
        for name, tensor in tensors:
            *path, leaf = name.split(".")
            module: torch.nn.Module = self
            for part in path:
                children = dict(module.named_children())
                if part not in children:
                    children[part] = torch.nn.Module()
                    module.add_module(part, children[part])
                module = children[part]
            if isinstance(tensor, torch.nn.Parameter):
                module.register_parameter(leaf, tensor)
            else:
                module.register_buffer(leaf, tensor)

    def use(self, graph_module: torch.nn.Module) -> None:
        """Run ``graph_module`` (one trace of this stage) from now on."""
        self._trace[:] = [graph_module]

    @property
    def graph(self) -> Any:
        """The trace's graph, which torch's traced stage reads its inputs and outputs from."""
        return self._trace[0].graph

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        from torch.func import functional_call

        # read at every call, not kept: FSDP2 registers the gathered parameters before each
        # forward and the shards after it
        tensors = {
            **dict(self.named_parameters(remove_duplicate=False)),
            **dict(self.named_buffers(remove_duplicate=False)),
        }
        mesh = self._tp_mesh[0]
        if mesh is None:
            return functional_call(self._trace[0], tensors, args, kwargs, tie_weights=False)
        from torch.distributed.tensor import DTensor, Replicate
        from torch.utils._pytree import tree_map

        def enter(value: Any) -> Any:
            if isinstance(value, torch.Tensor) and not isinstance(value, DTensor):
                return DTensor.from_local(value, mesh, [Replicate()], run_check=False)
            return value

        def leave(value: Any) -> Any:
            return value.full_tensor() if isinstance(value, DTensor) else value

        # under the caller's implicit_replication (a constant the graph makes, an index), which
        # must cover the backward too: the strategy enters it around the whole schedule
        args, kwargs = tree_map(enter, args), tree_map(enter, kwargs)
        with _attention_for(mesh):
            output = functional_call(self._trace[0], tensors, args, kwargs, tie_weights=False)
        return tree_map(leave, output)


def _attention_for(mesh: Any) -> Any:
    """On CPU, attention in math ops: DTensor has no sharding rule for the CPU flash kernel
    (``_scaled_dot_product_flash_attention_for_cpu``), and the math backend's ops all have one.
    On GPUs the fused kernels' rules exist: nothing changes."""
    if mesh.device_type != "cpu":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel(SDPBackend.MATH)


def plan_styles(model: torch.nn.Module, plan: dict[str, Any]) -> dict[str, str]:
    """Submodule name -> ``"col"``/``"row"`` for a tensor-parallel ``plan`` (``*`` is one name),
    checked: every entry matches a layer, and a split layer is an ``nn.Linear`` or
    ``nn.Embedding``."""
    modules = dict(model.named_modules())
    styles: dict[str, str] = {}
    for pattern, value in plan.items():
        split = plan_split(value) if isinstance(value, str) else None
        if split is None and value not in WHOLE:
            raise ConfigurationError(
                f"pp's tp_plan[{pattern!r}] is {value!r}; under pp a plan entry is 'colwise' or "
                f"'rowwise' (Hugging Face's colwise_*/rowwise_* too) or 'replicate'. Use those "
                f"strings (layouts between layers follow from the split weights)."
            )
        hits = [name for name in modules if name and plan_matches(name, pattern)]
        if not hits:
            raise ConfigurationError(
                f"pp's tp_plan entry {pattern!r} matches no submodule of "
                f"{type(model).__name__}; names look like "
                f"{[n for n in modules if n][:6]} ('*' stands for one name)."
            )
        for name in hits:
            if split and not isinstance(modules[name], (torch.nn.Linear, torch.nn.Embedding)):
                raise ConfigurationError(
                    f"pp's tp_plan[{pattern!r}] = {value!r} matches {name}, a "
                    f"{type(modules[name]).__name__}; colwise/rowwise split nn.Linear and "
                    f"nn.Embedding weights only. Leave it out of the plan (or 'replicate')."
                )
            if split:
                kind = "emb" if isinstance(modules[name], torch.nn.Embedding) else "lin"
                styles[name] = f"{split}-{kind}"
    if not styles:
        raise ConfigurationError(
            f"pp's tp_plan splits nothing of {type(model).__name__}: tp_size > 1 would hold and "
            f"compute every layer whole on every tensor-parallel rank. Name layers to split, "
            f"e.g. tp_plan={{'layers.*.fc': 'colwise', 'layers.*.out': 'rowwise'}}."
        )
    return styles


def place(stage: StageModule, mesh: Any, styles: dict[str, str]) -> None:
    """The stage's parameters as DTensors over the tensor-parallel ``mesh``: planned weights
    split (a Linear's colwise weight and bias by output features, its rowwise weight by input
    features; an Embedding's weight by embedding features, colwise or rowwise: split by rows,
    its lookup gives a masked partial sum the next op cannot reduce), everything else
    replicated."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    done: dict[int, torch.nn.Parameter] = {}
    for module_name, module in stage.named_modules():
        style = styles.get(module_name, "")
        for leaf, param in list(module.named_parameters(recurse=False, remove_duplicate=False)):
            if id(param) not in done:
                dim = {"col-lin": 0, "row-lin": 1, "col-emb": 1, "row-emb": 1}.get(style)
                if dim is not None and param.dim() < 2:  # a bias
                    dim = 0 if style == "col-lin" else None
                placement = Shard(dim) if dim is not None else Replicate()
                value = distribute_tensor(param.detach(), mesh, [placement], src_data_rank=None)
                done[id(param)] = torch.nn.Parameter(value, requires_grad=param.requires_grad)
            module.register_parameter(leaf, done[id(param)])


__all__ = ["StageModule", "place", "plan_styles"]
