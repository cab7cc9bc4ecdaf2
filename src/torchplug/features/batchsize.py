"""Finding the largest batch that fits: run the training function, halve the batch size on an
out-of-memory error, and run it again (Accelerate's ``find_executable_batch_size``).

Out of memory is recognised whichever device raised it: ``torch.OutOfMemoryError`` (CUDA, XPU,
MPS), the CPU allocator's ``RuntimeError`` ("DefaultCPUAllocator: can't allocate memory"),
cuDNN's allocation failure and XLA's ``RESOURCE_EXHAUSTED``. Any other error is raised at once:
halving would hide a bug.
"""

from __future__ import annotations

import functools
import gc
import inspect
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from torchplug.contract.errors import ConfigurationError

F = TypeVar("F", bound=Callable[..., Any])

#: Messages of out-of-memory errors that are raised as a plain RuntimeError.
OUT_OF_MEMORY = (
    "DefaultCPUAllocator: can't allocate memory",
    "CUDA out of memory",
    "CUDNN_STATUS_ALLOC_FAILED",
    "cuDNN error: CUDNN_STATUS_NOT_SUPPORTED",  # what cuDNN says when its workspace did not fit
    "RESOURCE_EXHAUSTED",  # XLA
    "out of memory",
)


def is_out_of_memory(error: BaseException) -> bool:
    """Whether ``error`` says a device (or the host) ran out of memory."""
    if isinstance(error, torch.OutOfMemoryError):
        return True
    return isinstance(error, RuntimeError) and any(m in str(error) for m in OUT_OF_MEMORY)


def _free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def find_executable_batch_size(
    function: F | None = None,
    *,
    starting_batch_size: int = 128,
    minimum: int = 1,
    factor: float = 0.9,
) -> Any:
    """Decorate a function whose first parameter is ``batch_size``: calling it (without that
    argument) runs it with ``starting_batch_size``, and after each out-of-memory error frees
    memory and runs it again with the batch size times ``factor`` (rounded down: 64, 57, 51,
    ... as Accelerate's current one; ``factor=0.5`` halves, as its older one did), until it
    returns or the size would drop below ``minimum`` (then a RuntimeError says so). The sizes
    tried are kept on the wrapper as ``tried`` (the last one is the size that ran).

    ```python
    @tp.find_executable_batch_size(starting_batch_size=256)
    def train(batch_size):
        loader = engine.setup_dataloader(DataLoader(data, batch_size=batch_size))
        ...

    train()
    ```

    Build what depends on the batch size (loaders, and what holds memory: models, optimizers)
    inside the function, so a retry starts from scratch. On several ranks each rank halves on
    its own error: ranks that run the same model on the same memory fail at the same size,
    which is the usual case; a rank that fails alone leaves the others waiting in their next
    collective until its timeout names it.

    Args:
        function: The function to decorate (or leave it out and call the decorator with the
            keywords).
        starting_batch_size: The first batch size tried.
        minimum: The smallest batch size tried before giving up.
        factor: What each retry multiplies the batch size by (``0 < factor < 1``).

    Returns:
        The wrapped function (or a decorator, without ``function``).

    Raises:
        RuntimeError: Out of memory even at ``minimum`` (raised by the wrapped function).
    """
    if not (isinstance(factor, float | int) and 0 < factor < 1):
        raise ConfigurationError(
            f"find_executable_batch_size(factor={factor!r}): expected a number between 0 and 1 "
            f"(what each retry multiplies the batch size by), e.g. 0.9 or 0.5."
        )
    if starting_batch_size < 1 or minimum < 1 or minimum > starting_batch_size:
        raise ConfigurationError(
            f"find_executable_batch_size(starting_batch_size={starting_batch_size!r}, "
            f"minimum={minimum!r}): expected 1 <= minimum <= starting_batch_size. Pass a "
            f"positive starting size and a minimum no larger than it."
        )
    if function is None:
        return functools.partial(
            find_executable_batch_size,
            starting_batch_size=starting_batch_size,
            minimum=minimum,
            factor=factor,
        )
    parameters = list(inspect.signature(function).parameters)
    if not parameters or parameters[0] != "batch_size":
        raise ConfigurationError(
            f"find_executable_batch_size needs a function whose first parameter is "
            f"'batch_size'; {function.__qualname__} takes ({', '.join(parameters)}). Add "
            f"batch_size as its first parameter."
        )

    @functools.wraps(function)
    def run(*args: Any, **kwargs: Any) -> Any:
        if "batch_size" in kwargs:
            raise ConfigurationError(
                f"{function.__qualname__} is decorated with find_executable_batch_size, which "
                f"passes batch_size itself; call it without batch_size."
            )
        batch_size = starting_batch_size
        run.tried = []  # type: ignore[attr-defined]
        while True:
            run.tried.append(batch_size)  # type: ignore[attr-defined]
            try:
                return function(batch_size, *args, **kwargs)
            except Exception as error:
                if not is_out_of_memory(error):
                    raise
                _free_memory()
                smaller = min(int(batch_size * factor), batch_size - 1)
                if smaller < minimum:
                    raise RuntimeError(
                        f"{function.__qualname__} ran out of memory at every batch size from "
                        f"{starting_batch_size} down to {batch_size} (minimum {minimum}): "
                        f"{str(error).splitlines()[0][:200]}. Make the model or its inputs "
                        f"smaller, or use a strategy that shards (fsdp, deepspeed-zero3)."
                    ) from error
                batch_size = smaller

    run.tried = []  # type: ignore[attr-defined]
    return run
