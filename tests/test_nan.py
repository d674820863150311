"""NaN tracer and data guard: the culprit is named."""

from __future__ import annotations

import pytest
import torch

import stabilitykit as sk
from stabilitykit.testing.syncs import count_host_syncs
from tests.conftest import batches


def test_forward_nan_names_the_module() -> None:
    model = sk.testing.tiny_gpt()
    model.blocks[1].mlp.fc.register_forward_hook(lambda m, i, o: o * float("nan"))
    x, y = batches(1)[0]
    with sk.NaNTracer(model) as tracer:
        tracer.step = 12
        model.loss(x, y).backward()
    first = tracer.first
    assert first is not None
    assert (first.module, first.phase, first.step) == ("blocks.1.mlp.fc", "forward", 12)
    assert first.dtype == "float32" and first.stats["input_absmax"] > 0
    assert not model.blocks[1].mlp.fc._forward_hooks.keys() - {next(iter(model.blocks[1].mlp.fc._forward_hooks))}


def test_backward_nan_names_the_module() -> None:
    model = sk.testing.tiny_gpt()

    class NaNGrad(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            return g * float("nan")

    inner = model.blocks[2].attn.proj
    original = inner.forward
    inner.forward = lambda t: original(NaNGrad.apply(t))  # type: ignore[method-assign]
    x, y = batches(1)[0]
    with sk.NaNTracer(model) as tracer:
        model.loss(x, y).backward()
    assert tracer.first is not None
    assert (tracer.first.module, tracer.first.phase) == ("blocks.2.attn.proj", "backward")


def test_tracer_makes_no_sync_while_finite_and_removes_hooks() -> None:
    model = sk.testing.tiny_gpt()
    x, y = batches(1)[0]
    with count_host_syncs() as counter, sk.NaNTracer(model) as tracer:
        model.loss(x, y).backward()
    assert counter.count == 0
    assert tracer.first is None
    assert all(not m._forward_hooks and not m._backward_hooks for m in model.modules())


def test_guard_tracing_names_source_in_skip_event() -> None:
    model = sk.testing.tiny_gpt()
    poison = {"on": False}
    model.blocks[3].attn.qkv.register_forward_hook(lambda m, a, o: o * float("nan") if poison["on"] else o)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    cfg = sk.StabilityConfig(nan_trace=sk.NaNTraceConfig(mode="always"))
    guard = sk.StabilityGuard(model, opt, cfg)
    events: list[sk.Event] = []
    guard.hooks.on("nonfinite", events.append)
    for i, (x, y) in enumerate(batches(4)):
        poison["on"] = i == 2
        guard.backward(model.loss(x, y))
        guard.step()
        guard.zero_grad()
    assert len(events) == 1 and events[0].details["module"] == "blocks.3.attn.qkv"
    assert events[0].details["phase"] == "forward" and events[0].step == 2
    assert guard.summary()["nonfinite_source"] == "forward of blocks.3.attn.qkv at step 2"
    guard.close()


def test_check_batch_names_the_path() -> None:
    good = {"input_ids": torch.ones(2, 3, dtype=torch.long), "weights": torch.ones(2, 3)}
    sk.check_batch(good)
    bad = {"input_ids": torch.ones(2, 3, dtype=torch.long), "weights": torch.ones(2, 3)}
    bad["weights"][1, 2] = float("nan")
    with pytest.raises(sk.BadBatchError, match=r"batch\['weights'\]\[1\]\[2\] is nan") as info:
        sk.check_batch(bad, step=5)
    assert info.value.step == 5 and "step 5" in str(info.value)
    labels = {"x": torch.zeros(4, 2), "labels": torch.tensor([0, 3, 9, -100])}
    with pytest.raises(sk.BadBatchError, match=r"batch\['labels'\]\[2\] is 9, outside \[0, 5\)"):
        sk.check_batch(labels, num_classes=5)
    with pytest.raises(sk.BadBatchError, match="empty"):
        sk.check_batch([torch.zeros(0)])
    with pytest.raises(sk.BadBatchError, match=r"batch\[1\]\['a'\] is an empty sequence"):
        sk.check_batch([torch.ones(1), {"a": []}])


def test_tracing_an_hf_model_makes_torch_warn_nothing_and_finds_the_backward_nan() -> None:
    """A transformers model returns a ModelOutput, on which torch's module backward hooks cannot work
    (torch warns "module output should be a Tensor or a tuple of Tensors"): the model itself
    is not hooked for backward (its submodules are), and the first non-finite backward value is still
    named: a NaN loss (weights of 0/0, as a corrupt shard gives) is found where it enters, lm_head."""
    import warnings

    from tests.hf_models import tiny_llama, token_batches

    model = tiny_llama()
    batch = token_batches(1, seed=0)[0]
    with warnings.catch_warnings(record=True) as caught, sk.NaNTracer(model) as tracer:
        warnings.simplefilter("always")
        out = model(**batch)
        (out.loss * torch.tensor(float("nan"))).backward()
    assert [str(w.message) for w in caught if "backward hooks" in str(w.message)] == []
    first = tracer.first
    assert first is not None and first.phase == "backward"
    assert first.module == "lm_head", first
