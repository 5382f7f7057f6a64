"""Cost of lossysim's tensor parallelism: one training step, side by side in one run.

One step = forward, backward and AdamW step of a sequence classifier (3 labels) on a
right-padded batch of 8 x 128 tokens, dropout 0, sdpa attention, random weights, for
the tiny shape (GPT-2, n_layer 2, n_head 4, n_embd 128, vocab 8192: lossysim's ``tiny``
with its default BPE vocabulary), ``tiny-llama`` (Llama, 2 layers, 4 query and 2 kv
heads, width 128, SwiGLU 352, vocab 8192: lossysim's ``tiny-llama``) and GPT-2 small
(n_layer 12, n_head 12, n_embd 768, vocab 50257).

Variants, all from the same initial weights:
  * ``hf``: the unmodified HF model;
  * ``sim tp2``, ``sim tp4``: lossysim's ``sim`` backend (all ranks in this process), no loss;
  * ``sim tp2 bern 1%``, ``sim tp2 GE 1% b8``: the same with Bernoulli 1% and
    Gilbert-Elliott (1% loss, mean burst 8 packets) on both directions;
  * ``dist tp2``: lossysim's ``dist`` backend, 2 gloo processes with 1 thread each, no loss,
    against ``pytorch TP``: torch.distributed.tensor.parallel.parallelize_module with
    ColwiseParallel (c_attn, c_fc) / RowwiseParallel (both c_proj) on a 1-D CPU DeviceMesh,
    applied to the same HF model after converting its Conv1D layers to nn.Linear (weight
    transposed; c_attn's outputs reordered [Q_r|K_r|V_r] per rank so each rank's contiguous
    column shard holds whole heads, and ``split_size`` set to the local width); for Llama,
    ColwiseParallel q/k/v/gate/up and RowwiseParallel o/down on the HF model as it is.
Variants of one group are held in memory together and stepped interleaved (one step of
each per round) after warm-up: all five for tiny; pairs for GPT-2 small, whose five
AdamW-equipped copies do not fit in memory beside other jobs. Times are medians over
rounds; a ratio (and its PASS/FAIL) is the median over rounds of the two variants'
per-round ratio, so load from other processes, which drifts, hits both sides of a ratio
alike; the plain ratio of medians is printed next to it. ``hf`` and ``sim tp2`` are
timed again with 1 thread, the fair baseline for the 2 x 1-thread ``dist`` runs. Peak
memory (RSS high-water mark over 2 steps) of ``hf`` and ``sim tp4`` comes from separate
subprocesses. ``--device cuda`` runs the in-process variants on the GPU (``dist`` and
memory stay on the CPU, and are skipped there). The models, batches and PyTorch's own tensor parallelism
are built by ``tp_models.py``.

    python benchmarks/bench_tensor_parallel.py [--quick] [--repeats N] [--device cpu|cuda] [--profile VARIANT]
"""
from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import torch  # noqa: E402
from torch import nn  # noqa: E402

from lossysim import LossyNetwork, parallelize  # noqa: E402
from tp_models import (BATCH, SEQ, SHAPES, describe, make_batch, make_model, pytorch_tensor_parallel,  # noqa: E402
                       train_step)

DEVICE = torch.device("cpu")  # of the in-process variants (--device)
SIM_VARIANTS = {  # name -> (tp_size, loss spec); tp 0 = unmodified HF
    "hf": (0, None),
    "sim tp2": (2, "none"),
    "sim tp4": (4, "none"),
    "sim tp2 bern 1%": (2, "bernoulli:0.01"),
    "sim tp2 GE 1% b8": (2, "ge:rate=0.01,burst=8"),
}
TARGETS = (  # (label, numerator, denominator, limit)
    ("sim tp2 <= 1.3 x hf", "sim tp2", "hf", 1.3),
    ("bernoulli 1% <= 1.15 x no loss (sim tp2)", "sim tp2 bern 1%", "sim tp2", 1.15),
    ("Gilbert-Elliott 1% b8 <= 1.15 x no loss (sim tp2)", "sim tp2 GE 1% b8", "sim tp2", 1.15),
)


# -- variants and timed rounds --------------------------------------------------------

def make_variant(name: str, base: nn.Module):
    tp, spec = SIM_VARIANTS[name]
    model = copy.deepcopy(base).to(DEVICE)
    if tp:
        model = parallelize(model, tp, LossyNetwork(tp, spec, seed=0))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def timed_rounds(steps: dict, warmup: int, repeats: int, barrier=None) -> dict:
    """{name: [seconds per step]}: warm-up, then ``repeats`` rounds of one step of each, interleaved."""
    for _ in range(warmup):
        for step in steps.values():
            step()
    times = {name: [] for name in steps}
    for _ in range(repeats):
        for name, step in steps.items():
            if barrier:
                barrier()
            start = time.perf_counter()
            step()
            if barrier:
                barrier()
            times[name].append(time.perf_counter() - start)
    return times


def measure_group(names, base, batch, warmup: int, repeats: int) -> dict:
    """Variants in memory together, stepped interleaved (one step of each per round).

    Returns {"times": {name: [s per round]}, "first_loss": {name: loss before any update},
    "loss_summary": {name: (network totals, loss model)} for the lossy ones}.
    """
    variants = {name: make_variant(name, base) for name in names}
    first = {name: train_step(m, o, batch) for name, (m, o) in variants.items()}  # the first warm-up round
    steps = {name: (lambda m=m, o=o: train_step(m, o, batch)) for name, (m, o) in variants.items()}
    times = timed_rounds(steps, max(warmup - 1, 0), repeats)
    summary = {name: (m.network.summary(by=())[0], m.network.loss_model) for name, (m, _) in variants.items()
               if hasattr(m, "network") and not m.network.loss_model.lossless}
    del variants, steps
    gc.collect()
    return {"times": times, "first_loss": first, "loss_summary": summary}


def measure(groups, base, batch, warmup: int, repeats: int) -> dict:
    """Merge several groups: each variant's times come from the first group that ran it;
    ``pairs[(a, b)]`` are the per-round ratios a/b from a group that ran both side by side."""
    out = {"times": {}, "first_loss": {}, "loss_summary": {}, "pairs": {}}
    for names in groups:
        got = measure_group(names, base, batch, warmup, repeats)
        for key in ("times", "first_loss", "loss_summary"):
            for name, value in got[key].items():
                out[key].setdefault(name, value)
        for a in names:
            for b in names:
                if a != b:
                    out["pairs"].setdefault((a, b), [x / y for x, y in zip(got["times"][a], got["times"][b])])
    return out


def paired_ratio(measured: dict, a: str, b: str) -> float:
    """Median over rounds of t_a / t_b, both timed in the same round (robust to drifting load)."""
    return statistics.median(measured["pairs"][(a, b)])


def summarise(times: dict) -> dict:
    return {name: {"median": statistics.median(t), "min": min(t), "n": len(t)} for name, t in times.items()}


# -- PyTorch's own tensor parallelism, in 2 gloo processes -------------------------------------

def dist_worker(rank: int, world: int, shape: str, warmup: int, repeats: int, out_dir: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="file://" + os.path.join(out_dir, "init"), rank=rank,
                            world_size=world, timeout=timedelta(seconds=600))
    try:
        base = make_model(shape)
        batch = make_batch(base.config.vocab_size)
        with torch.no_grad():
            hf_loss = base(**batch).loss.item()
        ours = parallelize(copy.deepcopy(base), world, backend="dist")
        theirs = pytorch_tensor_parallel(base, init_device_mesh("cpu", (world,)))  # base is consumed
        del base
        models = {"pytorch TP": theirs, "dist tp2": ours}
        optimizers = {name: torch.optim.AdamW(m.parameters(), lr=1e-4) for name, m in models.items()}
        check = {}
        with torch.no_grad():  # both reproduce HF's loss before any step
            for name, model in models.items():
                check[name] = abs(model(**batch).loss.item() - hf_loss) / abs(hf_loss)
        steps = {name: (lambda m=models[name], o=optimizers[name]: train_step(m, o, batch)) for name in models}
        times = timed_rounds(steps, warmup, repeats, barrier=dist.barrier)
        if rank == 0:
            with open(os.path.join(out_dir, "dist.json"), "w") as f:
                json.dump({"times": summarise(times), "raw": times, "loss_rel_diff": check}, f)
    finally:
        dist.destroy_process_group()


def run_dist(shape: str, warmup: int, repeats: int) -> dict:
    import torch.multiprocessing as mp
    with tempfile.TemporaryDirectory() as out_dir:
        mp.start_processes(dist_worker, args=(2, shape, warmup, repeats, out_dir), nprocs=2,
                           join=True, start_method="spawn")
        with open(os.path.join(out_dir, "dist.json")) as f:
            return json.load(f)


# -- memory -------------------------------------------------------------------------------

def _status_mib(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024  # kB
    raise KeyError(field)


def memory_probe(shape: str, variant: str) -> None:
    """In a fresh process, JSON on stdout: RSS once model, optimizer state and lazy imports exist
    (after a 1 x 8-token step), then the peak RSS over 2 full steps (VmHWM, reset in between)."""
    base = make_model(shape)
    model, optimizer = make_variant(variant, base)
    del base
    batch = make_batch(model.config.vocab_size)
    train_step(model, optimizer, {k: v[:1, :8] if v.dim() == 2 else v[:1] for k, v in batch.items()})
    before = _status_mib("VmRSS")
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset the peak-RSS counter (Linux >= 4.0)
        reset = True
    except OSError:
        reset = False
    for _ in range(2):
        train_step(model, optimizer, batch)
    print(json.dumps({"before_mib": before, "peak_mib": _status_mib("VmHWM"), "reset": reset}))


def measure_memory(shape: str, variant: str) -> dict:
    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--memory-probe", shape, variant],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


# -- profiling ------------------------------------------------------------------------------

def profile(shape: str, variant: str, rows: int = 25) -> None:
    from torch.profiler import ProfilerActivity, profile as torch_profile
    base = make_model(shape)
    model, optimizer = make_variant(variant, base)
    batch = {k: v.to(DEVICE) for k, v in make_batch(base.config.vocab_size).items()}
    for _ in range(2):
        train_step(model, optimizer, batch)
    with torch_profile(activities=[ProfilerActivity.CPU], record_shapes=False) as prof:
        train_step(model, optimizer, batch)
    print(f"== torch.profiler: {shape}, {variant}, {torch.get_num_threads()} thread(s)")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows))


# -- report ----------------------------------------------------------------------------------

def fmt_row(name: str, stats: dict, ref_name: str = None, ratio: float = None) -> str:
    line = f"  {name:<20} {stats['median'] * 1e3:10.1f} {stats['min'] * 1e3:10.1f}"
    if ratio is not None:
        line += f"   {ratio:5.2f} x {ref_name}"
    return line


def bench_shape(shape: str, warmup: int, repeats: int, with_dist: bool, with_memory: bool) -> list:
    """Run and print one shape; return [(target label, paired ratio, limit, ratio of medians)]."""
    print(f"\n== {shape}: {describe(shape)}; batch {BATCH} x {SEQ}; warm-up {warmup}, median of {repeats}; "
          f"device {DEVICE}")
    base = make_model(shape)
    batch = {k: v.to(DEVICE) for k, v in make_batch(base.config.vocab_size).items()}
    results = []

    threads = torch.get_num_threads()
    if sum(p.numel() for p in base.parameters()) < 50e6:
        groups = [list(SIM_VARIANTS)]
        how = "all variants interleaved"
    else:  # 5 GPT-2 small models with AdamW state do not fit beside other jobs: pairs at a time
        groups = [("hf", "sim tp2"), ("hf", "sim tp4"), ("sim tp2", "sim tp2 bern 1%"),
                  ("sim tp2", "sim tp2 GE 1% b8")]
        how = "interleaved in pairs: " + ", ".join("/".join(g) for g in groups)
    got = measure(groups, base, batch, warmup, repeats)
    times = summarise(got["times"])
    first = got["first_loss"]
    print(f"-- in-process, {threads} threads, {how}")
    print(f"  {'variant':<20} {'median ms':>10} {'min ms':>10}   paired ratio (median over rounds)")
    for name in SIM_VARIANTS:
        ref = "hf" if name in ("sim tp2", "sim tp4") else ("sim tp2" if name != "hf" else None)
        print(fmt_row(name, times[name], ref, paired_ratio(got, name, ref) if ref else None))
    print(f"  first-step loss, rel. diff to hf: sim tp2 {abs(first['sim tp2'] - first['hf']) / first['hf']:.1e}, "
          f"sim tp4 {abs(first['sim tp4'] - first['hf']) / first['hf']:.1e}")
    for name in ("sim tp2 bern 1%", "sim tp2 GE 1% b8"):
        total, model = got["loss_summary"][name]
        print(f"  {name}: observed loss {total['observed_loss_rate']:.4f} over {total['sent']} packets, "
              f"mean burst {total['observed_mean_burst']:.2f} (configured {model.loss_rate:g}, "
              f"{model.mean_burst:.2f})")
    for label, num, den, limit in TARGETS:
        results.append((f"{shape}: {label} ({threads} threads)", paired_ratio(got, num, den), limit,
                        times[num]["median"] / times[den]["median"]))
    del got
    gc.collect()

    torch.set_num_threads(1)
    try:
        got = measure([("hf", "sim tp2")], base, batch, warmup, repeats)
    finally:
        torch.set_num_threads(threads)
    one = summarise(got["times"])
    print("-- in-process, 1 thread, interleaved")
    print(fmt_row("hf", one["hf"]))
    print(fmt_row("sim tp2", one["sim tp2"], "hf", paired_ratio(got, "sim tp2", "hf")))
    results.append((f"{shape}: sim tp2 <= 1.3 x hf (1 thread)", paired_ratio(got, "sim tp2", "hf"), 1.3,
                    one["sim tp2"]["median"] / one["hf"]["median"]))
    del got, base
    gc.collect()

    if with_dist:
        got = run_dist(shape, warmup, repeats)
        d = got["times"]
        print("-- dist: 2 gloo processes x 1 thread, no loss")
        dist_ratio = statistics.median(a / b for a, b in zip(got["raw"]["dist tp2"], got["raw"]["pytorch TP"]))
        print(fmt_row("pytorch TP", d["pytorch TP"]))
        print(fmt_row("dist tp2", d["dist tp2"], "pytorch TP", dist_ratio))
        print(f"  vs in-process 1 thread: hf {one['hf']['median'] * 1e3:.1f} ms, "
              f"sim tp2 {one['sim tp2']['median'] * 1e3:.1f} ms -> dist tp2 = "
              f"{d['dist tp2']['median'] / one['hf']['median']:.2f} x hf (1 thread)")
        print("  loss before training, rel. diff to hf: " +
              ", ".join(f"{k} {v:.1e}" for k, v in got["loss_rel_diff"].items()))
        results.append((f"{shape}: dist tp2 <= 1.1 x pytorch TP", dist_ratio, 1.1,
                        d["dist tp2"]["median"] / d["pytorch TP"]["median"]))

    if with_memory:
        print("-- memory: separate processes, MiB: RSS before the steps (weights, AdamW state, imports), "
              "peak RSS over 2 steps, peak - before")
        mem = {name: measure_memory(shape, name) for name in ("hf", "sim tp4")}
        for name, m in mem.items():
            print(f"  {name:<20} {m['before_mib']:10.0f} {m['peak_mib']:10.0f} {m['peak_mib'] - m['before_mib']:10.0f}"
                  + ("" if m["reset"] else "   (peak counter not reset: includes start-up)"))
        growth = {k: m["peak_mib"] - m["before_mib"] for k, m in mem.items()}
        print(f"  sim tp4 / hf: peak {mem['sim tp4']['peak_mib'] / mem['hf']['peak_mib']:.2f} x, "
              f"step growth {growth['sim tp4'] / max(growth['hf'], 1e-9):.2f} x")
    return results


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny shapes only (skip GPT-2 small)")
    parser.add_argument("--device", default="cpu", help="device of the in-process variants (cpu, cuda)")
    parser.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=None,
                        help="shapes to run (default: all; --quick: tiny and tiny-llama)")
    parser.add_argument("--repeats", type=int, default=None, help="timed rounds (default 15 tiny, 6 small)")
    parser.add_argument("--warmup", type=int, default=None, help="warm-up rounds (default 3 tiny, 1 small)")
    parser.add_argument("--no-dist", action="store_true", help="skip the 2-process dist comparison")
    parser.add_argument("--no-memory", action="store_true", help="skip the peak-memory subprocesses")
    parser.add_argument("--profile", metavar="VARIANT", choices=sorted(SIM_VARIANTS),
                        help="print a torch.profiler table for one step of VARIANT and exit")
    parser.add_argument("--shape", choices=list(SHAPES), default=None, help="with --profile: which shape")
    parser.add_argument("--threads", type=int, default=None, help="torch threads in this process")
    parser.add_argument("--memory-probe", nargs=2, metavar=("SHAPE", "VARIANT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    global DEVICE
    DEVICE = torch.device(args.device)
    if DEVICE.type != "cpu":  # gloo processes and RSS measure the CPU only
        args.no_dist = args.no_memory = True
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.memory_probe:
        memory_probe(*args.memory_probe)
        return 0
    if args.profile:
        profile(args.shape or "tiny", args.profile)
        return 0

    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, {torch.get_num_threads()} threads; "
          f"load average {os.getloadavg()[0]:.2f} at start")
    shapes = args.shapes or (["tiny", "tiny-llama"] if args.quick else list(SHAPES))
    results = []
    for shape in shapes:
        small = shape.startswith("tiny")
        warmup = args.warmup if args.warmup is not None else (3 if small else 1)
        repeats = args.repeats or (15 if small else 6)
        results += bench_shape(shape, warmup, repeats, not args.no_dist, not args.no_memory)
    print(f"\n== targets (load average {os.getloadavg()[0]:.2f} at end; other processes on this "
          "machine inflate and scatter every figure)")
    for label, ratio, limit, ratio_of_medians in results:
        print(f"  {'PASS' if ratio <= limit else 'FAIL'}  {label}: {ratio:.2f} (ratio of medians {ratio_of_medians:.2f})")
    return 0  # timings on a shared machine are reported, not enforced (as bench_loss_models does)


if __name__ == "__main__":
    sys.exit(main())
