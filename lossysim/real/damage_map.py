"""Where packet loss hurts a pretrained model: a layer x site map of eval damage, forward only.

    python -m lossysim.real.damage_map [--out results/damage_map] [--sequences 1] [--tokens 128]
                                       [--layers all | 0-5,12]

For the pretrained ``smollm2-135m`` (the ``real`` extra; weights dequantised from Q4_1) and the
random-weight ``smollm2-135m-shape``, both tensor-parallel at tp 3 on ``sim``: the forward
all-reduce of ONE call site (one layer's attention output or MLP output) loses packets at a time,
under Bernoulli loss at each rate, with each recovery of ``--recoveries`` (by default ``zero`` and
``hadamard``; the real profile adds ``outliers`` and ``outliers+hadamard``); every other site is
delivered intact (``lossy_layers``, ``lossy_sites``). The text is the held-out topics of Python's
documentation (``dataset: pydoc``): ``--sequences`` windows of ``--tokens`` tokens, evenly spaced.

Sizes: a cell replays the loss-free layers before its lossy one and applies the vocabulary head to
rank 0 alone, so it costs about a third of a whole forward pass (0.2 s for the last layer to 3 s for
the first, one 128-token sequence, on a busy 2-core CPU); the defaults (one sequence, every layer:
30 layers x 2 sites x 3 rates x 2 recoveries x 2 models, 720 cells) took 23 minutes on a shared
2-core machine. ``--layers`` and ``--rates`` narrow it.

Per cell: the eval perplexity (rank 0's logits, as the runner evaluates) and the KL divergence per
token of the lossy next-token distribution from the loss-free one. Writes ``damage_map.csv`` (one
row per model, rate, recovery, layer and site, plus each model's loss-free row) and
``damage_map.png`` (KL per token, layer x site, one panel per rate and recovery, a row per model),
and ``outliers.csv``: per layer, how far the largest magnitude of the residual stream and of each
site's sum stands above the median magnitude (loss-free).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from ..io import atomic_write_text, check_writable
from ..net.selection import parse_layers

MODELS = ("smollm2-135m", "smollm2-135m-shape")
SITES = ("attn", "mlp")
DEFAULT_LAYERS = "all"
TP = 3


def eval_windows(tokenizer, sequences: int, tokens: int) -> torch.Tensor:
    """[sequences, tokens] ids: windows evenly spaced over the held-out documentation text."""
    from ..data import pydoc_text
    ids = tokenizer("\n".join(pydoc_text.texts("eval")))["input_ids"]
    stride = (len(ids) - tokens) // max(sequences - 1, 1)
    return torch.tensor([ids[i * stride:i * stride + tokens] for i in range(sequences)])


def _load(name: str, vocab: int, pad: int) -> torch.nn.Module:
    from ..models import build_model
    model = build_model(name, vocab_size=vocab, pad_token_id=pad, num_labels=3, max_length=1024,
                        seed=0, task="lm")
    return model.eval()


@torch.no_grad()
def residual_outliers(model: torch.nn.Module, ids: torch.Tensor) -> list[dict]:
    """Per layer, the residual stream's largest magnitude over its median magnitude, and the
    attention and MLP outputs' (the two sites' all-reduced sums), loss-free on the unsharded model:
    how outlier-heavy what each site sends is."""
    seen, hooks = {}, []

    def keep(name):
        def hook(module, args, output):
            seen[name] = (output[0] if isinstance(output, tuple) else output).abs().float()
        return hook
    for i, layer in enumerate(model.model.layers):
        hooks += [layer.register_forward_hook(keep((i, "residual"))),
                  layer.self_attn.o_proj.register_forward_hook(keep((i, "attn"))),
                  layer.mlp.down_proj.register_forward_hook(keep((i, "mlp")))]
    try:
        model(input_ids=ids, attention_mask=torch.ones_like(ids))
    finally:
        for hook in hooks:
            hook.remove()
    return [{"layer": i, "tensor": what, "max_over_median": float(x.max() / x.median().clamp_min(1e-30))}
            for (i, what), x in seen.items()]


class _Known(torch.nn.Module):
    """Stands for a decoder layer whose (loss-free) output is already known."""

    def __init__(self, output: torch.Tensor):
        super().__init__()
        self.output = output

    def forward(self, hidden_states, *args, **kwargs):
        return self.output


class _Model:
    """The TP model run for one cell at a time, paying only for what loss can change: the layers
    before the lossy one replay their loss-free outputs, and the (replicated, tied) vocabulary head
    is applied to rank 0's final hidden state alone, not once per simulated rank."""

    def __init__(self, tpm, ids: torch.Tensor):
        self.tpm, self.ids = tpm, ids
        self.head = tpm.model.lm_head
        self.layers = tpm.model.model.layers
        self.known: list = []
        hooks = [layer.register_forward_hook(lambda m, a, out: self.known.append(out)) for layer in self.layers]
        try:
            self.clean = self.logits(None)
        finally:
            for hook in hooks:
                hook.remove()

    @torch.no_grad()
    def logits(self, network, start: int = 0) -> torch.Tensor:
        """Rank 0's logits [B, S, vocab] with ``network`` (None: loss-free), layers before ``start``
        replayed."""
        from ..net import LossyNetwork
        from ..util import swapped
        originals = list(self.layers)
        try:
            for i in range(start):
                self.layers[i] = _Known(self.known[i])
            with swapped(self.tpm.model, "lm_head", torch.nn.Identity()), \
                    swapped(self.tpm.group, "network", network or LossyNetwork(self.tpm.network.ranks)):
                self.tpm(input_ids=self.ids, attention_mask=torch.ones_like(self.ids))
        finally:
            for i in range(start):
                self.layers[i] = originals[i]
        # The head's class forward: parallelize makes the module itself run once per simulated rank
        # (run_per_rank), which would repeat rank 0's rows for every rank.
        return type(self.head).forward(self.head, self.tpm.rank_logits[0]).float()


def _scores(logits: torch.Tensor, clean: torch.Tensor, ids: torch.Tensor) -> dict:
    nll = F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    log_p, log_q = F.log_softmax(clean, -1), F.log_softmax(logits, -1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1).mean()
    return {"perplexity": float(nll.exp()), "kl_per_token": float(kl)}


def run(args) -> tuple:
    """(the damage rows, the outlier rows) as DataFrames."""
    import pandas as pd
    from ..data.tokenizers import load_pretrained_tokenizer
    from ..net import LossyNetwork
    from ..tp import parallelize
    torch.set_num_threads(args.threads)
    tokenizer = load_pretrained_tokenizer(MODELS[0])
    ids = eval_windows(tokenizer, args.sequences, args.tokens)
    rows, outliers = [], []
    for name in args.models:
        model = _load(name, len(tokenizer), tokenizer.pad_token_id)
        outliers += [{"model": name, **row} for row in residual_outliers(model, ids)]
        tpm = parallelize(model, TP)
        chosen = parse_layers(args.layers)
        layers = range(tpm.config.num_hidden_layers) if chosen is None else sorted(chosen)
        runner = _Model(tpm, ids)
        clean = runner.clean
        base = _scores(clean, clean, ids)
        rows.append({"model": name, "rate": 0.0, "recovery": "none", "layer": -1, "site": "none", **base})
        print(f"{name}: loss-free perplexity {base['perplexity']:.2f}", file=sys.stderr, flush=True)
        for rate in args.rates:
            for recovery in args.recoveries:
                t0 = time.perf_counter()
                for layer in layers:
                    for site in SITES:
                        network = LossyNetwork(TP, f"bernoulli:{rate}", seed=args.seed, recovery=recovery,
                                               lossy="fwd", lossy_layers=str(layer), lossy_sites=site)
                        rows.append({"model": name, "rate": rate, "recovery": recovery, "layer": layer,
                                     "site": site, **_scores(runner.logits(network, layer), clean, ids)})
                print(f"{name}: rate {rate} {recovery}: {time.perf_counter() - t0:.0f} s", file=sys.stderr,
                      flush=True)
                # what is done so far is kept should the map be stopped (each write whole or not at all)
                atomic_write_text(Path(args.out) / "damage_map.csv", pd.DataFrame(rows).to_csv(index=False))
    return pd.DataFrame(rows), pd.DataFrame(outliers)


def plot(frame, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import LogNorm
    lossy = frame[frame["layer"] >= 0]
    models, panels = list(dict.fromkeys(lossy["model"])), list(dict.fromkeys(zip(lossy["rate"], lossy["recovery"])))
    floor = max(float(lossy["kl_per_token"].clip(lower=0).replace(0, float("nan")).min()), 1e-6)
    norm = LogNorm(vmin=floor, vmax=max(float(lossy["kl_per_token"].max()), floor * 10))
    fig, axes = plt.subplots(len(models), len(panels), figsize=(1.6 * len(panels) + 1.5, 4.2 * len(models)),
                             squeeze=False, sharey=True)
    for i, model in enumerate(models):
        for j, (rate, recovery) in enumerate(panels):
            cells = lossy[(lossy["model"] == model) & (lossy["rate"] == rate) & (lossy["recovery"] == recovery)]
            grid = cells.pivot(index="layer", columns="site", values="kl_per_token")[list(SITES)]
            image = axes[i, j].imshow(grid.clip(lower=floor).to_numpy(), aspect="auto", norm=norm, cmap="magma")
            axes[i, j].set_xticks(range(len(SITES)), SITES)
            # rows are the mapped layers in order, which need not be 0, 1, 2, ... (--layers 0-2,11)
            axes[i, j].set_yticks(range(len(grid)), [str(layer) for layer in grid.index], fontsize=7)
            axes[i, j].set_title(f"{rate:.1%} {recovery}\n{model}", fontsize=8)
            if j == 0:
                axes[i, j].set_ylabel("layer")
    fig.colorbar(image, ax=axes, label="KL per token from the loss-free logits (nats)", shrink=0.6)
    fig.suptitle("Loss on one TP all-reduce site at a time (tp 3, forward; smollm2-135m: Q4_1 weights)", fontsize=9)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def _check(args) -> None:
    """Every bad argument as a one-line ValueError, before any work and before ``--out`` is created."""
    chosen = parse_layers(args.layers)
    if args.sequences < 1 or args.tokens < 2:
        raise ValueError("--sequences must be >= 1 and --tokens >= 2")
    if args.threads < 1:
        raise ValueError(f"--threads {args.threads} must be >= 1")
    for rate in args.rates:
        if not 0 < rate < 1:
            raise ValueError(f"--rates: {rate} must be in (0, 1)")
    from ..net.recovery import RECOVERY_POLICIES
    for recovery in args.recoveries:
        if recovery not in RECOVERY_POLICIES:
            raise ValueError(f"--recoveries: {recovery!r} is not one of {', '.join(RECOVERY_POLICIES)}")
    for name in args.models:
        if name not in MODELS:
            raise ValueError(f"--models: {name!r} is not one of {', '.join(MODELS)}")
    from ..models.pretrained import model_dir
    model_dir(MODELS[0])  # the real extra is there (and converted) before any work
    for name in args.models:
        depth = _depth(name)
        if chosen is not None and max(chosen) >= depth:
            raise ValueError(f"--layers {args.layers}: {name} has layers 0-{depth - 1}")
    check_writable(args.out, "--out")


def _depth(name: str) -> int:
    """Model ``name``'s layers, from its config alone."""
    from transformers import AutoConfig
    from ..models.pretrained import resolve
    from ..models.shapes import NAMED_SHAPES, named_config
    if name in NAMED_SHAPES:
        return named_config(name).num_hidden_layers
    return AutoConfig.from_pretrained(resolve(name)).num_hidden_layers


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lossysim.real.damage_map", description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="results/damage_map", help="folder for damage_map.csv and .png")
    parser.add_argument("--sequences", type=int, default=1, help="eval windows")
    parser.add_argument("--layers", default=DEFAULT_LAYERS, help="layers to map: all, or e.g. 0-5,12")
    parser.add_argument("--tokens", type=int, default=128, help="tokens per window")
    parser.add_argument("--rates", type=lambda s: [float(x) for x in s.split(",")], default=[0.001, 0.01, 0.05])
    parser.add_argument("--recoveries", type=lambda s: s.split(","), default=["zero", "hadamard"])
    parser.add_argument("--models", type=lambda s: s.split(","), default=list(MODELS))
    parser.add_argument("--seed", type=int, default=0, help="seed of the loss masks")
    parser.add_argument("--threads", type=int, default=max(1, torch.get_num_threads()))
    args = parser.parse_args(argv)
    out = Path(args.out)
    try:
        _check(args)
    except (ValueError, OSError) as err:
        print(f"damage_map: {err}", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)   # every check passed: only now does the map take the folder
    frame, outliers = run(args)
    frame.to_csv(out / "damage_map.csv", index=False)
    outliers.to_csv(out / "outliers.csv", index=False)
    plot(frame, out / "damage_map.png")
    print(f"wrote {out / 'damage_map.csv'} and {out / 'damage_map.png'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
