"""One experiment: fine-tune a tensor-parallel model over a lossy network and record what happened.

``run_experiment(config, run_dir)`` is the whole job; ``lossysim train`` (``run/command.py``) its command line.
A run builds what it trains with (``build``), then loops: a training step (``step``), a metrics
row, evaluations (``evaluate``), a checkpoint now and then (``checkpoint``). What it writes
(``metrics``, ``summary``) is described in docs/run_directory.md.
"""
from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from tqdm.auto import tqdm

from ..config import ExperimentConfig, save_yaml, set_threads
from ..config.fabric import event_schedule, training_refusal
from ..data import EVAL_SPLITS, train_batches
from ..io import atomic_write_json, atomic_write_text, check_writable, nearest_existing, read_summary, run_status
from ..net import cable_events
from . import checkpoint, failures, tracking
from .clock import clock, clock_mark
from .fabric_record import stretch_clocks
from .metrics import Metrics, cut_metrics, eval_row, train_row
from .summary import collectives, fabric, failure, sections, summary as run_summary, traffic_summary
from .build import Parts, build
from .evaluate import evaluate
from .runtime import device as _device, init_distributed
from .state import TrainState, Window
from .step import train_step

log = logging.getLogger(__name__)


def run_experiment(config: ExperimentConfig, run_dir, *, progress: bool = True, position: int = 0,
                   resume: bool = False) -> dict:
    """Train one configuration; write ``run_dir``; return the summary.

    With ``resume``, continue from the newest complete checkpoint in ``run_dir``
    (if any) and end exactly as an uninterrupted run would; a run of this experiment
    already finished there is left as it is, and its summary returned. Everything that can be
    checked before training is, and a problem raises (ValueError or OSError) with
    ``run_dir`` untouched: bad settings, a model or data that cannot be built, a
    wrong world size, an output folder that cannot hold the run or already holds a
    finished one, a checkpoint of another experiment. Only then does the run take
    ``run_dir`` over; a training failure is recorded there (status ``failed`` or
    ``diverged``), not raised.
    """
    config.validate()
    if training_refusal(config):
        raise ValueError(training_refusal(config))
    set_threads(config.threads)   # before any work; summary.json's config records it
    run_dir = Path(run_dir)
    started = time.time()
    previous_handler = None
    if config.backend == "dist":  # torchrun stops the other ranks with SIGTERM when one fails
        previous_handler = signal.signal(signal.SIGTERM, _terminated)
    try:
        try:
            runtime, parts, state, window = _setup(config, run_dir, resume)
        except _Finished as done:   # resumed by doing nothing: a finished run is never trained again
            return done.args[0]
        _claim(runtime, state)
        try:
            with cable_events.active(_events_of(config), config.reroute, config.ib_timeout):
                summary = _train(runtime, parts, state, window, progress and runtime.is_main, position, started)
        except Exception as err:  # recorded, so a sweep goes on
            summary = _record_failure(runtime, err, started)
    finally:
        if config.backend == "dist" and dist.is_initialized():
            dist.destroy_process_group()
        if previous_handler is not None:
            signal.signal(signal.SIGTERM, previous_handler)
    return summary


def _events_of(config: ExperimentConfig):
    """The run's link events on its fabric (None without any), over the horizon a run cannot outlast."""
    if not str(config.link_event or "").strip():
        return None
    return event_schedule(config, cable_events.HORIZON_S)


def _setup(config: ExperimentConfig, run_dir: Path, resume: bool):
    """Every check a run can make before training, cheapest first; writes nothing in ``run_dir``."""
    runtime = _start(config, run_dir, resume)
    config, run_dir = runtime.config, runtime.run_dir   # dist: rank 0's
    if runtime.is_main:
        _check_run_dir(run_dir, resume)
        tracking.require(config.report_to)
    parts = build(config, runtime.device, runtime.rank, runtime.is_main,
                  runtime.barrier if config.backend == "dist" else None)
    stretch_clocks(parts, config)   # shared cables on the step clock (none without a fabric)
    if resume:
        _check_finished(runtime, parts)
    if runtime.is_main:
        _check_free_space(run_dir, parts.model, config)
    state = TrainState(last_row=clock_mark(0, 0.0, parts.train_net, parts.pipeline))
    window = Window(runtime.device)
    if resume:
        state = checkpoint.resume(run_dir, parts, window, config, runtime.rank) or state
    return runtime, parts, state, window


def _check_finished(rt: _Runtime, parts: Parts) -> None:
    """Raise _Finished with the run's summary when ``run_dir`` already holds this experiment finished
    (any status but ``failed``): resuming it has nothing left to do, and training it again would delete its
    results. Another experiment's finished run is refused (ValueError), as its checkpoints would be."""
    found = [None]
    if rt.is_main:
        summary = read_summary(rt.run_dir)
        if summary is not None and summary.get("status") not in (None, "failed"):
            if not isinstance(summary.get("config"), dict):
                raise ValueError(f"--out {rt.run_dir} holds a finished run (status {summary['status']}) whose "
                                 "summary.json has no config: choose another --out")
            checkpoint.check_same_experiment(summary["config"], rt.config, f"--out {rt.run_dir}",
                                             None if parts.pipeline is None else sum(parts.pipeline.layout))
            found[0] = summary
    if rt.config.backend == "dist":
        dist.broadcast_object_list(found, src=0)
    if found[0] is not None:
        log.info("%s holds this run finished (status %s): nothing to resume", rt.run_dir, found[0]["status"])
        raise _Finished(found[0])


def _record_failure(rt: _Runtime, err: Exception, started: float) -> dict:
    config = rt.config
    if config.backend == "dist" and isinstance(err, (RuntimeError, getattr(dist, "DistError", RuntimeError))):
        err = RuntimeError(f"a peer rank failed or stopped responding (timeout_s={config.timeout_s:g}): "
                           f"{str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__}")
    summary = failure(config, err, started)
    log.debug("run failed", exc_info=True)
    if rt.is_main:
        with contextlib.suppress(OSError):
            atomic_write_text(rt.run_dir / "traceback.txt", traceback.format_exc())
            atomic_write_json(rt.run_dir / "summary.json", summary)
    return summary


def _train(rt: _Runtime, parts: Parts, state: TrainState, window: Window, progress: bool, position: int,
           started: float) -> dict:
    """Train to ``config.steps``, logging, evaluating and checkpointing on the way."""
    config = rt.config
    metrics = Metrics(rt.run_dir, config, rt.is_main, resume_step=state.step)
    status, diverged_at = "completed", None
    batches = train_batches(parts.data, config.batch_size, config.seed, start_step=state.step)
    bar = tqdm(total=config.steps, initial=state.step, desc=config.name, position=position,
               leave=position == 0, disable=not progress, dynamic_ncols=True)
    try:
        for step in range(state.step + 1, config.steps + 1):
            if cable_events.ACTIVE is not None:   # the step's calls meet the events at its simulated start
                cable_events.ACTIVE.at(clock(state, parts.train_net, config, parts.pipeline,
                                             failures.count(parts, config))["sim_time_s"])
            if not train_step(parts, config, state, window, next(batches), rt.device):
                raise _Divergence(step)
            state.step = step

            if step % config.log_every == 0 or step == config.steps:
                averages = window.flush(parts.model.group)
                disagreement = parts.model.disagreement()
                row = train_row(step, started, averages, state, parts, parts.scheduler.get_last_lr()[0],
                                disagreement, config)
                state.train_disagreement.append(row["disagreement"])
                metrics.write(row)
                bar.set_postfix(loss=f"{row['loss']:.3f}", acc=f"{row['accuracy']:.3f}",
                                lost=f"{row['observed_loss_rate']:.4f}", refresh=False,
                                **({"lost_dp": f"{row['observed_loss_rate_dp']:.4f}", "drift": f"{row['drift']:.2g}"}
                                   if parts.dp.grouped else {}),
                                **({"lost_pp": f"{row['observed_loss_rate_pp']:.4f}"} if parts.pipeline else {}))
                if config.max_failures and row["failures"] >= config.max_failures:
                    raise _GaveUp(step, row["failures"])

            if step % config.eval_every == 0 or step == config.steps:
                for split in parts.data.eval_splits:
                    scores = evaluate(parts, split, config, rt.device)
                    row = eval_row(step, split, started, scores, state, parts, config)
                    metrics.write(row)
                    # time to accuracy is measured on the first (primary) split
                    state.record_evaluation(row, config.target_accuracy if split == EVAL_SPLITS[0] else None)

            if config.checkpoint_every and step % config.checkpoint_every == 0:
                checkpoint.save_training(rt.run_dir, parts, state, window, config, rt.rank, rt.barrier)
            bar.update(1)
    except _Divergence as div:
        status = "diverged"
        diverged_at = {"step": div.args[0], **(parts.train_net.channels.first_nonfinite() or {"site": None})}
        log.warning("loss or gradients became non-finite at step %d (first non-finite traffic: %s); "
                    "run marked diverged", div.args[0], diverged_at["site"] or "none")
    except _GaveUp as stop:
        status = "gave_up"
        log.warning("the transport gave up on %d collectives by step %d (max_failures=%d): run ended",
                    stop.args[1], stop.args[0], config.max_failures)
    finally:
        bar.close()
        metrics.close()

    if status == "completed" and config.save_checkpoint:
        checkpoint.export_model(parts, rt.run_dir, rt.is_main)
    summary = run_summary(status, diverged_at, config, parts.data.name, state, parts.train_net,
                          parts.eval_net, started, parts.pipeline, failures.count(parts, config))
    summary.update(sections(parts, config, state))   # every used axis's (lossysim.axes)
    summary["traffic"] = traffic_summary(parts, config)
    summary["collectives"] = collectives(parts, config)
    summary.update(fabric(parts, config))   # the fabric's, beside the axes' (it belongs to none)
    if rt.is_main:
        atomic_write_json(rt.run_dir / "summary.json", summary)
    return summary


class _Finished(Exception):
    """``--resume`` found the run finished (its argument: the run's summary)."""


class _Divergence(Exception):
    """A step's loss or gradients became non-finite (its argument: the step)."""


class _GaveUp(Exception):
    """The transport gave up on max_failures collectives (arguments: the step, the failures)."""


class Terminated(Exception):
    """SIGTERM arrived (torchrun stops every rank when one of them fails)."""


def _terminated(signum, frame):
    raise Terminated("terminated by SIGTERM")


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


def _start(config: ExperimentConfig, run_dir: Path, resume: bool) -> _Runtime:
    if config.backend == "dist":
        rank, world = init_distributed(timeout_s=config.timeout_s)
        if world != config.mesh().world:
            raise ValueError(f"{config.mesh().name.split(' = ')[0]} is {config.mesh().world} ranks but torchrun "
                             f"started {world} processes")
        shared = [config.to_dict(), str(run_dir)]  # rank 0's config is the experiment
        dist.broadcast_object_list(shared, src=0)
        config = ExperimentConfig(**shared[0]).validate()
        run_dir = Path(shared[1])
        local = int(os.environ.get("LOCAL_RANK", 0))
        device = torch.device("cuda", local) if torch.cuda.is_available() else torch.device("cpu")
    else:
        rank = 0
        device = _device(config.device)
    return _Runtime(config, run_dir, device, rank, rank == 0, resume)


def _check_run_dir(run_dir: Path, resume: bool) -> None:
    """Refuse, before anything is built, an output folder this run could not write or must not replace.

    A finished run's results (any status but ``failed``) and sealed training checkpoints are work a
    new run would delete: only ``--resume`` may continue them (a finished run by doing nothing).
    """
    check_writable(run_dir, "--out")
    status = run_status(run_dir)
    if status not in (None, "failed") and not resume:
        raise ValueError(f"--out {run_dir} holds a finished run (status {status}): choose another --out, "
                         "or delete the folder to train it again")
    if not resume and checkpoint.latest(run_dir):
        raise ValueError(f"--out {run_dir} holds training checkpoints: add --resume to continue that run, "
                         "or choose another --out (or delete the folder) to start a new one")


def _claim(rt: _Runtime, state: TrainState) -> None:
    """Every check passed: the run takes ``run_dir`` over. A stale summary from an earlier (failed or
    killed) attempt must not mix in; when resuming, metrics and training checkpoints stay, the metrics
    cut back to the checkpoint's step (the run that died wrote on past it)."""
    if rt.is_main:
        run_dir = rt.run_dir
        try:
            run_dir.mkdir(parents=True, exist_ok=True)
            for name in ("summary.json", "traceback.txt") + (() if rt.resume else ("metrics.jsonl",)):
                with contextlib.suppress(FileNotFoundError):
                    (run_dir / name).unlink()
            shutil.rmtree(run_dir / "checkpoint", ignore_errors=True)
            if not rt.resume:
                shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
            save_yaml(rt.config, run_dir / "config.yaml")
            if rt.resume:
                cut_metrics(run_dir, state.step or None)
        except OSError as err:
            raise ValueError(f"--out {run_dir} is not writable: {err.strerror or err}") from None
    rt.barrier()   # dist: no rank writes (a checkpoint) into the folder before rank 0 has taken it over


def _check_free_space(run_dir: Path, model: torch.nn.Module, cfg: ExperimentConfig) -> None:
    """Fail before training, not at the first checkpoint, when the disk cannot hold the run."""
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    if cfg.backend == "sim" and cfg.dp_mode == "ddp":  # one process checkpoints every whole replica
        weights *= cfg.dp_size
    need = 16 << 20  # metrics, summary, tokenizer
    if cfg.checkpoint_every:
        kept = cfg.keep_checkpoints or max(1, cfg.steps // cfg.checkpoint_every)
        need += (kept + 1) * 3 * weights  # weights and two AdamW moments, one more while sealing
    if cfg.save_checkpoint:
        need += 2 * weights
    free = shutil.disk_usage(nearest_existing(run_dir)).free
    if free < need:
        raise ValueError(f"not enough free space in {run_dir}: the run writes about {need / 2**20:.0f} MiB, "
                         f"{free / 2**20:.0f} MiB are free; free some space or choose another --out")
