"""Real training instabilities on the CPU: a small byte-level GPT on the Python standard library.

    python benchmarks/instability/train.py [--steps 400] [--lrs 0.01,0.1,0.3,1] [--arms all]
                                           [--seed 0] [--append] [--out benchmarks/instability/traces.npz]

The stored traces hold seed 0 (22 runs, the tuning set of the spike detectors) and seeds 1-2
(28 runs, ``--seed 1 --append``, keyed ``arm@lr#s1``: the held-out set, generated afterwards).

Small transformers go unstable at high learning rates the way large ones do (Wortsman et al.
2023): attention logits grow without qk-norm, output logits drift without z-loss. Each run
trains the same model (4 pre-norm blocks, width 96, 4 heads, context 64: ~0.5M parameters) on
bytes of the standard library's ``.py`` sources (on every machine, no download) with AdamW
(betas 0.9/0.99, weight decay 0.1), 100 warmup steps, cosine decay to 10%. Arms:

``baseline`` (nothing), ``qknorm`` (sk.nn.QKNorm), ``zloss`` (sk.nn.z_loss 1e-4), ``both``,
``clip`` (fixed clip 1.0), ``zclip`` (the zclip package), ``adaptive`` (sk.StabilityGuard with
adaptive clipping), ``skip`` (stabilitykit.spike_skip.SpikeSkipRule, skip-on-spike), ``qkclip``
(sk.nn.QKClip, tau 100, query_share 0.5, after each optimizer step), ``softcap`` (sk.nn.softcap: attention
logits 50, final logits 30) and ``agc`` (sk.StabilityGuard with per-tensor adaptive clipping).

Every arm skips a step whose grad norm or loss is not finite (so a run is never killed by one
NaN and its later steps stay readable). Recorded per step: loss, total grad norm (before any
clipping), per-layer grad norms, max attention logit, mean log Z of the output logits, the
update's relative size ||dθ||/||θ||, and whether the step was skipped. Final loss: mean loss
on 16 held-out batches. The traces go to one compressed ``.npz`` (float32).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import sysconfig
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

ARMS = ("baseline", "qknorm", "zloss", "both", "clip", "zclip", "adaptive", "skip", "qkclip", "softcap", "agc")
#: QK-clip threshold (Kimi K2 / Megatron default), soft caps (Gemma 2 defaults): published values, not tuned here.
QK_CLIP_TAU, ATTN_CAP, FINAL_CAP = 100.0, 50.0, 30.0
LAYERS = ("embed", "blocks.0", "blocks.1", "blocks.2", "blocks.3", "head")
CONTEXT, BATCH, WIDTH, HEADS, DEPTH = 64, 16, 96, 4, 4


# ----------------------------------------------------------------------------- data
def corpus(max_bytes: int = 6_000_000) -> np.ndarray:
    """Bytes of the standard library's .py files, in sorted path order (the same on every machine)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, size = [], 0
    for path in sorted(root.rglob("*.py")):
        if "site-packages" in path.parts or "test" in path.parts:
            continue
        try:
            data = path.read_bytes()
        except OSError:
            continue
        chunks.append(data)
        size += len(data)
        if size >= max_bytes:
            break
    return np.frombuffer(b"".join(chunks), dtype=np.uint8)


def batch(data: np.ndarray, gen: torch.Generator) -> tuple[Tensor, Tensor]:
    """BATCH random windows of CONTEXT + 1 bytes: (inputs, targets)."""
    starts = torch.randint(0, len(data) - CONTEXT - 1, (BATCH,), generator=gen).numpy()
    rows = np.stack([data[s : s + CONTEXT + 1] for s in starts]).astype(np.int64)
    seq = torch.from_numpy(rows)
    return seq[:, :-1], seq[:, 1:]


# ----------------------------------------------------------------------------- model
class Attention(nn.Module):
    """Causal attention written out, so the max attention logit is at hand every step.

    It implements ``sk.nn.QKClipTarget`` (three members), so the ``qkclip`` arm can rescale it.
    """

    qk_clip_tracking = False

    def __init__(self, qk_norm: bool, cap: float | None = None) -> None:
        super().__init__()
        self.qkv = nn.Linear(WIDTH, 3 * WIDTH)
        self.proj = nn.Linear(WIDTH, WIDTH)
        self.head_dim = WIDTH // HEADS
        if qk_norm:
            from stabilitykit.nn import QKNorm

            self.qk_norm: nn.Module | None = QKNorm(self.head_dim, HEADS, per_head=True, kind="layer")
        else:
            self.qk_norm = None
        self.register_buffer("mask", torch.ones(CONTEXT, CONTEXT, dtype=torch.bool).tril(), persistent=False)
        self.max_logit = torch.zeros(())
        self.head_max: Tensor | None = None
        self.cap = cap

    def qk_clip_layout(self) -> Any:
        from stabilitykit.nn import QKLayout

        return QKLayout.fused(self.qkv, HEADS, self.head_dim)

    def qk_clip_max_logits(self) -> Tensor | None:
        return self.head_max

    def forward(self, x: Tensor) -> Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, HEADS, self.head_dim).transpose(1, 2) for z in (q, k, v))
        if self.qk_norm is not None:
            q, k = self.qk_norm(q, k)
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(self.head_dim)
        scores = scores.masked_fill(~self.mask[:t, :t], -math.inf)
        self.max_logit = scores.detach().amax()  # before any soft cap
        if self.qk_clip_tracking:
            self.head_max = scores.detach().amax(dim=(0, 2, 3))
        if self.cap is not None:
            from stabilitykit.nn import softcap

            scores = softcap(scores, self.cap)
        y = scores.softmax(-1) @ v
        return self.proj(y.transpose(1, 2).reshape(b, t, c))  # type: ignore[no-any-return]


class Block(nn.Module):
    def __init__(self, qk_norm: bool, cap: float | None = None) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.attn = Attention(qk_norm, cap)
        self.mlp = nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH))

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))  # type: ignore[no-any-return]


class ByteGPT(nn.Module):
    def __init__(self, qk_norm: bool, attn_cap: float | None = None, final_cap: float | None = None) -> None:
        super().__init__()
        self.tok = nn.Embedding(256, WIDTH)
        self.pos = nn.Embedding(CONTEXT, WIDTH)
        self.blocks = nn.ModuleList([Block(qk_norm, attn_cap) for _ in range(DEPTH)])
        self.ln_f = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, 256, bias=False)
        self.final_cap = final_cap

    def forward(self, idx: Tensor) -> Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        if self.final_cap is not None:
            from stabilitykit.nn import softcap

            logits = softcap(logits, self.final_cap)
        return logits  # type: ignore[no-any-return]

    def layer_of(self, name: str) -> int:
        if name.startswith(("tok.", "pos.")):
            return 0
        if name.startswith("blocks."):
            return 1 + int(name.split(".")[1])
        return len(LAYERS) - 1


# ----------------------------------------------------------------------------- one run
def lr_at(step: int, steps: int, peak: float, warmup: int = 100) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def run(arm: str, lr: float, steps: int, data: np.ndarray, heldout: np.ndarray, seed: int = 0) -> dict[str, Any]:
    """Train one arm at one peak LR; the per-step trace and the final held-out loss."""
    torch.manual_seed(seed)
    capped = arm == "softcap"
    model = ByteGPT(arm in ("qknorm", "both"), ATTN_CAP if capped else None, FINAL_CAP if capped else None)
    z_coef = 1e-4 if arm in ("zloss", "both") else 0.0
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.99), weight_decay=0.1)
    names, params = zip(*model.named_parameters(), strict=True)
    params = list(params)
    layer_index = torch.tensor([model.layer_of(n) for n in names])
    gen = torch.Generator().manual_seed(1000 + seed)
    guard = zclip = rule = qk_clip = None
    if arm in ("adaptive", "agc"):
        import stabilitykit as sk

        mode = "adaptive" if arm == "adaptive" else "per_tensor_adaptive"
        cfg = sk.StabilityConfig(
            log_every_n_steps=50, clip=sk.ClipConfig(mode=mode), spikes=sk.SpikeConfig(enabled=False)
        )
        guard = sk.StabilityGuard(model, opt, config=cfg)
    elif arm == "qkclip":
        from stabilitykit.nn import QKClip

        qk_clip = QKClip(model, threshold=QK_CLIP_TAU, query_share=0.5)
    elif arm == "zclip":
        from zclip import ZClip

        zclip = ZClip(mode="zscore", alpha=0.97, z_thresh=2.5, max_grad_norm=1.0)
    elif arm == "skip":
        from stabilitykit.spike_skip import SpikeSkipRule

        rule = SpikeSkipRule()
    cols = ["loss", "grad_norm", "max_attn_logit", "log_z", "update", "skipped"]
    trace = np.full((steps, len(cols) + len(LAYERS)), np.nan, dtype=np.float32)
    from stabilitykit.nn import log_z as log_z_of

    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, steps, lr)
        x, y = batch(data, gen)
        logits = model(x)
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
        lz = log_z_of(logits.detach()).mean()
        total_loss = loss + z_coef * log_z_of(logits).pow(2).mean() if z_coef else loss
        opt.zero_grad(set_to_none=False)
        if guard is not None:
            guard.backward(total_loss)
        else:
            total_loss.backward()
        grads = [p.grad for p in params]
        per_tensor = torch.stack(torch._foreach_norm(grads)).float()
        layer_sq = torch.zeros(len(LAYERS)).index_add_(0, layer_index, per_tensor.square())
        total = layer_sq.sum().sqrt()
        finite = bool(torch.isfinite(total) & torch.isfinite(loss))
        max_logit = torch.stack([b.attn.max_logit for b in model.blocks]).amax()  # type: ignore[union-attr]
        before = [p.detach().clone() for p in params]
        skipped = not finite
        if guard is not None:
            report = guard.step()
            skipped = bool(report.skipped)
        elif not skipped:
            if arm == "clip":
                torch.nn.utils.clip_grad_norm_(params, 1.0)
            elif zclip is not None:
                zclip.step(model)
            elif rule is not None:
                skipped = bool(rule.decide(total, loss.detach(), torch.isfinite(total) & torch.isfinite(loss)))
            if not skipped:
                opt.step()
                if qk_clip is not None:
                    qk_clip.apply()
        diff = torch._foreach_sub([p.detach() for p in params], before)
        update = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(diff))) / torch.linalg.vector_norm(
            torch.stack(torch._foreach_norm(before))
        )
        row = torch.stack([loss.detach(), total, max_logit, lz, update, torch.tensor(float(skipped))])
        trace[step, : len(cols)] = row.numpy()
        trace[step, len(cols) :] = layer_sq.sqrt().numpy()
    model.eval()
    eval_gen = torch.Generator().manual_seed(99)
    with torch.no_grad():
        losses = [
            F.cross_entropy(model(xe).flatten(0, 1), ye.flatten())
            for xe, ye in (batch(heldout, eval_gen) for _ in range(16))
        ]
    final = float(torch.stack(losses).mean())
    return {"trace": trace, "columns": cols + [f"layer/{n}" for n in LAYERS], "final_loss": final}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--lrs", default="0.01,0.1,0.3,1")
    parser.add_argument("--arms", default="all")
    parser.add_argument("--seed", type=int, default=0, help="init and data order; seed s > 0 keys runs arm@lr#s<s>")
    parser.add_argument("--out", default=str(Path(__file__).with_name("traces.npz")))
    parser.add_argument("--append", action="store_true", help="keep the runs already in --out")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    data = corpus()
    cut = int(len(data) * 0.95)
    train, heldout = data[:cut], data[cut:]
    arms = ARMS if args.arms == "all" else tuple(args.arms.split(","))
    lrs = [float(v) for v in args.lrs.split(",")]
    out: dict[str, Any] = {}
    meta: dict[str, Any] = {"steps": args.steps, "seed": args.seed, "corpus_bytes": len(data), "runs": {}}
    if args.append and Path(args.out).exists():
        with np.load(args.out) as old:
            meta = json.loads(str(old["meta"]))
            out = {key: old[key] for key in meta["runs"]}
    for lr in lrs:
        for arm in arms:
            start = time.perf_counter()
            result = run(arm, lr, args.steps, train, heldout, args.seed)
            key = f"{arm}@{lr:g}" + (f"#s{args.seed}" if args.seed else "")
            out[key] = result["trace"]
            meta["runs"][key] = {"arm": arm, "lr": lr, "final_loss": result["final_loss"], "seed": args.seed}
            meta["columns"] = result["columns"]
            print(f"{key:>20}  final loss {result['final_loss']:.4f}  ({time.perf_counter() - start:.0f}s)", flush=True)
            np.savez_compressed(args.out, meta=np.array(json.dumps(meta)), **out)  # after every run: resumable reading
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
