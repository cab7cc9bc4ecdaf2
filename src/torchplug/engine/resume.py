"""Restarts that resume by themselves: numbered checkpoints, rotation, and RNG state.

``Engine(checkpoint_dir="ckpt", resume="latest", keep_last=3)`` gives a training script two calls:
``engine.save_checkpoint(state)`` writes ``ckpt/step-N`` (N from ``state["step"]``) and deletes
the oldest beyond ``keep_last``, never the newest complete one; ``engine.resume(state)`` loads the
newest complete checkpoint into ``state`` if there is one. Both add the RNG states of every rank
(torch CPU and CUDA, Python's ``random``) as the entry ``"rng"``, so that after a restart by
``torchplug launch --max-restarts K`` the job goes on exactly as if it had not been interrupted.
Only the public ``engine.save``/``engine.load`` are used: the on-disk format is the usual one.
"""

from __future__ import annotations

import os
import random
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from torchplug.contract.errors import CheckpointError, ConfigurationError
from torchplug.util.records import Record

if TYPE_CHECKING:
    from torchplug.engine._typing import Engine

RESUME_CHOICES = ("latest", "never")
STEP_DIR = re.compile(r"^step-(\d+)$")
RNG_KEY = "rng"


@dataclass(frozen=True, eq=False, repr=False)
class CheckpointPolicy(Record):
    """Where numbered checkpoints go, whether to resume from them, and how many to keep."""

    directory: Path | None = None
    resume: str = "never"
    keep_last: int | None = None

    @classmethod
    def checked(
        cls, directory: str | os.PathLike[str] | None, resume: str | None, keep_last: int | None
    ) -> CheckpointPolicy:
        """The policy from Engine's arguments, or an error saying which one is wrong."""
        mode = "never" if resume is None else str(resume).strip().lower()
        if mode not in RESUME_CHOICES:
            raise ConfigurationError(
                f"resume={resume!r} is not a resume mode; expected 'latest' (load the newest "
                f"complete checkpoint in checkpoint_dir, if any) or None. Fix: resume='latest'."
            )
        if keep_last is not None and (
            isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1
        ):
            raise ConfigurationError(
                f"keep_last={keep_last!r} is not a number of checkpoints; expected a whole "
                f"number of 1 or more, or None to keep all. Fix: e.g. keep_last=3."
            )
        if directory is None and (mode == "latest" or keep_last is not None):
            raise ConfigurationError(
                "resume='latest' and keep_last need checkpoint_dir, the directory the numbered "
                "checkpoints go to. Fix: Engine(..., checkpoint_dir='checkpoints')."
            )
        return cls(path_argument("checkpoint_dir", directory), mode, keep_last)


def path_argument(name: str, value: Any) -> Path | None:
    """A directory argument (``checkpoint_dir``, ``log_dir``): a non-empty path or ``None``."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (str, os.PathLike)):
        raise ConfigurationError(
            f"{name} must be a directory path (str or pathlib.Path), got "
            f"{type(value).__name__} {value!r}. Pass e.g. {name}='checkpoints'."
        )
    if not str(os.fspath(value)).strip():
        raise ConfigurationError(
            f"{name} is an empty path; it would write into the current directory unnoticed. "
            f"Pass a directory, e.g. {name}='checkpoints', or leave it out."
        )
    return Path(value)


class RNGState:
    """Every rank's RNG states as one checkpoint entry (tensors and JSON, no pickles).

    Saved: torch's CPU generator, the CUDA generators, Python's ``random`` and numpy's global
    generator (what Accelerate's ``save_state`` keeps), gathered from all ranks. Loaded: rank
    ``r`` takes row ``r`` (``r % saved ranks`` on another world size). ``save_checkpoint`` and
    ``resume`` keep one under the state's ``"rng"`` entry; put ``tp.RNGState(engine)`` in the
    state given to ``engine.save``/``load`` to have the same there::

        engine.save("ckpt", {"model": model, "optimizer": opt, "rng": tp.RNGState(engine)})

    Args:
        engine: The Engine whose ranks' generators are saved and restored.
    """

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def state_dict(self) -> dict[str, Any]:
        """Every rank's states, gathered (a collective: called on every rank by save)."""
        version, internal, gauss = random.getstate()
        local = {
            "torch": torch.get_rng_state(),
            "python": torch.tensor(list(internal), dtype=torch.int64),
        }
        state: dict[str, Any] = {
            "python_version": version,
            "python_gauss": [_gather_json(self.engine, gauss)],
        }
        for name, tensor in local.items():
            state[name] = self.engine.gather(tensor).cpu()
        if torch.cuda.is_available():
            cuda = torch.stack(torch.cuda.get_rng_state_all())
            state["cuda"] = self.engine.gather(cuda).cpu()
        import numpy

        _, keys, position, has_gauss, gauss = numpy.random.get_state(legacy=True)
        words = torch.tensor([*keys.tolist(), position, has_gauss], dtype=torch.int64)
        state["numpy"] = self.engine.gather(words).cpu()
        state["numpy_gauss"] = self.engine.gather(torch.tensor([gauss], dtype=torch.float64))
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Set this rank's generators from its row of ``state``.

        Args:
            state: What `state_dict` returned when the checkpoint was saved.
        """
        row = self.engine.rank % len(state["torch"])
        torch.set_rng_state(state["torch"][row].clone())
        gauss = state["python_gauss"][0][row % len(state["python_gauss"][0])]
        internal = tuple(int(x) for x in state["python"][row].tolist())
        random.setstate((int(state["python_version"]), internal, gauss))
        if "numpy" in state:  # checkpoints from before numpy's state was kept lack it
            import numpy

            words = state["numpy"][row % len(state["numpy"])].tolist()
            gauss = float(state["numpy_gauss"][row % len(state["numpy_gauss"])][0])
            keys = numpy.array(words[:-2], dtype=numpy.uint32)
            numpy.random.set_state(("MT19937", keys, words[-2], words[-1], gauss))
        if "cuda" in state and torch.cuda.is_available():
            saved = state["cuda"][row]
            for device in range(min(len(saved), torch.cuda.device_count())):
                torch.cuda.set_rng_state(saved[device].clone(), device)


def _gather_json(engine: Engine, value: float | None) -> list[float | None]:
    """``value`` from every rank (a float or None) through a tensor collective."""
    flag = torch.tensor([0.0 if value is None else 1.0, value or 0.0], dtype=torch.float64)
    rows = engine.gather(flag).cpu().tolist()
    return [v if f else None for f, v in rows]


def step_of(state: dict[str, Any], step: int | None) -> int:
    """The step that names the checkpoint: ``step``, else ``state["step"]``; checked."""
    if step is None:
        step = state.get("step")
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise CheckpointError(
            f"save_checkpoint needs the training step as a whole number of 0 or more, got "
            f"{step!r}. Keep it in the state as state['step'] = step, or pass step=N."
        )
    return step


def complete(directory: Path) -> list[tuple[int, Path]]:
    """``(step, path)`` of the complete numbered checkpoints in ``directory``, newest first.

    A checkpoint is swapped into place only once complete, so a ``step-N`` with its manifest is
    whole; a crash mid-save leaves only a temporary directory, which does not match.
    """
    if not directory.is_dir():
        return []
    found = []
    for path in directory.iterdir():
        match = STEP_DIR.match(path.name)
        if match and (path / "manifest.json").is_file():
            found.append((int(match.group(1)), path))
    return sorted(found, reverse=True)


def _step_mismatch(engine: Engine, step: int, path: Path) -> str | None:
    """Why the checkpoint at ``path`` is not the step its name says (a renamed directory would
    otherwise be resumed as a step it never was, and never rotated away), or ``None``. Its
    metadata comes from the active set (``torchplug_checkpoint_metadata``: the checkpoint
    plugin reads its manifest), so core reads no checkpoint format itself."""
    try:
        metadata = engine._hooks.checkpoint_metadata(path)
    except CheckpointError as exc:
        return f"Cannot resume from {path}: {exc}"
    saved = metadata.get("step") if isinstance(metadata, dict) else None
    if saved is not None and saved != step:
        fix = f"rename it back to step-{saved}, or move it out of {path.parent}"
        plugins = _answering(engine)
        if not plugins:
            return (
                f"Cannot resume from {path}: its name says step {step}, but its metadata says "
                f"step {saved}: the directory was renamed or copied. Fix: {fix}."
            )
        return (
            f"Cannot resume from {path}: its name says step {step}, but its metadata says step "
            f"{saved}. Either the directory was renamed or copied ({fix}), or a plugin answers "
            f"torchplug_checkpoint_metadata with another step than the one save_checkpoint "
            f"saved (implemented here by: {plugins})."
        )
    return None


def _answering(engine: Engine) -> str:
    """The plugins other than the built-in checkpoint plugin that implement
    ``torchplug_checkpoint_metadata``, for the message: a backend's wrong answer is not the
    user's renamed directory."""
    names = set()
    for impl in engine._pm.hook.torchplug_checkpoint_metadata.get_hookimpls():
        where = getattr(impl.plugin, "__name__", None)  # a module plugin
        if where is None:
            names.add(f"{type(impl.plugin).__name__} (strategy '{engine.strategy}')")
        elif not where.startswith("torchplug.checkpoint"):
            names.add(where)
    return ", ".join(sorted(names))


def save_checkpoint(
    engine: Engine, state: dict[str, Any], step: int | None = None, async_: bool = False
) -> Path:
    """Write ``state`` (plus every rank's RNG) to ``checkpoint_dir/step-N``; rotate old ones
    (after the commit: in the background for an asynchronous save)."""
    policy = engine.checkpoints
    if policy.directory is None:
        raise ConfigurationError(
            "save_checkpoint writes to the Engine's checkpoint_dir, which is not set. Fix: "
            "Engine(..., checkpoint_dir='checkpoints'), or use engine.save(path, state)."
        )
    if RNG_KEY in state:
        raise CheckpointError(
            f"save_checkpoint keeps every rank's RNG state under the key {RNG_KEY!r}, which your "
            f"state uses too (it would be silently replaced). Rename your {RNG_KEY!r} entry."
        )
    n = step_of(state, step)
    path = policy.directory / f"step-{n}"
    if engine.is_main:
        policy.directory.mkdir(parents=True, exist_ok=True)
    engine.wait_for_save()
    engine.barrier()
    engine.save(path, {**state, RNG_KEY: RNGState(engine)}, metadata={"step": n}, async_=async_)
    if engine.is_main:
        engine.after_save(lambda: _rotate(policy, path, n))
    return path


def _rotate(policy: CheckpointPolicy, path: Path, n: int) -> None:
    """Rank 0, once ``path`` (step ``n``) has committed: delete what ``keep_last`` drops."""
    from torchplug.features.preemption import note_checkpoint

    assert policy.directory is not None
    if policy.keep_last is not None:
        kept = complete(policy.directory)
        newest = kept[0][1] if kept else path
        for _, old in kept[policy.keep_last :]:
            if old != newest and old != path:
                remove(old)
        for leftover in policy.directory.glob(f"{REMOVING}*"):  # a crash mid-removal
            shutil.rmtree(leftover, ignore_errors=True)
    note_checkpoint(path, n)


#: Prefix of a checkpoint being removed: renamed out of the ``step-N`` namespace first.
REMOVING = ".removing-"


def remove(checkpoint: Path) -> None:
    """Remove an old checkpoint so that no crash can leave a ``step-N`` that looks complete
    but lost files: it is renamed out of the ``step-N`` namespace (one atomic rename) before
    anything inside it is deleted; a crash leaves a ``.removing-*`` directory, removed by the
    next rotation and never resumed from."""
    hidden = checkpoint.with_name(f"{REMOVING}{checkpoint.name}-{os.urandom(4).hex()}")
    try:
        checkpoint.rename(hidden)
    except OSError:
        return  # gone already, or not ours to rename: leave it whole
    shutil.rmtree(hidden, ignore_errors=True)


def resume(engine: Engine, state: dict[str, Any]) -> int | None:
    """Load the newest complete checkpoint into ``state``; return its step (None: none found).
    A backend that restores ``state`` from live peers answers first (``torchplug_resume``):
    then the step is ``state["step"]``, and the disk is not read."""
    if engine._hooks.resume(state):
        step = state.get("step")
        return step if isinstance(step, int) else None
    policy = engine.checkpoints
    if policy.resume != "latest" or policy.directory is None:
        return None
    found = complete(policy.directory) if engine.is_main else []
    problem = _step_mismatch(engine, found[0][0], found[0][1]) if found else None
    chosen, problem = engine.broadcast_object((str(found[0][1]) if found else None, problem))
    if problem is not None:
        raise CheckpointError(problem)
    if chosen is None:
        return None
    merged = {**state, RNG_KEY: RNGState(engine)}
    engine.load(chosen, merged)
    for key in state:  # plain values (the step, ...) are replaced in the dict loaded into
        state[key] = merged[key]
    match = STEP_DIR.match(Path(chosen).name)
    return int(match.group(1)) if match else None
