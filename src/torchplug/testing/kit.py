"""The conformance kit: the properties every strategy must have, each checked in real processes.

Run it as ``torchplug check STRATEGY [-n 2]``, or in a test suite through
`torchplug.testing.Conformance`. Each property yields an `Outcome` whose detail
holds the measured numbers, so a failure says which property broke and by how much.

Strategies whose communication is lossy (gradient compression) declare ``tolerance`` in their
`StrategyInfo`; with ``tolerance=None`` parity is checked as convergence.

Why this module is over 500 lines: the `Kit` holds every property of the conformance kit (parity,
checkpoints across strategies and world sizes, collectives, accumulation, ...), each a short method
with its measured numbers; they share the kit's processes and reference runs, so they stay one
class.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

import torchplug as tp
from torchplug.contract import manager
from torchplug.contract.errors import ConfigurationError
from torchplug.contract.types import StrategyInfo
from torchplug.testing import bodies, real_model
from torchplug.testing.processes import RankError, RankPool, default_sys_path

PROPERTIES = (
    "parity",
    "sgd",
    "clipping",
    "accumulation",
    "schedulers",
    "fp16_skip",
    "nan_skip",
    "optimizer_type",
    "data_order",
    "collectives",
    "checkpoint",
    "resume",
    "portability",
    "single_process",
    "materialization",
    "replicas",
    "real_model",
    "hyperparameters",
    "barrier",
    "sharding",
    "unsupported",
    "reuse",
    "frozen",
    "rank_dependent",
)
#: The bodies that train in the kit's precision (the others train in fp32 whatever it is).
IN_PRECISION = (bodies.train, bodies.train_again, real_model.train, bodies.train_experts)
#: The bodies that train, each as the user writes a step (``loop``: `Kit.loop`).
STEPPING = (
    bodies.train,
    bodies.train_again,
    real_model.train,
    bodies.hyperparameters_saved,
    bodies.held_elements,
    bodies.train_experts,
)
#: Checked only when asked for (``torchplug check NAME --only compile``): compiling takes seconds.
OPTIONAL_PROPERTIES = ("compile",)


@dataclass(frozen=True)
class Outcome:
    """One property's result. ``skipped``: it did not run (``detail`` says why), which is
    neither a pass nor a failure: ``passed`` is False so that nothing counts it as a PASS."""

    name: str
    passed: bool
    detail: str
    skipped: bool = False
    #: Passed as a refusal the strategy declares (``StrategyInfo.refuses``), not by working.
    refused: bool = False
    #: Failed as the strategy declares it must (``StrategyInfo.deviations``): not a failure,
    #: not a PASS either (``passed`` stays False), reported as ``DEVIATES`` with the reason.
    deviated: bool = False

    @property
    def status(self) -> str:
        if self.deviated:
            return "DEVIATES"
        return "SKIP" if self.skipped else "PASS" if self.passed else "FAIL"

    def __str__(self) -> str:
        if self.skipped:
            return f"SKIP  {self.name} ({self.detail})"
        return f"{self.status}  {self.name:<15} {self.detail}"


#: Widened tolerance per precision: the same math reduced in another order rounds differently.
LOW_PRECISION_TOLERANCE = {"bf16": 5e-2, "fp16": 1e-2}
#: BatchNorm running statistics may differ from the reference's by this much of their size, or
#: the tolerance: XLA's batch_norm computes the variance another way (0.1% off on one device).
#: A rank's statistics from another share, or averaged over the ranks, are tens of percent off.
STATS_RELATIVE = 1e-2


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    if a.keys() != b.keys():
        return float("inf")
    return max(((a[k].double() - b[k].double()).abs().max().item() for k in a), default=0.0)


def _rounded(
    values: dict[str, torch.Tensor], like: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """``values`` in the dtypes of ``like`` (fp32 state compared with a low-precision copy)."""
    return {k: v.to(like[k].dtype) if k in like else v for k, v in values.items()}


def _without(state: dict[str, torch.Tensor], names: set[str]) -> dict[str, torch.Tensor]:
    return {k: v for k, v in state.items() if k not in names}


def bit_exact(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    """Names whose tensors differ in any bit (or exist on one side only)."""
    return sorted(
        k for k in a.keys() | b.keys() if k not in a or k not in b or not torch.equal(a[k], b[k])
    )


class Kit:
    """Checks one strategy. Results of shared runs are cached across properties."""

    def __init__(
        self,
        strategy: str,
        nprocs: int = 2,
        *,
        plugins: Sequence[str] = (),
        options: dict[str, Any] | None = None,
        pool: RankPool | None = None,
        precision: str = "32",
    ) -> None:
        bodies.register(plugins)
        self.info: StrategyInfo = manager.get_registry().strategy(strategy)
        self.strategy = self.info.name
        self.plugins = list(plugins)
        self.options = dict(options or {})
        self.precision = precision
        self.nprocs = nprocs if self.info.distributed else 1
        self._pool = pool
        self._own_pool = pool is None
        self._cache: dict[str, Any] = {}
        self._tmp = Path(tempfile.mkdtemp(prefix="torchplug-check-"))

    # -- running ----------------------------------------------------------------------------------

    @property
    def started(self) -> bool:
        """Whether this kit's ranks are running (a kit whose every property skipped has none)."""
        return self._pool is not None

    @property
    def pool(self) -> RankPool:
        if self._pool is None:
            self._pool = RankPool(self.nprocs, sys_path=default_sys_path())
        return self._pool

    def close(self) -> None:
        if self._own_pool and self._pool is not None:
            self._pool.stop()

    def run(self, body: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
        """``body`` on every rank of the strategy (or in this process if it runs one)."""
        kwargs.update(plugins=self.plugins, options=self.options)
        if body in (*IN_PRECISION, bodies.load, bodies.data_order):
            kwargs.setdefault("precision", self.precision)
        if body in STEPPING:
            kwargs.setdefault("loop", self.loop)
        if self.nprocs == 1:
            return [body(self.strategy, *args, **kwargs)]
        return self.pool.run(body, self.strategy, *args, **kwargs)

    @property
    def loop(self) -> str:
        """The training step the kit's bodies write (`bodies.LOOPS`): ``model(x)`` and
        ``engine.backward``, or ``engine.forward_backward`` where the strategy refuses the first
        (``refuses=("backward",)``: a pipeline schedule runs forward and backward together)."""
        return "forward_backward" if "backward" in self.info.refuses else "backward"

    def cached(self, key: str, make: Callable[[], Any]) -> Any:
        if key not in self._cache:
            self._cache[key] = make()
        return self._cache[key]

    def reference(self, **kwargs: Any) -> dict[str, Any]:
        """The independent plain-PyTorch run (no torchplug) in this kit's precision."""
        kwargs.setdefault("precision", self.precision)
        key = f"reference{sorted(kwargs.items())}"
        return self.cached(key, lambda: bodies.reference(**kwargs))

    def for_options(self, value: Any) -> Any:
        """A `StrategyInfo` declaration for this kit's run: a function of the options (``tolerance``
        or ``resume_exact`` that an option's value changes) is called with every option's value,
        the defaults filled in."""
        return value(self.info.resolve_options(self.options)) if callable(value) else value

    @property
    def tolerance(self) -> float | None:
        """How far results may stray from the reference: the strategy's own tolerance, widened
        for low precision (reductions in another order round differently in bf16/fp16)."""
        declared = self.for_options(self.info.tolerance)
        if declared is None:
            return None
        return max(declared, LOW_PRECISION_TOLERANCE.get(self.precision, 0.0))

    def compare(
        self, name: str, results: list[dict[str, Any]], reference: dict[str, Any], what: str
    ) -> Outcome:
        """Losses and parameters of every rank against the reference, within tolerance."""
        if self.tolerance is None:
            return self.converges(name, results, reference)
        worst_loss = max(
            0.0 if a == b else abs(a - b)  # the same inf (a skipped step) on both sides
            for r in results
            for a, b in zip(r["losses"], reference["losses"], strict=True)
        )
        worst_param = max(max_diff(r["params"], reference["params"]) for r in results)
        worst = max(worst_loss, worst_param)
        return Outcome(
            name,
            worst <= self.tolerance,
            f"{what}: max |loss diff| {worst_loss:.2e}, max |param diff| {worst_param:.2e} "
            f"{'<=' if worst <= self.tolerance else '>'} tolerance {self.tolerance:.0e} "
            f"({len(results)} ranks vs plain PyTorch on the combined batch)",
        )

    def converges(
        self, name: str, results: list[dict[str, Any]], reference: dict[str, Any]
    ) -> Outcome:
        """For a lossy backend (``tolerance=None``): every rank's loss falls by at least half as
        much as the reference's over the same steps (skipped steps' inf left out), and its
        parameters stay finite. Relative to the reference, so a short run (``fp16_skip``'s 4
        steps) or a low precision passes when the backend trains, and fails when it does not."""
        import math

        ref = [v for v in reference["losses"] if math.isfinite(v)]
        gain_ref = ref[0] - ref[-1] if len(ref) > 1 else 0.0
        problems = []
        for rank, result in enumerate(results):
            losses = [v for v in result["losses"] if math.isfinite(v)]
            gain = losses[0] - losses[-1] if len(losses) > 1 else 0.0
            finite = all(bool(torch.isfinite(t).all()) for t in result["params"].values())
            if not finite or (gain_ref > 0 and gain < 0.5 * gain_ref) or not losses:
                problems.append(
                    f"rank {rank}: loss {losses[0] if losses else float('nan'):.4f} -> "
                    f"{losses[-1] if losses else float('nan'):.4f}"
                    + ("" if finite else ", non-finite parameters")
                )
        detail = (
            f"lossy: checked for convergence against the reference's loss drop "
            f"{ref[0]:.4f} -> {ref[-1]:.4f}"
        )
        if problems:
            return Outcome(name, False, f"{detail}: less than half of it on {'; '.join(problems)}")
        losses = results[0]["losses"]
        return Outcome(name, True, f"{detail}: {losses[0]:.4f} -> {losses[-1]:.4f}")

    def refused(
        self, name: str, body: Callable[[], Outcome], declared: str | None = None
    ) -> Outcome:
        """``body``'s outcome. A ConfigurationError raised on the ranks passes only as a refusal
        the strategy declares (``StrategyInfo(refuses=...)`` names ``declared`` or the
        property); an undeclared one fails, so a backend cannot pass by refusing everything."""
        try:
            return body()
        except (RankError, ConfigurationError) as exc:
            text = _last_line(str(exc))
            if isinstance(exc, RankError) and "ConfigurationError" not in str(exc):
                raise
        return self.refusal(name, declared or name, text)

    def refusal(self, name: str, what: str, text: str) -> Outcome:
        """A ConfigurationError for ``what``: PASS (refused) if declared, else FAIL."""
        if what in self.info.refuses:
            return Outcome(name, True, f"refused as declared: {text}", refused=True)
        return Outcome(
            name,
            False,
            f"refused with a ConfigurationError, but strategy '{self.info.name}' does not "
            f"declare that refusal: {text}. Implement it, or, if refusing is by design, declare "
            f"it: StrategyInfo(..., refuses=({what!r},)).",
        )

    # -- properties -------------------------------------------------------------------------------

    def parity(self) -> Outcome:
        """The kit's run equals plain PyTorch; where the kit's step is ``model(x)`` and
        ``engine.backward``, the same run written with ``engine.forward_backward`` too (the
        step that runs on every strategy)."""
        results = self.cached("train10", lambda: self.run(bodies.train))
        outcome = self.compare("parity", results, self.reference(), "AdamW")
        if self.loop == "forward_backward" or not outcome.passed:
            return outcome
        other = self.run(bodies.train, loop="forward_backward")
        written = self.compare("parity", other, self.reference(), "engine.forward_backward")
        return Outcome("parity", written.passed, f"{outcome.detail}; {written.detail}")

    def sgd(self) -> Outcome:
        """SGD is scale-sensitive: summing gradients instead of averaging them shows at once."""
        results = self.run(bodies.train, optimizer="SGD", lr=0.1)
        return self.compare("sgd", results, self.reference(optimizer="SGD", lr=0.1), "SGD")

    def clipping(self) -> Outcome:
        def body() -> Outcome:
            results = self.run(bodies.train, optimizer="SGD", lr=0.1, clip=0.05)
            reference = self.reference(optimizer="SGD", lr=0.1, clip=0.05)
            norms = [r["norms"] for r in results]
            tolerance = self.tolerance if self.tolerance is not None else 1e-1
            spread = max(abs(a - b) for n in norms for a, b in zip(n, norms[0], strict=True))
            off = max(abs(a - b) for n in norms for a, b in zip(n, reference["norms"], strict=True))
            if spread > 1e-6 or off > max(tolerance, 1e-5) * max(reference["norms"]) * 10:
                return Outcome(
                    "clipping",
                    False,
                    f"clip_grad_norm_ total norms differ: between ranks by {spread:.2e}, from "
                    f"the reference by {off:.2e} (rank 0 {norms[0][:2]}, reference "
                    f"{reference['norms'][:2]})",
                )
            if self.tolerance is None:  # lossy: heavy clipping slows it, nothing to compare with
                return Outcome("clipping", True, "total norm equal on every rank (lossy backend)")
            outcome = self.compare("clipping", results, reference, "SGD clipped to 0.05")
            # the norm's order is honoured: the largest gradient value (inf) and the sum of
            # absolute values (1), not the L2 norm whatever norm_type says
            for norm_type in (float("inf"), 1.0):
                try:
                    other = self.run(
                        bodies.train, optimizer="SGD", lr=0.1, clip=0.05, norm_type=norm_type,
                        steps=2,
                    )  # fmt: skip
                except (RankError, ConfigurationError) as exc:
                    if isinstance(exc, RankError) and "ConfigurationError" not in str(exc):
                        raise
                    refusal = self.refusal("clipping", "clip_norm_type", _last_line(str(exc)))
                    if not refusal.passed:
                        return refusal
                    return Outcome(
                        "clipping",
                        outcome.passed,
                        f"total norm equal on every rank and to the reference; "
                        f"norm_type={norm_type:g} {refusal.detail}; {outcome.detail}",
                    )
                expected = self.reference(
                    optimizer="SGD", lr=0.1, clip=0.05, norm_type=norm_type, steps=2
                )
                off = max(
                    abs(a - b) / max(abs(b), 1e-12)
                    for r in other
                    for a, b in zip(r["norms"], expected["norms"], strict=True)
                )
                if off > max(tolerance, 1e-5) * 10:
                    return Outcome(
                        "clipping",
                        False,
                        f"clip_grad_norm_(norm_type={norm_type:g}) total norms "
                        f"{other[0]['norms']} differ from the reference's {expected['norms']} "
                        f"(relative {off:.2e}): the norm_type argument is not honoured",
                    )
            try:  # an inf gradient with error_if_nonfinite=True: torch's error on every rank
                self.run(
                    bodies.train, optimizer="SGD", lr=0.1, clip=0.05, steps=2, inf_at_step=1,
                    error_if_nonfinite=True,
                )  # fmt: skip
            except (RankError, RuntimeError) as exc:  # RuntimeError: in this process
                if "is non-finite" not in str(exc):
                    raise
            else:
                return Outcome(
                    "clipping",
                    False,
                    "clip_grad_norm_(error_if_nonfinite=True) returned after an inf gradient "
                    "instead of raising: the total norm the backend answers must be the "
                    "gradients' (inf or nan when they are), not a finite stand-in",
                )
            detail = (
                f"total norm (L2, inf and 1) equal on every rank and to the reference, a "
                f"non-finite one refused with error_if_nonfinite; {outcome.detail}"
            )
            return Outcome("clipping", outcome.passed, detail)

        return self.refused("clipping", body)

    def accumulation(self) -> Outcome:
        """``engine.accumulate`` (what users write) must equal the large batch on every backend;
        the lower-level ``engine.no_sync`` loop too, unless the strategy declares it refuses
        that (``refuses=("no_sync",)``, e.g. DeepSpeed, whose boundaries only accumulate marks).
        On a non-sharding backend the first micro-batch's gradients must differ across ranks
        (a backend that synchronizes inside no_sync wastes the point of accumulating)."""
        probe = self.nprocs > 1 and not self.info.shards_parameters
        reference = self.reference(optimizer="SGD", lr=0.1, accumulate=2)
        outcomes = []
        for mode, what in ((True, "engine.accumulate"), (False, "engine.no_sync")):
            if not mode and "no_sync" in self.info.refuses:
                continue

            def body(mode: bool = mode, what: str = what) -> Outcome:
                results = self.run(
                    bodies.train, optimizer="SGD", lr=0.1, accumulate=2, probe_sync=probe,
                    with_accumulate=mode,
                )  # fmt: skip
                seen = [x for r in results for x in r["synced"]]
                if probe and seen and all(x is True for x in seen):
                    return Outcome(
                        "accumulation",
                        False,
                        f"gradients were synchronized inside {what}: every rank had the same "
                        f"gradients after a micro-batch of different data. A backend that "
                        f"synchronizes in backward (a DDP wrapper) answers torchplug_no_sync "
                        f"with the wrapper's no_sync() (the default answer does nothing)",
                    )
                hidden = probe and any(x is None for x in seen)
                note = " (gradient sync not observable: the backend keeps its gradients)"
                outcome = self.compare(
                    "accumulation", results, reference, f"2 micro-batches, {what}"
                )
                if hidden:
                    outcome = Outcome(outcome.name, outcome.passed, outcome.detail + note)
                return outcome

            outcomes.append(
                self.refused("accumulation", body, declared="no_sync" if not mode else None)
            )
        failed = [o for o in outcomes if not o.passed]
        if failed:
            return failed[0]
        return Outcome(
            "accumulation",
            True,
            "; ".join(o.detail for o in outcomes),
            refused=any(o.refused for o in outcomes),
        )

    def schedulers(self) -> Outcome:
        reference = self.reference(optimizer="SGD", lr=0.1, scheduler="step")
        outcomes = []
        for when in ("before", "after"):
            results = self.run(bodies.train, optimizer="SGD", lr=0.1, scheduler=when)
            lrs = results[0]["lrs"]
            if any(abs(a - b) > 1e-12 for a, b in zip(lrs, reference["lrs"], strict=True)):
                return Outcome(
                    "schedulers",
                    False,
                    f"an LR scheduler made {when} setup does not drive the optimizer: lr "
                    f"{lrs[:3]}, expected {reference['lrs'][:3]}",
                )
            outcomes.append(self.compare("schedulers", results, reference, f"made {when} setup"))
        failed = [o for o in outcomes if not o.passed]
        if failed:
            return failed[0]
        return Outcome("schedulers", True, "; ".join(o.detail for o in outcomes))

    def fp16_skip(self) -> Outcome:
        if self.precision != "fp16":
            return Outcome("fp16_skip", False, f"n/a in precision {self.precision}", skipped=True)
        results = self.run(bodies.train, steps=4, inf_at_step=1)
        reference = self.reference(steps=4, inf_at_step=1)
        flags = [r["skipped"] for r in results]
        if any(f != reference["skipped"] for f in flags):
            return Outcome(
                "fp16_skip",
                False,
                f"step_was_skipped per step {flags[0]}, expected {reference['skipped']} "
                f"(an inf loss on rank 0 at step 1 must skip that step on every rank)",
            )
        return self.compare("fp16_skip", results, reference, "inf at step 1, skipped")

    def nan_skip(self) -> Outcome:
        """An extension skips a step from a wrapper (the NaN guard of docs/plugins.md): a NaN
        loss on rank 0 at step 1 must leave every rank's parameters un-updated at that step,
        report ``step_was_skipped`` there only, and train on afterwards like the reference."""

        def body() -> Outcome:
            results = self.run(
                bodies.train, optimizer="SGD", lr=0.1, steps=4, nan_at_step=1, nan_guard=True
            )
            reference = self.reference(optimizer="SGD", lr=0.1, steps=4, nan_at_step=1)
            expected = reference["skipped"]
            flags = [r["skipped"] for r in results]
            if any(f != expected for f in flags):
                return Outcome(
                    "nan_skip",
                    False,
                    f"step_was_skipped per step {flags}, expected {expected} on every rank (a "
                    f"wrapper of torchplug_optimizer_step used engine.skipping_updates and "
                    f"returned False at step 1, after a NaN loss on rank 0)",
                )

            def finite(run: dict[str, Any]) -> dict[str, Any]:
                losses = [x if x == x else 0.0 for x in run["losses"]]  # the NaN step: no loss
                return {**run, "losses": losses}

            outcome = self.compare(
                "nan_skip", [finite(r) for r in results], finite(reference), "NaN at step 1"
            )
            detail = f"the NaN step was skipped on every rank; {outcome.detail}"
            return Outcome("nan_skip", outcome.passed, detail)

        return self.refused("nan_skip", body)

    def data_order(self) -> Outcome:
        """Shuffled global batches equal (seed, epoch)'s, across epochs, after a probe, and after
        resuming mid-epoch from a checkpoint."""
        expected = bodies.reference_order()
        whole = self.run(bodies.data_order)
        if any(r != expected for r in whole):
            bad = [r for r in whole if r != expected][0]
            pairs = enumerate(zip(bad, expected, strict=False))
            step = next((i for i, (a, b) in pairs if a != b), min(len(bad), len(expected)) - 1)
            return Outcome(
                "data_order",
                False,
                f"global batch {step} is {bad[step]}, expected {expected[step]} (the order "
                f"must depend on seed and epoch only, not on iter() calls or world size)",
            )
        path = str(self._tmp / "order")
        cut = len(expected) // 2 + 3  # inside the second epoch
        first = self.run(bodies.data_order, save_to=path, save_at=cut)[0]
        rest = self.run(bodies.data_order, load_from=path)[0]
        ok = first + rest == expected
        return Outcome(
            "data_order",
            ok,
            f"2 epochs of shuffled global batches match (seed, epoch) on {len(whole)} rank(s), "
            f"and a resume after step {cut} continues with the same batches"
            if ok
            else f"after resuming at step {cut}: {rest[:2]}, expected {expected[cut : cut + 2]}",
        )

    def optimizer_type(self) -> Outcome:
        results = self.cached("train10", lambda: self.run(bodies.train))
        ok = all(r["is_torch_optimizer"] for r in results)
        return Outcome(
            "optimizer_type",
            ok,
            "engine.setup returns a torch.optim.Optimizer (LR schedulers accept it)"
            if ok
            else "engine.setup returned an optimizer that is not a torch.optim.Optimizer",
        )

    def collectives(self) -> Outcome:
        """reduce (every op) and gather in every dtype of `bodies.COLLECTIVE_DTYPES`, alone and
        mixed in one nested call: each answer equals the exact one, in the input's dtype (the
        mean of integers: a true mean, in the default float dtype)."""
        results = self.run(bodies.collectives)
        n = results[0]["world_size"]
        expected = {}
        for dtype in bodies.COLLECTIVE_DTYPES:
            values = torch.tensor([bodies.collective_values(r, dtype) for r in range(n)])
            floating = getattr(torch, dtype).is_floating_point
            mean_dtype = dtype if floating else str(torch.get_default_dtype())[6:]
            answers = {
                "sum": (values.sum(0), dtype),
                "mean": (values.sum(0) / n, mean_dtype),
                "max": (values.max(0).values, dtype),
                "min": (values.min(0).values, dtype),
                "gather": (values, dtype),
            }
            for op, (want, want_dtype) in answers.items():
                for key in (f"{dtype} {op}", f"mixed {dtype} {op}"):
                    expected[key] = (want.double().tolist(), want_dtype)
        wrong = []
        for r in results:
            for key, (want, want_dtype) in expected.items():
                got, got_dtype = r[key]
                # an answer rounded to its dtype: a mean of 2 or 3 ranks in bf16 is the nearest
                eps = torch.finfo(getattr(torch, want_dtype)).eps if want_dtype[0] in "fb" else 0
                close = torch.allclose(
                    torch.tensor(got, dtype=torch.float64),
                    torch.tensor(want, dtype=torch.float64),
                    rtol=eps,
                    atol=0.0,
                )
                if got_dtype != want_dtype or not close:
                    wrong.append(
                        f"rank {r['rank']} {key}: got {got} ({got_dtype}), expected {want} "
                        f"({want_dtype})"
                    )
        return Outcome(
            "collectives",
            not wrong,
            "; ".join(wrong[:4]) + (f"; and {len(wrong) - 4} more" if len(wrong) > 4 else "")
            or f"sum/mean/max/min and gather exact in {len(bodies.COLLECTIVE_DTYPES)} dtypes "
            f"(alone and mixed in one nested call) on {n} ranks",
        )

    def _saved(self) -> tuple[str, dict[str, Any]]:
        def make() -> tuple[str, dict[str, Any]]:
            path = str(self._tmp / "ckpt")
            return path, self.run(bodies.train, steps=3, save_to=path)[0]

        return self.cached("saved", make)

    def checkpoint(self) -> Outcome:
        path, saved = self._saved()
        loaded = self.run(bodies.load, path)
        differ = sorted({n for r in loaded for n in bit_exact(r["params"], saved["params"])})
        differ += sorted({n for r in loaded for n in bit_exact(r["optimizer"], saved["optimizer"])})
        steps = {r["step"] for r in loaded}
        ok = not differ and steps == {3}
        detail = (
            "parameters and optimizer state load back bit-exact"
            if ok
            else f"differ after save -> load: {differ[:5]}; step {steps} (expected 3)"
        )
        return Outcome("checkpoint", ok, detail)

    def resume(self) -> Outcome:
        """5 steps, save, 5 more from the checkpoint equal 10 steps: through ``engine.save`` /
        ``load`` and through ``save_checkpoint`` / ``resume="latest"`` (which checks the step
        the ``torchplug_checkpoint_metadata`` answer gives against the directory's name)."""
        path = str(self._tmp / "half")
        first = self.run(bodies.train, steps=5, save_to=path)[0]
        second = self.run(bodies.train, steps=5, first_step=5, load_from=path)[0]
        whole = self.cached("train10", lambda: self.run(bodies.train))[0]
        latest = str(self._tmp / "latest")
        self.run(bodies.train, steps=5, checkpoint_dir=latest)
        try:
            third = self.run(bodies.train, steps=5, first_step=5, checkpoint_dir=latest)[0]
        except RankError as exc:
            return Outcome(
                "resume",
                False,
                f'resume="latest" failed after save_checkpoint: {_last_line(str(exc))} (the step '
                f"torchplug_checkpoint_metadata answers must be the one save_checkpoint saved)",
            )
        worst_loss = max(
            abs(a - b)
            for a, b in zip(first["losses"] + second["losses"], whole["losses"], strict=True)
        )
        worst = max(
            worst_loss,
            max_diff(second["params"], whole["params"]),
            max_diff(third["params"], whole["params"]),
        )
        # A resumed run repeats the same arithmetic, lossy communication included: it must
        # agree to 1e-6 whatever the parity tolerance. Only a strategy whose communication keeps
        # state that checkpoints do not carry (PowerSGD's error feedback) declares
        # resume_exact=False, and is held to convergence-level agreement.
        exact = bool(self.for_options(self.info.resume_exact))
        tolerance = 1e-6 if exact else 1e-1
        why = "" if exact else " (resume_exact=False: state not checkpointed)"
        return Outcome(
            "resume",
            worst <= tolerance,
            f"5 steps + save/load (and save_checkpoint/resume='latest') + 5 steps vs 10 "
            f"steps: max diff {worst:.2e} "
            f"{'<=' if worst <= tolerance else '>'} {tolerance:.0e}{why}",
        )

    def frozen(self) -> Outcome:
        """A frozen first layer and two param groups (their own lr and weight decay; the frozen
        tensors in one of them, as ``model.parameters()`` passed whole leaves them): setup keeps
        them frozen and each group trains as the reference's."""
        results = self.run(bodies.train, frozen=True)
        thawed = sorted({name for r in results for name in r["thawed"]})
        if thawed:
            return Outcome(
                "frozen",
                False,
                f"setup made frozen parameters trainable ({', '.join(thawed)}): they now get "
                f"gradients and move. Leave requires_grad as the model had it.",
            )
        return self.compare(
            "frozen", results, self.reference(frozen=True), "AdamW, a frozen layer, 2 groups"
        )

    def rank_dependent(self) -> Outcome:
        """Ranks that use different parameters in one step (rank r's share through expert
        r % 2): every rank's result equals plain PyTorch on the global batch, or the step is
        refused (a ConfigurationError the strategy declares) before anything goes wrong."""

        def body() -> Outcome:
            results = self.run(bodies.train_experts)
            dp = results[0]["data_parallel_size"]
            reference = self.cached(
                f"experts{dp}",
                lambda: bodies.experts_reference(ranks=dp, precision=self.precision),
            )
            return self.compare(
                "rank_dependent", results, reference, "rank r's share through expert r % 2"
            )

        return self.refused("rank_dependent", body)

    def reuse(self) -> Outcome:
        """Set up, ``close()``, set up again on the same model and optimizer: the two Engines
        together equal one (no hook or wrapper of the first left to run under the second)."""

        def body() -> Outcome:
            results = self.run(bodies.train_again)
            left = sorted({hook for r in results for phase in r["left"] for hook in phase})
            if left:
                return Outcome(
                    "reuse",
                    False,
                    f"close() left {len(left)} hook(s) on the user's model ({', '.join(left[:3])}"
                    f"{', ...' if len(left) > 3 else ''}): the next Engine given it runs them too. "
                    f"Remove them in torchplug_teardown (or register them with "
                    f"engine.restore_on_close).",
                )
            return self.compare(
                "reuse", results, self.reference(), "5 steps, close(), 5 more on the same objects"
            )

        return self.refused("reuse", body)

    def portability(self) -> Outcome:
        """Both ways: this strategy's checkpoint loads into 'single' in one process, and one
        written by 'single' loads into this strategy on its ranks, model and optimizer state
        bit-exact."""
        path, saved = self._saved()
        loaded = bodies.load("single", path)  # in fp32: the checkpoint holds fp32 state
        # A backend that keeps low-precision weights beside fp32 masters (DeepSpeed bf16) saves
        # the masters: they must round to the weights it trained with.
        differ = bit_exact(_rounded(loaded["params"], saved["params"]), saved["params"])
        differ += bit_exact(loaded["optimizer"], saved["optimizer"])
        if differ:
            return Outcome(
                "portability", False, f"differ after loading into 'single': {differ[:5]}"
            )
        source = str(self._tmp / "from-single")
        written = self.cached(
            "from-single", lambda: bodies.train("single", steps=3, save_to=source)
        )
        back = self.run(bodies.load, source)
        differ = sorted(
            {
                n
                for r in back
                for n in bit_exact(r["params"], _rounded(written["params"], r["params"]))
                + (
                    bit_exact(r["optimizer"], written["optimizer"])
                    if r["optimizer_portable"]
                    else []
                )
            }
        )
        if differ:
            return Outcome(
                "portability", False, f"differ after loading a 'single' checkpoint: {differ[:5]}"
            )
        note = (
            ""
            if loaded["optimizer_portable"] and all(r["optimizer_portable"] for r in back)
            else " (model only: this strategy's optimizer state has no portable form, and "
            "loading it elsewhere is refused unless strict=False)"
        )
        return Outcome(
            "portability",
            True,
            f"checkpoint of {self.nprocs} rank(s) loads bit-exact into 'single' in one process, "
            f"and one of 'single' into {self.nprocs} rank(s){note}",
        )

    def single_process(self) -> Outcome:
        return self.refused("single_process", self._single_process)

    def _single_process(self) -> Outcome:
        result = bodies.train(
            self.strategy,
            plugins=self.plugins,
            options=self.options,
            precision=self.precision,
            loop=self.loop,
        )
        reference = self.reference()
        if self.tolerance is None:
            ok = result["losses"][-1] < 0.5 * result["losses"][0]
            return Outcome(
                "single_process",
                ok,
                "lossy: converges in one process"
                if ok
                else f"does not converge in one process: {result['losses']}",
            )
        worst = max(
            max(abs(a - b) for a, b in zip(result["losses"], reference["losses"], strict=True)),
            max_diff(result["params"], reference["params"]),
        )
        return Outcome(
            "single_process",
            result["world_size"] == 1 and worst <= self.tolerance,
            f"runs as a world of one; max diff vs reference {worst:.2e}",
        )

    def materialization(self) -> Outcome:
        """A model built with ``engine.init_module(empty=True)`` comes out of setup equal to the
        same model built eagerly (each rank allocating what the backend keeps)."""
        eager = self.run(real_model.materialized, empty=False)
        empty = self.run(real_model.materialized, empty=True)
        differ = sorted({n for e, m in zip(eager, empty, strict=True) for n in bit_exact(m, e)})
        return Outcome(
            "materialization",
            not differ,
            "a meta-device model materialised by setup equals the eager build, bit for bit"
            if not differ
            else f"materialised parameters differ from the eager build: {differ[:5]}",
        )

    def hyperparameters(self) -> Outcome:
        """A learning rate changed by hand and a scheduler's position, saved, come back in
        fresh objects after load (the optimizer's param_groups and the scheduler's state)."""
        path = str(self._tmp / "hyperparameters")
        saved = self.run(bodies.hyperparameters_saved, path, False)[0]
        loaded = self.run(bodies.hyperparameters_saved, path, True)
        wrong = [
            f"rank {rank}: {what} {got[what]!r}, saved {saved[what]!r}"
            for rank, got in enumerate(loaded)
            for what in ("lr", "momentum", "scheduler")
            if got[what] != saved[what]
        ]
        if saved["lr"] != bodies.SET_LR:
            wrong.insert(0, f"the lr set by hand read back as {saved['lr']!r} before saving")
        return Outcome(
            "hyperparameters",
            not wrong,
            "; ".join(wrong[:2])
            or f"lr {bodies.SET_LR} set by hand and the scheduler at step "
            f"{saved['scheduler']['last_epoch']} come back after load into fresh objects",
        )

    def precision_independent(self, name: str) -> Outcome | None:
        """SKIP for a property no precision enters (the model as built, a barrier), outside
        precision 32 where the strategy runs 32: it is checked there (``torchplug check NAME
        --precision 32``), so the run is not repeated per precision."""
        if self.precision == "32" or "32" not in self.info.precisions:
            return None
        return Outcome(
            name,
            False,
            f"precision-independent: checked in precision 32 (torchplug check {self.strategy} "
            f"--precision 32 --only {name})",
            skipped=True,
        )

    def barrier(self) -> Outcome:
        """``engine.barrier()`` waits for the last rank (delayed by a second before it)."""
        if self.nprocs == 1:
            return Outcome("barrier", False, "one process: nothing to wait for", skipped=True)
        if (skip := self.precision_independent("barrier")) is not None:
            return skip
        marker = self._tmp / f"barrier-{len(list(self._tmp.iterdir()))}"
        seen = self.run(bodies.barrier_waits, str(marker))
        late = [rank for rank, ok in enumerate(seen) if not ok]
        return Outcome(
            "barrier",
            not late,
            f"rank(s) {late} left engine.barrier() before the last rank arrived"
            if late
            else "every rank waited in engine.barrier() for the delayed last rank",
        )

    def sharding(self) -> Outcome:
        """Each rank's parameter and optimizer-state elements match what the registration
        declares: under ``shards_parameters`` / ``shards_optimizer`` no rank holds the whole and
        the ranks together hold at most 3/4 of a copy each (2 FSDP ranks hold about half each;
        2 pipeline stages split it unevenly), the others the whole on every rank."""
        if self.nprocs == 1:
            return Outcome("sharding", False, "one process: nothing to shard", skipped=True)
        held = self.run(bodies.held_elements)
        problems = []
        together = {key: sum(h[key] for h in held) for key in ("params", "optimizer")}
        for rank, h in enumerate(held):
            for what, key, flag, whole in (
                ("parameters", "params", "shards_parameters", h["full"]),
                ("optimizer state", "optimizer", "shards_optimizer", 2 * h["full"]),
            ):
                mine, declared = h[key], getattr(self.info, flag)
                if declared and (mine >= whole or together[key] > 0.75 * whole * len(held)):
                    problems.append(
                        f"rank {rank} holds {mine} of {whole} {what} elements ({together[key]} on "
                        f"{len(held)} ranks together), but the strategy declares {flag}"
                    )
                if not declared and mine < whole:
                    problems.append(
                        f"rank {rank} holds {mine} of {whole} {what} elements: sharded, but the "
                        f"strategy does not declare {flag}=True"
                    )
        first = held[0]
        return Outcome(
            "sharding",
            not problems,
            "; ".join(problems[:2])
            or f"rank 0 holds {first['params']}/{first['full']} parameter and "
            f"{first['optimizer']}/{2 * first['full']} optimizer-state elements, as declared",
        )

    def replicas(self) -> Outcome:
        """Ranks that built the model from different seeds all hold rank 0's model after
        setup, built eagerly or on the meta device (DDP broadcasts rank 0's; a sharding backend
        that skipped that would shard a mix of differently initialised models)."""
        if self.nprocs == 1:
            return Outcome("replicas", False, "one process: nothing to compare", skipped=True)
        if (skip := self.precision_independent("replicas")) is not None:
            return skip
        expected = real_model.replica_reference()
        problems = []
        for empty in (False, True):
            how = "built empty" if empty else "built eagerly"
            try:
                results = self.run(real_model.replicas, empty=empty)
            except RankError as exc:
                if empty and "init_module" in str(exc):  # a backend without meta support
                    continue
                raise
            for rank, result in enumerate(results):
                state = result["state"]
                differ = bit_exact(_rounded(state, expected), _rounded(expected, state))
                if differ:
                    problems.append(
                        f"rank {rank} ({how}) differs from rank 0's model: {differ[:3]}"
                    )
                if not result["tied"]:
                    problems.append(f"rank {rank} ({how}): the tied embedding and head came apart")
        return Outcome(
            "replicas",
            not problems,
            "; ".join(problems[:2])
            or "ranks seeded differently all hold rank 0's model (parameters, a random buffer, "
            "BatchNorm statistics, a tied embedding kept tied) after setup, eager and empty",
        )

    def real_model(self) -> Outcome:
        """A model with BatchNorm, a convolution, a random buffer and a tied embedding
        (`KitNet`), built from a different seed on every
        rank and trained with SGD + momentum on the ranks' shares, against plain PyTorch
        running each share's forward (its own batch statistics). Every rank's parameters equal
        the reference; each rank's BatchNorm statistics are its own shares' or, as DDP gives
        them, rank 0's updated by its share (never a mix across ranks); the checkpoint loads into
        ``single`` with exactly rank 0's parameters and buffers."""
        path = str(self._tmp / "real-model")
        results = self.run(real_model.train, save_to=path)
        world = results[0]["dp_size"]
        reference = self.cached(
            f"real-model-{world}", lambda: real_model.reference(world, self.precision)
        )
        tolerance = self.tolerance
        problems, rules = [], []
        if tolerance is None:
            outcome = self.converges("real_model", results, reference)
            if not outcome.passed:
                problems.append(outcome.detail)
        else:
            stats = set(reference["own"][0])
            for rank, result in enumerate(results):
                mine = _without(result["params"], stats)
                worst = max_diff(mine, _without(reference["params"], stats))
                worst_loss = max(
                    abs(a - b) for a, b in zip(result["losses"], reference["losses"], strict=True)
                )
                if max(worst, worst_loss) > tolerance:
                    problems.append(
                        f"rank {rank}: parameters differ from plain PyTorch by {worst:.2e}, losses "
                        f"by {worst_loss:.2e} (tolerance {tolerance:.0e})"
                    )
        if not any(result["stats"] for result in results):
            problems.append("no rank holds the BatchNorm statistics after training")
        for rank, result in enumerate(results):
            dp = result["dp_rank"]
            mine = result["stats"]
            if not mine:
                # a pipeline stage without BatchNorm layers: another rank of its replica holds them
                if any(o["stats"] and o["dp_rank"] == dp for o in results):
                    rules.append("none held")
                else:
                    rules.append("none")
                    problems.append(
                        f"rank {rank} holds no BatchNorm statistics and no other rank of its "
                        f"data-parallel replica {dp} does: they were dropped"
                    )
                continue
            fits = [
                rule
                for rule in ("own", "ddp")
                if mine.keys() == reference[rule][dp].keys()
                and all(
                    torch.equal(mine[n], v)
                    if not v.is_floating_point()
                    else tolerance is None
                    or (mine[n].float() - v).abs().max()
                    <= max(tolerance, STATS_RELATIVE * float(v.abs().max()))
                    for n, v in reference[rule][dp].items()
                )
            ]
            rules.append("/".join(fits) or "none")
            if not fits:
                off = {
                    rule: max_diff(
                        {n: mine[n].float() for n in mine},
                        {n: v.float() for n, v in reference[rule][dp].items()},
                    )
                    for rule in ("own", "ddp")
                }
                problems.append(
                    f"rank {rank}'s BatchNorm statistics are neither its own shares' (off by "
                    f"{off['own']:.2e}) nor rank 0's updated by its share as DDP gives them (off "
                    f"by {off['ddp']:.2e}): mixed across ranks. A strategy that synchronises "
                    f"them on purpose (SyncBatchNorm) declares a deviation for real_model"
                )
        loaded = real_model.load(path)
        saved = results[0]["params"]
        differ = bit_exact(_rounded(loaded, saved), saved)
        if differ:
            problems.append(
                f"the checkpoint loaded into 'single' differs from rank 0's model: {differ[:4]}"
            )
        return Outcome(
            "real_model",
            not problems,
            "; ".join(problems[:3])
            or f"{len(results)} rank(s) from different seeds "
            + (
                "converge as plain PyTorch does (lossy: statistics not compared)"
                if tolerance is None
                else f"equal plain PyTorch (BatchNorm, conv, tied embedding, SGD momentum); "
                f"each rank's BatchNorm statistics follow a data-parallel rule (by rank: "
                f"{', '.join(rules)})"
            )
            + "; the checkpoint holds exactly rank 0's model",
        )

    def compile(self) -> Outcome:
        """``Engine(compile=True)`` trains like eager, or is refused with a clear error."""
        try:
            compiled = self.run(bodies.train, engine_args={"compile": True})[0]
        except (RankError, ConfigurationError) as exc:
            text = _last_line(str(exc))
            if "ConfigurationError" in str(exc) or isinstance(exc, ConfigurationError):
                return self.refusal("compile", "compile", text)
            return Outcome("compile", False, f"failed: {text}")
        eager = self.cached("train10", lambda: self.run(bodies.train))[0]
        worst = max(
            max(abs(a - b) for a, b in zip(compiled["losses"], eager["losses"], strict=True)),
            max_diff(compiled["params"], eager["params"]),
        )
        tolerance = max(1e-5, self.tolerance or 0.0)
        return Outcome(
            "compile",
            worst <= tolerance,
            f"compile=True vs eager over 10 steps: max diff {worst:.2e} "
            f"{'<=' if worst <= tolerance else '>'} {tolerance:.0e}",
        )

    def unsupported(self) -> Outcome:
        problems = []
        asks: list[tuple[str, dict[str, Any]]] = [
            (f"precision {p!r}", {"precision": p})
            for p in ("32", "bf16", "fp16")
            if p not in self.info.precisions
        ]
        asks.append(("an unknown option", {"no_such_option_xyz": 1}))
        for what, kwargs in asks:
            try:
                engine = tp.Engine(self.strategy, **{**self.options, **kwargs})
            except ConfigurationError:
                continue
            except Exception as exc:  # an error, but not the clear configuration error
                problems.append(f"{what} raised {type(exc).__name__}, not ConfigurationError")
                continue
            engine.close()
            problems.append(f"{what} was accepted instead of refused")
        return Outcome(
            "unsupported",
            not problems,
            "; ".join(problems)
            or f"refused with ConfigurationError: {', '.join(w for w, _ in asks)}",
        )

    def unavailable(self) -> str | None:
        """Why this kit's precision cannot run on this machine (the registry's one probe), or
        ``None``; every property is then ``SKIP`` with that reason, never run and never PASS."""
        return manager.get_registry().precision_unavailable(self.info, self.precision)

    def check(self, only: Sequence[str] = PROPERTIES) -> list[Outcome]:
        unavailable = self.unavailable()
        if unavailable is not None:
            return [Outcome(name, False, unavailable, skipped=True) for name in only]
        outcomes = []
        unknown = sorted(set(self.info.deviations) - set(PROPERTIES))
        if unknown:  # a misspelt declaration would otherwise excuse nothing, silently
            outcomes.append(
                Outcome(
                    "deviations",
                    False,
                    f"strategy '{self.info.name}' declares deviations for {unknown}, which are "
                    f"not kit properties (they are: {', '.join(PROPERTIES)}). Fix the names in "
                    f"StrategyInfo(deviations=...).",
                )
            )
        outcomes.extend(self.outcome(name) for name in only)
        return outcomes

    def outcome(self, name: str) -> Outcome:
        """Property ``name`` run once, as `check` and the pytest face report it: a rank's or the
        property's own failure is a FAIL naming it, and a declared deviation is reported as one.

        Args:
            name: One of `PROPERTIES` or `OPTIONAL_PROPERTIES`.
        """
        try:
            outcome = getattr(self, name)()
        except RankError as exc:
            outcome = Outcome(name, False, f"a rank failed: {_last_line(str(exc))}")
        except Exception as exc:
            outcome = Outcome(name, False, f"{type(exc).__name__}: {exc}")
        return self.declared(outcome)

    def declared(self, outcome: Outcome) -> Outcome:
        """A failure of a property the strategy declares a deviation for, as that deviation
        (with the reason and what was measured); a pass stays a pass, reported as passing."""
        reason = self.info.deviations.get(outcome.name)
        if reason is None or outcome.passed or outcome.skipped:
            return outcome
        return Outcome(
            outcome.name, False, f"as declared ({reason}): {outcome.detail}", deviated=True
        )


def _last_line(text: str) -> str:
    lines = [line for line in text.splitlines() if line.strip()]
    errors = [line for line in lines if "Error" in line]
    return (errors or lines or [""])[-1].strip()


def check(
    strategy: str,
    nprocs: int = 2,
    *,
    plugins: Sequence[str] = (),
    options: dict[str, Any] | None = None,
    only: Sequence[str] = PROPERTIES,
    pool: RankPool | None = None,
    precision: str = "32",
) -> list[Outcome]:
    """Run the kit on ``strategy`` in ``precision``; every property's outcome, in order."""
    kit = Kit(strategy, nprocs, plugins=plugins, options=options, pool=pool, precision=precision)
    try:
        return kit.check(only)
    finally:
        kit.close()
