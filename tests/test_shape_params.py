"""A published shape's parameters from its numbers (estimate/shape_params.py) are its meta model's: the same
names, sizes and order, the same stages, and so the same DDP buckets, element by element, on every layout."""
import pytest
import torch

from lossysim.estimate import Workload, job_config, shape_params, shapes
from lossysim.estimate.job import Job
from lossysim.pp.stages import parameter_stages, stage_parameters


def _layout(layers: int, pp: int) -> tuple[int, ...]:
    """Blocks per stage, the remainder on the last stages (DeepSeek-V3's 61 blocks split unevenly)."""
    return tuple(layers // pp + (s >= pp - layers % pp) for s in range(pp))


@pytest.mark.parametrize("name", shapes.PUBLISHED)
def test_the_parameters_are_the_meta_models(name):
    shape = shapes.load(name)
    params = shape_params.parameters(shape)
    model = shape.meta_model()
    base = model.base_model
    built = [(n, p.numel()) for n, p in base.named_parameters()]
    built += [(n, p.numel()) for n, p in model.named_parameters() if not n.startswith(f"{model.base_model_prefix}.")]
    assert [(p.name, p.numel) for p in params] == built
    layout = _layout(shape.layers, 3)
    owner = parameter_stages(model, layout)
    assert [shape_params.stage_of(p, layout) for p in params] == [owner[id(p)] for p in model.parameters()]
    assert shape_params.stage_parameters(params, layout) == stage_parameters(model, layout)
    if shape.experts:   # counted as a token multiplies them, at tp 2
        weight = shape.experts.top_k / shape.experts.count * 2
        assert shape_params.stage_parameters(params, layout, weight) == stage_parameters(model, layout, 2)
    assert sum(p.numel for p in params) == shape.parameters
    if shape.experts:
        assert sum(p.numel for p in params if p.expert) == shape.experts.parameters


def _job(name: str, monkeypatch, derived: bool, tp: int, pp: int, ep: int, mb: float) -> Job:
    shape = shapes.load(name)
    with monkeypatch.context() as patch:
        if not derived:
            patch.setattr(shape_params, "parameters", lambda shape: None)
        config = job_config(name, tp_size=tp, pp_size=pp, dp_size=2, ep_size=ep, dp_bucket_mb=mb,
                            ranks_per_node=tp * pp)
        job = Job(shape, config, Workload(seq=8), _layout(shape.layers, pp), 8)
        job._stage_parameters
        return job


# (shape, tp, pp, ep, bucket MiB): every family, kv heads split and held by several ranks (405B at tp 16),
# routed experts bucketed with the rest (ep 1) and apart (ep 2), fp32 gradients' small and large caps
LAYOUTS = [(name, 5 if name == "gpt2-xl" else 2, 2, 1, 25) for name in shapes.PUBLISHED] + [   # (25 heads)
    ("gpt2", 4, 1, 1, 1), ("llama-3.1-70b", 8, 4, 1, 25), ("llama-3.1-405b", 16, 2, 1, 100),
    ("qwen2.5-7b", 4, 2, 1, 5), ("mixtral-8x7b", 8, 2, 2, 25), ("qwen3-30b-a3b", 4, 3, 2, 10),
    ("deepseek-v3", 8, 4, 2, 25), ("llama-3.2-1b", 2, 4, 1, 3)]


@pytest.mark.parametrize("name,tp,pp,ep,mb", LAYOUTS)
def test_the_buckets_and_stages_are_the_meta_models(name, tp, pp, ep, mb, monkeypatch):
    built = _job(name, monkeypatch, False, tp, pp, ep, mb)
    derived = _job(name, monkeypatch, True, tp, pp, ep, mb)
    assert len(derived.buckets) == pp and all(derived.buckets)
    assert derived.buckets == built.buckets     # Bucket is a dataclass: params, sharded, numels, ready compared
    assert derived.ready == built.ready
    assert derived._stage_parameters == built._stage_parameters


def test_a_shape_not_published_is_built(monkeypatch):
    shape = shapes.load("tiny-llama")
    assert shape_params.parameters(shape) is None
    job = _job("tiny-llama", monkeypatch, True, 2, 2, 1, 0.01)
    assert sum(len(stage) for stage in job.buckets) > 2
