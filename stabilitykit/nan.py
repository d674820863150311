"""Locating non-finite values: the first module to produce one (forward or backward) and bad batches.

``NaNTracer`` keeps its flags on the device: while everything is finite it never reads a value
back. Each hooked call gets an index; a device tensor holds the index of the first call whose
output (forward) or input gradient (backward) was non-finite. ``.first`` reads it (one sync).
"""

from __future__ import annotations

import contextlib
import math
import re
import traceback
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from pydantic import Field
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode
from torch.utils.hooks import RemovableHandle

from stabilitykit.batch_walk import walk_batch
from stabilitykit.compat.private import dynamo_disable, is_compiled_module
from stabilitykit.engine.layers import clean_name, unwrap_model
from stabilitykit.events import BadBatchError
from stabilitykit.section import Section


class DataGuardConfig(Section):
    """Checking batches before they are trained on: non-finite floats, out-of-range labels, empty tensors."""

    mode: Literal["off", "skip", "raise"] = Field(
        "off",
        description=(
            "'raise': BadBatchError naming the path and index (one sync per checked batch); "
            "'skip': the step is skipped on the device, no sync (the event says the batch was bad)."
        ),
    )
    num_classes: int | None = Field(None, ge=1, description="Labels must lie in [0, num_classes) (-100 is ignored).")
    label_keys: list[str | int] = Field(
        default_factory=lambda: ["labels", "label", "targets", "target", "y"],  # type: ignore[arg-type]
        description="Mapping keys (or tuple positions, e.g. 1 for (x, y) batches) whose integer tensors are labels.",
    )


# Backward hooks on modules fed only integer inputs (embeddings) are expected here; torch warns about them.
warnings.filterwarnings("ignore", message="Full backward hook is firing when gradients are computed with respect")


@dataclass
class NonFiniteRecord:
    """Where the first non-finite value appeared."""

    module: str
    phase: str  # "forward" | "backward"
    step: int | None
    dtype: str | None = None
    stats: dict[str, float] = field(default_factory=dict)
    #: The forward source line that made the value (from the anomaly-mode replay), e.g. ``model.py:42: y = x / s``.
    source: str | None = None

    def __str__(self) -> str:
        at = f" at step {self.step}" if self.step is not None else ""
        line = f" [{self.source}]" if self.source else ""
        return f"{self.phase} of {self.module or '<root>'}{at}{line}"


def _tensors(value: Any) -> Iterator[Tensor]:
    """Every floating tensor inside a (possibly nested) tuple/list/dict value."""
    if isinstance(value, Tensor):
        if value.is_floating_point() or value.is_complex():
            yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)


def is_compiled(model: nn.Module) -> bool:
    """True when ``model`` or a submodule runs under ``torch.compile``."""
    return any(is_compiled_module(m) for m in model.modules())


def eager_if(compiled: bool) -> contextlib.AbstractContextManager[Any]:
    """Run every ``torch.compile``'d function as plain eager code inside the block when ``compiled``
    (``torch.compiler.set_stance("force_eager")``): the NaN replay hooks and checks each op without
    tracing, breaking or recompiling the compiled graph, which is used unchanged afterwards."""
    if not compiled:
        return contextlib.nullcontext()
    return torch.compiler.set_stance("force_eager")


_COMPILE_WARNED = False


def _warn_compiled_once() -> None:
    global _COMPILE_WARNED
    if not _COMPILE_WARNED:
        _COMPILE_WARNED = True
        warnings.warn(
            "stabilitykit: NaN tracing hooks on a torch.compile'd model run eagerly: one graph break per "
            "hooked module on traced steps (19 breaks, 47 compiled frames instead of 1 on a 2-layer Llama); "
            "backward is traced on module outputs. nan_trace.mode='on_nonfinite' never hooks a compiled "
            "model: it replays the bad batch eagerly instead.",
            RuntimeWarning,
            stacklevel=3,
        )


def _returns_tensors(module: nn.Module) -> bool:
    """Whether ``module`` returns a Tensor or a tuple, as torch's module backward hooks need (else torch
    warns "module output should be a Tensor or a tuple of Tensors" and the hook sees nothing).

    A Hugging Face ``PreTrainedModel`` returns a ``ModelOutput`` (a mapping): it gets no backward hook.
    Its backward is its submodules' (``lm_head``, the layers), which are traced and are where the first
    non-finite backward value is named. Read from the class names, so transformers is never imported.
    """
    return not any(cls.__name__ == "PreTrainedModel" for cls in type(module).__mro__)


class NaNTracer:
    """Context manager that names the first module whose forward output or input grad is non-finite.

    ``step`` is a label the caller advances (``tracer.step = n``) so records say when. ``reset()``
    forgets the current record and the call log (the guard calls it per step).
    """

    def __init__(self, model: nn.Module, forward: bool = True, backward: bool = True) -> None:
        self.model = model
        self.trace_forward = forward
        self.trace_backward = backward
        #: Under ``torch.compile`` the hooks run eagerly (``torch._dynamo.disable``): one graph break
        #: per hooked module while tracing, no recompiles; backward is traced on module outputs.
        self.compiled = is_compiled(model)
        self.step: int | None = None
        self._hook_fns: dict[tuple[str, str], Any] = {}
        self._handles: list[RemovableHandle] = []
        self._calls: list[tuple[str, str, str | None, int | None]] = []
        self._first: Tensor | None = None
        self._stats: Tensor | None = None
        self._found: NonFiniteRecord | None = None

    # -- lifecycle
    def attach(self) -> NaNTracer:
        """Register hooks on every submodule (idempotent)."""
        if self._handles:
            return self
        if self.compiled:
            _warn_compiled_once()
        for raw_name, module in unwrap_model(self.model).named_modules():
            name = clean_name(raw_name)
            by_outputs = self.compiled
            if self.trace_forward or (by_outputs and self.trace_backward):
                self._handles.append(module.register_forward_hook(self._hook_fn(name, "forward", by_outputs)))
            if self.trace_backward and not by_outputs and _returns_tensors(module):
                self._handles.append(module.register_full_backward_hook(self._hook_fn(name, "backward")))
        return self

    def _hook_fn(self, name: str, phase: str, by_outputs: bool = False) -> Any:
        """One hook function per module and phase, kept for the tracer's life (so re-attaching changes
        nothing a compiler guards on). ``by_outputs``: backward is traced on the module's outputs."""
        key = (name, phase)
        if key not in self._hook_fns:
            fn = self._forward_hook(name, by_outputs) if phase == "forward" else self._backward_hook(name)
            self._hook_fns[key] = dynamo_disable(fn) if self.compiled else fn
        return self._hook_fns[key]

    @property
    def attached(self) -> bool:
        """The hooks are in place."""
        return bool(self._handles)

    def detach(self) -> None:
        """Remove every hook this tracer added."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def __enter__(self) -> NaNTracer:
        return self.attach()

    def __exit__(self, *exc: object) -> None:
        self.detach()

    def reset(self) -> None:
        """Forget the record so far (call between steps to bound memory)."""
        if self._found is None and self._first is not None:
            self._found = self._resolve()
        self._calls.clear()
        self._first = None
        self._stats = None

    def clear(self) -> None:
        """Forget everything, including a record already resolved."""
        self._calls.clear()
        self._first = None
        self._stats = None
        self._found = None

    # -- hooks
    def _record(self, name: str, phase: str, inputs: Any, outputs: Any) -> None:
        outs = list(_tensors(outputs))
        if not outs:
            return
        ins = list(_tensors(inputs))
        device = outs[0].device
        bad = torch.stack([~torch.isfinite(t).all() for t in outs]).to(device).any()
        index = len(self._calls)
        self._calls.append((name, phase, str(outs[0].dtype).replace("torch.", ""), self.step))
        if self._first is None:
            self._first = torch.full((), -1, dtype=torch.int64, device=device)
            self._stats = torch.zeros(4, dtype=torch.float32, device=device)
        assert self._stats is not None
        newly = (self._first < 0) & bad
        stats = torch.stack(
            [
                torch.stack([t.detach().abs().amax().float() for t in ins]).amax()
                if ins
                else torch.zeros((), device=device),
                torch.stack([t.detach().abs().amin().float() for t in ins]).amin()
                if ins
                else torch.zeros((), device=device),
                torch.stack([t.detach().abs().amax().float() for t in outs]).amax(),
                torch.stack([t.detach().abs().amin().float() for t in outs]).amin(),
            ]
        ).to(self._stats.device)
        self._stats = torch.where(newly, stats, self._stats)
        self._first = torch.where(newly, torch.full_like(self._first, index), self._first)

    def _forward_hook(self, name: str, by_outputs: bool) -> Any:
        def hook(module: nn.Module, inputs: Any, outputs: Any) -> None:
            if self._found is not None:
                return
            if self.trace_forward:
                self._record(name, "forward", inputs, outputs)
            if by_outputs and self.trace_backward:  # module backward hooks need compiled autograd
                for out in _tensors(outputs):
                    if out.requires_grad:
                        out.register_hook(self._output_grad_hook(name))

        return hook

    def _output_grad_hook(self, name: str) -> Any:
        def hook(grad: Tensor) -> None:
            if self._found is None:
                self._record(name, "backward", (), grad)

        return hook

    def _backward_hook(self, name: str) -> Any:
        def hook(module: nn.Module, grad_input: Any, grad_output: Any) -> None:
            if self._found is None:
                self._record(name, "backward", grad_output, grad_input)

        return hook

    # -- result
    def _resolve(self) -> NonFiniteRecord | None:
        if self._first is None:
            return None
        index = int(self._first.item())
        if index < 0:
            return None
        name, phase, dtype, step = self._calls[index]
        assert self._stats is not None
        values = self._stats.tolist()
        keys = ("input_absmax", "input_absmin", "output_absmax", "output_absmin")
        return NonFiniteRecord(name, phase, step, dtype, dict(zip(keys, values, strict=False)))

    @property
    def first(self) -> NonFiniteRecord | None:
        """The first non-finite module seen (None while all is finite). Reading it syncs once."""
        if self._found is None:
            self._found = self._resolve()
        return self._found


def check_batch(
    batch: Any,
    num_classes: int | None = None,
    step: int | None = None,
    label_keys: Sequence[str | int] = ("labels", "label", "targets", "target", "y"),
) -> None:
    """Raise ``BadBatchError`` naming the path (``batch['labels'][3][17]``, ``batch.labels[3]``) of the first bad value.

    Walks mappings (``BatchEncoding`` and other ``UserDict`` mappings too), dataclasses, namedtuples,
    lists and tuples. Checks: non-finite floats anywhere; integer tensors under a label key (a
    mapping key, a field name, or a position such as ``1`` for ``(x, y)`` batches) outside
    ``[0, num_classes)`` (ignoring -100); empty tensors or containers. One host sync for the whole batch.
    """
    floats: list[tuple[str, Tensor]] = []
    labels: list[tuple[str, Tensor]] = []
    for leaf in walk_batch(batch, label_keys):
        value, path = leaf.value, leaf.path
        if leaf.empty is not None:
            raise BadBatchError(path, f"is an empty {leaf.empty}", step)
        if isinstance(value, Tensor):
            if value.numel() == 0:
                raise BadBatchError(path, "is empty", step)
            if value.is_floating_point():
                floats.append((path, value))
            elif leaf.is_label and num_classes is not None and value.dtype != torch.bool:
                labels.append((path, value))
        elif isinstance(value, float) and not math.isfinite(value):
            raise BadBatchError(path, f"is {value}", step)

    checks = [~torch.isfinite(t).all() for _, t in floats]
    checks += [((t < 0) & (t != -100)).any() | (t >= (num_classes or 0)).any() for _, t in labels]
    if not checks:
        return
    flags = torch.stack([c.cpu() for c in checks]).tolist()
    if not any(flags):
        return
    index = flags.index(True)
    if index < len(floats):
        path, tensor = floats[index]
        bad = (~torch.isfinite(tensor)).nonzero()[0].tolist()
        where = "".join(f"[{i}]" for i in bad)
        raise BadBatchError(f"{path}{where}", f"is {tensor[tuple(bad)].item()} (non-finite)", step)
    path, tensor = labels[index - len(floats)]
    bad_mask = ((tensor < 0) & (tensor != -100)) | (tensor >= (num_classes or 0))
    bad = bad_mask.nonzero()[0].tolist()
    where = "".join(f"[{i}]" for i in bad)
    raise BadBatchError(f"{path}{where}", f"is {int(tensor[tuple(bad)])}, outside [0, {num_classes})", step)


_FRAME = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<func>\S+)\n\s+(?P<code>.+)')
_INTERNAL = ("/torch/", "/lightning/", "/stabilitykit/nan.py", "/stabilitykit/guard.py", "/stabilitykit/lightning.py")


def _forward_source(messages: Sequence[str]) -> str | None:
    """The innermost user frame of the forward traceback that anomaly mode attaches to its warning."""
    for message in messages:
        if "Traceback of forward call" not in message:
            continue
        frames = [m for m in _FRAME.finditer(message) if not any(x in m["file"] for x in _INTERNAL)]
        if frames:
            last = frames[-1]
            return f"{last['file'].rsplit('/', 1)[-1]}:{last['line']} in {last['func']}: {last['code'].strip()}"
    return None


class _FirstNonFiniteOp(TorchFunctionMode):
    """Records the user source line of the first torch call that turns finite inputs non-finite."""

    def __init__(self) -> None:
        super().__init__()
        self.source: str | None = None

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if self.source is None:
            outs = list(_tensors(out))
            if outs and not all(bool(torch.isfinite(t).all()) for t in outs):
                ins = list(_tensors(list(args) + list((kwargs or {}).values())))
                if all(bool(torch.isfinite(t).all()) for t in ins):
                    self.source = _user_frame()
        return out


def _user_frame() -> str | None:
    for frame in reversed(traceback.extract_stack()[:-2]):
        if not any(x in frame.filename for x in _INTERNAL):
            return f"{frame.filename.rsplit('/', 1)[-1]}:{frame.lineno} in {frame.name}: {(frame.line or '').strip()}"
    return None


def replay_nonfinite(
    model: nn.Module,
    loss_fn: Callable[[], Tensor],
    params: Sequence[Tensor] | None = None,
    step: int | None = None,
) -> NonFiniteRecord | None:
    """Re-run one batch with hooks and ``torch.autograd.detect_anomaly`` to locate its first non-finite value.

    ``loss_fn`` recomputes the batch's loss (forward only). In forward, every torch call is
    checked (this replay only) for the first one that turns finite inputs non-finite; in
    backward, anomaly mode names the forward line of the first op whose gradient is NaN. Grads are taken with
    ``torch.autograd.grad``, so ``.grad`` of the parameters is not touched. Returns the record of
    the first module to go non-finite, with the forward source line when anomaly mode found one,
    or None when the replay stayed finite (the cause was not in this batch's computation).
    """
    params = [p for p in (params if params is not None else model.parameters()) if p.requires_grad]
    buffers = [b for b in model.buffers() if b is not None]
    saved = [b.detach().clone() for b in buffers]  # a training-mode forward moves running statistics
    try:
        return _replay(model, loss_fn, params, step)
    finally:
        if buffers:
            torch._foreach_copy_(buffers, saved)


def _replay(
    model: nn.Module, loss_fn: Callable[[], Tensor], params: Sequence[Tensor], step: int | None
) -> NonFiniteRecord | None:
    tracer = NaNTracer(model)
    tracer.step = step
    error: str | None = None
    finder = _FirstNonFiniteOp()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with tracer, torch.enable_grad(), torch.autograd.detect_anomaly(check_nan=True):
            try:
                with finder:  # forward: the first op that makes a non-finite value from finite inputs
                    loss = loss_fn()
                if loss.requires_grad:  # backward: anomaly mode names the forward line of the failing op
                    torch.autograd.grad(loss.float().sum(), params, allow_unused=True)
            except RuntimeError as exc:  # anomaly mode raises at the first backward op returning NaN
                error = str(exc)
        record = tracer.first
    source = finder.source or _forward_source([str(w.message) for w in caught])
    if record is None and error is None:
        return None
    if record is None:
        record = NonFiniteRecord("<autograd>", "backward", step, None)
    record.source = source or (error.split("\n", 1)[0] if error else None)
    return record


def batch_is_bad(
    batch: Any,
    num_classes: int | None = None,
    label_keys: Sequence[str | int] = ("labels", "label", "targets", "target", "y"),
) -> Tensor | None:
    """A 0-d device bool: the batch holds a non-finite float or an out-of-range label (no host sync).

    Walks the same containers as ``check_batch``. None when the batch holds no tensor to check.
    Empty tensors count as bad.
    """
    flags: list[Tensor] = []
    for leaf in walk_batch(batch, label_keys):
        value = leaf.value
        if not isinstance(value, Tensor):
            continue
        if value.numel() == 0:
            flags.append(torch.ones((), dtype=torch.bool, device=value.device))
        elif value.is_floating_point():
            flags.append(~torch.isfinite(value).all())
        elif leaf.is_label and num_classes is not None and value.dtype != torch.bool:
            flags.append((((value < 0) & (value != -100)) | (value >= num_classes)).any())
    if not flags:
        return None
    device = flags[0].device
    return torch.stack([f.to(device) for f in flags]).any()
