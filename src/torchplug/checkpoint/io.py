"""Saving and loading a checkpoint: the phases every rank goes through, and who does what.

A save runs four phases, each ended by an agreement between ranks
(`Coordinator`): *arrive* (every rank is here, for the same
path; rank 0 makes the temporary directory), *capture* (each entry's state through the strategy's
state hooks), *write* (each rank writes the tensors it owns and hashes its own files), *commit*
(rank 0 writes the manifest and swaps the directory into place); then each rank removes its own
files of the checkpoint that was replaced. A load runs *arrive* (every rank
reads and checks the same manifest), *verify* (each file hashed by one rank) and *read*. A failure
in any phase on any rank raises a CheckpointError on every rank at the end of that phase.

Module and optimizer state goes through the strategy hooks ``torchplug_model_state`` /
``torchplug_optimizer_state`` and their ``load`` counterparts, so this module has no branch for any
backend.

Why this module is over 500 lines: it holds the save and load phases end to end, each phase ended by
the ranks' agreement; keeping the phases and their failure handling together is what lets one read,
in one place, that a failure in any phase on any rank reaches every rank.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from torchplug.checkpoint import async_save as background
from torchplug.checkpoint import columns, deferred, fresh, sealed, verify
from torchplug.checkpoint import files as fs
from torchplug.checkpoint import manifest as mf
from torchplug.checkpoint import tensors as store
from torchplug.checkpoint.coordinate import ARRIVING, Coordinator
from torchplug.contract.context import HookContext
from torchplug.contract.errors import CheckpointError

if TYPE_CHECKING:
    from torchplug.contract.hooks import Hooks


def coordinator(engine: HookContext, operation: str, path: str) -> Coordinator:
    return Coordinator(
        operation=operation,
        path=path,
        rank=engine.rank,
        world_size=engine.world_size,
        timeout=engine.collective_timeout,
        arrival_timeout=engine.checkpoint_timeout,
    )


def _same_everywhere(results: list[Any], what: str, operation: str) -> None:
    differ = [r for r, value in enumerate(results) if value != results[0]]
    if differ:
        raise CheckpointError(
            f"engine.{operation} was called with a different {what} on rank(s) "
            f"{', '.join(map(str, differ))} than on rank 0 ({results[0]!r} there, "
            f"{results[differ[0]]!r} on rank {differ[0]}). Call it with the same path and state "
            f"keys on every rank."
        )


# -- saving ----------------------------------------------------------------------------------------


def _hooks(engine: Any) -> Hooks:
    """The active set's typed hooks, whether ``engine`` is the hook's context (the save and
    load hooks) or an Engine (``torchplug.checkpoint.save`` called by a backend's own code)."""
    return engine.hooks


def capture(engine: HookContext, key: str, obj: Any, state: dict[str, Any]) -> tuple[str, Any]:
    """``(kind, payload)`` of one live state entry, through the strategy's state hooks."""
    kind = mf.kind_of(obj, key)
    if kind == "module":
        return kind, _hooks(engine).model_state(obj)
    if kind == "optimizer":
        model = engine.model_of(obj, state)
        return kind, fresh.read_optimizer_state(
            obj, lambda: _hooks(engine).optimizer_state(model, obj)
        )
    if kind == "stateful":
        return kind, obj.state_dict()
    return kind, obj


#: Module names that wrappers put in front of a model's own names (DDP's and DeepSpeed's
#: ``module``, torch.compile's ``_orig_mod``, ...): a buffer is found by its name without them.
WRAPPER_PARTS = frozenset(
    {"module", "_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_forward_module"}
)


def unwrapped(name: str) -> str:
    """A parameter's name without the parts wrappers add (compile, checkpointing, DDP)."""
    return ".".join(p for p in name.split(".") if p not in WRAPPER_PARTS)


def replicated(kind: str, key: str, obj: Any, payload: Any, paths: set[str]) -> set[str]:
    """Which of the tensor ``paths`` one state entry added are equal on every rank by
    construction: a module's parameters (not its buffers: each rank updates BatchNorm's running
    statistics from its own batches) and an optimizer's state. Anything else is rank 0's copy
    (`torchplug.checkpoint.tensors.assign`). A buffer is known by its name (wrapper
    prefixes aside) or by sharing storage with one of the module's buffers; taking a parameter
    for a buffer only costs balance, never correctness."""
    if kind == "optimizer":
        return paths
    if kind != "module" or not isinstance(payload, Mapping):
        return set()
    names, storages = set(), set()
    for name, buffer in obj.named_buffers():
        names.add(unwrapped(name))
        with contextlib.suppress(RuntimeError):  # a buffer without storage (meta, fake)
            storages.add(buffer.untyped_storage().data_ptr())
    buffers = set()
    for name, value in payload.items():
        if not isinstance(name, str) or not isinstance(value, (torch.Tensor, deferred.Deferred)):
            continue
        shared = False
        with contextlib.suppress(RuntimeError, AttributeError):  # meta, fake, deferred
            shared = value.untyped_storage().data_ptr() in storages and value.numel() > 0
        if unwrapped(name) in names or shared:
            buffers.add(f"{key}/{name}")
    return paths - buffers


def save(
    engine: HookContext,
    path: str,
    state: dict[str, Any],
    metadata: dict[str, Any],
    *,
    entries_of: Callable[[Path], tuple[dict[str, Any], dict[str, torch.Tensor]]] | None = None,
    native: Callable[[Path], None] | None = None,
    header: dict[str, Any] | None = None,
) -> None:
    """Write ``state`` as a checkpoint at ``path`` on every rank.

    A backend with its own format passes ``native`` (writes its files into the temporary
    directory, on every rank) and ``entries_of`` (the portable entries and tensors, given that
    directory); ``header`` adds keys to the manifest.
    """
    co = coordinator(engine, "save", path)
    tmp: Path | None = None

    def arrive() -> dict[str, Any]:
        nonlocal tmp
        final = fs.resolve_target(path)
        if engine.is_main:
            tmp = fs.temporary_dir(final)
        return {"path": str(final), "keys": sorted(state), "tmp": tmp.name if tmp else None}

    try:
        arrived = co.run(ARRIVING, arrive, share=True)
        _same_everywhere([a["path"] for a in arrived], "path", "save")
        _same_everywhere([a["keys"] for a in arrived], "set of state keys", "save")
        final = Path(arrived[0]["path"])
        tmp = final.parent / arrived[0]["tmp"]
        entries: dict[str, Any] = {}
        tensors: dict[str, torch.Tensor] = {}

        if native is not None:  # a collective of the backend's: all ranks finish before the rest
            co.run("writing the backend's own checkpoint", lambda: native(tmp))

        def take() -> dict[str, Any]:
            spread: set[str] = set()
            if entries_of is not None:
                found = entries_of(tmp)
                spread.update(found[1])  # a conversion's tensors: one process, one copy each
            else:
                found = ({}, {})
                for key, obj in state.items():
                    with deferred.deferring():
                        kind, payload = capture(engine, key, obj, state)
                    before = set(found[1])
                    found[0][key] = {"kind": kind, "data": mf.encode(payload, key, found[1])}
                    spread.update(replicated(kind, key, obj, payload, set(found[1]) - before))
            entries.update(found[0])
            tensors.update(found[1])
            return {"sizes": store.plain_sizes(tensors), "spread": sorted(spread)}

        taken = co.run("capturing state", take, share=True)
        owners = store.assign([t["sizes"] for t in taken], [set(t["spread"]) for t in taken])
        mine = store.owned(tensors, engine.rank, owners)
        if any(isinstance(t, deferred.Deferred) for t in tensors.values()):
            mine = co.run("gathering state", lambda: deferred.produce(tensors, mine))
        pending = background.taker() if native is None else None  # native: written already
        staged: Callable[[], dict[str, Any]] | None = None
        if pending is not None:
            # Every tensor staged before the call returns: whatever changes them afterwards
            # (an optimizer step, .data, set_) cannot reach the checkpoint.
            copies: tuple[dict[str, Any], Callable[[], None]] | Exception
            try:
                copies = background.stage(mine, pending.staging)
                background.keep_only(pending.staging, set(mine))
            except Exception as exc:  # raised in the background's first phase, on every rank
                copies = exc

            def staged() -> dict[str, Any]:
                if isinstance(copies, Exception):
                    raise copies
                copies[1]()  # queued device copies done
                return copies[0]

        def write() -> dict[str, Any]:
            try:
                index, digests = store.write(tmp, mine, engine.rank)
            except (KeyboardInterrupt, SystemExit):
                raise
            except BaseException as exc:  # DCP's CheckpointException is a BaseException
                raise _named_os_error(exc, tmp) from exc
            here = tmp / mf.TENSORS / f"rank-{engine.rank}"
            described = _describe(tmp, here, digests=digests) if here.is_dir() else {}
            return {"index": index, "files": described}

        # what the manifest records about the run, taken now (an async commit comes later)
        recorded = {**engine.checkpoint_header(state), **(header or {}), "metadata": metadata}

        def finish() -> None:
            nonlocal mine
            if staged is not None:
                mine = co.run("staging state in memory", staged)
            written = co.run("writing tensors", write, share=True)
            old_name = co.run("committing", lambda: commit(written), share=True)[0]
            if old_name is not None:
                _remove_previous(engine, co, final.parent / old_name, final)

        def commit(written: list[dict[str, Any]]) -> str | None:
            if not engine.is_main:
                return None
            described: dict[str, Any] = {}
            for part in written:
                described.update(part["files"])
            described.update(_describe(tmp, tmp, skip=described))
            index = store.merge([part["index"] for part in written])
            index_file = columns.write(tmp, index)
            body = mf.build(recorded, entries, {}, described, index_file=index_file)
            verify.sign(body, engine.checkpoint_key)
            _write_manifest(tmp, body)
            old = fs.swap_into_place(tmp, final, remove_old=False)
            return old.name if old is not None else None

        if pending is None:
            finish()
            return

        def finish_or_clean() -> None:
            try:
                finish()
            except BaseException:
                if engine.is_main and tmp is not None:
                    shutil.rmtree(tmp, ignore_errors=True)
                raise

        pending.start(finish_or_clean)
    except BaseException:
        if engine.is_main and tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        raise


def _named_os_error(exc: BaseException, directory: Path) -> BaseException:
    """A write that failed in a library's words, as the OS error behind it (ENOSPC, EDQUOT,
    EROFS, EIO) with the path and the free space; anything else unchanged."""
    from torchplug.checkpoint.coordinate import error_text

    found = fs.os_error_behind(directory)
    if found is None:
        return exc
    space = fs.free_space(directory)
    return CheckpointError(
        f"{fs.describe_os_error(found)} while writing tensors"
        + (f" ({space})" if space else "")
        + f"; the writer reported: {error_text(exc)[:200]}. Free space (or fix the file system) "
        f"and save again."
    )


def _remove_previous(engine: HookContext, co: Coordinator, old: Path, final: Path) -> None:
    """Every rank removes the tensor files its rank wrote into the replaced checkpoint, at the
    same time; rank 0 then removes the rest. The save has happened: nothing here raises."""
    fs.remove_previous(old / mf.TENSORS / f"rank-{engine.rank}", final)
    try:
        co.run("removing the previous checkpoint", lambda: None)
    except CheckpointError as exc:
        warnings.warn(f"The checkpoint at {final} was saved; {exc}", stacklevel=3)
    if engine.is_main:
        fs.remove_previous(old, final)


def _describe(
    root: Path,
    below: Path,
    skip: dict[str, Any] | None = None,
    digests: dict[str, dict[str, str]] | None = None,
) -> dict[str, Any]:
    """Size and digest of every file below ``below`` (fsynced on the way), by path from root.
    ``digests`` holds the digests of files hashed while they were written (not read back)."""
    described = {}
    for path in sorted(p for p in below.rglob("*") if p.is_file()):
        name = path.relative_to(root).as_posix()
        if skip is not None and name in skip:
            continue
        fs.fsync(path)
        digest = (digests or {}).get(name) or fs.digest(path)
        described[name] = {"size": path.stat().st_size, **digest}
    for directory in [below, *(p for p in below.rglob("*") if p.is_dir())]:
        fs.fsync(directory)
    return described


def _write_manifest(directory: Path, body: dict[str, Any]) -> None:
    import json

    path = directory / mf.MANIFEST
    with path.open("w") as handle:
        json.dump(body, handle, indent=1, sort_keys=True)
        handle.flush()
        os.fsync(handle.fileno())
    fs.fsync(directory)


# -- loading ---------------------------------------------------------------------------------------


def read_manifest(path: str | os.PathLike[str], key: bytes | None = None) -> dict[str, Any]:
    """The validated manifest of the checkpoint at ``path`` (signature checked when a key is
    given); files are not hashed here."""
    root = Path(path)
    where = root / mf.MANIFEST
    if not where.is_file():
        raise CheckpointError(
            f"No torchplug checkpoint at {root}: {where} does not exist. Check the path; a "
            f"checkpoint is the directory that engine.save() created."
        )
    if where.is_symlink() and not where.resolve().is_relative_to(root.resolve()):
        raise CheckpointError(f"{where} is a symlink leading outside the checkpoint; refusing it.")
    try:
        raw = where.read_bytes()
    except OSError as exc:
        raise CheckpointError(f"Cannot read {where}: {fs.describe_os_error(exc)}.") from None
    # The signature first: with a key, a forged manifest costs one HMAC, not a validation.
    body = mf.load_json(raw, str(where))
    verify.check_signature(body, key, str(root))
    sizes = {}

    def read_index(checked: dict[str, Any]) -> Any:
        sizes.update((name, info["size"]) for name, info in checked["files"].items())
        return columns.read(root, checked["index"], sizes)

    mf.check(body, str(where), read_index)
    return body


def open_checkpoint(
    path: str | os.PathLike[str],
    key: bytes | None,
    co: Coordinator | None = None,
    *,
    hash_files: bool = True,
) -> tuple[Path, dict[str, Any]]:
    """Read, check and verify a checkpoint (each file hashed once, split over the ranks).

    Its tensors are then read through ``body[VERIFIED]``. With a key (signed checkpoints: the
    threat is someone who can write the files) each file is read into memory again and hashed
    from there before any byte is used, so no later change reaches the caller; without one
    (the threat is corruption, which a checker of identical bytes could not stop anyway) the
    files are read in place, each refused unless it is the file that was hashed. `load` with a
    key passes ``hash_files=False`` and verifies as it reads instead (each byte hashed once)."""
    root = Path(path)
    if co is None:
        co = Coordinator("load", str(root), 0, 1, 0.0, 0.0)
    read: dict[str, Any] = {}

    def arrive() -> str:
        read["body"] = read_manifest(root, key)  # read and validated once per load
        return read["body"]["digest"]

    digests = co.run(ARRIVING, arrive, share=True)
    _same_everywhere(digests, "checkpoint (its manifest differs)", "load")
    body = read["body"]
    pins = None
    if hash_files:
        names = verify.share(list(body["files"]), co.rank, co.world_size)
        found = co.run(
            "verifying files", lambda: verify.check_files(root, body["files"], names), share=True
        )
        pins = {name: tuple(pin) for part in found for name, pin in part.items()}
    body[mf.VERIFIED] = (
        verify.VerifiedBytes(root, body["files"], keep=1)
        if key is not None
        else verify.PinnedFiles(root, pins)
    )
    return root, body


def load(
    engine: HookContext,
    path: str,
    state: dict[str, Any] | None,
    strict: bool = True,
    *,
    skip: Callable[[str, dict[str, Any]], bool] | None = None,
) -> dict[str, Any]:
    """Load the checkpoint at ``path`` into ``state``'s objects in place.

    Returns the plain values (and tensors) of the entries not restored into an object. With
    ``state=None``: every value entry, and a summary of module/optimizer entries.
    ``skip(key, entry)`` tells entries a backend restored on its own.
    """
    co = coordinator(engine, "load", path)
    key = engine.checkpoint_key
    as_read = key is not None and state is not None  # every byte used hashed as it is read
    root, body = open_checkpoint(path, key, co, hash_files=not as_read)
    entries, index = body["entries"], body["tensors"]
    if state is None:
        return co.run("reading values", lambda: summary(root, body))
    # torchplug's own entries (plugins' state) are optional: a checkpoint saved without the
    # plugin leaves its object as it is
    missing = [k for k in state if k not in entries and not str(k).startswith("torchplug.")]
    if missing:
        raise CheckpointError(
            f"Checkpoint {root} has no entries {missing}; it holds {sorted(entries)}. "
            f"Remove those keys from the state you load into."
        )
    remainder: dict[str, Any] = {}
    plan: list[Callable[[dict[str, torch.Tensor], dict[str, Any]], None]] = []
    targets: dict[str, torch.Tensor] = {}
    wanted: dict[str, Any] = {}

    def prepare() -> list[str]:
        for key, entry in entries.items():
            if skip is not None and skip(key, entry):
                continue
            action = _plan(engine, root, body, key, entry, state, strict, targets)
            if action is not None:
                plan.append(action)
        wanted.update(store.plan(index, targets))
        return sorted(store.needed(wanted))

    # With a key, each rank reads the files it needs into memory and hashes them there (the
    # bytes it uses are the bytes hashed, whatever happens to the files later); files nobody
    # needs are hashed by one rank each. Only once every rank has verified does any rank copy
    # a byte into the objects: nothing is half-loaded.
    # A file that several ranks of one host need is read and hashed by one of them into a
    # sealed memory file the others map (`sealed`): each byte read and hashed once per host.
    planned = co.run(
        "planning the read",
        lambda: {"needs": prepare(), "host": sealed.host() if as_read else ""},
        share=True,
    )
    needs = [plan["needs"] for plan in planned]
    source = body[mf.VERIFIED]
    if as_read:
        source = verify.VerifiedBytes(root, body["files"])
        unread = sorted(set(body["files"]) - set().union(*needs))
        hosts = [plan["host"] for plan in planned]
        owners = sealed.owners(needs, hosts)
        here = hosts[co.rank]
        mine = [n for n in needs[co.rank] if owners.get(f"{here}/{n}") == co.rank]

        def check(offers: list[Any]) -> None:
            source.take(needs[co.rank], offers, owners, here, co.rank)
            source.prefetch(needs[co.rank])
            verify.check_files(root, body["files"], verify.share(unread, co.rank, co.world_size))

        try:
            offers = co.run("verifying files", lambda: source.seal(mine), share=True)
            co.run("verifying the files shared", lambda: check(offers))
        finally:
            source.release()  # every rank has mapped what it takes from this one

    def read() -> None:
        try:
            store.read(root, index, targets, source, wanted)
        except CheckpointError:
            raise
        except BaseException as exc:  # DCP's CheckpointException is a BaseException
            from torchplug.checkpoint.coordinate import error_text

            raise CheckpointError(
                f"Reading the tensors of checkpoint {root} failed: {error_text(exc)}. Either the "
                f"objects you load into differ from the ones saved (check the architecture), or "
                f"the checkpoint is damaged (load an earlier one)."
            ) from None
        for action in plan:
            action(targets, remainder)

    co.run("reading tensors", read)
    return remainder


def _plan(
    engine: HookContext,
    root: Path,
    body: dict[str, Any],
    key: str,
    entry: dict[str, Any],
    state: dict[str, Any],
    strict: bool,
    targets: dict[str, torch.Tensor],
) -> Callable[[dict[str, torch.Tensor], dict[str, Any]], None] | None:
    """Add the tensors one entry needs to ``targets``; return how to restore it afterwards."""
    kind, data = entry["kind"], entry["data"]
    index = body["tensors"]
    names = list(mf.tensor_paths(data))
    wanted = key in state
    target = state.get(key)
    if kind in ("module", "optimizer"):
        if not wanted:
            return None  # big state nobody asked for: not read
        expected = torch.nn.Module if kind == "module" else torch.optim.Optimizer
        if not isinstance(target, expected):
            if strict:
                raise CheckpointError(
                    f"Checkpoint {root} entry '{key}' holds the state of an "
                    f"{'nn.Module' if kind == 'module' else 'optimizer'}, but the object given "
                    f"under '{key}' is a {type(target).__name__}. Pass the "
                    f"{'model' if kind == 'module' else 'optimizer'} itself (engine.load(path, "
                    f"{{'{key}': {'model' if kind == 'module' else 'optimizer'}}})), or "
                    f"strict=False to get the saved state back as plain data."
                )
            targets.update(store.allocate(index, names))
            return lambda t, rest: _replace(state, rest, key, mf.decode(data, t))
        model = target if kind == "module" else engine.model_of(target, state)
        hooks = _hooks(engine)
        if hooks.reads_in_place(kind):
            if kind == "module":
                live = hooks.model_state(target)
            else:
                live = hooks.optimizer_state(model, target)
                if fresh.is_fresh(data):  # saved before its first step: loads as fresh
                    live = fresh.without_state(live)
            found = _names(live, key)
            common = _compare(root, key, set(names), set(found), strict, kind)
            targets.update({n: found[n] for n in common})
            if len(common) != len(names):
                targets.update(store.allocate(index, [n for n in names if n not in found]))
        else:
            if kind == "module":
                with deferred.deferring():  # only the names are compared: nothing gathered
                    live = hooks.model_state(target)
                _compare(root, key, set(names), set(_names(live, key)), strict, kind)
            targets.update(store.allocate(index, names))

        def restore(t: dict[str, torch.Tensor], rest: dict[str, Any]) -> None:
            payload = mf.decode(data, t)
            if kind == "module":
                hooks.load_model_state(target, payload, strict)
            else:
                hooks.load_optimizer_state(model, target, payload)

        return restore
    if kind not in mf.KINDS:
        if wanted and strict:
            raise CheckpointError(
                f"Checkpoint {root} entry '{key}' is of kind '{kind}', which only the strategy "
                f"that wrote it can restore (it was written by '{body['strategy']['name']}'). "
                f"Load it with that strategy, leave '{key}' out of the state, or pass "
                f"strict=False to skip it."
            )
        return None
    if wanted and isinstance(target, (torch.nn.Module, torch.optim.Optimizer)):
        raise CheckpointError(
            f"Checkpoint {root} entry '{key}' holds a {kind}, not the state of a "
            f"{type(target).__name__}; it cannot be loaded into one. Check the key."
        )
    restorable = callable(getattr(target, "load_state_dict", None))
    if kind == "stateful" and wanted and not restorable and strict:
        raise CheckpointError(
            f"Checkpoint {root} entry '{key}' holds the state_dict() of an object, but the "
            f"object given under '{key}' is a {type(target).__name__} with no "
            f"load_state_dict(). Pass the object itself, or strict=False to get the state "
            f"back as plain data."
        )
    targets.update(store.allocate(index, names))

    def restore_value(t: dict[str, torch.Tensor], rest: dict[str, Any]) -> None:
        payload = mf.decode(data, t)
        if kind == "stateful" and wanted and callable(getattr(target, "load_state_dict", None)):
            target.load_state_dict(payload)
        else:
            _replace(state, rest, key, payload)

    return restore_value


def _names(state: Any, key: str) -> dict[str, torch.Tensor]:
    found: dict[str, torch.Tensor] = {}
    mf.encode(state, key, found)
    return found


def _replace(state: dict[str, Any], rest: dict[str, Any], key: str, payload: Any) -> None:
    rest[key] = payload
    if key in state:
        state[key] = payload


def _compare(
    root: Path, key: str, saved: set[str], live: set[str], strict: bool, kind: str
) -> list[str]:
    """The tensor names to read; with strict (or for optimizers) any difference is an error."""
    if saved == live:
        return sorted(saved)
    strip = len(key) + 1
    only_saved = sorted(n[strip:] for n in saved - live)
    only_live = sorted(n[strip:] for n in live - saved)
    if strict or kind != "module":
        fix = (
            "Load into the same architecture that was saved, or pass strict=False to load the "
            "common part."
            if kind == "module"
            else "An optimizer's state loads only into the optimizer class that saved it, over "
            "the same parameters and groups (SGD's momentum_buffer is not AdamW's exp_avg): "
            "create that optimizer, or leave this entry out of the state you load so the "
            "optimizer starts fresh (strict=False does not mix optimizer states)."
        )
        raise CheckpointError(
            f"Checkpoint {root} entry '{key}' does not match the object you load it into: "
            f"unexpected (in the checkpoint only): {only_saved[:10] or 'none'}"
            f"{' ...' if len(only_saved) > 10 else ''}; missing (in your object only): "
            f"{only_live[:10] or 'none'}{' ...' if len(only_live) > 10 else ''}. {fix}"
        )
    return sorted(saved & live)


def summary(root: Path, body: dict[str, Any]) -> dict[str, Any]:
    """Plain values of a checkpoint, and what its modules and optimizers hold."""
    index = body["tensors"]
    result: dict[str, Any] = {}
    for key, entry in body["entries"].items():
        names = list(mf.tensor_paths(entry["data"]))
        if entry["kind"] in ("value", "tensor", "stateful"):
            tensors = store.allocate(index, names)
            store.read(root, index, tensors, body[mf.VERIFIED])
            result[key] = mf.decode(entry["data"], tensors)
        else:
            strip = len(key) + 1
            result[key] = {
                "kind": entry["kind"],
                "tensors": {
                    n[strip:]: {"shape": head["shape"], "dtype": head["dtype"]}
                    for n in names
                    for head in [store.head(index, n)]
                },
            }
    return result
