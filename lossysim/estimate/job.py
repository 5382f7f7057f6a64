"""The job an estimate simulates: its groups on the mesh's networks, its messages' sizes and bucket plans,
and which of its identical lossy groups are simulated.

Groups whose links cannot lose a packet are all alike: one is simulated and stands for the others
(its counts multiplied), which is exact, as their fates are all "delivered". Every group whose links
can lose packets is simulated, or, with ``Workload.sampled_groups`` k (the default beyond 64 GPUs), k of
each stage's or boundary's alike groups, the slowest of the others drawn from their times
(docs/estimate.md, "The slowest of identical groups"): ``Job._sample`` picks them, ``Job._draw_groups``
draws the others.
"""
from __future__ import annotations

import numpy as np

from .. import traffic
from ..axes import AXES
from ..config import ExperimentConfig
from ..dp.buckets import plan_buckets
from ..ep.estimate import routed_load
from ..models import cost
from ..net import LossyNetwork, NetworkSpec
from ..pp.stages import stage_parameters
from ..tp.parallelize import parallelize
from ..util import stream_seed
from .accounting import Group, Tally, is_lossy
from .messages import Messages
from . import shape_params
from .shapes import Shape
from .workload import AMP_DTYPE, DTYPES, Workload, step_calls

# The most ranks one group may have. Every collective is simulated send by send, and a ring all-reduce over
# R ranks is 2R(R-1) sends whose schedule the network keeps (about 1.6 KB a send: a tiny model at dp 600,
# 718,800 sends, peaked at 1.6 GB), so memory grows with the square of the largest group.
MAX_GROUP_RANKS = 1024


def check_group_size(mesh) -> None:
    """Refuse, before any work, a layout whose groups an estimate cannot hold (``MAX_GROUP_RANKS``):
    a one-line ValueError with what it would take. Sampling (``sampled_groups``) bounds how many groups
    are simulated, not how large one is."""
    limit = MAX_GROUP_RANKS
    for axis, ranks in mesh.sizes.items():
        if ranks > limit:
            raise ValueError(f"{axis}_size={ranks}: its groups of {ranks} ranks would be simulated send by send, "
                             f"{2 * ranks * (ranks - 1):.2g} sends an all-reduce against {2 * limit * (limit - 1):.2g} "
                             f"at the most an estimate takes ({limit} ranks; --sampled-groups bounds how many groups "
                             f"are simulated, not their size): use {axis}_size <= {limit}")


# each axis's part of the job (``Axis.estimate``: the experts', ``ep.estimate``; the context groups',
# ``cp.estimate``), in the axes' order
PARTS = tuple(part for part in (axis.estimate_part() for axis in AXES) if part is not None)


class Job(Tally, Messages, *PARTS):
    """A job's groups, messages and bucket plans, and the per-step simulation of every class (``run``; each
    class's messages: ``messages``, then each axis's part, ``PARTS``), counted as ``Tally`` counts."""

    PARTS = PARTS
    # the time keys a part stretches itself on a fabric (``collisions.stretched`` leaves them alone)
    STRETCHED = tuple(key for part in PARTS for key in vars(part).get("STRETCHED", ()))

    def __init__(self, shape: Shape, config: ExperimentConfig, w: Workload, layout: tuple[int, ...], tokens: int):
        super().__init__()
        self.shape, self.config, self.w, self.layout = shape, config, w, layout
        self.mesh = mesh = config.mesh()
        tp, pp, dp, cp = mesh.tp, mesh.pp, mesh.dp, mesh.cp
        self.dtype_name = AMP_DTYPE[config.amp]
        self.dtype = DTYPES[self.dtype_name]
        self.sampled = w.sampled(mesh.world)
        settings = config.network_settings()
        # tp[s]: stage s's groups, one per replica and context rank (context rank 0's first; or one for
        # all: loss-free); pp[b] alike
        self.tp = [_groups([mesh.network_spec("tp", mesh.rank(dp=r, pp=s, cp=c), settings) for r in range(dp)
                            for c in range(cp)])
                   for s in range(pp)]
        pp_lossy = config.pp_lossy()   # (parsed once: 1,920 boundaries' groups in the 405B layout)
        self.pp = [_groups([mesh.network_spec("pp", mesh.rank(dp=r, pp=b, cp=c), settings, pp_lossy)
                            for r in range(dp)
                            for c in range(cp)]) for b in range(pp - 1)]
        mode = config.dp_mode if mesh.size("dp_cp") > 1 else None   # the gradients' group: dp x cp (Megatron's)
        if mode == "fsdp" and pp > 1:   # (training runs it: lossysim.dp.fsdp, each stage's units)
            raise ValueError(f"dp_mode=fsdp with pp_size={pp}: the estimate does not time FSDP's gathers around a "
                             "pipeline schedule (training does); use dp_mode=ddp or pp_size=1")
        self.dp = [_groups([mesh.network_spec("dp_cp", mesh.rank(tp=t, pp=s), settings, config.dp_lossy())
                            for t in range(tp)])
                   for s in range(pp)] if mode else []
        self.mode = mode
        self.dp_class = config.dp_class
        # the job's classes: those whose axis has more than one rank (data-parallel traffic is DDP's or FSDP's)
        self.classes = tuple(c.name for c in traffic.CLASSES if mesh.size("dp_cp" if c.axis == "dp" else c.axis) > 1
                             and (c.axis != "dp" or c.name == self.dp_class))
        for part in self.PARTS:   # each axis's groups (its part's ``init_part``)
            part.init_part(self, shape, config, w, tokens, settings)
        self.buckets = self._buckets() if mode else []
        self.ready = [[b.ready for b in stage] for stage in self.buckets]
        self.calls = [step_calls(shape, config.activation_checkpointing, self.blocks(s)) for s in range(pp)]
        self.numel = tokens * shape.hidden // cp     # a context rank's tokens of the micro-batch
        self.rng = np.random.default_rng(stream_seed(config.seed, "estimate.slowest", "groups"))

    def groups_of(self, specs: list[NetworkSpec]) -> list[Group]:
        """Identical groups by the job's one rule (``_groups``): an axis's part builds its own with it."""
        return _groups(specs)

    def aliased(self, kind, specs: list, lossy: list[bool]) -> list:
        """A fabric's groups in their order (``_aliased``), for an axis's part."""
        return _aliased(kind, specs, lossy)

    def _sample(self, groups: list[Group], stages: float = 1) -> tuple[list[Group], int]:
        """The groups simulated, each standing for its share of the G (of each of ``stages`` alike
        stages: a stage of fewer blocks counts its share), and how many of the first stage's are drawn
        instead."""
        k = self.sampled
        if groups[0].spec.cables is not None and stages == 1 and not (
                k and all(g.copies == 1 and g.same_as < 0 for g in groups)
                and self.alike_on_fabric([(g.spec,) for g in groups])):
            return groups, 0   # a fabric's lossy groups are each simulated, unless alike but for their streams
        if not k or groups[0].copies > 1 or (len(groups) <= k and stages == 1):
            return groups, 0
        k = min(k, len(groups))
        if groups[0].spec.cables is not None:   # each sampled one stands for every k-th group from it
            self.stand_for.update((g.spec, [h.spec for h in groups[j::k]]) for j, g in enumerate(groups[:k]))
        return [g._replace(copies=len(groups) * stages / k) for g in groups[:k]], len(groups) - k

    def alike_on_fabric(self, groups: list[tuple[NetworkSpec, ...]]) -> bool:
        """Whether a fabric's groups (each its networks: one, or an expert group's per class) differ only by
        their streams, so they are sampled as groups without a fabric are (exact in distribution,
        docs/fabric.md "The same mean loss over every cable"): every cable one Bernoulli rate
        (``Placement.uniform``), no link events, and the groups' links crossing as many lossy cables flow by
        flow (``_crossings``)."""
        if len(groups) < 2 or self.config.link_event or not groups[0][0].cables.uniform:
            return False
        first = [_crossings(spec) for spec in groups[0]]
        return all([_crossings(spec) for spec in group] == first for group in groups[1:])

    def _draw_groups(self, per_step: list[list], k: int) -> None:
        """Fill each step's groups after the first ``k`` (simulated) with [micro-batch] of two items,
        each drawn independently from the simulated groups' items of that kind over every micro-batch
        and step (they are identically distributed: the same messages on groups alike but for streams)."""
        pool = np.asarray([groups[j] for groups in per_step for j in range(k)], dtype=float).reshape(-1, 2, 2)
        for groups in per_step:
            for j in range(k, len(groups)):
                drawn = self.rng.integers(len(pool), size=(len(groups[0]), 2))
                groups[j] = [(pool[a, 0].tolist(), pool[b, 1].tolist()) for a, b in drawn]

    def blocks(self, stage: int) -> range:
        first = sum(self.layout[:stage])
        return range(first, first + self.layout[stage])

    def shares(self, tokens: int) -> list[float]:
        """Each stage's share of a micro-batch's compute: its share of the FLOPs (training's
        ``_stage_shares``)."""
        if len(self.layout) == 1:   # f / f: the share is 1.0 exactly, and the model's parameters need no building
            return [1.0]
        flops = [cost.step_flops(n, tokens, layers, self.shape.hidden, self.w.seq)
                 for n, layers in zip(self._stage_parameters, self.layout)]
        return [f / sum(flops) for f in flops]

    def _buckets(self) -> list:
        """Each stage's buckets of a TP rank's local gradients, planned as training plans them on the
        TP-sharded model, in the reduce dtype: a published shape's from its numbers (``shape_params``), any
        other's built on the meta device."""
        cap = self.config.dp_bucket_mb * (1 << 20)
        params = shape_params.parameters(self.shape)
        if params is not None:
            return [plan_buckets(local, sharded, cap) for local, sharded in shape_params.stage_locals(
                self.shape, params, self.mesh.tp, self.layout, self.experts is not None, self.w.grad_torch_dtype)]
        model = self.shape.meta_model()
        experts = self._expert_parameters(model)   # averaged over their own groups (``expert_buckets``)
        tp_model = parallelize(model, self.mesh.tp, LossyNetwork(self.mesh.tp)).to(self.w.grad_torch_dtype)
        owner = self._owners(model)    # after sharding: its layers' parameters are new ones
        sharded = {id(p) for p in tp_model.sharded_parameters()}
        params = [p for p in tp_model.parameters() if id(p) not in experts]
        return [plan_buckets([p for p in params if owner.get(id(p), self.mesh.pp - 1) == s], sharded, cap)
                for s in range(self.mesh.pp)]

    def _expert_parameters(self, model) -> set[int]:
        """The ids of ``model``'s routed experts' parameters (none without expert parallelism)."""
        plan = self.shape.plan
        if self.experts is None:
            return set()
        parent, _, leaf = plan.experts.rpartition(".")
        return {id(p) for block in model.base_model.get_submodule(plan.blocks)
                if hasattr(block.get_submodule(parent), leaf) for p in getattr(block.get_submodule(parent), leaf).parameters()}

    @property
    def _stage_parameters(self) -> list[float]:
        """Each stage's parameters as the step's compute counts them (``simulate._busiest``): its routed
        experts' as often as the busiest rank's tokens reach them, run whole by every TP rank."""
        if not hasattr(self, "_stage_counts"):
            e, scale = self.shape.experts, float(self.mesh.tp)
            if e is not None:
                scale *= routed_load(self.shape, self.mesh, self.w, self.config.seed)
            params = shape_params.parameters(self.shape)
            self._stage_counts = stage_parameters(self.shape.meta_model(), self.layout, scale) if params is None \
                else shape_params.stage_parameters(params, self.layout, 1.0 if e is None else e.top_k / e.count * scale)
        return self._stage_counts

    def _owners(self, model) -> dict:
        """Parameter id -> its stage (as ``stage_parameters`` places them); the head is the last's."""
        plan, last = self.shape.plan, self.mesh.pp - 1
        stage_of = [s for s, count in enumerate(self.layout) for _ in range(count)]
        owner = {}
        for name, param in model.base_model.named_parameters():
            if name.startswith(f"{plan.blocks}."):
                owner[id(param)] = stage_of[int(name.split(".")[1])]
            else:
                owner[id(param)] = last if name.startswith(f"{plan.final_norm}.") else 0
        return owner


def _groups(specs: list[NetworkSpec]) -> list[Group]:
    """Identical groups: every one that can lose packets, or one for all when none can. On a fabric the
    groups are not alike: every group whose links cross a lossy cable is simulated (sampled only when the
    cables are all alike and so are the groups' crossings: ``Job.alike_on_fabric``), and one that crosses
    none stands for all the others (they lose nothing)."""
    if specs[0].cables is not None:
        return _aliased(Group, specs, [is_lossy(LossyNetwork(spec)) for spec in specs])
    if not is_lossy(LossyNetwork(specs[0])):
        return [Group(specs[0], len(specs))]
    return [Group(spec, 1) for spec in specs]


def _crossings(spec: NetworkSpec) -> tuple:
    """Per directed link of a fabric's group, in order: NVLink inside a node, or its flows' (modulus, residue,
    lossy cables crossed) (``Placement.counts``). Under a uniform fabric, groups with equal crossings draw
    identically distributed fates."""
    top, cables, n = spec.topology, spec.cables, spec.ranks
    return tuple(() if top.link_class(s, d) == "intra" else cables.counts(s, d)
                 for s in range(n) for d in range(n) if s != d)


def _aliased(kind, specs: list, lossy: list[bool]) -> list:
    """A fabric's groups in their order: each lossy one simulated, the first clean one standing for every
    clean one (its copies), the other clean ones its aliases (``same_as``: their times are its own); all
    clean, one group for all, as without a fabric."""
    clean = [j for j, is_lossy_group in enumerate(lossy) if not is_lossy_group]
    if len(clean) == len(specs):
        return [kind(specs[0], len(specs))]
    return [kind(spec, 1) if lossy[j] else kind(spec, len(clean)) if j == clean[0] else kind(spec, 0, clean[0])
            for j, spec in enumerate(specs)]
