"""One experiment: fine-tune a tensor-parallel GPT-2 over a lossy network and record what happened.

``run_experiment(config, run_dir)`` is the whole job; ``lossysim train`` is its
command line. The run directory's files are described in docs/run_directory.md.
"""
from __future__ import annotations

import contextlib
import copy
import json
import logging
import os
import platform
import shutil
import signal
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist
import transformers
from tqdm.auto import tqdm

from .. import __version__, timing
from ..config import ExperimentConfig, load_config, parse_overrides, save_yaml
from ..data import EVAL_SPLITS, eval_batches, prepare_data, train_batches
from ..tp import TensorParallelModel, gather_full_model, parallelize
from ..io import append_jsonl, atomic_write_json, atomic_write_text, read_jsonl
from ..models import build_model, check_max_length
from ..net import LossyNetwork
from ..net.links import stream_seed
from . import checkpoint
from .runtime import device as _device, init_distributed
from .tracking import open_tracker

log = logging.getLogger(__name__)

# CLI flags for the common settings; everything else goes through --set key=value.
FLAGS = {
    "--loss": ("loss", "loss model spec, e.g. bernoulli:0.01 or ge:rate=0.01,burst=8"),
    "--tp-size": ("tp_size", "tensor-parallel degree"),
    "--backend": ("backend", "sim (all ranks in one process) or dist (torchrun)"),
    "--lossy": ("lossy", "which traffic is lossy: fwd, bwd or both"),
    "--recovery": ("recovery", "zero or rescale"),
    "--algorithm": ("algorithm", "collective algorithm: ring, tree or direct"),
    "--transport": ("transport", "drop, retransmit or deadline"),
    "--model": ("model", "tiny | small | tiny-llama | llama-1b-shape | a HF name | a local directory"),
    "--dataset": ("dataset", "synthetic | mnli | a local directory or file"),
    "--max-train-samples": ("max_train_samples", "cap on training examples"),
    "--max-eval-samples": ("max_eval_samples", "cap on examples per eval split"),
    "--steps": ("steps", "optimizer steps"),
    "--seed": ("seed", "seed of data order, init, masks and dropout"),
    "--out": ("out", "run directory"),
}


def add_arguments(parser) -> None:
    parser.add_argument("--config", help="experiment YAML (see experiments/)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override any config key (repeatable)")
    for flag, (key, help_text) in FLAGS.items():
        parser.add_argument(flag, dest=key, help=help_text)
    parser.add_argument("--resume", action="store_true",
                        help="continue from the newest complete checkpoint in --out (see checkpoint_every)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def run(args) -> int:
    overrides = parse_overrides(args.set)
    overrides.update({key: getattr(args, key) for _, (key, _) in FLAGS.items()
                      if getattr(args, key) is not None})
    config = load_config(args.config, overrides)
    summary = run_experiment(config, config.out, progress=not args.no_progress, resume=args.resume)
    if summary["status"] != "completed":
        print(f"lossysim train: {summary['status']}: {summary.get('error') or ''}".rstrip(": "),
              file=__import__("sys").stderr)
        return 1
    return 0


@dataclass
class _Runtime:
    """Where this process stands: its rank, device and whether it writes files."""
    config: ExperimentConfig
    run_dir: Path
    device: torch.device
    rank: int = 0
    is_main: bool = True
    resume: bool = False

    def barrier(self):
        if self.config.backend == "dist":
            dist.barrier()


def run_experiment(config: ExperimentConfig, run_dir, *, progress: bool = True, position: int = 0,
                   resume: bool = False) -> dict:
    """Train one configuration; write ``run_dir``; return the summary.

    With ``resume``, continue from the newest complete checkpoint in ``run_dir``
    (if any) and end exactly as an uninterrupted run would. A training failure
    is recorded (status ``failed`` or ``diverged``), not raised.
    """
    config.validate()
    run_dir = Path(run_dir)
    started = time.time()
    runtime = None
    previous_handler = None
    if config.backend == "dist":  # torchrun stops the other ranks with SIGTERM when one fails
        previous_handler = signal.signal(signal.SIGTERM, _terminated)
    try:
        runtime = _start(config, run_dir, resume)
        summary = _Experiment(runtime, progress, position).run(started)
    except Exception as err:  # recorded, so a sweep goes on
        if config.backend == "dist" and isinstance(err, (RuntimeError, getattr(dist, "DistError", RuntimeError))):
            err = RuntimeError(f"a peer rank failed or stopped responding (timeout_s={config.timeout_s:g}): "
                               f"{str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__}")
        summary = _failure(config, err, started)
        log.debug("run failed", exc_info=True)
        if runtime is None or runtime.is_main:
            with contextlib.suppress(OSError):
                run_dir.mkdir(parents=True, exist_ok=True)
                atomic_write_text(run_dir / "traceback.txt", traceback.format_exc())
                atomic_write_json(run_dir / "summary.json", summary)
    finally:
        if config.backend == "dist" and dist.is_initialized():
            dist.destroy_process_group()
        if previous_handler is not None:
            signal.signal(signal.SIGTERM, previous_handler)
    return summary


class Terminated(Exception):
    """SIGTERM arrived (torchrun stops every rank when one of them fails)."""


def _terminated(signum, frame):
    raise Terminated("terminated by SIGTERM")


def _start(config: ExperimentConfig, run_dir: Path, resume: bool) -> _Runtime:
    if config.backend == "dist":
        rank, world = init_distributed(timeout_s=config.timeout_s)
        if world != config.tp_size:
            raise ValueError(f"tp_size={config.tp_size} but torchrun started {world} processes")
        shared = [config.to_dict(), str(run_dir)]  # rank 0's config is the experiment
        dist.broadcast_object_list(shared, src=0)
        config = ExperimentConfig(**shared[0]).validate()
        run_dir = Path(shared[1])
        local = int(os.environ.get("LOCAL_RANK", 0))
        device = torch.device("cuda", local) if torch.cuda.is_available() else torch.device("cpu")
    else:
        rank = 0
        device = _device(config.device)
    runtime = _Runtime(config, run_dir, device, rank, rank == 0, resume)
    if runtime.is_main:
        _prepare_run_dir(run_dir, keep_checkpoints=resume)
        save_yaml(config, run_dir / "config.yaml")
    return runtime


def _prepare_run_dir(run_dir: Path, keep_checkpoints: bool) -> None:
    """Start clean: a stale summary from an earlier attempt must not mix in.

    When resuming, metrics and training checkpoints stay (metrics are cut back
    to the checkpoint's step once it is loaded).
    """
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        probe = run_dir / ".write-test"
        probe.write_text("ok")
        probe.unlink()
    except OSError as err:
        raise ValueError(f"output folder {run_dir} is not writable: {err.strerror or err}") from None
    for name in ("summary.json", "traceback.txt") + (() if keep_checkpoints else ("metrics.jsonl",)):
        with contextlib.suppress(FileNotFoundError):
            (run_dir / name).unlink()
    shutil.rmtree(run_dir / "checkpoint", ignore_errors=True)
    if not keep_checkpoints:
        shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)


def _failure(config: ExperimentConfig, err: BaseException, started: float) -> dict:
    message = f"{type(err).__name__}: {err}".splitlines()[0]
    return {"status": "failed", "error": message, "name": config.name, "config": config.to_dict(),
            "steps": 0, "wall_time_s": time.time() - started, "versions": _versions()}


def _versions() -> dict:
    return {"lossysim": __version__, "torch": torch.__version__,
            "transformers": transformers.__version__, "python": platform.python_version()}


def cache_dir() -> Path:
    return Path(os.environ.get("LOSSYSIM_CACHE", Path.home() / ".cache" / "lossysim"))


class _Divergence(Exception):
    pass


class _Experiment:
    def __init__(self, runtime: _Runtime, progress: bool, position: int):
        self.rt = runtime
        self.cfg = runtime.config
        self.progress = progress and runtime.is_main
        self.position = position

    # -- set-up ------------------------------------------------------------------
    def _build(self):
        cfg, rt = self.cfg, self.rt
        check_max_length(cfg.model, cfg.max_length)
        self.data = prepare_data(cfg, cache_dir() / "data", is_main=rt.is_main,
                                 barrier=rt.barrier if cfg.backend == "dist" else None)
        model = build_model(cfg.model, vocab_size=self.data.vocab_size, pad_token_id=self.data.pad_token_id,
                            num_labels=self.data.num_labels, max_length=cfg.max_length,
                            attn_implementation=cfg.attn_implementation, dropout=cfg.dropout,
                            seed=cfg.seed, task=cfg.task).to(rt.device)
        self.train_net = LossyNetwork(cfg.network_spec())
        # Evaluation draws from its own streams and keeps its own statistics.
        self.eval_net = LossyNetwork(cfg.network_spec(evaluation=True))
        # FLOPs of a training step count the whole model's parameters (6 * N * tokens / tp).
        self.parameters = sum(p.numel() for p in model.parameters())
        self.compute = timing.parse_compute(cfg.compute)
        if isinstance(self.compute, timing.Measured) and not (cfg.backend == "dist" and rt.device.type == "cuda"):
            raise ValueError("compute=measured needs backend=dist on CUDA GPUs: a simulation's own wall "
                             "clock is not a cluster's time; name a GPU model instead (e.g. compute=h100)")
        self.model: TensorParallelModel = parallelize(
            model, cfg.tp_size, self.train_net, backend=cfg.backend, seed=cfg.seed,
            sync_replicated=cfg.sync_replicated)
        torch.manual_seed(stream_seed(cfg.seed, "sharded-dropout", str(rt.rank)))
        if cfg.activation_checkpointing:
            self.model.model.activation_checkpointing_enable(
                {"use_reentrant": False, "context_fn": self.model.group.checkpoint_contexts})
        decay, no_decay = [], []
        for name, param in self.model.named_parameters():
            (no_decay if name.endswith("bias") or ".ln_" in name or "norm" in name else decay).append(param)
        self.optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                                            {"params": no_decay, "weight_decay": 0.0}], lr=cfg.lr)
        self.scheduler = transformers.get_linear_schedule_with_warmup(
            self.optimizer, min(cfg.warmup_steps, cfg.steps), cfg.steps)
        self.autocast = _autocast(cfg.amp, rt.device)
        self.scaler = torch.amp.GradScaler(rt.device.type, enabled=cfg.amp == "fp16")

    # -- the loop --------------------------------------------------------------------
    def run(self, started: float) -> dict:
        cfg, rt = self.cfg, self.rt
        self._build()
        if rt.is_main:
            _check_free_space(rt.run_dir, self.model, cfg)
        self.started = started
        metrics_path = rt.run_dir / "metrics.jsonl"
        # Everything below changes as training goes, and is saved in checkpoints.
        self.state = {"step": 0, "best": {}, "final": {}, "train_disagreement": [],
                      "tokens": 0, "train_time": 0.0, "compute_s": 0.0, "reached": None,
                      "last_row": {"step": 0, "compute_s": 0.0, **self.train_net.clock()}}
        window = _Window(rt.device)
        if rt.resume:
            self._restore(window, metrics_path)
        self.tracker = open_tracker(cfg.report_to if rt.is_main else "none", rt.run_dir, cfg.to_dict(),
                                    resume_step=self.state["step"])
        status, diverged_at = "completed", None
        batches = train_batches(self.data, cfg.batch_size, cfg.seed, start_step=self.state["step"])
        bar = tqdm(total=cfg.steps, initial=self.state["step"], desc=cfg.name, position=self.position,
                   leave=self.position == 0, disable=not self.progress, dynamic_ncols=True)
        try:
            for step in range(self.state["step"] + 1, cfg.steps + 1):
                host = next(batches)
                batch = {k: v.to(rt.device) for k, v in host.items()}
                # tokens/s counts real tokens, not padding (counted on the host: no device sync)
                if not self._train_step(batch, window, int(host["attention_mask"].sum())):
                    raise _Divergence(step)
                self.state["step"] = step
                if step % cfg.log_every == 0 or step == cfg.steps:
                    row = self._train_row(step, window)
                    self.state["train_disagreement"].append(row["disagreement"])
                    self._write(metrics_path, row)
                    bar.set_postfix(loss=f"{row['loss']:.3f}", acc=f"{row['accuracy']:.3f}",
                                    lost=f"{row['observed_loss_rate']:.4f}", refresh=False)
                if step % cfg.eval_every == 0 or step == cfg.steps:
                    for split in EVAL_SPLITS:
                        row = self._evaluate(split, step)
                        self._write(metrics_path, row)
                        final = {k: row[k] for k in ("accuracy", "loss", "step", "disagreement",
                                                     "hidden_rel_diff", "sim_time_s")}
                        if split == EVAL_SPLITS[0] and self.state["reached"] is None \
                                and row["accuracy"] >= cfg.target_accuracy:
                            self.state["reached"] = {"step": step, "sim_time_s": row["sim_time_s"]}
                        self.state["final"][split] = final
                        best = self.state["best"].get(split)
                        if best is None or final["accuracy"] > best["accuracy"]:
                            self.state["best"][split] = dict(final)
                if cfg.checkpoint_every and step % cfg.checkpoint_every == 0:
                    self._checkpoint(window)
                bar.update(1)
        except _Divergence as div:
            status = "diverged"
            diverged_at = {"step": div.args[0], **(self.train_net.first_nonfinite() or {"site": None})}
            log.warning("loss or gradients became non-finite at step %d (first non-finite traffic: %s); "
                        "run marked diverged", div.args[0], diverged_at["site"] or "none")
        finally:
            bar.close()
            self.tracker.close()
        if status == "completed" and cfg.save_checkpoint:
            self._save_checkpoint()
        return self._summary(status, diverged_at)

    def _summary(self, status: str, diverged_at: Optional[dict]) -> dict:
        cfg, state = self.cfg, self.state
        final = state["final"]
        seen = state["train_disagreement"]
        summary = {
            "status": status, "error": None, "name": cfg.name, "dataset": self.data.name,
            "config": cfg.to_dict(), "steps": state["step"],
            "wall_time_s": time.time() - self.started,
            "tokens_per_s": state["tokens"] / max(state["train_time"], 1e-9),
            "final": final, "best": state["best"],
            "packets": {"train": self.train_net.summary(), "eval": self.eval_net.summary()},
            "packets_by_class": {"train": self.train_net.summary(by=("direction", "link_class")),
                                 "eval": self.eval_net.summary(by=("direction", "link_class"))},
            "packets_by_site": {"train": self.train_net.summary(by=("site", "direction")),
                                "eval": self.eval_net.summary(by=("site", "direction"))},
            "disagreement": {
                "final_eval": max((f["disagreement"] for f in final.values()), default=None),
                "final_eval_hidden_rel_diff": max((f["hidden_rel_diff"] for f in final.values()), default=None),
                "mean_train": sum(seen) / len(seen) if seen else None,
            },
            "diverged_at": diverged_at, "versions": _versions(),
            "sim_time": self._sim_time_summary(),
            "time_to_accuracy": {"target": cfg.target_accuracy, "split": EVAL_SPLITS[0],
                                 "step": (state["reached"] or {}).get("step"),
                                 "sim_time_s": (state["reached"] or {}).get("sim_time_s")},
        }
        if self.rt.is_main:
            atomic_write_json(self.rt.run_dir / "summary.json", summary)
        return summary

    def _sim_time_s(self) -> float:
        """The simulated cluster's clock: modelled (or measured) compute plus simulated communication."""
        return self.state["compute_s"] + self.train_net.clock()["comm_s"]

    def _sim_time_summary(self) -> dict:
        steps = max(self.state["step"], 1)
        clock = self.train_net.clock()
        sent = {row["direction"]: row for row in self.train_net.summary()}
        return {"total_s": self._sim_time_s(), "compute_s_per_step": self.state["compute_s"] / steps,
                "comm_s_per_step": clock["comm_s"] / steps, "ideal_comm_s_per_step": clock["ideal_comm_s"] / steps,
                "retransmit_s_per_step": clock["retransmit_s"] / steps,
                "retransmitted_packets": sum(row["resent"] for row in sent.values()),
                "missing_packets": sum(row["missing"] for row in sent.values()),
                "compute": self.cfg.compute, "algorithm": self.cfg.algorithm, "transport": self.cfg.transport}

    def _clock_row(self, step: int) -> dict:
        """Simulated time per step since the last row, and the cumulative clock."""
        clock = self.train_net.clock()
        last = self.state["last_row"]
        steps = max(step - last["step"], 1)
        row = {"sim_time_s": self.state["compute_s"] + clock["comm_s"],
               "comm_s_per_step": (clock["comm_s"] - last["comm_s"]) / steps,
               "retransmit_s_per_step": (clock["retransmit_s"] - last["retransmit_s"]) / steps,
               "compute_s_per_step": (self.state["compute_s"] - last["compute_s"]) / steps}
        self.state["last_row"] = {"step": step, "compute_s": self.state["compute_s"], **clock}
        return row

    # -- checkpoints for resume ----------------------------------------------------
    def _training_state(self, window: "_Window") -> dict:
        group = self.model.group
        return {
            "config": _resumable(self.cfg), "progress": copy.deepcopy(self.state),
            "model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(), "scaler": self.scaler.state_dict(),
            "window": window.state_dict(),
            "rng": {"torch": torch.get_rng_state(), "replicated": group.rng_state(),
                    "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None},
            "train_net": self.train_net.state_dict(), "eval_net": self.eval_net.state_dict(),
        }

    def _checkpoint(self, window: "_Window") -> None:
        cfg, rt = self.cfg, self.rt
        checkpoint.save(rt.run_dir, self.state["step"], self._training_state(window), rank=rt.rank,
                        world=cfg.tp_size if cfg.backend == "dist" else 1, keep=cfg.keep_checkpoints,
                        barrier=rt.barrier)

    def _restore(self, window: "_Window", metrics_path: Path) -> None:
        cfg, rt = self.cfg, self.rt
        found = [str(checkpoint.latest(rt.run_dir) or "")]
        if cfg.backend == "dist":  # every rank loads the checkpoint rank 0 chose
            dist.broadcast_object_list(found, src=0)
        if not found[0]:
            log.info("no complete checkpoint in %s: starting from step 0", rt.run_dir)
            if rt.is_main and metrics_path.exists():
                metrics_path.unlink()
            return
        world = cfg.tp_size if cfg.backend == "dist" else 1
        saved = checkpoint.load(Path(found[0]), rt.rank, world, map_location=rt.device)
        if saved["config"] != _resumable(cfg):
            key = next(k for k in saved["config"] if saved["config"][k] != _resumable(cfg).get(k))
            raise ValueError(f"{found[0]} was written with {key}={saved['config'][key]!r}, this run has "
                             f"{key}={getattr(cfg, key)!r}: resume needs the same experiment")
        self.model.load_state_dict(saved["model"])
        self.optimizer.load_state_dict(saved["optimizer"])
        self.scheduler.load_state_dict(saved["scheduler"])
        self.scaler.load_state_dict(saved["scaler"])
        window.load_state_dict(saved["window"])
        torch.set_rng_state(saved["rng"]["torch"].cpu())
        if saved["rng"]["cuda"] is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(saved["rng"]["cuda"])
        self.model.group.load_rng_state(saved["rng"]["replicated"])
        self.train_net.load_state_dict(saved["train_net"])
        self.eval_net.load_state_dict(saved["eval_net"])
        self.state = saved["progress"]
        if rt.is_main:  # rows after the checkpoint were written by the run that died
            kept = [row for row in read_jsonl(metrics_path) if row["step"] <= self.state["step"]] \
                if metrics_path.exists() else []
            atomic_write_text(metrics_path, "".join(json.dumps(row) + "\n" for row in kept))
        log.info("resumed from %s at step %d", found[0], self.state["step"])

    def _train_step(self, batch, window: _Window, tokens: int) -> bool:
        """One optimizer step; False (and no update) if the loss or gradients are non-finite."""
        cfg = self.cfg
        t0 = time.perf_counter()
        self.model.train()
        with self.autocast:
            out = self.model(**(_lm_inputs(batch) if cfg.task == "lm" else batch))
        self.scaler.scale(out.loss).backward()
        self.scaler.unscale_(self.optimizer)
        norm = _clip_grad_norm(self.model, cfg.grad_clip)
        finite = torch.isfinite(norm) & torch.isfinite(self.model.rank_losses.detach()).all()
        # Every rank must agree, or dist ranks would part ways at the next collective.
        if not bool(self.model.group.all_gather_reliable(finite.reshape(1)).all()):
            return False
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.state["tokens"] += tokens
        if isinstance(self.compute, timing.Measured):
            torch.cuda.synchronize(self.rt.device)
            self.state["compute_s"] += time.perf_counter() - t0
        else:  # the GPU computes every position of the padded batch
            self.state["compute_s"] += self.compute.step_time(self.parameters, batch["input_ids"].numel(),
                                                              cfg.tp_size)
        seconds = time.perf_counter() - t0
        self.state["train_time"] += seconds
        logits, labels = _next_tokens(out.logits.detach(), batch) if cfg.task == "lm" \
            else (out.logits.detach(), batch["labels"])
        window.add(self.model.rank_losses.detach(), logits, labels, tokens, seconds)
        return True

    def _train_row(self, step: int, window: _Window) -> dict:
        values = window.flush(self.model.group)
        disagreement = self.model.disagreement()
        return {"step": step, "split": "train", "time_s": time.time() - self.started, **values,
                **self._clock_row(step),
                "lr": self.scheduler.get_last_lr()[0], **_traffic(self.train_net),
                "disagreement": disagreement["prediction"],
                "hidden_rel_diff": disagreement["hidden_rel_diff"]}

    @torch.no_grad()
    def _evaluate(self, split: str, step: int) -> dict:
        """Rank 0's accuracy and loss, and rank divergence, with one collective for the whole split."""
        if self.cfg.task == "lm":
            return self._evaluate_lm(split, step)
        group = self.model.group
        self.model.eval()
        self.eval_net.reset_stats()
        preds, losses, pooled = [], [], []
        with _using_network(group, self.eval_net):
            for batch in eval_batches(self.data.splits[split], self.cfg.eval_batch_size):
                batch = {k: v.to(self.rt.device) for k, v in batch.items()}
                with self.autocast:
                    self.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
                logits = self.model.rank_logits.float()  # [R, B, labels]
                preds.append(logits.argmax(-1))
                losses.append(torch.nn.functional.cross_entropy(
                    logits.flatten(0, 1), batch["labels"].repeat(logits.shape[0]),
                    reduction="none").view(logits.shape[0], -1))
                last = _last_token(batch["input_ids"], self.data.pad_token_id)
                hidden = self.model.rank_hidden.float()
                pooled.append(hidden[:, torch.arange(hidden.shape[1], device=hidden.device), last])
            labels = self.data.splits[split]["labels"].to(self.rt.device)
        local = torch.cat([torch.cat(preds, 1).float().unsqueeze(-1), torch.cat(losses, 1).unsqueeze(-1),
                           torch.cat(pooled, 1)], dim=-1)  # [R, N, 2 + hidden]
        every = group.all_gather_reliable(local.contiguous())  # [tp, N, 2 + hidden]
        pred = every[..., 0].long()
        hidden = every[..., 2:]
        rel = (hidden - hidden[:1]).flatten(1).norm(dim=1) / hidden[0].norm().clamp_min(1e-30)
        self.model.train()
        return {"step": step, "split": split, "time_s": time.time() - self.started,
                "sim_time_s": self._sim_time_s(),
                "loss": float(every[0, :, 1].mean()),
                "accuracy": float((pred[0] == labels).float().mean()),
                **_traffic(self.eval_net),
                "disagreement": float((pred != pred[:1]).float().mean(-1).max()),
                "hidden_rel_diff": float(rel.max())}

    @torch.no_grad()
    def _evaluate_lm(self, split: str, step: int) -> dict:
        """Causal LM: rank 0's next-token loss and accuracy over the texts' tokens; ``disagreement`` is the
        fraction of those tokens whose predicted next token differs from rank 0's (worst rank)."""
        group = self.model.group
        self.model.eval()
        self.eval_net.reset_stats()
        rows = []
        with _using_network(group, self.eval_net):
            for batch in eval_batches(self.data.splits[split], self.cfg.eval_batch_size):
                batch = {k: v.to(self.rt.device) for k, v in batch.items()}
                with self.autocast:
                    self.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
                logits = self.model.rank_logits[:, :, :-1].float()  # [R, B, S - 1, vocab]
                ranks = logits.shape[0]
                target = batch["input_ids"][:, 1:].expand(ranks, -1, -1)
                valid = batch["attention_mask"][:, 1:].bool().expand(ranks, -1, -1)
                losses = torch.nn.functional.cross_entropy(logits.flatten(0, 2), target.flatten(),
                                                           reduction="none").view(target.shape)
                pred = logits.argmax(-1)
                last = _last_token(batch["input_ids"], self.data.pad_token_id)
                hidden = self.model.rank_hidden.float()
                pooled = hidden[:, torch.arange(hidden.shape[1], device=hidden.device), last]
                # Per example: loss sum, correct, tokens, pooled hidden state, predictions (-1: no token),
                # the predictions padded to one width for every batch.
                pred = torch.nn.functional.pad(pred.masked_fill(~valid, -1).float(),
                                               (0, self.cfg.max_length - 1 - pred.shape[-1]), value=-1)
                rows.append(torch.cat([(losses * valid).sum(-1, keepdim=True),
                                       ((pred[..., :target.shape[-1]] == target) & valid).sum(-1, keepdim=True),
                                       valid.sum(-1, keepdim=True), pooled, pred], dim=-1))
        every = group.all_gather_reliable(torch.cat(rows, 1).contiguous())  # [tp, N, 3 + hidden + S - 1]
        width = self.model.rank_hidden.shape[-1]
        tokens = every[0, :, 2].sum().clamp_min(1)
        hidden, pred = every[..., 3:3 + width], every[..., 3 + width:]
        rel = (hidden - hidden[:1]).flatten(1).norm(dim=1) / hidden[0].norm().clamp_min(1e-30)
        differs = ((pred != pred[:1]) & (pred[:1] >= 0)).flatten(1).sum(1).max()
        self.model.train()
        return {"step": step, "split": split, "time_s": time.time() - self.started,
                "sim_time_s": self._sim_time_s(),
                "loss": float(every[0, :, 0].sum() / tokens), "accuracy": float(every[0, :, 1].sum() / tokens),
                **_traffic(self.eval_net), "disagreement": float(differs / tokens),
                "hidden_rel_diff": float(rel.max())}

    def _save_checkpoint(self) -> None:
        """The gathered HF model and tokenizer, verified against the in-memory one before it counts."""
        full = gather_full_model(self.model)
        if not self.rt.is_main:
            return
        final = self.rt.run_dir / "checkpoint"
        tmp = self.rt.run_dir / ".checkpoint.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        full.save_pretrained(tmp)
        self.data.tokenizer.save_pretrained(tmp)
        reloaded = type(full).from_pretrained(tmp)
        for name, tensor in full.state_dict().items():
            if not torch.equal(reloaded.state_dict()[name].to(tensor.device), tensor):
                raise RuntimeError(f"saved checkpoint differs from the trained model at {name}")
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)

    def _write(self, path: Path, row: dict) -> None:
        if self.rt.is_main:
            append_jsonl(path, row)
            self.tracker.log(row)


class _Window:
    """Training metrics summed on the device between log steps (no host sync per step)."""

    def __init__(self, device):
        self.device = device
        self.loss = torch.zeros((), device=device)
        self.correct = torch.zeros((), device=device)
        self.examples = self.steps = self.tokens = 0
        self.seconds = 0.0

    def add(self, rank_losses, logits, labels, tokens: int, seconds: float):
        self.loss += rank_losses.float().mean()
        self.correct += (logits.argmax(-1) == labels).sum()
        self.examples += labels.numel()
        self.steps += 1
        self.tokens += tokens
        self.seconds += seconds

    def state_dict(self) -> dict:
        return {k: v for k, v in vars(self).items() if k != "device"}

    def load_state_dict(self, state: dict) -> None:
        for key, value in state.items():
            setattr(self, key, value.to(self.device) if torch.is_tensor(value) else value)

    def flush(self, group) -> dict:
        # dist: the mean over every rank's loss, through one reliable gather.
        loss = group.all_gather_reliable((self.loss / self.steps).reshape(1)).mean()
        values = {"loss": float(loss), "accuracy": float(self.correct) / self.examples, "tokens": self.tokens,
                  "tokens_per_s": self.tokens / self.seconds if self.seconds > 0 else 0.0}
        self.__init__(self.device)
        return values


def _traffic(network: LossyNetwork) -> dict:
    row = {}
    lost_total = sent_total = 0
    for entry in network.summary():
        d = entry["direction"]
        row[f"packets_sent_{d}"], row[f"packets_lost_{d}"] = entry["sent"], entry["lost"]
        if d in network.lossy:
            sent_total += entry["sent"]
            lost_total += entry["lost"]
    for d in ("fwd", "bwd"):
        row.setdefault(f"packets_sent_{d}", 0)
        row.setdefault(f"packets_lost_{d}", 0)
    row["observed_loss_rate"] = lost_total / sent_total if sent_total else 0.0
    return row


def _clip_grad_norm(model: TensorParallelModel, max_norm: float) -> torch.Tensor:
    """Global gradient norm as Megatron computes it: replicated grads once, every rank's shards."""
    def sq(params):
        # Grouped-query kv heads held by several ranks count once.
        grads = [p.grad.float().pow(2).sum() / getattr(p, "tp_copies", 1) for p in params if p.grad is not None]
        return torch.stack(grads).sum() if grads else torch.zeros((), device=next(model.parameters()).device)
    sharded = model.group.all_gather_reliable(sq(model.sharded_parameters()).reshape(1)).sum()
    norm = (sq(model.replicated_parameters()) + sharded).sqrt()
    if max_norm > 0:
        scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        for p in model.parameters():
            if p.grad is not None:
                p.grad.mul_(scale.to(p.grad.dtype))
    return norm


def _check_free_space(run_dir: Path, model: torch.nn.Module, cfg: ExperimentConfig) -> None:
    """Fail before training, not at the first checkpoint, when the disk cannot hold the run."""
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    need = 16 << 20  # metrics, summary, tokenizer
    if cfg.checkpoint_every:
        kept = cfg.keep_checkpoints or max(1, cfg.steps // cfg.checkpoint_every)
        need += (kept + 1) * 3 * weights  # weights and two AdamW moments, one more while sealing
    if cfg.save_checkpoint:
        need += 2 * weights
    free = shutil.disk_usage(run_dir).free
    if free < need:
        raise ValueError(f"not enough free space in {run_dir}: the run writes about {need / 2**20:.0f} MiB, "
                         f"{free / 2**20:.0f} MiB are free")


def _resumable(config: ExperimentConfig) -> dict:
    """The settings a checkpoint must share with the run resuming from it."""
    free = ("out", "name", "timeout_s", "device", "checkpoint_every", "keep_checkpoints", "save_checkpoint",
            "report_to")
    return {k: v for k, v in config.to_dict().items() if k not in free}


def _lm_inputs(batch: dict) -> dict:
    """Causal-LM fine-tuning: the labels are the texts' own tokens (padding ignored)."""
    return dict(batch, labels=batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100))


def _next_tokens(logits: torch.Tensor, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits, targets) of every real next token: [tokens, vocab], [tokens]."""
    valid = batch["attention_mask"][:, 1:].bool()
    return logits[:, :-1][valid], batch["input_ids"][:, 1:][valid]


def _last_token(input_ids: torch.Tensor, pad_token_id: int) -> torch.Tensor:
    """Index of the token GPT2ForSequenceClassification classifies from (rightmost non-pad)."""
    positions = torch.arange(input_ids.shape[-1], device=input_ids.device)
    return (positions * (input_ids != pad_token_id)).argmax(-1)


@contextlib.contextmanager
def _using_network(group, network: LossyNetwork):
    previous, group.network = group.network, network
    try:
        yield
    finally:
        group.network = previous


def _autocast(amp: str, device: torch.device):
    if amp == "none":
        return contextlib.nullcontext()
    dtype = torch.bfloat16 if amp == "bf16" else torch.float16
    if device.type == "cpu" and amp == "fp16":
        raise ValueError("amp=fp16 needs a GPU; use amp=bf16 on CPU")
    if device.type == "cuda" and amp == "bf16" and not torch.cuda.is_bf16_supported():
        raise ValueError("this GPU does not support bf16; use amp=fp16")
    return torch.autocast(device.type, dtype=dtype)
