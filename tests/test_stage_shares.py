"""A pipeline stage's share of a step's compute counts the parameters its tokens multiply: a routed
expert's top-k / experts of the time (times tp, every TP rank running its experts whole), and in the
estimate as often as the busiest rank's tokens reach it, so the stages' counts sum to the whole step's
(``cost.active_parameters`` for training, ``simulate._busiest`` for the estimate), not to the experts' size."""
import pytest
import torch

from lossysim.estimate import Workload, job_config, shape_params, shapes
from lossysim.estimate.job import Job
from lossysim.estimate.simulate import _busiest
from lossysim.models import cost
from lossysim.run.build import build
from tiny_runs import tiny_run

MOE = [name for name in shapes.PUBLISHED if shapes.load(name).experts is not None]


def _layout(layers: int, pp: int) -> tuple[int, ...]:
    return tuple(layers // pp + (s >= pp - layers % pp) for s in range(pp))


@pytest.mark.parametrize("tp", [1, 2])
def test_a_training_stage_of_experts_is_charged_its_active_parameters(tmp_path, tp):
    parts = build(tiny_run(tmp_path, model="tiny-moe", tp_size=tp, pp_size=2), torch.device("cpu"), 0, True, None)
    model = parts.model.model
    routed = cost.routed_experts(model)
    whole = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for p in model.parameters() if id(p) in routed)
    top_k, count = model.config.num_experts_per_tok, model.config.num_local_experts
    assert experts > 0 and parts.pipeline.stages == 2
    assert sum(parts.pipeline.parameters) == pytest.approx(parts.parameters, rel=1e-12)
    assert sum(parts.pipeline.parameters) == pytest.approx(whole - experts + experts * top_k / count * tp, rel=1e-12)


@pytest.mark.parametrize("name", MOE)
@pytest.mark.parametrize("skew", [0.0, 1.0])
def test_the_estimates_stages_sum_to_the_busiest_ranks_step(name, skew, monkeypatch):
    shape = shapes.load(name)
    pp, w = 4, Workload(seq=8, routing_skew=skew)
    config = job_config(name, tp_size=2, pp_size=pp, dp_size=4, ep_size=4, ranks_per_node=8)
    for derived in (True, False):    # from the shape's numbers, and from its meta model
        with monkeypatch.context() as patch:
            if not derived:
                patch.setattr(shape_params, "parameters", lambda shape: None)
            job = Job(shape, config, w, _layout(shape.layers, pp), 8)
            counts = job._stage_parameters
        assert sum(counts) == pytest.approx(_busiest(shape, job.mesh, w, config.seed), rel=1e-9), derived
        assert sum(counts) < shape.parameters     # not the experts' size
        shares = job.shares(8)
        assert sum(shares) == pytest.approx(1.0) and all(s > 0 for s in shares)


def test_deepseek_v3s_dense_first_stage_is_not_starved():
    """DeepSeek-V3's first three blocks are dense: by parameters held its first stage of 3 would get a
    twentieth of the next stage's (4 blocks, 256 experts each), by parameters multiplied most of it."""
    shape = shapes.load("deepseek-v3")
    config = job_config("deepseek-v3", tp_size=1, pp_size=16, dp_size=2, ep_size=2, ranks_per_node=8)
    layout = (3,) + (4,) * 13 + (3, 3)
    job = Job(shape, config, Workload(seq=4096), layout, 4096)
    held = shape_params.stage_parameters(shape_params.parameters(shape), layout)
    active = job._stage_parameters
    assert held[0] / held[1] < 0.1
    assert 0.6 < active[0] / active[1] < 1.2
    assert active[1] == active[2]
