"""What changes as a run trains, and is saved in its checkpoints for an exact resume."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Optional

import torch

from .. import axes


@dataclass
class TrainState:
    """A run's progress: steps done, evaluation records, and the counters its summary reports.

    Checkpoints hold it as a plain dict (``state_dict``) under the key ``progress``, the form
    every checkpoint has had, so checkpoints resume across versions of this class.
    """
    step: int = 0
    best: dict = field(default_factory=dict)    # eval split -> its best evaluation so far
    final: dict = field(default_factory=dict)   # eval split -> its latest evaluation
    train_disagreement: list = field(default_factory=list)  # every train row's disagreement
    tokens: int = 0                              # real (non-padding) tokens trained on
    train_time: float = 0.0                      # wall seconds spent in training steps
    compute_s: float = 0.0                       # simulated compute seconds (see lossysim.timing)
    reached: Optional[dict] = None               # when the primary split first reached target_accuracy
    last_row: dict = field(default_factory=dict)  # the clock at the last train row (per-step rates)
    failures: int = 0                            # collectives the transport gave up on, charged so far
    restart_s: float = 0.0                       # simulated seconds their restarts cost
    # every axis's counters (``lossysim.axes``: dp_s, drift, pipeline_s, ...), read and written as
    # attributes (``state.dp_s``)
    counters: dict = field(default_factory=lambda: {c.name: c.fresh() for c in axes.counters()})

    def __getattr__(self, name: str):
        counters = self.__dict__.get("counters")
        if counters is not None and name in counters:
            return counters[name]
        raise AttributeError(f"{type(self).__name__!r} has no attribute {name!r}")

    def __setattr__(self, name: str, value) -> None:
        counters = self.__dict__.get("counters")
        if counters is not None and name in counters:
            counters[name] = value
        else:
            super().__setattr__(name, value)

    def state_dict(self) -> dict:
        saved = dataclasses.asdict(self)  # a deep copy: later steps must not change a saved checkpoint
        counters = saved.pop("counters")
        # An axis's counters only when used: other runs' checkpoints keep the keys they always had.
        fresh = {c.name: c.fresh() for c in axes.counters()}
        saved.update({name: value for name, value in counters.items() if value != fresh.get(name)})
        return saved

    @classmethod
    def from_dict(cls, saved: dict) -> "TrainState":
        names = {c.name for c in axes.counters()}
        state = cls(**{k: v for k, v in saved.items() if k not in names})
        state.counters.update({k: v for k, v in saved.items() if k in names})
        return state

    def record_evaluation(self, row: dict, target_accuracy: Optional[float] = None) -> None:
        """Keep an evaluation row as its split's final one, and as its best if it is; ``target_accuracy``
        (given for the primary split only) marks when it was first reached."""
        split = row["split"]
        final = {k: row[k] for k in ("accuracy", "loss", "step", "disagreement", "hidden_rel_diff", "sim_time_s")}
        if target_accuracy is not None and self.reached is None and row["accuracy"] >= target_accuracy:
            self.reached = {"step": row["step"], "sim_time_s": row["sim_time_s"],
                            "sim_time_s_ideal_nic": row.get("sim_time_s_ideal_nic")}
        self.final[split] = final
        best = self.best.get(split)
        if best is None or final["accuracy"] > best["accuracy"]:
            self.best[split] = dict(final)


class Window:
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
        """The window's loss, accuracy and throughput; the window starts over."""
        # dist: the mean over every rank's loss, through one reliable gather.
        loss = group.all_gather_reliable((self.loss / self.steps).reshape(1)).mean()
        values = {"loss": float(loss), "accuracy": float(self.correct) / self.examples, "tokens": self.tokens,
                  "tokens_per_s": self.tokens / self.seconds if self.seconds > 0 else 0.0}
        self.__init__(self.device)
        return values
