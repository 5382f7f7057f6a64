"""lossy_layers / lossy_sites: only the selected TP call sites lose packets, with the very masks an
all-lossy run draws there (each site keeps its own random stream); the rest is delivered, counted."""
from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _tp_common import build, make_batch, tp_step  # noqa: E402

from lossysim import LossyNetwork, parallelize  # noqa: E402
from lossysim.config import ExperimentConfig  # noqa: E402
from lossysim.net.selection import SiteSelection, parse_layers  # noqa: E402
from tiny_runs import dp_group_spec  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

LAYERS = 3


def test_layers_parse_to_indices():
    assert parse_layers("all") is None
    assert parse_layers(3) == {3}
    assert parse_layers("0-2, 7") == {0, 1, 2, 7}
    for bad in ("", "x", "3-1", "1,", "-2", "0-99999999999"):
        with pytest.raises(ValueError, match="lossy_layers="):
            parse_layers(bad)
    with pytest.raises(ValueError, match="lossy_sites='ffn' must be one of all, attn, mlp"):
        SiteSelection.parse("all", "ffn")


@pytest.mark.parametrize("site, layers, kind, covered", [
    ("layers.3.self_attn.reduce", "3", "attn", True),
    ("layers.3.self_attn.copy", "0-5", "all", True),
    ("layers.13.mlp.reduce", "3", "all", False),     # 13 is not 3
    ("layers.3.mlp.copy", "3", "attn", False),
    ("h.0.attn.copy", "0", "attn", True),            # GPT-2's names
    ("h.0.mlp.reduce", "all", "mlp", True),
    ("dp.bucket0", "0", "all", False),               # not a TP block's site: only "all" covers it
    ("dp.bucket0", "all", "all", True),
])
def test_which_sites_a_selection_covers(site, layers, kind, covered):
    assert SiteSelection.parse(layers, kind).covers(site) is covered


def _lost_by_site(network: LossyNetwork) -> dict:
    return {(row["site"], row["direction"]): (row["sent"], row["lost"], row["configured_loss_rate"])
            for row in network.summary(by=("site", "direction"))}


def _run(**selection) -> dict:
    network = LossyNetwork(2, "bernoulli:0.3", seed=4, payload_bytes=64, **selection)  # many packets a site
    tpm = parallelize(build("lm", family="llama", num_hidden_layers=LAYERS), 2, network)
    tp_step(tpm, "lm", make_batch("lm"))
    return _lost_by_site(network)


@pytest.mark.parametrize("layers, kind", [("1", "mlp"), ("0,2", "attn"), ("2", "all")])
def test_only_the_selected_sites_lose_packets_and_with_the_same_masks(layers, kind):
    everywhere, selected = _run(), _run(lossy_layers=layers, lossy_sites=kind)
    chosen = SiteSelection.parse(layers, kind)
    assert selected.keys() == everywhere.keys() and len(selected) == 4 * LAYERS  # attn, mlp x copy, reduce
    assert any(chosen.covers(site) for site, _ in selected)
    for key, (sent, lost, configured) in selected.items():
        assert sent == everywhere[key][0] > 0, key            # every site still sends (and is timed)
        if chosen.covers(key[0]):
            assert (lost, configured) == everywhere[key][1:], key
            assert lost > 0, key
        else:
            assert (lost, configured) == (0, 0.0), key


def test_data_parallel_traffic_is_not_narrowed_by_a_tp_selection():
    config = ExperimentConfig(lossy_layers="1", lossy_sites="mlp", dp_size=2, tp_size=2, batch_size=4).validate()
    assert config.network_spec().selection == SiteSelection(frozenset({1}), "mlp")
    assert dp_group_spec(config).selection.everything


def test_a_layer_the_model_lacks_is_refused():
    SiteSelection.parse("0-2", "all").check_depth(3)
    with pytest.raises(ValueError, match=r"lossy_layers names layer 3, but the model has 3 layers \(0-2\)"):
        SiteSelection.parse("1,3-4", "all").check_depth(3)
    with pytest.raises(ValueError, match="lossy_layers="):
        ExperimentConfig(lossy_layers="first").validate()
