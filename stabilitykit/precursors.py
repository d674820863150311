"""What each early-warning signal means, what to do about it, and how far ahead of the loss it usually is.

The spike monitor (``spikes.py``) scores signals by name: the total grad norm and the loss, each
layer's grad norm, and precursors handed over by the engine (the model monitors'
``monitors/<signal>/<module>``, the update-to-weight ratio, metrics recorded with ``sk.record``).
This module turns a signal's name into the words of its event: the kind of signal, the module it
was measured on, an explanation a user can act on, and the signal's usual lead over the loss.

The leads are the medians measured by ``benchmarks/warning/score.py`` on the tuning families of the
early-warning corpus (``benchmarks/warning/corpus.py``, GPT-2 and BERT): steps from the event to the
step the loss moved; 0 means at the step it moved. The grad norm and the loss fired at the step the
loss moved (median 0). The attention-logit trend came before 1 of 13 tuning onsets (25 steps, GPT-2's
LR edge) and before none held out; the update ratio over the LR and the layers' grad-norm shares before
none: the precursors' leads stay None ("not established"), not a guess. The numbers are in the spike guide.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SignalKind:
    """One kind of signal: ``name`` (short, the event's ``details["source"]``), what it measures, the advice
    its event gives, and its usual lead in steps (None: not measured)."""

    name: str
    meaning: str
    advice: str
    lead: int | None


GRAD_NORM = SignalKind(
    "grad_norm",
    "the total grad norm jumped against its one-step-ahead prediction",
    "look at the batch of this step; if the loss follows, lower the LR or clip (ClipConfig)",
    0,
)
LAYER = SignalKind(
    "layer_grad_norm",
    "one layer's grad norm jumped against its own prediction",
    "that layer moves first: look at its inputs (attention logits, activations) and its LR",
    0,
)
ATTENTION = SignalKind(
    "attention_logits",
    "the largest attention logit of an attention module grew over its long-run level",
    "attention entropy collapse ahead: add qk-norm (sk.nn.QKNorm) or QK-clip (sk.nn.QKClip), or lower the LR",
    None,
)
OUTPUT_LOGITS = SignalKind(
    "output_logits",
    "the output logits (max |logit| or log Z) grew over their long-run level",
    "output-logit drift: add a z-loss (sk.nn.z_loss, 1e-4) or lower the output head's LR",
    None,
)
LAYER_SHARE = SignalKind(
    "layer_grad_share",
    "one layer's share of the total grad norm grew over its long-run level",
    "that layer's gradient grows apart from the rest: look at its inputs (attention logits, activations) "
    "and its LR (a parameter group of its own?)",
    None,
)
UPDATE = SignalKind(
    "update_ratio",
    "the update-to-weight ratio ||dw|| / ||w|| grew over its long-run level",
    "updates outgrow the weights: lower the LR; with Adam, a beta2 near 1 or a tiny eps lets updates "
    "balloon when gradients grow",
    None,
)
ACTIVATIONS = SignalKind(
    "activations",
    "activations (output max |x|, RMS or the residual-stream norm) grew over their long-run level",
    "activation growth: check the LR, the norms' placement, and the data of recent steps",
    None,
)
OTHER = SignalKind("metric", "a recorded metric grew over its long-run level", "see what the metric measures", None)
LOSS = SignalKind(
    "loss", "the loss moved", "a spike or divergence is under way: look at the last steps' data and LR", 0
)


def kind_of(signal: str) -> SignalKind:
    """The kind of a precursor signal, from its name (``monitors/attn_logit_max/model.layers.1.self_attn``,
    ``update_ratio``, ``stability/metrics/...``)."""
    if "attn_logit" in signal or "attention" in signal:
        return ATTENTION
    if "log_z" in signal or "logits_max" in signal:
        return OUTPUT_LOGITS
    if "update_ratio" in signal:
        return UPDATE
    if "grad_share" in signal:
        return LAYER_SHARE
    if any(key in signal for key in ("act_max", "act_rms", "resid_norm")):
        return ACTIVATIONS
    return OTHER


def module_of(signal: str) -> str | None:
    """The module a monitor signal was measured on (``monitors/<signal>/<module>``), else None."""
    parts = signal.split("/")
    if "monitors" in parts:
        i = parts.index("monitors")
        if len(parts) > i + 2:
            return "/".join(parts[i + 2 :])
    return None


def lead_text(kind: SignalKind) -> str:
    """A few words on the kind's usual lead over the loss."""
    if kind.lead is None:
        return "lead over the loss not measured"
    if kind.lead > 0:
        return f"usually {kind.lead} steps before the loss moves"
    if kind.lead == 0:
        return "usually at the step the loss moves"
    return f"usually {-kind.lead} steps after the loss moves"
