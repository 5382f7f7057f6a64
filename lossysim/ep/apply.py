"""``apply_ep``: a run's MoE blocks made expert-parallel over the mesh's ep groups (torchtitan applies it
after tensor parallelism, before data parallelism), and ``ExpertParallelism``, what the training step asks
of it: running the replicas side by side (``sim``), the experts' gradients averaged over their own
expert-data-parallel groups, their share of the gradient norm, the all-to-alls' seconds, statistics and
saved state.

Megatron's layout: ``ep`` is carved out of the data-parallel ranks (``Mesh.group("ep", rank)``); rank e of a group
holds the e-th block of ``num_experts / ep`` experts; the ranks holding the same experts
(``Mesh.group("edp", rank)``, dp / ep of them) average their gradients over a lossy network of their own, as DDP's
buckets (site ``dp.bucket{i}``, lossy when ``lossy_traffic`` names dp), divided by ep as well: each
expert's gradient sums the tokens of its whole ep group, so (1 / edp) x (1 / ep) x that sum is the
gradient of the global batch's mean loss, as every dense parameter's is.

Inside pipeline stages a block's experts use its stage's groups (the mesh's groups fix pp), and beside FSDP
the experts stay out of its units: their own groups average them as above (docs/experts.md).
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist

from ..config import ExperimentConfig
from ..dp import DataParallel, Replica
from ..dp.replicas import DistDataParallel
from ..mesh import Mesh
from ..net import LossyNetwork
from .axis import EP_CLASSES
from .context import ContextExperts, ContextGroup, MemberView, members
from .experts import ExpertParallel
from .groups import DistGroup, Networks, SimGroup, SimShared
from .lockstep import Lockstep


def check(config: ExperimentConfig, device: torch.device) -> None:
    """What training does not model beside expert parallelism (the estimate does; every command's pairs
    are the config's)."""
    if config.ep_size == 1:
        return
    ep = f"ep_size={config.ep_size}"
    # each pair, the setting that leaves it (spelt as --set takes it), and whether lossysim estimate times it
    for name, used, why, default, timed in (
            ("activation_checkpointing", config.activation_checkpointing, "recomputed blocks", "false", True),
            ("dp_sync_every", config.dp_sync_every, "synchronised replicas", 0, False)):
        if used:
            choices = [f"{key}={value}" for key, value in ((name, default), ("ep_size", 1))
                       if config.accepts(**{key: value})]
            leave = f"; set {' or '.join(choices)}" if choices else ""
            raise ValueError(f"training {ep} with {name}={getattr(config, name)} ({why}) is not supported{leave}"
                             f"{' (lossysim estimate times the pair)' if timed else ''}")
    if config.cp_size > 1 and config.ep_size % config.cp_size:   # Megatron's carving allows it; ours trains
        # a replica's context ranks as members of one ep group (``ep.context``)
        raise ValueError(f"training {ep} with cp_size={config.cp_size}: experts beside context parallelism need "
                         "ep_size a multiple of cp_size (a replica's context ranks, members of one ep group; "
                         "lossysim estimate times the pair)")
    if config.backend == "sim" and device.type != "cpu":
        raise ValueError(f"{ep} on backend=sim runs on the CPU (its replicas meet inside CPU backward passes); "
                         "use device=cpu, or backend=dist")


def shard_experts(tp_model, mesh: Mesh, rank: int, pipeline=None, contexts: int = 1) -> list[ExpertParallel]:
    """Every MoE block's experts (the plan's ``experts``) as global ``rank``'s share of them (all of them
    with ep 1), in place, before the optimiser sees the parameters. None: not a mixture of experts.
    ``pipeline``: the replica's stages; a block's experts sit on its stage's TP group and ep group (the
    mesh's groups at that stage, as Megatron's expert layers inside a pipeline stage). ``contexts``: the
    context ranks the model runs (``sim``: cp), each holding its own member's experts (``ContextExperts``)."""
    plan = tp_model.plan
    if plan.experts is None:
        if mesh.ep > 1:
            raise ValueError(f"ep_size={mesh.ep} needs a mixture-of-experts model (tiny-moe, Mixtral, Qwen3-MoE), "
                             f"not {type(tp_model.model).__name__}")
        return []
    member = mesh.coordinates(rank)["ep"]
    blocks = tp_model.model.base_model.get_submodule(plan.blocks)
    layout = (len(blocks),) if pipeline is None else pipeline.layout
    stage_of = [s for s, count in enumerate(layout) for _ in range(count)]
    modules = []
    for i, block in enumerate(blocks):
        parent, _, leaf = plan.experts.rpartition(".")
        holder = block.get_submodule(parent) if parent else block
        if not hasattr(holder, leaf):       # a dense block (DeepSeek-V3's first layers)
            continue
        # sim holds every stage's TP group; a dist process its own stage's alone (the others' blocks never run)
        group = tp_model.groups[stage_of[i]] if len(tp_model.groups) == len(layout) else tp_model.group
        site = f"{plan.blocks}.{i}.{plan.experts}"
        if contexts > 1:
            module = ContextExperts(getattr(holder, leaf), site, member, mesh.ep, group, contexts)
        else:
            module = ExpertParallel(getattr(holder, leaf), site, member, mesh.ep, group)
            module.routers = min(mesh.cp, mesh.ep)   # evaluation: the first replica's context ranks route
        module.stage = stage_of[i]
        setattr(holder, leaf, module)
        modules.append(module)
    tp_model.experts = modules
    return modules


class ExpertParallelism:
    """A run's expert parallelism as this process holds it: every group's networks (``sim``) or its own
    (``dist``), the expert-data-parallel averaging, and the clock's views of the all-to-alls. With
    pipeline stages every stage's experts have groups of their own (at that stage's ranks): ``sim``
    holds every stage's, a ``dist`` process its own ``stage``'s, the others' crossing ``pp_group``."""

    def __init__(self, mesh: Mesh, groups: list[Networks], lockstep: Optional[Lockstep],
                 edp: Sequence[DataParallel], replica_groups: list[dict[int, list[Networks]]], tp_group=None,
                 ep_group=None, stage: int = 0, pp_group=None, contexts: int = 1):
        self.mesh, self.groups, self.lockstep, self.edp = mesh, groups, lockstep, list(edp)
        self.contexts = contexts                # sim: the context ranks a replica runs (each one member)
        # per replica this process runs: per stage it holds, its groups TP rank by TP rank
        self.replica_groups = replica_groups
        self.tp_group = tp_group                # dist: the TP ranks whose groups run side by side
        self.ep_group = ep_group                # dist: this rank's ep group (None: ep 1, or sim)
        self.stage, self.pp_group = stage, pp_group   # dist: this process's stage, its pipeline's ranks
        self._mark = self._seconds()

    def run(self, tasks: Sequence) -> list:
        """Every replica's task (forward and backward); side by side where their experts meet."""
        if self.lockstep is not None and self.mesh.ep > 1 and len(tasks) > 1:
            return self.lockstep.run(tasks)
        return [task() for task in tasks]

    def stage_clocks(self, replica: int, stage: int) -> list:
        """Per class, the slowest of a replica's stage's TP ranks' groups (they run side by side); none for
        a stage this process does not run."""
        groups = self.replica_groups[replica].get(stage)
        if groups is None:
            return []
        return [_Slowest([g.train[c] for g in groups], self.tp_group) for c in EP_CLASSES]

    def clocks(self, replica: int) -> list:
        """What ``_accumulate`` reads a replica's all-to-all seconds from: every stage's ``stage_clocks``."""
        return [view for s in sorted(self.replica_groups[replica]) for view in self.stage_clocks(replica, s)]

    def beside(self, networks: list, replica: int, staged: bool) -> list:
        """The clocks ``_accumulate`` reads a replica's forward and backward from: ``networks`` (one per
        stage when ``staged``) with the all-to-alls beside them; staged, each stage's inside its own (a
        stage's forward and backward wait for its all-to-alls: the schedule sees them)."""
        if not staged:
            return [*networks, *self.clocks(replica)]
        return [_Summed([network, *self.stage_clocks(replica, s)]) for s, network in enumerate(networks)]

    def step_seconds(self) -> tuple[float, float]:
        """Replica 0's all-to-all seconds since the last call (its configured nic's, the ideal nic's)."""
        now = self._seconds()
        added = (now[0] - self._mark[0], now[1] - self._mark[1])
        self._mark = now
        return added

    def _seconds(self) -> tuple[float, float]:
        """Replica 0's all-to-alls' seconds so far, stage by stage and class by class (dist: every stage's
        gathered, summed in ``sim``'s order)."""
        clocks = [[view.clock()[key] for key in ("comm_s", "comm_s_ideal_nic")] for view in self.clocks(0)] \
            if self.replica_groups else []
        if self.pp_group is not None:
            mine = torch.tensor(clocks, dtype=torch.float64).reshape(-1)
            every = mine.new_empty(dist.get_world_size(self.pp_group) * mine.numel())
            dist.all_gather_into_tensor(every, mine, group=self.pp_group)
            clocks = every.view(-1, 2).tolist()
        return (sum(c[0] for c in clocks), sum(c[1] for c in clocks))

    def average_gradients(self, replicas: Sequence[Replica]) -> float:
        """The experts' gradients averaged over their expert-data-parallel groups, then divided by ep;
        the seconds it adds (the slowest group's)."""
        seconds = 0.0
        for edp in self.edp:
            seconds = max(seconds, sum(sum(stage) for stage in edp.average_gradients()))
        # an ep group spans ep / cp replicas (Megatron carves it out of dp x cp): its experts' gradients
        # sum that many replicas' losses
        spanned = self.mesh.ep // self.mesh.cp if self.mesh.cp > 1 else self.mesh.ep
        for replica in replicas:
            for param in expert_parameters(replica.model):
                if param.grad is not None:
                    param.grad.div_(spanned)
        return seconds

    def squares(self, replicas: Sequence[Replica]) -> list[torch.Tensor]:
        """Per replica this process runs: the sum of squares of its ep group's expert gradients (every member
        holds other experts; summed member by member, then stage by stage, in both backends' order)."""
        ep, stages = self.mesh.ep, self.mesh.pp
        if self.ep_group is not None:      # dist: the group's, gathered reliably
            own = _squares(replicas[0].model, self.stage)
            every = torch.empty(ep, dtype=own.dtype, device=own.device)
            dist.all_gather_into_tensor(every, own.reshape(1), group=self.ep_group)
            mine = _sum(every.unbind())
            if self.pp_group is None:
                return [mine]
            across = mine.new_empty(stages)
            dist.all_gather_into_tensor(across, mine.reshape(1), group=self.pp_group)
            return [_sum(across.unbind())]
        if self.lockstep is None:          # dist, ep 1: the group is this rank (and no expert is ep-sharded)
            return [_sum([_squares(replica.model, s) for s in range(stages)]) for replica in replicas]
        # sim: [replica][stage][its context ranks' members]; a group's ep / cp replicas' members in order
        own = [[_squares(replica.model, s, c) for s in range(stages)] for replica in replicas
               for c in range(self.contexts)]
        own = [[[own[r * self.contexts + c][s] for c in range(self.contexts)] for s in range(stages)]
               for r in range(len(replicas))]
        spans = ep // self.contexts
        return [_sum([_sum([m for j in range((r // spans) * spans, (r // spans + 1) * spans) for m in own[j][s]])
                      for s in range(stages)]) for r in range(len(replicas))]

    def networks(self) -> list[LossyNetwork]:
        return [n for g in self.groups for n in g.train.values()]

    def summaries(self, by: Sequence[str] = ("direction",)) -> dict[str, list[dict]]:
        """Per class, replica 0's groups' traffic, stage by stage, one per TP rank (dist: gathered over the
        TP group, then the pipeline's stages)."""
        out = {}
        for c in EP_CLASSES:
            held = self.replica_groups[0]
            rows = [row for s in sorted(held) for g in held[s] for row in g.train[c].summary(by=by)]
            for group in (self.tp_group, self.pp_group):
                if group is not None:
                    every: list = [None] * dist.get_world_size(group)
                    dist.all_gather_object(every, rows, group=group)
                    rows = [row for part in every for row in part]
            out[c] = rows
        return out

    def state_dict(self) -> dict:
        """The groups' networks (the replicas themselves are saved with data parallelism)."""
        return {"groups": [g.state_dict() for g in self.groups],
                "edp": [[n.state_dict() for n in e.networks] for e in self.edp]}

    def load_state_dict(self, state: dict) -> None:
        for group, saved in zip(self.groups, state["groups"], strict=True):
            group.load_state_dict(saved)
        for edp, saved in zip(self.edp, state["edp"], strict=True):
            for network, entry in zip(edp.networks, saved, strict=True):
                network.load_state_dict(entry)
        self._mark = self._seconds()


class _Slowest:
    """A clock over networks that run side by side: per key, the largest (dist: over the TP group too)."""

    def __init__(self, networks: list[LossyNetwork], tp_group=None):
        self.networks, self.tp_group = networks, tp_group

    def clock(self) -> dict:
        clocks = [n.clock() for n in self.networks]
        out = {key: max(c[key] for c in clocks) for key in clocks[0]}
        if self.tp_group is not None and dist.get_world_size(self.tp_group) > 1:
            values = torch.tensor(list(out.values()), dtype=torch.float64)
            dist.all_reduce(values, op=dist.ReduceOp.MAX, group=self.tp_group)
            out = dict(zip(out, values.tolist()))
        return out


class _Summed:
    """A pipeline stage's clock: its TP network's and its all-to-alls' seconds together."""

    def __init__(self, clocks: list):
        self.clocks = clocks

    def clock(self) -> dict:
        clocks = [c.clock() for c in self.clocks]
        return {key: sum(c[key] for c in clocks) for key in ("comm_s", "comm_s_ideal_nic")}


def expert_parameters(model) -> list[torch.Tensor]:
    return [p for p in model.parameters() if getattr(p, "expert_parallel", False)]


def _squares(model, stage: int = 0, context: int = 0) -> torch.Tensor:
    """The sum of squares of the gradients of ``model``'s ep-sharded experts on pipeline stage ``stage``
    (``sim`` beside context parallelism: context rank ``context``'s member's)."""
    grads = [p.grad.float().pow(2).sum() for m in getattr(model, "experts", ()) if m.stage == stage
             for p in (members(m)[context].gate_up_proj, members(m)[context].down_proj)
             if p.expert_parallel and p.grad is not None]
    device = next(model.parameters()).device
    return torch.stack(grads).sum() if grads else torch.zeros((), device=device)


def _sum(values) -> torch.Tensor:
    total = values[0]
    for value in values[1:]:
        total = total + value
    return total


def _networks(config: ExperimentConfig, mesh: Mesh, rank: int) -> Networks:
    """Global ``rank``'s ep group's networks, per class: training's, and evaluation's (their own streams)."""
    def placed(settings: dict) -> dict:
        return {c: LossyNetwork(mesh.network_spec("ep", rank, settings, config.lossy_directions(c), traffic=c))
                for c in EP_CLASSES}
    return Networks(placed(config.network_settings()), placed(config.network_settings(evaluation=True)))


def apply_ep(replicas: Sequence[Replica], config: ExperimentConfig, mesh: Mesh, rank: int = 0,
             groups: Optional[dict] = None) -> Optional[ExpertParallelism]:
    """Connect the replicas' sharded experts (``shard_experts``) to their groups: ``sim`` every replica of
    this process, ``dist`` this rank's over its process groups (``Mesh.process_groups``; None: the world
    is one TP group). None when the model has no experts."""
    if not any(getattr(r.model, "experts", None) for r in replicas):
        return None
    bucket = config.dp_bucket_mb * (1 << 20)
    if config.backend == "sim":
        return _connect_sim(replicas, config, mesh, bucket)
    groups = groups or {}
    networks = _networks(config, mesh, rank)
    process_group = groups["ep"][rank] if mesh.ep > 1 else None
    for module in replicas[0].model.experts:
        module.groups = [_dist_group(networks, process_group, module)]
    edp = []
    at = mesh.coordinates(rank)
    if mesh.ep > 1 and mesh.size("edp") > 1:
        edp_net = LossyNetwork(mesh.network_spec("edp", rank, config.network_settings(), config.dp_lossy()))
        edp = [DistDataParallel(replicas[0], edp_net, bucket, replica_index=at["edp"],
                                tp_rank=at["tp"], dp_size=mesh.size("edp"), tp_size=mesh.tp,
                                dp_group=groups["edp"][rank], tp_group=groups["tp"][rank], stage=at["pp"],
                                experts=True)]
    tp_group = groups["tp"][rank] if mesh.tp > 1 and "tp" in groups else None
    pp_group = groups["pp"][rank] if mesh.pp > 1 else None
    return ExpertParallelism(mesh, [networks], None, edp, [{at["pp"]: [networks]}], tp_group, process_group,
                             stage=at["pp"], pp_group=pp_group)


def _dist_group(networks: Networks, process_group, module: ExpertParallel):
    if process_group is None:            # ep 1: a group of one, all experts here (gathered: its own)
        shared = SimShared(networks, Lockstep(), 1)
        shared.experts[module.site] = [module]
        return SimGroup(shared, 0, training=lambda: module.training)
    return DistGroup(networks, process_group, training=lambda: module.training)


def _connect_sim(replicas: Sequence[Replica], config: ExperimentConfig, mesh: Mesh, bucket: float):
    """Every replica's experts on their groups, one per (stage, expert-data-parallel index, TP rank); beside
    context parallelism each replica's context ranks are consecutive members (``lossysim.ep.context``)."""
    lockstep = Lockstep()
    shared: dict[tuple[int, int, int], SimShared] = {}
    replica_groups = []
    contexts = mesh.cp
    for r, replica in enumerate(replicas):
        at = mesh.coordinates(mesh.rank(dp=r))
        member, g = at["ep"], at["edp"]
        for s in range(mesh.pp):
            for t in range(mesh.tp):
                if (s, g, t) not in shared:
                    shared[(s, g, t)] = SimShared(_networks(config, mesh, mesh.rank(dp=r, tp=t, pp=s)), lockstep,
                                                  mesh.ep)
        replica_groups.append({s: [shared[(s, g, t)].networks for t in range(mesh.tp)] for s in range(mesh.pp)})
        for module in replica.model.experts:
            s = module.stage
            if contexts > 1:
                module.groups = [ContextGroup(shared[(s, g, t)], member // contexts, contexts,
                                              training=lambda m=module: m.training) for t in range(mesh.tp)]
            else:
                module.groups = [SimGroup(shared[(s, g, t)], member, training=lambda m=module: m.training)
                                 for t in range(mesh.tp)]
            for t in range(mesh.tp):
                held = shared[(s, g, t)].experts.setdefault(module.site, [None] * mesh.ep)
                for c, one in enumerate(members(module)):
                    held[member + c] = one
    edp = []
    if mesh.ep > 1 and mesh.size("edp") > 1:
        # per expert block e: the (context rank, replica) members holding it, in their group's order
        for e in range(mesh.ep):
            held = [divmod(i * mesh.ep + e, contexts)[::-1] for i in range(mesh.size("edp"))]   # (context, replica)
            networks = [[LossyNetwork(mesh.network_spec("edp", mesh.rank(dp=held[0][1], cp=held[0][0], tp=t, pp=s),
                                                        config.network_settings(), config.dp_lossy()))
                         for t in range(mesh.tp)] for s in range(mesh.pp)]
            views = [replicas[d] if contexts == 1 else Replica(MemberView(replicas[d].model, c), None, None)
                     for c, d in held]
            edp.append(DataParallel(views, networks, bucket, experts=True))
    return ExpertParallelism(mesh, [shared[key].networks for key in sorted(shared)], lockstep, edp,
                             replica_groups, contexts=contexts)
