"""Saved guard states, altered every way a truncated or hand-edited checkpoint can be: each is either
loaded (and training goes on) or refused with "invalid stabilitykit state at <path>" and the guard untouched.

The alterations are generated from a real guard's ``state_dict()`` (a tiny random-init Llama, spike
detectors per layer, adaptive or per-tensor clipping, unread journal rows): every node dropped, every
list cut short or emptied, every section emptied or nulled, every leaf given a wrong type, every
tensor reshaped.
"""

from __future__ import annotations

import copy
import math
import re
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

import stabilitykit as sk
from stabilitykit.state import STATE_VERSION
from tests.hf_models import tiny_llama, token_batches

Path = tuple[Any, ...]
Alteration = tuple[str, Callable[[dict[str, Any]], None]]

CONFIGS = {
    "adaptive": sk.StabilityConfig(
        clip=sk.ClipConfig(mode="adaptive", warmup_steps=2),
        spikes=sk.SpikeConfig(per_layer=True, warmup_steps=2),
        log_every_n_steps=16,
    ),
    "per_tensor+spike_skip": sk.StabilityConfig(
        clip=sk.ClipConfig(mode="per_tensor_adaptive"),
        spikes=sk.SpikeConfig(per_layer=True, warmup_steps=2),
        skip=sk.SkipConfig(spike=True, spike_warmup_steps=2),
        log_every_n_steps=16,
    ),
}


def _train(guard: sk.StabilityGuard, model: torch.nn.Module, batches: list[dict[str, torch.Tensor]]) -> None:
    for batch in batches:
        loss = model(**batch).loss
        guard.record("loss_copy", loss.detach())  # a recorded metric: a journal column and a precursor trend
        guard.backward(loss)
        guard.step()
        guard.zero_grad()


def _guard(config: sk.StabilityConfig) -> tuple[sk.StabilityGuard, torch.nn.Module]:
    model = tiny_llama()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    guard = sk.StabilityGuard(model, optimizer, config)
    _train(guard, model, token_batches(5, seed=1))  # 5 steps: warmed detectors, rows left unread
    return guard, model


def _get(state: Any, path: Path) -> Any:
    for key in path:
        state = state[key]
    return state


def _set(path: Path, value: Any) -> Callable[[dict[str, Any]], None]:
    def apply(state: dict[str, Any]) -> None:
        _get(state, path[:-1])[path[-1]] = value

    return apply


def _drop(path: Path) -> Callable[[dict[str, Any]], None]:
    def apply(state: dict[str, Any]) -> None:
        del _get(state, path[:-1])[path[-1]]

    return apply


def _wrong_type(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if isinstance(value, str):
        return 3
    if isinstance(value, bool | int | float) or value is None:
        return "x"
    return 1.5


def _reshapes(tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    yield "unsqueezed", tensor.unsqueeze(0)
    if tensor.dim() != 1:
        yield "flattened", tensor.flatten()
    flat = tensor.flatten()
    yield "one longer", torch.cat([flat, flat[:1].clone() if tensor.numel() else tensor.new_zeros(1)])
    if tensor.numel():
        yield "one shorter", tensor.flatten()[:-1]
    if tensor.dim() == 2:
        yield "one column short", tensor[:, :-1]


def alterations(state: Any, path: Path = ()) -> Iterator[Alteration]:
    """Every alteration of ``state`` below ``path`` (the state itself is never changed)."""
    name = ".".join(str(p) for p in path) or "<root>"
    if isinstance(state, dict):
        if path:
            yield f"{name} emptied", _set(path, {})
            yield f"{name} null", _set(path, None)
        for key, value in state.items():
            yield f"{name}.{key} dropped", _drop((*path, key))
            yield from alterations(value, (*path, key))
    elif isinstance(state, list):
        if state:
            yield f"{name} cut short", _set(path, copy.deepcopy(state[:-1]))
            yield f"{name} emptied", _set(path, [])
            yield f"{name}[0] wrong type", _set((*path, 0), _wrong_type(state[0]))
            for i, item in enumerate(state):
                if isinstance(item, dict | list):
                    yield from alterations(item, (*path, i))
        yield f"{name} null", _set(path, None)
    elif isinstance(state, torch.Tensor):
        yield f"{name} wrong type", _set(path, _wrong_type(state))
        yield f"{name} null", _set(path, None)
        for how, reshaped in _reshapes(state):
            yield f"{name} {how}", _set(path, reshaped)
    else:
        yield f"{name} wrong type", _set(path, _wrong_type(state))
        if state is not None:
            yield f"{name} null", _set(path, None)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return (
            isinstance(b, torch.Tensor)
            and a.shape == b.shape
            and a.dtype == b.dtype
            and bool(torch.equal(a.nan_to_num(), b.nan_to_num()))
        )
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return isinstance(b, list | tuple) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return bool(a == b) and type(a) is type(b)


def _sweep(config: sk.StabilityConfig) -> dict[str, list[str]]:
    guard, model = _guard(config)
    original = guard.state_dict()
    more = token_batches(2, seed=2)
    outcome: dict[str, list[str]] = {"accepted": [], "refused": [], "bare": [], "touched": [], "broke": []}
    cases = [*alterations(original), ("version given as the string '2'", _set(("version",), "2"))]
    for name, apply in cases:
        altered = copy.deepcopy(original)
        apply(altered)
        before = guard.state_dict()
        try:
            guard.load_state_dict(altered)
        except ValueError as exc:
            if not str(exc).startswith("invalid stabilitykit state at '"):
                outcome["bare"].append(f"{name}: ValueError: {exc}")
            elif not _same(before, guard.state_dict()):
                outcome["touched"].append(name)
            else:
                outcome["refused"].append(name)
            continue
        except Exception as exc:
            outcome["bare"].append(f"{name}: {type(exc).__name__}: {exc}")
            continue
        try:
            _train(guard, model, more)
        except Exception as exc:
            outcome["broke"].append(f"{name}: {type(exc).__name__}: {exc}")
        else:
            outcome["accepted"].append(name)
        guard.load_state_dict(copy.deepcopy(original))
    return outcome


@pytest.mark.parametrize("mode", list(CONFIGS))
def test_every_altered_state_loads_or_is_refused_by_path(mode: str) -> None:
    outcome = _sweep(CONFIGS[mode])
    counts = {k: len(v) for k, v in outcome.items()}
    print(f"{mode}: {sum(counts.values())} cases, {counts}")
    assert outcome["bare"] == []
    assert outcome["touched"] == []
    assert outcome["broke"] == []
    assert len(outcome["refused"]) > 50 and len(outcome["accepted"]) > 5
    assert "version given as the string '2'" in outcome["refused"]
    assert "<root>.version dropped" in outcome["refused"]


def test_detector_list_one_short_is_refused_and_training_goes_on() -> None:
    """The reported case: one item popped from the grad-norm detector's ``last`` list."""
    guard, model = _guard(CONFIGS["adaptive"])
    state = guard.state_dict()
    before = copy.deepcopy(state)
    state["optimizers"][0]["engine"]["ledger"]["spikes"]["detector"]["last"].pop()
    with pytest.raises(
        ValueError, match=r"invalid stabilitykit state at 'optimizers\.0\.engine\.ledger\.spikes\.detector'.*'last'"
    ):
        guard.load_state_dict(state)
    assert _same(before, guard.state_dict())
    _train(guard, model, token_batches(2, seed=3))
    assert guard.step_count == 7


def test_version_as_a_string_is_refused_by_name() -> None:
    guard, _ = _guard(CONFIGS["adaptive"])
    state = guard.state_dict()
    state["version"] = "2"
    with pytest.raises(ValueError, match=r"invalid stabilitykit state at 'version': must be an int.*got str '2'"):
        guard.load_state_dict(state)
    del state["version"]  # a key dropped is refused as a wrong one is
    with pytest.raises(ValueError, match=r"invalid stabilitykit state at 'version': missing"):
        guard.load_state_dict(state)
    state["version"] = STATE_VERSION
    state["optimizers"][0]["engine"]["ledger"]["spikes"]["alerts"] = "2"
    with pytest.raises(
        ValueError, match=r"invalid stabilitykit state at 'optimizers\.0\.engine\.ledger\.spikes\.alerts'"
    ):
        guard.load_state_dict(state)


def test_a_state_round_trips_through_torch_save(tmp_path: Any) -> None:
    guard, _ = _guard(CONFIGS["per_tensor+spike_skip"])
    torch.save(guard.state_dict(), tmp_path / "guard.pt")
    fresh, fresh_model = _guard(CONFIGS["per_tensor+spike_skip"])
    fresh.load_state_dict(torch.load(tmp_path / "guard.pt", weights_only=True))
    assert _same(guard.state_dict(), fresh.state_dict())
    _train(fresh, fresh_model, token_batches(2, seed=4))


def test_a_detector_refuses_a_list_one_short_by_name() -> None:
    """Loaded directly (outside a guard), a detector checks every list, not only the first."""
    from stabilitykit.spikes import PredictiveDetector

    detector = PredictiveDetector(size=2)
    detector.update([1.0, 2.0])
    state = detector.state_dict()
    state["last"] = state["last"][:1]
    with pytest.raises(ValueError, match="'last' has 1 series, this detector scores 2"):
        PredictiveDetector(size=2).load_state_dict(state)
    three = PredictiveDetector(size=3).state_dict()
    three["count"] = None
    with pytest.raises(ValueError, match="needs 'count' as a list of 3 values"):
        PredictiveDetector(size=3).load_state_dict(three)


@pytest.mark.parametrize(
    ("section", "alter", "path"),
    [
        ("counters", lambda s: s["ledger"]["counters"].update(skipped_total=-1), r"ledger\.counters\.skipped_total"),
        ("counters", lambda s: s["ledger"]["counters"].update(unknown=1), r"ledger\.counters\.unknown"),
        ("row notes", lambda s: s["journal"]["infos"][0].update(step=-3), r"journal\.infos\.0\.step"),
    ],
)
def test_sections_declared_on_their_owners_keep_their_constraints(
    section: str, alter: Callable[[dict[str, Any]], None], path: str
) -> None:
    """The counters and row notes are validated from the owners' dataclasses (``state.schema_of``):
    a negative count, an unknown key or a negative step is refused by its full path."""
    guard, _ = _guard(CONFIGS["adaptive"])
    state = copy.deepcopy(guard.state_dict())
    alter(state["optimizers"][0]["engine"])
    with pytest.raises(ValueError, match=r"invalid stabilitykit state at 'optimizers\.0\.engine\." + path):
        guard.load_state_dict(state)
    guard.close()


@pytest.mark.parametrize(
    ("path", "value", "named"),
    [
        (("engine", "ledger", "counters"), {}, "engine.ledger.counters': value error, emptied"),
        (("engine", "ledger", "counters", "skipped_total"), None, "engine.ledger.counters.skipped_total'"),
        (("engine", "journal", "infos", 0, "folded"), None, "engine.journal.infos.0.folded'"),
        (("engine", "clip"), {}, "engine.clip': emptied"),
        (("engine", "spike_rule"), None, "engine.spike_rule': null"),
        (("engine", "ledger", "spikes"), None, "engine.ledger.spikes': null"),
        (("engine", "ledger", "spikes", "layer_detector"), None, "engine.ledger.spikes.layer_detector': null"),
        (("engine", "journal", "columns"), [], "engine.journal.columns': [] is not this release's row layout"),
        # the four that loaded silently: the trends emptied, the score window cut short, the rows a column
        # short (the per-layer norms misread), the loss trend dropped or nulled (its warm-up restarted)
        (("engine", "ledger", "spikes", "trends"), {}, "engine.ledger.spikes': value error, 'trends' is empty"),
        (
            ("engine", "ledger", "spikes", "spike_score", "values"),
            "cut",
            "engine.ledger.spikes': value error, 'spike_score.values' holds 4",
        ),
        (("engine", "journal", "rows"), "column", "engine.journal.rows': unread rows are"),
        (("engine", "ledger", "spikes", "loss_trend"), "drop", "engine.ledger.spikes.loss_trend': field required"),
        (("engine", "ledger", "spikes", "loss_trend"), None, "engine.ledger.spikes.loss_trend': input should be"),
    ],
)
def test_an_emptied_or_dropped_section_is_refused_naming_its_path(path: Path, value: Any, named: str) -> None:
    """A container emptied (or nulled) is as wrong as a key dropped: refused by path, the guard untouched,
    instead of loading as a fresh count (the run's skips forgotten, the clip statistics restarted)."""
    guard, _ = _guard(CONFIGS["per_tensor+spike_skip"])
    original = guard.state_dict()
    altered = copy.deepcopy(original)
    core = altered["optimizers"][0]
    if value == "drop" or (value is None and path[-1] in ("skipped_total", "folded")):
        _drop(path)(core)
    elif value == "cut":
        _set(path, _get(core, path)[:-1])(core)
    elif value == "column":
        _set(path, _get(core, path)[:, :-1])(core)
    else:
        _set(path, value)(core)
    with pytest.raises(ValueError, match=re.escape("invalid stabilitykit state at 'optimizers.0." + named)):
        guard.load_state_dict(altered)
    assert _same(original, guard.state_dict())
