"""Record the profiler traces under tests/data/traces: PyTorch's own data and pipeline parallelism training
lossysim's ``tiny-llama`` shape for a few steps on gloo CPU ranks, each rank profiled as a user would
(``torch.profiler``, ``record_shapes=True``, the first steps skipped: DDP rebuilds its buckets after
its first backward).

    python tests/data/traces/record.py [--out tests/data/traces] [--jobs ddp,fsdp,pp]

Writes ``<job>/rank<r>.json.gz`` (``export_chrome_trace`` gzips a path ending in .gz) and
``<job>/job.json``: the settings the tests hold the trace against (the same job as a named shape).
The traces are PyTorch 2.13's (CPU); another version writes other ids and times, the same calls.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[2]))

SEQ, MICRO_BATCH, MICROBATCHES = 64, 2, 4
# Each job: its world, the steps traced after two unprofiled ones, the ranks whose trace is kept (DDP's and
# FSDP's ranks mirror each other: one file stands for both), and what the estimate needs to describe the
# same job by its named shape.
JOBS = {
    "ddp": dict(world=2, traced=2, keep=(0,), dp_size=2, dp_mode="ddp", pp_size=1, microbatches=1, dp_bucket_mb=1),
    "fsdp": dict(world=2, traced=1, keep=(0,), dp_size=2, dp_mode="fsdp", pp_size=1, microbatches=1),
    "pp": dict(world=2, traced=1, keep=(0, 1), dp_size=1, pp_size=2, pp_schedule="gpipe", microbatches=MICROBATCHES),
}


def _config():
    from lossysim.estimate.shapes import config_of
    config = config_of("tiny-llama")
    config._attn_implementation = "sdpa"
    return config


def _batch(step: int, rank: int, rows: int, vocab: int) -> torch.Tensor:
    return torch.randint(vocab, (rows, SEQ), generator=torch.Generator().manual_seed(1000 * step + rank))


def _profiler(path: Path, job: str, rank: int):
    def ready(prof):
        if rank in JOBS[job]["keep"]:
            prof.export_chrome_trace(str(path))
    return torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True,
                                  schedule=torch.profiler.schedule(wait=1, warmup=1, active=JOBS[job]["traced"]),
                                  on_trace_ready=ready)


def _steps(job: str) -> int:
    return 2 + JOBS[job]["traced"]


def _data_parallel(rank: int, mode: str, out: Path) -> None:
    from transformers import AutoModelForCausalLM
    config = _config()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    if mode == "ddp":
        # a cap of one's own (1 MiB: many buckets to compare); DDP's default cap, 25 MiB, also makes its
        # first bucket 1 MiB (docs/estimate.md)
        model = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=JOBS["ddp"]["dp_bucket_mb"])
    else:
        from torch.distributed.fsdp import fully_shard
        # lossysim's FSDP keeps a unit's gathered weights through the backward (FSDP2's default gathers
        # them again there): the setting both describe, so that the comparison holds like with like
        for layer in model.model.layers:
            fully_shard(layer, reshard_after_forward=False)
        fully_shard(model, reshard_after_forward=False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    with _profiler(out / f"rank{rank}.json.gz", mode, rank) as prof:
        for step in range(_steps(mode)):
            ids = _batch(step, rank, MICRO_BATCH, config.vocab_size)
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            prof.step()


class _Stage(nn.Module):
    """One pipeline stage of a Llama: the embeddings on the first, its blocks, the norm and head on the last."""

    def __init__(self, model, blocks: range, first: bool, last: bool):
        super().__init__()
        self.embed = model.model.embed_tokens if first else None
        self.rotary = model.model.rotary_emb
        self.layers = nn.ModuleList(model.model.layers[i] for i in blocks)
        self.norm = model.model.norm if last else None
        self.head = model.lm_head if last else None

    def forward(self, x):
        hidden = self.embed(x) if self.embed is not None else x
        positions = torch.arange(hidden.shape[1]).unsqueeze(0)
        rotary = self.rotary(hidden, positions)
        for layer in self.layers:
            hidden = layer(hidden, position_embeddings=rotary, position_ids=positions)
        return self.head(self.norm(hidden)) if self.head is not None else hidden


def _pipeline(rank: int, out: Path) -> None:
    from transformers import AutoModelForCausalLM
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe
    config = _config()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    half = config.num_hidden_layers // 2
    blocks = range(0, half) if rank == 0 else range(half, config.num_hidden_layers)
    stage_module = _Stage(model, blocks, rank == 0, rank == 1)
    stage = PipelineStage(stage_module, rank, 2, torch.device("cpu"))

    def loss_fn(logits, labels):
        return nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())

    schedule = ScheduleGPipe(stage, MICROBATCHES, loss_fn=loss_fn)
    optimizer = torch.optim.AdamW(stage_module.parameters(), lr=1e-4)
    with _profiler(out / f"rank{rank}.json.gz", "pp", rank) as prof:
        for step in range(_steps("pp")):
            ids = _batch(step, 0, MICRO_BATCH * MICROBATCHES, config.vocab_size)
            if rank == 0:
                schedule.step(ids)
            else:
                schedule.step(target=ids)
            optimizer.step()
            optimizer.zero_grad()
            prof.step()


def _worker(rank: int, job: str, world: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        if job == "pp":
            _pipeline(rank, Path(out))
        else:
            _data_parallel(rank, job, Path(out))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(HERE))
    parser.add_argument("--jobs", default=",".join(JOBS))
    args = parser.parse_args()
    for job in args.jobs.split(","):
        out = Path(args.out) / job
        out.mkdir(parents=True, exist_ok=True)
        settings = JOBS[job]
        mp.spawn(_worker, args=(job, settings["world"], _free_port(), str(out)), nprocs=settings["world"])
        keys = {k: v for k, v in settings.items() if k not in ("world", "traced", "keep")}
        (out / "job.json").write_text(json.dumps({"model": "tiny-llama", "seq": SEQ, "micro_batch": MICRO_BATCH,
                                                  "steps_traced": settings["traced"], "torch": torch.__version__,
                                                  **keys}, indent=1) + "\n")
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
