"""The config every training test starts from: the tiny GPT-2 on the synthetic task, a few steps.

Not collected by pytest (no ``test_`` prefix). Each test module sizes its runs (samples, steps,
evaluations) in the ``settings`` it passes; what they all share, and the validation, is here once.
"""
from __future__ import annotations

from pathlib import Path
from typing import Union

import torch

from lossysim.config import ExperimentConfig
from lossysim.net import NetworkSpec

# Short rows and small batches: a CPU step in milliseconds.
TINY = dict(model="tiny", dataset="synthetic", max_length=32, batch_size=8, eval_batch_size=32)


def tiny_run(out: Union[str, Path], /, **settings) -> ExperimentConfig:
    """A validated config writing to ``out``: ``TINY``, then ``settings`` (which may override both,
    ``out`` included: positional-only, so a caller's ``out=`` reaches the config)."""
    return ExperimentConfig(**{**TINY, "out": str(out), **settings}).validate()


def dp_group_spec(config: ExperimentConfig, tp_rank: int = 0) -> NetworkSpec:
    """The network spec of TP position ``tp_rank``'s data-parallel group, as a run places it."""
    mesh = config.mesh()
    return mesh.network_spec("dp", mesh.rank(tp=tp_rank), config.network_settings(), config.dp_lossy())


def train_steps(config: ExperimentConfig, steps: int):
    """Build ``config``'s run (sim, CPU) and train ``steps`` steps with the run's own step: its parts,
    state and window."""
    from lossysim.data import train_batches
    from lossysim.run.build import build
    from lossysim.run.state import TrainState, Window
    from lossysim.run.step import train_step
    cpu = torch.device("cpu")
    parts = build(config, cpu, 0, True, None)
    state, window = TrainState(), Window(cpu)
    for _, batch in zip(range(steps), train_batches(parts.data, config.batch_size, config.seed)):
        assert train_step(parts, config, state, window, batch, cpu)
        state.step += 1
    return parts, state, window


def assert_train_refuses(settings: list, message: str, out: Path, capsys) -> None:
    """``lossysim train`` of a one-step tiny run with ``settings`` (flags) exits 2 with one line holding
    ``message`` and writes no summary."""
    from lossysim import cli
    code = cli.main(["train", "--set", "max_length=32", "--set", "batch_size=8", "--set", "max_train_samples=16",
                     "--steps", "1", "--tp-size", "1", "--no-progress", "--out", str(out), *settings])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and message in err, err
    assert not (out / "summary.json").exists()
