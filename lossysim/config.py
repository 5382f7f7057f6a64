"""Experiment configuration: one flat dataclass, loaded from YAML and CLI overrides.

Validated once here, at the edge, so the rest of the code can trust it.
"""
from __future__ import annotations

import contextvars
import dataclasses
import math
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Optional, Union, get_args, get_origin, get_type_hints

import yaml

from .util import one_of, stream_seed
from .mesh import DEFAULT_ORDER, Mesh, parse_order
from .net.recovery import require
from .net.spec import SETTINGS, NetworkSpec
from .timing import DEFAULT_NIC, parse_compute
from .traffic import BY_NAME, parse_kinds as traffic_kinds

EP_CLASSES = tuple(c.name for c in BY_NAME.values() if c.axis == "ep")   # an MoE block's all-to-alls


# Keys that say where or how a run is executed, not what it trains: they stay out of a run's
# identity (the sweep's hash, what a resumed checkpoint must match), so a shard on another
# machine (another device, another output folder) finds the run. Checkpointing settings too:
# a resumed run ends exactly as an uninterrupted one.
NON_SEMANTIC = ("out", "name", "device", "timeout_s", "save_checkpoint", "checkpoint_every", "keep_checkpoints",
                "report_to")
TRACKERS = ("tensorboard", "wandb")
BACKENDS = ("sim", "dist")     # every rank in one process, or one per process (torchrun)
DP_MODES = ("ddp", "fsdp")
# Keys added after the first sweeps (data parallelism, micro-batches, ...): at their defaults they stay
# out of a run's identity (the sweep's hash), so sweeps written before them still find their runs.
IDENTITY_AT_DEFAULT_OMITTED = ("dp_size", "dp_bucket_mb", "dp_overlap", "dp_sync_every", "lossy_traffic",
                              "dp_mode", "lossy_layers", "lossy_sites", "outlier_fraction", "microbatches",
                              "pp_size", "pp_schedule", "pp_layout", "parallel_order", "ep_size", "cp_size",
                              "cp_mode")
CP_MODES = ("ring", "allgather")   # Megatron's p2p ring of K/V blocks; Llama 3's all-gathered K/V
_TRYING = contextvars.ContextVar("trying", default=False)   # ExperimentConfig.accepts is validating a variant


def parse_report_to(value) -> tuple[str, ...]:
    """``"none"``, ``"tensorboard"``, ``"tensorboard,wandb"`` or a list -> tracker names (ValueError
    naming report_to otherwise)."""
    items = value if isinstance(value, (list, tuple)) else str(value).replace(" ", ",").split(",")
    names = [str(item).strip().lower() for item in items if str(item).strip()]
    unknown = [n for n in names if n not in ("none", *TRACKERS)]
    if unknown:
        raise ValueError(f"report_to={value!r}: unknown tracker {unknown[0]!r} "
                         f"(expected none, {', '.join(TRACKERS)}, or several separated by commas)")
    if "none" in names and len(names) > 1:
        raise ValueError(f"report_to={value!r}: 'none' cannot be combined with a tracker")
    return tuple(dict.fromkeys(n for n in names if n != "none"))



@dataclass
class ExperimentConfig:
    # what is trained
    name: str = "tiny-synthetic"
    seed: int = 0
    model: str = "tiny"               # tiny | small | tiny-llama | llama-1b-shape | smollm2-135m[-shape] | HF name | dir
    task: str = "classification"       # classification | lm (causal-LM fine-tuning on the texts)
    attn_implementation: str = "sdpa"  # sdpa | eager
    dropout: Optional[float] = None    # None keeps the model's own dropout
    # data
    dataset: str = "synthetic"         # synthetic | mnli | pydoc (task lm) | a local dir or file (jsonl / tsv)
    tokenizer: str = "auto"            # auto | bpe | bytes | a HF name or local dir
    max_length: int = 128
    max_train_samples: Optional[int] = 4000
    max_eval_samples: Optional[int] = 500
    # network
    loss: str = "none"                 # see lossysim.parse_loss_model
    lossy: str = "both"                # fwd | bwd | both
    recovery: str = "zero"             # a name in net.recovery.RECOVERY_POLICIES
    hadamard_block: int = 16384        # hadamard: elements per transform block (a power of two)
    outlier_fraction: float = 0.001    # outliers: share of each rank's message sent reliably, in (0, 0.5]
    payload_bytes: int = 1450
    eval_lossy: bool = True
    # ring | tree | direct | nvls | nvls_tree (in the NVSwitch, Hopper NVLink) | auto (NCCL's tuner's pick per call)
    algorithm: str = "ring"            # see lossysim.net.algorithms
    ranks_per_node: Optional[int] = None  # None: every rank on one node
    lossy_links: str = "all"           # all | inter_node (NVLink inside a node is reliable)
    lossy_layers: str = "all"          # TP sites of these layers can lose packets: all | 3 | 0-5,12
    lossy_sites: str = "all"           # ... and of these modules: all | attn | mlp
    # transport and simulated time (see docs/time_model.md)
    transport: str = "drop"            # drop | retransmit | deadline
    nic: str = DEFAULT_NIC             # how losses are found and repaired: a NIC_PRESETS name
    retransmit: Optional[str] = None   # selective | go_back_n: overrides the nic's (None: the nic's)
    deadline: float = 1.5              # deadline: a collective's budget, times its loss-free time
    rto_s: Optional[float] = None      # every retransmission timer, seconds (None: the nic's timers)
    channels: int = 2                  # connections per link (NCCL channels): each has its own tail
    sockets: int = 1                   # TCP nics: sockets per channel (NCCL_SOCKET_NTHREADS x NSOCKS_PERTHREAD), 1-64
    congestion: Optional[str] = None   # TCP nics: cubic | reno | bbr, over the nic's (None: the nic's)
    nics_per_node: Optional[int] = None  # NICs a node's inter-node traffic spreads over; None: one per rank
    restart_s: float = 300.0           # a failed collective restarts the job: this long (an assumption) ...
    restart_lost_steps: int = 50       # ... plus this many steps redone since the last checkpoint
    max_failures: int = 0              # end the run after this many failed collectives (0: never)
    link_intra: str = "nvlink4"        # a preset or alpha=..,bw=..,header=.. (lossysim.timing)
    link_inter: str = "roce-200g"
    compute: str = "h100"              # a GPU preset [,mfu=..], flops=..,mfu=.., or measured
    target_accuracy: float = 0.8       # time_to_accuracy is reported for this eval accuracy
    # parallelism
    tp_size: int = 2
    backend: str = "sim"               # sim | dist
    sync_replicated: bool = True       # dist: average replicated grads over a reliable channel
    dp_size: int = 1                   # data-parallel replicas of the TP group: world = tp_size x pp_size x dp_size
    pp_size: int = 1                   # pipeline stages: the blocks cut into this many consecutive stages
    ep_size: int = 1                   # expert parallelism: each MoE block's experts over this many replicas
    cp_size: int = 1                   # context-parallel ranks: each sequence cut into 2 x cp_size chunks
    cp_mode: str = "ring"              # ring (K/V blocks passed around, Megatron's) | allgather (Llama 3's)
    parallel_order: str = DEFAULT_ORDER  # how global ranks are laid out, innermost first (Megatron's order)
    pp_schedule: str = "1f1b"          # gpipe | 1f1b: how a step's micro-batches are timed through the stages
    pp_layout: Optional[str] = None    # blocks per stage, e.g. "1,3" (None: an even split)
    dp_bucket_mb: float = 25.0         # DDP gradient bucket cap, MiB (PyTorch DDP's bucket_cap_mb)
    dp_overlap: bool = True            # bucket all-reduces overlap the backward pass, as DDP's do
    dp_sync_every: int = 0             # reliable broadcast of replica 0's parameters every K steps (0: never)
    dp_mode: str = "ddp"               # ddp | fsdp (ZeRO-3: parameters sharded, gathered before the forward)
    lossy_traffic: str = "all"         # which traffic can lose packets: all, or some of lossysim.traffic.KINDS
    timeout_s: float = 600.0
    # training
    steps: int = 300
    batch_size: int = 16
    microbatches: Optional[int] = None  # each replica's shard in this many forward/backwards (None: pp_size)
    eval_batch_size: int = 64
    lr: float = 5e-4
    weight_decay: float = 0.01
    warmup_steps: int = 30
    grad_clip: float = 1.0
    eval_every: int = 100
    log_every: int = 10
    amp: str = "none"                  # none | bf16 | fp16
    activation_checkpointing: bool = False
    device: str = "auto"               # auto | cpu | cuda | cuda:N
    save_checkpoint: bool = False      # the gathered HF model at the end (checkpoint/)
    checkpoint_every: int = 0          # full training state every N steps for --resume (0: never)
    keep_checkpoints: int = 2
    report_to: str = "none"            # none | tensorboard | wandb, several comma-separated (HF's key)
    out: str = "runs/tiny-synthetic"

    def validate(self) -> "ExperimentConfig":
        """Raise ValueError with the offending field on the first problem."""
        _choice("attn_implementation", self.attn_implementation, ("sdpa", "eager"))
        _choice("task", self.task, ("classification", "lm"))
        if self.dataset == "pydoc" and self.task != "lm":
            raise ValueError("dataset=pydoc is unlabelled documentation text: use task=lm")
        _choice("backend", self.backend, BACKENDS)
        _choice("amp", self.amp, ("none", "bf16", "fp16"))
        for name in ("tp_size", "dp_size", "pp_size", "ep_size", "cp_size", "steps", "batch_size", "eval_batch_size",
                     "max_length", "eval_every", "log_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if self.microbatches is not None and self.microbatches < 1:
            raise ValueError(f"microbatches={self.microbatches} must be >= 1 (or null for pp_size)")
        for name in ("max_train_samples", "max_eval_samples"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name}={value} must be >= 1 (or null for no cap)")
        for name in ("lr", "weight_decay", "grad_clip", "timeout_s", "restart_s"):
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"{name}={value} must be a finite number >= 0")
        for name in ("checkpoint_every", "keep_checkpoints", "restart_lost_steps", "max_failures", "dp_sync_every"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 0")
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps={self.warmup_steps} must be >= 0")
        if self.dropout is not None and not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout={self.dropout} must be in [0, 1)")
        self._validate_pipeline()
        self._validate_data_parallel()
        self._validate_pairs()
        self.parallel_order = "-".join(parse_order(self.parallel_order))   # one spelling: one run identity
        self.mesh()                       # the layout's one check, for train, sweep and estimate alike
        self._check_something_can_lose()
        try:
            parse_compute(self.compute)
        except ValueError as err:
            raise ValueError(f"compute: {err}") from None
        if not 0.0 < self.target_accuracy <= 1.0:
            raise ValueError(f"target_accuracy={self.target_accuracy} must be in (0, 1]")
        parse_report_to(self.report_to)
        return self

    def _validate_data_parallel(self) -> None:
        _choice("dp_mode", self.dp_mode, DP_MODES)
        traffic_kinds(self.lossy_traffic)
        if not (math.isfinite(self.dp_bucket_mb) and self.dp_bucket_mb > 0):
            raise ValueError(f"dp_bucket_mb={self.dp_bucket_mb} must be a positive number of MiB")
        if self.batch_size % (self.dp_size * self.n_microbatches):
            raise ValueError(f"batch_size={self.batch_size} must be a multiple of dp_size={self.dp_size} x "
                             f"microbatches={self.n_microbatches}{' (pp_size)' if self.microbatches is None else ''}: "
                             "each replica trains on an equal shard of "
                             "the global batch, in equal micro-batches")
        if self.dp_size == 1 and self.dp_sync_every:
            raise ValueError(f"dp_sync_every={self.dp_sync_every} needs dp_size > 1: one replica has no "
                             "others to synchronise; set dp_sync_every=0")

    def _validate_pairs(self) -> None:
        """Settings each fine alone that do not go together: checked here only, for every command."""
        fsdp, pp, ep = self.dp_mode == "fsdp" and self.dp_size > 1, self.pp_size > 1, self.ep_size > 1
        if ep and self.cp_size > 1:
            raise ValueError(f"ep_size={self.ep_size} with cp_size={self.cp_size}: experts beside context "
                             "parallelism are not modelled (training or estimate); leave one of them at 1")
        self._validate_context(fsdp)
        for used, setting, collective in ((fsdp, "dp_mode=fsdp", "reduce_scatter"),
                                          (pp, f"pp_size={self.pp_size}", "send"),
                                          (ep, f"ep_size={self.ep_size}", "all_to_all"),
                                          (self.cp_size > 1, f"cp_size={self.cp_size}", "kv_exchange")):
            try:
                require(self.recovery, collective, used, works=lambda name: self.accepts(recovery=name))
            except ValueError as err:
                raise ValueError(f"{setting}: {err}") from None
        if fsdp and self.dp_sync_every:
            raise ValueError("dp_sync_every with dp_mode=fsdp: FSDP's replicas share one exact master copy and never drift")
        if fsdp and pp:
            raise ValueError(f"dp_mode=fsdp with pp_size={self.pp_size}: FSDP's gathers around a pipeline schedule "
                             "are not modelled; use dp_mode=ddp or pp_size=1")
        if pp and self.dp_sync_every:
            raise ValueError(f"dp_sync_every with pp_size={self.pp_size}: synchronising pipelined replicas is not "
                             "modelled; set dp_sync_every=0")
        # (what training does not model beside experts, ep with pipeline stages, the estimate does:
        # lossysim.ep refuses it where training builds it)

    def _validate_context(self, fsdp: bool) -> None:
        """Context parallelism's settings and their pairs (``lossysim.cp``)."""
        _choice("cp_mode", self.cp_mode, CP_MODES)
        cp = self.cp_size
        if self.recovery == "mask" and cp == 1:
            raise ValueError("recovery=mask leaves lost keys out of attention: it needs cp_size > 1 (on other "
                             "traffic it is zero); use recovery=zero")
        if cp == 1:
            return
        if self.max_length % (2 * cp):
            raise ValueError(f"max_length={self.max_length} is not a multiple of 2 x cp_size = {2 * cp}: context "
                             "parallelism cuts every sequence into 2 x cp_size equal chunks")
        if fsdp:
            raise ValueError(f"cp_size={cp} with dp_mode=fsdp: FSDP's gathers beside context parallelism are not "
                             "modelled; use dp_mode=ddp")
        if self.activation_checkpointing:
            raise ValueError(f"cp_size={cp} with activation_checkpointing: a recomputed block's key/value "
                             "exchange is not modelled; set activation_checkpointing=false")

    def _validate_pipeline(self) -> None:
        """pp keys alone; pp_layout against the model's depth is checked where the depth is known
        (``lossysim.pp.stages.stage_layout``, at build)."""
        # Canonical: microbatches equal to pp_size is its default, so a run's identity (and an older
        # saved config's ``microbatches: 1``) does not depend on whether it was written out.
        if self.microbatches == self.pp_size:
            self.microbatches = None
        _choice("pp_schedule", self.pp_schedule, PP_SCHEDULES)
        if self.pp_layout is not None:
            parse_layout(self.pp_layout, self.pp_size)

    @property
    def n_microbatches(self) -> int:
        """Micro-batches per step (``microbatches``, or ``pp_size`` when unset; torch's ``n_microbatches``)."""
        return self.pp_size if self.microbatches is None else self.microbatches

    @property
    def micro_batch_size(self) -> int:
        """Rows of one micro-batch on one replica (Megatron's ``--micro-batch-size``): batch_size / (dp_size x
        microbatches)."""
        return self.batch_size // (self.dp_size * self.n_microbatches)

    def _check_something_can_lose(self) -> None:
        """A loss model that no traffic can meet is a mistake (the run would lose 0 packets, and say
        nothing): the traffic it may hit (lossy, lossy_traffic) never crosses a lossy link."""
        spec = self.network_spec()
        if spec.loss.lossless:
            return
        mesh, settings = self.mesh(), self.network_settings()
        networks = [spec] + ([mesh.dp_network_spec(settings, 0, self.dp_lossy())] if self.dp_size > 1 else []) + \
            [mesh.tp_network_spec(settings, 0, s) for s in range(1, self.pp_size)] + \
            [mesh.pp_network_spec(settings, 0, b, self.pp_lossy()) for b in range(self.pp_size - 1)] + \
            [mesh.ep_network_spec(settings, 0, c, self.lossy_directions(c)) for c in EP_CLASSES if self.ep_size > 1] + \
            ([mesh.cp_network_spec(settings, 0, 0, self.lossy_directions("cp"))] if self.cp_size > 1 else [])
        if not any(net.lossy and net.topology.has_lossy_link for net in networks):
            raise ValueError(f"loss={self.loss} but no traffic can lose packets (tp_size={self.tp_size}, "
                             f"pp_size={self.pp_size}, dp_size={self.dp_size}, ep_size={self.ep_size}, "
                             f"cp_size={self.cp_size}, lossy={self.lossy}, "
                             f"lossy_traffic={self.lossy_traffic}, "
                             f"lossy_links={self.lossy_links}, ranks_per_node={self.ranks_per_node}): "
                             "use loss=none for a loss-free run, or make some traffic cross a lossy link")

    def mesh(self) -> Mesh:
        """Where this run's ranks sit (``lossysim.mesh``): tp_size x cp_size x pp_size x dp_size in
        ``parallel_order`` (ep_size carved out of the data-parallel ranks), ranks_per_node to a node (a bad
        layout: a one-line ValueError)."""
        return Mesh(self.tp_size, self.dp_size, self.ranks_per_node, pp=self.pp_size, cp=self.cp_size, ep=self.ep_size,
                    order=self.parallel_order)

    def network_spec(self, evaluation: bool = False) -> NetworkSpec:
        """The training network of replica 0's TP group, placed by the mesh; ``evaluation``: the
        evaluation network's, which draws from its own streams (and loses nothing unless ``eval_lossy``)."""
        return self.mesh().tp_network_spec(self.network_settings(evaluation))

    def network_settings(self, evaluation: bool = False) -> dict:
        """This run's network keys (``NetworkSpec``'s), before the mesh places them on a group's ranks."""
        settings = {name: getattr(self, name) for name in SETTINGS if hasattr(self, name)}
        tp = self.lossy_directions("tp")
        if tp != ("fwd", "bwd"):  # only then: every spec (and its saved config) stays as it was
            directions = (self.lossy,) if self.lossy != "both" else ("fwd", "bwd")
            settings["lossy"] = tuple(d for d in directions if d in tp)
        if evaluation:
            settings.update(seed=stream_seed(self.seed, "eval", "network"),
                            loss=self.loss if self.eval_lossy else "none")
        return settings

    def lossy_directions(self, traffic: str) -> tuple[str, ...]:
        """The directions of a traffic class (``lossysim.traffic``: tp, pp, dp, fsdp, cp) that ``lossy_traffic``
        lets lose packets (TP's are further limited by ``lossy``)."""
        return BY_NAME[traffic].lossy(traffic_kinds(self.lossy_traffic))

    @property
    def dp_class(self) -> str:
        """The class data-parallel traffic is: DDP's gradient buckets (``dp``) or FSDP's gathers and
        reduce-scatters (``fsdp``)."""
        return "fsdp" if self.dp_mode == "fsdp" else "dp"

    def dp_lossy(self) -> tuple[str, ...]:
        """The directions of the data-parallel traffic that may lose packets (none unless
        ``lossy_traffic`` names dp): DDP's gradient buckets (``bwd``); FSDP's weight gathers (``fwd``) too."""
        return self.lossy_directions(self.dp_class)

    def pp_lossy(self) -> tuple[str, ...]:
        """The directions of the pipeline's boundary traffic that may lose packets: activations (``fwd``)
        when ``lossy_traffic`` names pp_forward, their gradients (``bwd``) when it names pp_backward."""
        return self.lossy_directions("pp")

    def accepts(self, **changes) -> bool:
        """Whether this config with ``changes`` (values as --set spells them) validates, or is refused for
        another setting alone (the message names none of ``changes``): a refusal suggests only what this accepts.
        Inside such a trial, refusals suggest without trying (suggestions' suggestions would never end)."""
        if _TRYING.get():
            return True
        token = _TRYING.set(True)
        try:
            dataclasses.replace(self, **coerce(changes)).validate()
        except ValueError as err:
            return not any(f"{key}=" in str(err) for key in changes)
        finally:
            _TRYING.reset(token)
        return True

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def replace(self, **changes) -> "ExperimentConfig":
        return from_dict({**self.to_dict(), **changes})


def upgrade(values: dict) -> dict:
    """A config (dict) an earlier version wrote, as this version reads it: keys it lacks take their
    defaults, and 0.2's ``retransmit: selective`` (before ``nic`` existed) is the nic's own repair."""
    values = dict(values)
    if "nic" not in values and values.get("retransmit") == "selective":
        values["retransmit"] = None
    if values.get("microbatches") == values.get("pp_size", 1):  # written before pp: 1, now its default
        values["microbatches"] = None
    return {**{k: v for k, v in ExperimentConfig().to_dict().items() if k not in values}, **values}


# torch.distributed.pipelining's ScheduleGPipe / Schedule1F1B; 1f1b is Megatron's
# forward_backward_pipelining_without_interleaving (PipeDream-Flush). Timed by lossysim.pp.schedule.
PP_SCHEDULES = ("gpipe", "1f1b")


def parse_layout(value: str, stages: int) -> tuple[int, ...]:
    """``pp_layout``: blocks per stage separated by commas (``"1,3"``), one entry >= 1 per stage."""
    try:
        counts = tuple(int(part) for part in str(value).replace(" ", "").split(","))
    except ValueError:
        counts = ()
    if len(counts) != stages or min(counts, default=0) < 1:
        raise ValueError(f"pp_layout={value!r} must be pp_size={stages} block counts >= 1 separated by commas "
                         "(e.g. 1,3)")
    return counts


def _choice(name: str, value: str, allowed: tuple) -> None:
    if value not in allowed:
        raise ValueError(f"{name}={value!r} must be {one_of(allowed)}")


_TYPES = get_type_hints(ExperimentConfig)
_LIST_FIELDS = ("report_to", "lossy_traffic")          # str fields that also take a list of names


def _coerce(name: str, value: Any) -> Any:
    """Convert a YAML or command-line value to the field's type."""
    kind = _TYPES[name]
    optional = get_origin(kind) is Union and type(None) in get_args(kind)
    if optional:
        kind = next(t for t in get_args(kind) if t is not type(None))
        if value is None or (isinstance(value, str) and value.lower() in ("none", "null", "")):
            return None
    if name in _LIST_FIELDS and isinstance(value, (list, tuple)):
        value = ",".join(str(v) for v in value)   # report_to: [tensorboard, wandb], as HF takes it
    if isinstance(value, str) and kind is not str:
        try:
            value = yaml.safe_load(value)
        except yaml.YAMLError:
            raise ValueError(f"{name}={value!r} is not a valid {kind.__name__}") from None
    try:
        if kind is bool:
            if not isinstance(value, bool):
                raise TypeError
            return value
        if kind is int:
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise TypeError
            return int(value)
        if kind is float:
            if isinstance(value, bool):
                raise TypeError
            return float(value)
        return str(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name}={value!r} is not a valid {kind.__name__}") from None


def coerce(values: dict) -> dict:
    """Config keys (as YAML or --set spell them) as the fields' types: a one-line ValueError for an unknown
    key or a bad value, also where a later layer (a flag, --set over a file) replaces it."""
    known = {f.name for f in fields(ExperimentConfig)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(f"unknown config key {unknown[0]!r} (known: {', '.join(sorted(known))})")
    return {k: _coerce(k, v) for k, v in values.items()}


def from_dict(values: dict) -> ExperimentConfig:
    return ExperimentConfig(**coerce(values)).validate()


def load_yaml(path: Union[str, Path]) -> dict:
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"config file {path} does not exist")
    try:
        values = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        raise ValueError(f"{path}{where}: malformed YAML: {getattr(err, 'problem', err)}") from None
    if not isinstance(values, dict):
        raise ValueError(f"{path}: expected a mapping of config keys, got {type(values).__name__}")
    return values


def parse_overrides(pairs: list[str]) -> dict:
    """``["lr=1e-4", "loss=bernoulli:0.01"]`` -> dict (values converted later by field type)."""
    out = {}
    for pair in pairs:
        key, eq, value = pair.partition("=")
        if not eq or not key.strip():
            raise ValueError(f"--set {pair!r}: expected key=value")
        out[key.strip()] = value
    return out


def load_config(path: Optional[Union[str, Path]] = None, overrides: Optional[dict] = None) -> ExperimentConfig:
    """Defaults, then the YAML file, then overrides; validated (a file's bad value too where an override
    replaces it)."""
    values = coerce(load_yaml(path)) if path else {}
    values.update(overrides or {})
    return from_dict(values)


def save_yaml(config: ExperimentConfig, path: Union[str, Path]) -> None:
    from .io import atomic_write_text
    atomic_write_text(path, yaml.safe_dump(config.to_dict(), sort_keys=False))
