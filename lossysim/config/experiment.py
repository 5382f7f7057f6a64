"""Experiment configuration: one flat dataclass, validated once here, at the edge, so the rest of the
code can trust it; ``coerce`` and ``from_dict``: values as YAML or --set spell them, as its fields' types."""
from __future__ import annotations

import contextvars
import dataclasses
import math
from dataclasses import dataclass, fields
from typing import Any, Optional, Union, get_args, get_origin, get_type_hints

import yaml

from .. import axes
from ..mesh import DEFAULT_ORDER, Mesh, parse_order
from ..net.spec import SETTINGS, NetworkSpec
from ..timing import DEFAULT_NIC, parse_compute
from ..traffic import BY_NAME, parse_kinds as traffic_kinds
from ..util import nearest, stream_seed
from .choices import BACKENDS, check_choice, parse_layout, parse_report_to
from .execution import DEFAULT_THREADS, check_count
from .fabric import check_fabric
from .pairs import check_something_can_lose, validate_pairs

_TRYING = contextvars.ContextVar("trying", default=False)   # ExperimentConfig.accepts is validating a variant


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
    # parallelism: every axis's settings (tp_size, dp_size, dp_mode, ...) are declared by its package
    # (``lossysim/<axis>/axis.py``, collected in ``lossysim.axes``) and placed here, before ``backend``
    backend: str = "sim"               # sim | dist
    sync_replicated: bool = True       # dist: average replicated grads over a reliable channel
    parallel_order: str = DEFAULT_ORDER  # how global ranks are laid out, innermost first (Megatron's order)
    lossy_traffic: str = "all"         # which traffic can lose packets: all, or some of lossysim.traffic.KINDS
    timeout_s: float = 600.0
    # the fabric (config/fabric.py, docs/fabric.md): none keeps every rank pair its own link, as before
    fabric: str = "none"               # none | superpod:SU | leaf-spine:nodes=N,... | a .yaml file
    bad_link: str = ""                 # lossy cables, CABLE:LOSS entries separated by ';'
    corrupt_share: float = 0.0         # a share of cables lossy at CorrOpt's rates, drawn at the seed
    qps_per_connection: int = 1        # NCCL_IB_QPS_PER_CONNECTION: queue pairs hashed apart
    pxn: bool = True                   # NCCL's PXN: cross-rail traffic over NVLink first
    routing: str = "ecmp"              # ecmp | spray
    shared_cables: bool = True         # estimate: flows on one cable share its bandwidth (estimate/collisions.py)
    link_event: str = ""               # cables down, flapping or slowed in time, entries separated by ';'
    reroute: str = "ecmp"              # how routes go around a dead switch cable (fabric.events.REROUTE_S)
    ib_timeout: int = 20               # NCCL_IB_TIMEOUT: how long an RC queue pair waits out an outage
    event_steps: int = 1000            # estimate: the steps the job runs through its link events
    # training
    steps: int = 300
    batch_size: int = 16
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
    threads: int = DEFAULT_THREADS     # torch's intra-op threads (config/execution.py): speed, never results
    save_checkpoint: bool = False      # the gathered HF model at the end (checkpoint/)
    checkpoint_every: int = 0          # full training state every N steps for --resume (0: never)
    keep_checkpoints: int = 2
    report_to: str = "none"            # none | tensorboard | wandb, several comma-separated (HF's key)
    out: str = "runs/tiny-synthetic"

    def validate(self) -> "ExperimentConfig":
        """Raise ValueError with the offending field on the first problem."""
        check_choice("attn_implementation", self.attn_implementation, ("sdpa", "eager"))
        check_choice("task", self.task, ("classification", "lm"))
        if self.dataset == "pydoc" and self.task != "lm":
            raise ValueError("dataset=pydoc is unlabelled documentation text: use task=lm")
        check_choice("backend", self.backend, BACKENDS)
        check_choice("amp", self.amp, ("none", "bf16", "fp16"))
        for setting in axes.settings():   # each axis's own checks (its declaration's)
            setting.validate(getattr(self, setting.field))
        for name in ("steps", "batch_size", "eval_batch_size", "max_length", "eval_every", "log_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        for name in ("max_train_samples", "max_eval_samples"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name}={value} must be >= 1 (or null for no cap)")
        for name in ("lr", "weight_decay", "grad_clip", "timeout_s", "restart_s"):
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"{name}={value} must be a finite number >= 0")
        for name in ("checkpoint_every", "keep_checkpoints", "restart_lost_steps", "max_failures"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 0")
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps={self.warmup_steps} must be >= 0")
        if self.dropout is not None and not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout={self.dropout} must be in [0, 1)")
        check_count("threads", self.threads)
        self._validate_pipeline()
        self._validate_data_parallel()
        validate_pairs(self)
        self.parallel_order = "-".join(parse_order(self.parallel_order))   # one spelling: one run identity
        self.mesh()                       # the layout's one check, for train, sweep and estimate alike
        check_fabric(self)
        check_something_can_lose(self)
        try:
            parse_compute(self.compute)
        except ValueError as err:
            raise ValueError(f"compute: {err}") from None
        if not 0.0 < self.target_accuracy <= 1.0:
            raise ValueError(f"target_accuracy={self.target_accuracy} must be in (0, 1]")
        parse_report_to(self.report_to)
        return self

    def _validate_data_parallel(self) -> None:
        traffic_kinds(self.lossy_traffic)
        if self.batch_size % (self.dp_size * self.n_microbatches):
            raise ValueError(f"batch_size={self.batch_size} must be a multiple of dp_size={self.dp_size} x "
                             f"microbatches={self.n_microbatches}{' (pp_size)' if self.microbatches is None else ''}: "
                             "each replica trains on an equal shard of "
                             "the global batch, in equal micro-batches")
        if self.dp_size == 1 and self.dp_sync_every:
            raise ValueError(f"dp_sync_every={self.dp_sync_every} needs dp_size > 1: one replica has no "
                             "others to synchronise; set dp_sync_every=0")

    def _validate_pipeline(self) -> None:
        """pp keys alone; pp_layout against the model's depth is checked where the depth is known
        (``lossysim.pp.stages.stage_layout``, at build)."""
        # Canonical: microbatches equal to pp_size is its default, so a run's identity (and an older
        # saved config's ``microbatches: 1``) does not depend on whether it was written out.
        if self.microbatches == self.pp_size:
            self.microbatches = None
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

    def mesh(self) -> Mesh:
        """Where this run's ranks sit (``lossysim.mesh``): every axis's size (``lossysim.axes``) in
        ``parallel_order`` (experts carved out of the data-parallel ranks), ranks_per_node to a node (a bad
        layout: a one-line ValueError)."""
        return Mesh(**{axis.mesh: getattr(self, axis.size) for axis in axes.AXES if axis.mesh},
                    ranks_per_node=self.ranks_per_node, order=self.parallel_order)

    def network_spec(self, evaluation: bool = False) -> NetworkSpec:
        """The training network of replica 0's TP group, placed by the mesh; ``evaluation``: the
        evaluation network's, which draws from its own streams (and loses nothing unless ``eval_lossy``)."""
        return self.mesh().network_spec("tp", 0, self.network_settings(evaluation))

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


_CORE = dict(ExperimentConfig.__annotations__)   # the fields declared above, in order
_GENERATED = ("__init__", "__repr__", "__eq__", "__match_args__")
_TYPES: dict = {}


def _declare() -> None:
    """ExperimentConfig's fields: the ones above, with every axis's settings (``lossysim.axes``) before
    ``backend``; rebuilt (the same class, so every reference to it stays good) when an axis is declared or
    taken back."""
    cls = ExperimentConfig
    declared = {s.field: s for s in axes.settings()}
    for name in _GENERATED:
        if name in cls.__dict__:
            delattr(cls, name)
    for name in set(getattr(cls, "__dataclass_fields__", {})) - set(_CORE) - set(declared):
        delattr(cls, name)   # a setting of an axis taken back
    annotations = {}
    for name, kind in _CORE.items():
        if name == "backend":
            annotations.update({s.field: s.type for s in declared.values()})
        annotations[name] = kind
    cls.__annotations__ = annotations
    for setting in declared.values():
        setattr(cls, setting.field, setting.default)
    dataclass(cls)
    _TYPES.clear()
    _TYPES.update(get_type_hints(cls))


_declare()
axes.on_change(_declare)
_LIST_FIELDS = ("report_to", "lossy_traffic")          # str fields that also take a list of names


def _coerce(name: str, value: Any) -> Any:
    """Convert a YAML or command-line value to the field's type."""
    kind = _TYPES[name]
    optional = get_origin(kind) is Union and type(None) in get_args(kind)
    if optional:
        kind = next(t for t in get_args(kind) if t is not type(None))
        if value is None or (isinstance(value, str) and value.lower() in ("none", "null", "")):
            return None
    if name in ("bad_link", "link_event") and isinstance(value, (list, tuple)):
        value = ";".join(str(v) for v in value)   # loss specs hold commas: entries are separated by ';'
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
        close = nearest(unknown[0], known)
        hint = f"did you mean {close}?" if close else f"known: {', '.join(sorted(known))}"
        raise ValueError(f"unknown config key {unknown[0]!r} ({hint})")
    return {k: _coerce(k, v) for k, v in values.items()}


def from_dict(values: dict) -> ExperimentConfig:
    return ExperimentConfig(**coerce(values)).validate()
