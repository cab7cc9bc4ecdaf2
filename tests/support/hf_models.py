"""Tiny Hugging Face models built from configs (nothing downloaded) and a plain-PyTorch loop to
compare torchplug's strategies with."""

from __future__ import annotations

from typing import Any

import torch

VOCAB = 64


def llama(seed: int = 0) -> torch.nn.Module:
    """A 2-layer LlamaForCausalLM with grouped-query attention; it carries Hugging Face's
    tensor-parallel plan (``colwise``, ``rowwise``, ``embedding_rowwise``, ...)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=1,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


def gpt2(seed: int = 0) -> torch.nn.Module:
    """A 2-layer GPT2LMHeadModel: tied ``wte``/``lm_head``, ``Conv1D`` layers, an empty tp plan."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=2, n_head=4, bos_token_id=0,
        eos_token_id=1, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,  # deterministic
    )  # fmt: skip
    torch.manual_seed(seed)
    return GPT2LMHeadModel(config)


def tokens(step: int, batch: int = 4, length: int = 16) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, VOCAB, (batch, length), generator=generator)


def reference(
    make: Any = llama, steps: int = 3, lr: float = 0.5, precision: str = "32"
) -> dict[str, Any]:
    """``steps`` SGD steps on the whole batch in one process, no torchplug. SGD at lr 0.5 is
    scale-sensitive; AdamW would turn rounding noise in near-zero gradients into lr-sized steps.
    ``precision`` bf16/fp16: under torch's autocast (fp16 with a GradScaler)."""
    model = make()
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    scaler = torch.amp.GradScaler("cpu") if precision == "fp16" else None
    losses = []
    for step in range(steps):
        ids = tokens(step)
        with torch.autocast("cpu", dtype=dtype, enabled=dtype is not None):
            loss = model(input_ids=ids, labels=ids).loss
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
            losses.append(loss.item())
            continue
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "params": {k: v.detach() for k, v in model.state_dict().items()}}


def local_bytes(model: torch.nn.Module) -> int:
    """Bytes of parameters this rank holds (its shards of DTensors)."""
    from torch.distributed.tensor import DTensor

    total = 0
    for p in model.parameters():
        local = p.to_local() if isinstance(p, DTensor) else p
        total += local.numel() * local.element_size()
    return total


def train(
    strategy: str,
    options: dict[str, Any],
    make: Any = llama,
    steps: int = 3,
    save_to: str | None = None,
    load_from: str | None = None,
    first_step: int = 0,
) -> dict:
    """The reference's loop under ``strategy``: each data-parallel share of the batch per rank;
    ``load_from`` a checkpoint of steps before ``first_step``, ``save_to`` one after."""
    import torchplug as tp

    with tp.Engine(strategy, **options) as engine:
        model = make()
        full_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        model, optimizer = engine.setup(model, optimizer)
        if load_from is not None:
            engine.load(load_from, {"model": model, "optimizer": optimizer})
        losses = []
        for step in range(first_step, first_step + steps):
            ids = tokens(step).chunk(engine.data_parallel_size)[engine.data_parallel_rank]
            loss = model(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(engine.reduce(loss.detach(), "mean").item())
        if save_to is not None:
            engine.save(save_to, {"model": model, "optimizer": optimizer})
        return {
            "losses": losses,
            "params": engine.full_state(model)["model"],
            "local_bytes": local_bytes(model),
            "full_bytes": full_bytes,
        }


def setup_error(strategy: str, options: dict[str, Any], make: Any) -> str | None:
    import torchplug as tp

    with tp.Engine(strategy, **options) as engine:
        try:
            engine.setup(make())
        except tp.ConfigurationError as exc:
            return str(exc)
    return None


def built_empty(strategy: str, options: dict[str, Any], make: Any = llama) -> dict:
    """``make()`` inside ``init_module(empty=True)``, set up: its full state, to be bit-compared
    with an eager ``make()`` (both start from ``torch.manual_seed(0)``, which ``make`` calls)."""
    import torchplug as tp

    with tp.Engine(strategy, **options) as engine:
        torch.manual_seed(0)
        with engine.init_module(empty=True):
            model = make()
        assert all(p.is_meta for p in model.parameters())
        model = engine.setup(model)
        return {k: v.clone() for k, v in engine.full_state(model)["model"].items()}


def load_pretrained_under(strategy: str, options: dict[str, Any], path: str) -> dict:
    """An empty-built llama (another seed), set up under ``strategy``, loaded from ``path``:
    its full state, and how many elements this rank read from the files."""
    import safetensors

    import torchplug as tp

    read = [0]
    real = safetensors.safe_open

    class Counting:
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            self._inner = real(*args, **kwargs)

        def __enter__(self) -> Any:
            inner = self._inner.__enter__()

            class Handle:
                def get_slice(self, name: str) -> Any:
                    stored = inner.get_slice(name)

                    class Slice:
                        def get_shape(self) -> Any:
                            return stored.get_shape()

                        def __getitem__(self, block: Any) -> torch.Tensor:
                            out = stored[block]
                            read[0] += out.numel()
                            return out

                    return Slice()

                def get_tensor(self, name: str) -> torch.Tensor:
                    out = inner.get_tensor(name)
                    read[0] += out.numel()
                    return out

                def keys(self) -> Any:
                    return inner.keys()

            return Handle()

        def __exit__(self, *exc: Any) -> Any:
            return self._inner.__exit__(*exc)

    safetensors.safe_open = Counting  # torchplug imports it when it reads
    try:
        with tp.Engine(strategy, **options) as engine:
            torch.manual_seed(123)  # not the saved model's numbers
            with engine.init_module(empty=True):
                model = llama(seed=123)
            model = engine.setup(model)
            report = engine.load_pretrained(model, path)
            state = {k: v.clone() for k, v in engine.full_state(model)["model"].items()}
    finally:
        safetensors.safe_open = real
    return {"state": state, "read": read[0], "missing": report["missing"]}


def check_low_precision(ranks: Any, strategy: str, precision: str, make: str) -> None:
    """``make`` (``"gpt2"``/``"llama"``) trained under ``strategy`` in ``precision`` on the ranks
    equals torch's autocast in one process (bf16 within 5e-2, fp16 within 1e-2: the precisions
    round differently); SKIP where the machine cannot run the precision."""
    import pytest

    from support.reference import assert_close_dicts
    from torchplug.testing.conformance import require_precision

    require_precision(strategy, precision)
    build = globals()[make]
    reference_run = reference(build, precision=precision)
    tolerance = {"bf16": 5e-2, "fp16": 1e-2}[precision]
    options = {"precision": precision}
    if strategy == "single":  # one process: this one
        results = [train(strategy, options, build)]
    else:
        results = ranks.run(train, strategy, options, build, timeout=600)
    for result in results:
        assert result["losses"] == pytest.approx(reference_run["losses"], abs=tolerance)
        params = {k: v.float() for k, v in result["params"].items()}
        assert_close_dicts(params, reference_run["params"], atol=tolerance)
