"""The compatibility layer: every patch of a framework object and every read of a private attribute.

torch, Lightning, Accelerate and tqdm change their internals between releases; what stabilitykit
must reach inside them is here and nowhere else, so a new release breaks one small module:

* ``attributes``: instance attributes replaced for a run and put back exactly (an optimizer's
  ``step``, an Accelerator's ``backward``, a Trainer's ``log``);
* ``schedulers``: an LR scheduler held on skipped steps by a class swap (its state untouched);
* ``functional``: wrappers over ``torch.nn.functional`` calls (the monitors' attention call);
* ``grad_scaler``: a GradScaler's stage, scale and growth tracker;
* ``deepspeed``: a skipped step's clean-up inside DeepSpeed's ZeRO optimizers, its step counters;
* ``torchao_float8``: torchao's float8 training (the ``fp8`` extra): converting a model, re-running
  a ``Float8Linear``'s casts for the FP8 monitors, a layer's fallback to high precision;
* ``fsdp1``: FSDP1's default gradient reduction as a communication hook that measures the local
  gradient first (rerun names the rank of a local-gradient fault);
* ``tensors``: the one mark set on a framework's tensor (a DeepSpeed grad partition's groups);
* ``private``: every other read of a private attribute (``torch.compile``'s wrapped module,
  FSDP1's flat-parameter handle, the fused optimizers' AMP flag, tqdm's live bars, a framework
  optimizer wrapper's inner optimizer).

``tests/test_compat_boundary.py`` checks that no other module reads a private attribute of an
object that is not its own, replaces an attribute with ``setattr`` or swaps a class.
"""
