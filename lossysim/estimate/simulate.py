"""One estimate: the collectives of a model's training steps through one lossy network, without the model.

Every all-reduce goes through ``LossyNetwork.simulate``, the code path of a training run's
collectives: the same keyed streams draw the same fates, the same transport repairs them, the same
counters and clock move. Only the tensors are missing: a message is its element count and dtype.
Compute is modelled as a training run models it (``timing.compute``: the step's FLOPs at a GPU's
peak times an MFU, or its kernel launches), and a step takes its compute plus its communication
(no overlap).
"""
from __future__ import annotations

import contextlib
from collections import defaultdict, deque
from typing import Callable, Optional, Union

import numpy as np

from .. import timing
from ..models import cost
from ..net import LossyNetwork, NetworkSpec
from ..net.recovery import packets_of
from ..net.sparse import Losses, bad_packets_of
from .shapes import Shape, load
from .workload import Workload, step_calls


def estimate(model: Union[str, Shape], network: Union[NetworkSpec, dict], workload: Workload = Workload(),
             steps: int = 10, compute: str = "h100", tick: Optional[Callable[[], None]] = None) -> dict:
    """Simulate ``steps`` training steps of ``model`` (a name, a config path or a ``Shape``) over
    ``network`` (a ``NetworkSpec`` or its settings). Returns one flat row: per-step times, slowdown,
    packets, what was lost (docs/estimate.md lists the columns). ``tick`` is called after each step."""
    shape = model if isinstance(model, Shape) else load(model)
    spec = network if isinstance(network, NetworkSpec) else NetworkSpec(**network)
    if int(steps) < 1:
        raise ValueError(f"steps={steps} must be >= 1")
    shape.check_tp(spec.ranks)
    shape.check_seq(workload.seq)
    gpu = timing.parse_compute(compute)
    if isinstance(gpu, timing.Measured):
        raise ValueError("compute=measured needs a real training run; name a GPU model (e.g. h100)")
    tokens = workload.tokens
    kernels = shape.kernels + cost.collective_kernels(shape.layers, spec.ranks)   # as a training run counts them
    compute_s = gpu.step_time(shape.parameters, tokens, spec.ranks, kernels=kernels,
                              attention_flops=cost.step_flops(0, tokens, shape.layers, shape.hidden, workload.seq))

    net = LossyNetwork(spec)
    calls = step_calls(shape, workload.activation_checkpointing)
    numel, dtype = tokens * shape.hidden, workload.torch_dtype
    per_packet, _ = net.packets(numel, dtype)
    inexact, received = defaultdict(int), defaultdict(int)
    comm, done = [], 0.0
    for _ in range(int(steps)):
        record = defaultdict(deque)   # the first forward's deliveries, for the recomputed one
        for call in calls:
            if call.replay:
                with net.replaying(record):
                    net.simulate(call.site, call.direction, numel, dtype)
                continue
            with net.recording(record) if workload.activation_checkpointing else contextlib.nullcontext():
                delivery = net.simulate(call.site, call.direction, numel, dtype, deliver=False)
            received[call.direction] += spec.ranks * numel
            if delivery is not None:
                inexact[call.direction] += _inexact_elements(delivery, per_packet, numel)
        total = net.clock()["comm_s"]
        comm.append(total - done)
        done = total
        if tick is not None:
            tick()

    clock, steps = net.clock(), int(steps)
    totals = net.totals()
    packets = {name: totals[name] / steps for name in ("sent", "lost", "resent")}
    step_s = compute_s + np.asarray(comm)
    loss_free = compute_s + clock["ideal_comm_s"] / steps
    return {
        "model": shape.name, "parameters": shape.parameters, "tp_size": spec.ranks, "seq": workload.seq,
        "micro_batch": workload.micro_batch, "dtype": workload.dtype,
        "activation_checkpointing": workload.activation_checkpointing,
        "loss": spec.loss.spec, "loss_rate": spec.loss.loss_rate, "transport": spec.transport, "nic": spec.nic,
        "algorithm": spec.algorithm, "link_intra": spec.link_intra.spec, "link_inter": spec.link_inter.spec,
        "ranks_per_node": spec.ranks_per_node, "lossy_links": spec.lossy_links, "lossy": ",".join(spec.lossy),
        "recovery": spec.recovery,
        "seed": spec.seed, "compute": gpu.spec, "steps": steps,
        "collectives_per_step": sum(not call.replay for call in calls), "message_bytes": numel * dtype.itemsize,
        "compute_s": compute_s, "loss_free_comm_s": clock["ideal_comm_s"] / steps, "loss_free_step_s": loss_free,
        "step_mean_s": float(step_s.mean()), "step_p50_s": float(np.percentile(step_s, 50)),
        "step_p99_s": float(np.percentile(step_s, 99)), "slowdown": float(step_s.mean()) / loss_free,
        "comm_share": float(np.mean(comm)) / float(step_s.mean()),
        "packets_sent": packets["sent"], "packets_lost": packets["lost"], "packets_resent": packets["resent"],
        "elements_lost_fwd": inexact["fwd"] / received["fwd"] if received["fwd"] else 0.0,
        "elements_lost_bwd": inexact["bwd"] / received["bwd"] if received["bwd"] else 0.0,
        "failures_per_1000_steps": 1000.0 * net.failures() / steps,
    }


def _inexact_elements(delivery, per_packet: int, numel: int) -> int:
    """Elements, over every receiver, that are not the exact sum: a hole, or a sum missing a contribution
    (``delivery``: a policy's draw, or the lost packets as ``Losses``)."""
    bad, last = delivery.bad_packets() if isinstance(delivery, Losses) else bad_packets_of(packets_of(delivery))
    short = per_packet * -(-numel // per_packet) - numel       # the last packet is partial
    return bad * per_packet - last * short
