"""The compatibility layer: every patch of a framework object and every read of a private attribute.

torch, Lightning, Accelerate and tqdm change their internals between releases; what stabilitykit
must reach inside them is here and nowhere else, so a new release breaks one small module:

* ``attributes``: instance attributes replaced for a run and put back exactly (an optimizer's
  ``step``, an Accelerator's ``backward``, a Trainer's ``log``);
* ``schedulers``: an LR scheduler held on skipped steps by a class swap (its state untouched);
* ``functional``: wrappers over ``torch.nn.functional`` calls (the monitors' attention call);
* ``grad_scaler``: a GradScaler's stage, scale and growth tracker;
* ``private``: every other read of a private attribute (``torch.compile``'s wrapped module,
  FSDP1's flat-parameter handle, the fused optimizers' AMP flag, tqdm's live bars, a framework
  optimizer wrapper's inner optimizer).

``tests/test_compat_boundary.py`` checks that no other module reads a private attribute of an
object that is not its own, replaces an attribute with ``setattr`` or swaps a class.
"""
