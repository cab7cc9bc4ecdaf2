"""Helpers for the checkpoint trust tests: tampering as an attacker would, and loading under a
guard that fails on any unpickling. Module-level, so rank workers can import them."""

from __future__ import annotations

import contextlib
import hashlib
import json
import pickle
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

import torchplug as tp
from torchplug.checkpoint.manifest import canonical
from torchplug.testing.bodies import full_state, make_model


class Unpickled(AssertionError):
    pass


@contextlib.contextmanager
def no_unpickling() -> Iterator[None]:
    """pickle.load(s), pickle.Unpickler and torch.load(weights_only != True) raise inside."""

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise Unpickled("something unpickled checkpoint bytes")

    class Refusing(pickle.Unpickler):
        def load(self) -> Any:
            refuse()

    real_torch_load = torch.load

    def guarded_torch_load(*args: Any, **kwargs: Any) -> Any:
        if kwargs.get("weights_only") is not True:
            refuse()
        return real_torch_load(*args, **kwargs)

    saved = (pickle.load, pickle.loads, pickle.Unpickler, torch.load)
    pickle.load, pickle.loads, pickle.Unpickler = refuse, refuse, Refusing  # type: ignore[misc]
    torch.load = guarded_torch_load  # type: ignore[assignment]
    try:
        yield
    finally:
        pickle.load, pickle.loads, pickle.Unpickler, torch.load = saved  # type: ignore[misc]


def forge(path: Path, change: Callable[[dict[str, Any]], None]) -> None:
    """Edit a manifest and make its digest agree, as someone without the signing key can."""
    manifest_path = Path(path) / "manifest.json"
    body = json.loads(manifest_path.read_text())
    change(body)
    body["digest"] = hashlib.sha256(canonical(body)).hexdigest()
    manifest_path.write_text(json.dumps(body))


def load_state(
    path: str, strategy: str = "single", guard: bool = True, **engine_options: Any
) -> dict[str, Any]:
    """Load into a fresh (differently seeded) model and optimizer; return everything loaded."""
    with contextlib.ExitStack() as stack:
        if guard:
            stack.enter_context(no_unpickling())
        engine = stack.enter_context(tp.Engine(strategy, **engine_options))
        model = make_model(seed=123)
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.5)
        model, optimizer = engine.setup(model, optimizer)
        state = {"model": model, "optimizer": optimizer, "step": 0}
        rest = engine.load(path, state)
        return {"step": state["step"], "rest": rest, **full_state(engine, model, optimizer)}


def same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Bit-identical loaded states (tensors compared with torch.equal)."""
    if a.keys() != b.keys():
        return False
    for key in a:
        x, y = a[key], b[key]
        if isinstance(x, dict):
            if not isinstance(y, dict) or not same(x, y):
                return False
        elif isinstance(x, torch.Tensor):
            if not (isinstance(y, torch.Tensor) and x.dtype == y.dtype and torch.equal(x, y)):
                return False
        elif x != y:
            return False
    return True
