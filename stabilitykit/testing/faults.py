"""Faults injected on purpose, so a user can test a configuration the way stabilitykit tests itself.

    from stabilitykit.testing import inject_fault

    fault = inject_fault(model, "activation", "blocks.1.fc", step=40, rank=1)   # once: a transient fault
    fault = inject_fault(model, "grad", "head.weight", step=40, rank=1, repeat=True)  # every time: reproducible
    ...
    fault.remove()

Where a fault lands (``target``):

* ``"activation"``: the output of the named module's forward (a forward hook);
* ``"grad"``: the named parameter's gradient as backward computes it on this rank, before it is
  accumulated and before any data-parallel reduction (DDP's all-reduce, FSDP2's reduce-scatter): the
  local gradient, as a faulty device would compute it (a hook on the parameter the owning module's
  forward computes with: under FSDP2 the unsharded one);
* ``"param"``: the named parameter itself, before the forward of that step (a corrupted weight stays
  corrupted: it fires once);
* ``"loss"``: a loss handed to the fault, ``loss = fault(loss)`` (the loss is computed by your code).

What it does (``kind``): ``"bitflip"`` flips bit ``bit`` of element ``index`` (default: the exponent's
highest bit, so a value below 2 in magnitude becomes enormous or infinite), ``"nan"`` writes a NaN,
``"value"`` writes ``value``. ``repeat=False`` fires the first time step ``step`` is computed only
(a transient fault: gone when the step is computed again); ``repeat=True`` every time step ``step`` is
computed (a reproducible one). ``rank``: the only rank it fires on (None: every rank).

The step is the running driver's (``stabilitykit.drivers.base.active_drivers``), or what ``step_of``
returns: a fault knows no more of your loop than that.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import Tensor, nn

Target = Literal["activation", "grad", "param", "loss"]
Kind = Literal["bitflip", "nan", "value"]

_INT_VIEW = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def flip_bit(tensor: Tensor, index: int = 0, bit: int | None = None) -> None:
    """Flip bit ``bit`` of the flat element ``index`` of ``tensor`` in place (default: the exponent's
    highest bit: 30 for float32, 14 for float16 and bfloat16, 62 for float64)."""
    if not tensor.is_floating_point():
        raise TypeError(f"flip_bit needs a floating-point tensor, got {tensor.dtype}")
    size = tensor.element_size()
    top = size * 8 - 2  # the sign is the highest bit; the exponent's highest bit is the next
    bit = top if bit is None else bit
    if not 0 <= bit < size * 8:
        raise ValueError(f"bit {bit} is outside a {tensor.dtype} element ({size * 8} bits)")
    if not 0 <= index < tensor.numel():
        raise IndexError(f"element {index} is outside a tensor of {tensor.numel()} elements")
    with torch.no_grad():
        element = tensor.detach().reshape(-1)[index : index + 1]
        ints = element.view(_INT_VIEW[size])
        mask = torch.tensor(1, dtype=ints.dtype).bitwise_left_shift(bit) if bit < size * 8 - 1 else None
        if mask is None:  # the sign bit of a signed integer view: negate the pattern's top bit
            ints.copy_(ints ^ torch.tensor(torch.iinfo(ints.dtype).min, dtype=ints.dtype))
        else:
            ints.copy_(ints ^ mask.to(ints.device))


def _current_step() -> int:
    from stabilitykit.drivers.base import active_drivers

    drivers = active_drivers()
    if not drivers or not drivers[-1].engines:
        raise RuntimeError(
            "stabilitykit.testing: a fault fires at a step, and no stabilitykit driver is running to say which "
            "step this is: build the guard (or callback) first, or pass step_of=lambda: my_step"
        )
    return int(drivers[-1].engines[0].step)


def _this_rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


class Fault:
    """One injected fault (see the module docstring); ``remove()`` takes it out, ``fired`` counts its hits."""

    def __init__(
        self,
        target: Target,
        name: str | None,
        step: int,
        rank: int | None,
        repeat: bool,
        kind: Kind,
        index: int,
        bit: int | None,
        value: float | None,
        step_of: Callable[[], int] | None,
    ) -> None:
        self.target = target
        self.name = name
        self.step = step
        self.rank = rank
        self.repeat = repeat
        self.kind = kind
        self.index = index
        self.bit = bit
        self.value = value
        self._step_of = step_of or _current_step
        #: How many times the fault fired so far.
        self.fired = 0
        self._handles: list[Any] = []

    def due(self) -> bool:
        """The fault fires now: on its rank, at its step, the first time (or every time with ``repeat``)."""
        if self.rank is not None and _this_rank() != self.rank:
            return False
        if self._step_of() != self.step:
            return False
        return self.repeat or self.fired == 0

    def corrupt(self, tensor: Tensor) -> None:
        """Apply the fault to ``tensor`` in place (counted as one firing)."""
        self.fired += 1
        if self.kind == "bitflip":
            flip_bit(tensor, self.index, self.bit)
            return
        value = math.nan if self.kind == "nan" else float(self.value if self.value is not None else math.nan)
        with torch.no_grad():
            tensor.detach().reshape(-1)[self.index] = value

    def __call__(self, tensor: Tensor) -> Tensor:
        """``tensor`` with the fault applied when it is due (a new tensor; autograd goes through), else itself."""
        if not self.due():
            return tensor
        corrupted = tensor.detach().clone()
        self.corrupt(corrupted)
        mask = torch.zeros_like(tensor, dtype=torch.bool).reshape(-1)
        mask[self.index] = True
        return torch.where(mask.reshape(tensor.shape), corrupted, tensor)

    def hold(self, handle: Any) -> None:
        """Keep a hook's handle: ``remove()`` removes it."""
        self._handles.append(handle)

    def remove(self) -> None:
        """Take the fault out (its hooks removed); idempotent."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def __enter__(self) -> Fault:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


def _module(model: nn.Module, name: str) -> nn.Module:
    modules = dict(model.named_modules())
    if name in modules:
        return modules[name]
    clean = {_clean(n): m for n, m in modules.items()}
    if name in clean:
        return clean[name]
    raise KeyError(f"no module named {name!r} in {type(model).__name__} (modules: {sorted(clean)[:8]}...)")


def _parameter(model: nn.Module, name: str) -> nn.Parameter:
    params = dict(model.named_parameters())
    if name in params:
        return params[name]
    clean = {_clean(n): p for n, p in params.items()}
    if name in clean:
        return clean[name]
    raise KeyError(f"no parameter named {name!r} in {type(model).__name__} (parameters: {sorted(clean)[:8]}...)")


def _owner(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    """The module that holds parameter ``name`` (by its name with or without a wrapper's prefix), and the
    attribute it is held under."""
    path, _, attribute = name.rpartition(".")
    return (_module(model, path) if path else model), attribute


def _clean(name: str) -> str:
    """A module or parameter name without the wrappers' prefixes (DDP's ``module.``, torch.compile's ...)."""
    wrappers = {"module", "_orig_mod", "_forward_module", "_fsdp_wrapped_module", "_checkpoint_wrapped_module"}
    return ".".join(part for part in name.split(".") if part not in wrappers)


def _first_tensor(output: Any) -> Tensor | None:
    if isinstance(output, Tensor):
        return output
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], Tensor):
        return output[0]
    return None


def inject_fault(
    model: nn.Module | None,
    target: Target,
    name: str | None = None,
    *,
    step: int,
    rank: int | None = None,
    repeat: bool = False,
    kind: Kind = "bitflip",
    index: int = 0,
    bit: int | None = None,
    value: float | None = None,
    step_of: Callable[[], int] | None = None,
) -> Fault:
    """Inject a fault into ``model`` (see the module docstring); returns it, already armed.

    ``name``: the module (``"activation"``) or parameter (``"grad"``, ``"param"``) it hits, by the name
    ``named_modules()``/``named_parameters()`` give it, with or without a wrapper's prefix; not used
    for ``"loss"``.
    """
    if target not in ("activation", "grad", "param", "loss"):
        raise ValueError(f"target must be 'activation', 'grad', 'param' or 'loss', got {target!r}")
    if kind not in ("bitflip", "nan", "value"):
        raise ValueError(f"kind must be 'bitflip', 'nan' or 'value', got {kind!r}")
    if kind == "value" and value is None:
        raise ValueError("kind='value' needs value=...")
    fault = Fault(target, name, step, rank, repeat or False, kind, index, bit, value, step_of)
    if target == "loss":
        return fault
    if model is None or name is None:
        raise ValueError(f"a fault in an {target} needs the model and the name of what it hits")
    if target == "activation":
        module = _module(model, name)

        def on_output(_module: nn.Module, _args: Any, output: Any) -> Any:
            tensor = _first_tensor(output)
            if tensor is None or not tensor.is_floating_point():
                return None
            new = fault(tensor)  # a corrupted copy; autograd goes through
            if isinstance(output, Tensor):
                return new
            return type(output)([new, *output[1:]])

        fault.hold(module.register_forward_hook(on_output))
    elif target == "grad":
        param = _parameter(model, name)  # a clear error for a name that is not there
        owner, attribute = _owner(model, name)
        hooked: list[Tensor] = []  # the parameter objects whose grads are hooked

        def on_local_grad(grad: Tensor) -> Tensor | None:
            if not fault.due():
                return None
            corrupted = grad.detach().clone()
            fault.corrupt(corrupted)
            return corrupted

        def before_owner(_module: nn.Module, _args: Any) -> None:
            # The parameter the forward computes with: under FSDP2 the unsharded one (the sharded parameter's
            # grad is set after the reduce-scatter); a hook on its gradient before accumulation sees this rank's
            # local gradient before any reduction, and runs before anything that measures it once accumulated.
            current = getattr(_module, attribute, None)
            if not isinstance(current, Tensor) or hasattr(current, "to_local") or any(current is p for p in hooked):
                return
            hooked.append(current)
            fault.hold(current.register_hook(on_local_grad))

        if not hasattr(param, "to_local"):  # an ordinary parameter: hooked now, used through its module or not
            hooked.append(param)
            fault.hold(param.register_hook(on_local_grad))
        fault.hold(owner.register_forward_pre_hook(before_owner))
    else:  # param: before the forward of its step
        param = _parameter(model, name)

        def before_forward(_module: nn.Module, _args: Any) -> None:
            if fault.fired == 0 and fault.due():
                local = param.to_local() if hasattr(param, "to_local") else param
                fault.corrupt(local.data)

        fault.hold(model.register_forward_pre_hook(before_forward))
    return fault
