"""W&B dashboards as code: ``sk.wandb_dashboard(entity, project)`` builds the stabilitykit workspace.

Needs the ``dashboards`` extra (``wandb-workspaces``). Building is offline; ``.save()`` on the
returned workspace publishes it and needs a W&B login.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

#: Section names, in order.
SECTIONS = ("overview", "per-layer grad norms", "precision", "logits and attention", "update ratio")
#: The section added with ``monitors=True``.
MONITORS_SECTION = "monitors"


def _imports() -> tuple[Any, Any]:
    try:
        import wandb_workspaces.reports.v2 as wr
        import wandb_workspaces.workspaces as ws
    except ImportError as exc:
        raise ImportError("sk.wandb_dashboard needs wandb-workspaces: pip install 'stabilitykit[dashboards]'") from exc
    return ws, wr


def wandb_dashboard(
    entity: str,
    project: str,
    name: str = "stabilitykit",
    layers: Sequence[str] | None = None,
    prefix: str = "stability",
    step_metric: str = "trainer/global_step",
    monitors: bool = False,
) -> Any:
    """A ``wandb_workspaces.workspaces.Workspace`` with the stabilitykit sections (``SECTIONS``).

    ``layers``: per-layer names to chart one by one (``["blocks.0", ...]``), their grad norm and
    their update ratio; the per-layer sections always have one chart of every layer by regex. The
    update-ratio section charts what ``GradNormConfig(update_ratio=True)`` logs (closed by default).
    """
    ws, wr = _imports()

    def key(metric: str) -> str:
        return f"{prefix}/{metric}" if prefix else metric

    def line(title: str, metrics: list[str], log_y: bool = False, **kwargs: Any) -> Any:
        return wr.LinePlot(title=title, x=step_metric, y=[key(m) for m in metrics], log_y=log_y or None, **kwargs)

    overview = ws.Section(
        name=SECTIONS[0],
        is_open=True,
        panels=[
            line("loss", ["loss"], smoothing_factor=0.0),
            line(
                "total grad norm, with spike warnings",
                ["grad_norm/total", "grad_norm/max", "clip/threshold", "events/spike_warning"],
                log_y=True,
                line_marks={key("events/spike_warning"): "points", key("clip/threshold"): "dashed"},
            ),
            line("grad-norm z-score", ["spikes/z_grad_norm", "spikes/max_z_grad_norm", "spikes/z_loss"]),
            line("skipped steps", ["skipped/total", "skipped/recent", "events/skipped", "events/nonfinite"]),
            line("spike score (share of steps beyond 6 std over 128)", ["spikes/score"]),
        ],
    )
    per_layer_panels = [
        wr.LinePlot(
            title="grad norm of every layer",
            x=step_metric,
            metric_regex=f"^{prefix}/grad_norm/(?!total$|max$).*",
            log_y=True,
        )
    ]
    per_layer_panels += [line(f"grad norm: {layer}", [f"grad_norm/{layer}"], log_y=True) for layer in layers or []]
    per_layer = ws.Section(name=SECTIONS[1], is_open=True, panels=per_layer_panels)
    precision = ws.Section(
        name=SECTIONS[2],
        panels=[
            line("loss scale (GradScaler)", ["scaler/scale"], log_y=True),
            line("fp16 overflow rate", ["scaler/overflow_rate", "events/fp16_overflow"]),
            line("clip coefficient", ["clip/coef"]),
            line("clipped steps", ["clip/clipped_total", "clip/clipped_recent"]),
        ],
    )
    logits = ws.Section(
        name=SECTIONS[3],
        panels=[
            line("log Z (z-loss)", ["logits/log_z_mean", "logits/log_z_max"]),
            line("max attention logit", ["attention/max_logit"]),
        ],
    )
    update_panels = [
        line("update / weight ratio (total), rule of thumb ~1e-3", ["update_ratio"], log_y=True),
        wr.LinePlot(
            title="update / weight ratio of every layer",
            x=step_metric,
            metric_regex=f"^{prefix}/update_ratio/.*",
            log_y=True,
        ),
        wr.LinePlot(title="weight norm of every layer", x=step_metric, metric_regex=f"^{prefix}/weight_norm/.*"),
        line("weight norm (total)", ["weight_norm"]),
    ]
    update_panels += [line(f"update ratio: {layer}", [f"update_ratio/{layer}"], log_y=True) for layer in layers or []]
    updates = ws.Section(name=SECTIONS[4], panels=update_panels)
    monitor_charts = [
        ("max attention logit per attention module", "attn_logit_max", True),
        ("output logits: max |logit|", "logits_max", True),
        ("output logits: mean log Z", "log_z", False),
        ("residual-stream norm per block", "resid_norm", True),
        ("activation RMS per module", "act_rms", True),
        ("activation max |x| per module", "act_max", True),
    ]
    monitor_panels = [
        wr.LinePlot(title=title, x=step_metric, metric_regex=f"^{prefix}/monitors/{signal}/.*", log_y=log_y or None)
        for title, signal, log_y in monitor_charts
    ]
    monitor_panels.append(
        line("spike warnings (precursor trends included)", ["events/spike_warning", "spikes/max_trend"])
    )
    sections = [overview, per_layer, precision, logits, updates]
    if monitors:
        sections.append(ws.Section(name=MONITORS_SECTION, is_open=True, panels=monitor_panels))
    return ws.Workspace(entity=entity, project=project, name=name, sections=sections)
