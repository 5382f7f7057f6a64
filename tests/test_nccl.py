"""NCCL's own choices, checked against tuning.cc's arithmetic done here by hand: the protocol ceilings
(LL's per generation and node count, the per-channel caps), the channel search on our links, the
(algorithm, protocol) the tuner picks, NVLS and NVLS-tree, and what arrives through them under loss.

Numbers are NCCL 2.30.7's (src/graph/tuning.cc, ncclTunerConstantsDefaults; src/graph/search.cc's
speed tables); every expected value below is written out from those constants, not read from
lossysim.timing.nccl's tables.
"""
from __future__ import annotations

import pytest

from lossysim.timing import LINK_PRESETS, nccl

GBps = 1e9
NV4, NV3, NDR, HDR = (LINK_PRESETS[n] for n in ("nvlink4", "nvlink3", "ib-ndr400", "ib-hdr200"))


def _fabric(per_node: int, nodes: int, intra=NV4, nic=NDR, arch="hopper", nics=None) -> nccl.Fabric:
    """A fabric as the network builds it: one NIC per GPU unless told."""
    nics = per_node if nics is None else nics
    bus = intra.bandwidth_Bps if nodes == 1 else min(intra.bandwidth_Bps, nics * nic.bandwidth_Bps)
    return nccl.Fabric(per_node * nodes, nodes, bus, intra.bandwidth_Bps, nic.bandwidth_Bps, arch)


def _busbw(algorithm, protocol, fabric, collective="all_reduce"):
    return nccl._bus_bandwidth(collective, algorithm, protocol, fabric)[0]


# -- the channel search --------------------------------------------------------------------------

def test_channels_as_ncclTopoCompute_finds_them_on_dgx_nodes():
    # H100 node: 370 GB/s of NVLink; sm90's fastest intra speed 60 GB/s fits 6 times (360), doubled
    # by ncclTopoDupChannels (60 >= 50): 12 channels (NCCL logs 24 coll channels: 12, twice).
    assert nccl.ring_channels(_fabric(8, 1)) == 12
    # Across H100 nodes: one NIC path runs 48 GB/s (sm90's fastest inter speed), 370 / 48 = 7.7 -> 8
    # channels, one per NIC; below 50 GB/s with more than 4 channels Hopper does not double them.
    assert nccl.ring_channels(_fabric(8, 2)) == 8
    # A100 node (232 GB/s): 40 GB/s fits 5.8 -> 6 times, doubled (>= 25 GB/s before Hopper): 12.
    assert nccl.ring_channels(_fabric(8, 1, NV3, arch="ampere")) == 12
    # Two DGX-A100 with 8 HDR NICs: 200 GB/s of NICs at 24 GB/s (the fastest inter speed under 25): 8.
    assert nccl.ring_channels(_fabric(8, 2, NV3, HDR, arch="ampere")) == 8
    # NVLS: one channel per local GPU, the fastest intra speed all 8 fit in 370 GB/s (40: 320), bwInter
    # raised while below twice bwIntra (50, then 60: the table's top).
    assert nccl.nvls_graph(_fabric(8, 1)) == (8, 40.0, 60.0)
    # Across nodes the inter table: 48 x 8 = 384 > 370, so 45; bwInter up to 48 (one NIC).
    assert nccl.nvls_graph(_fabric(8, 16)) == (8, 45.0, 48.0)


# -- protocol ceilings ---------------------------------------------------------------------------

@pytest.mark.parametrize("arch, intra, ceiling", [("hopper", NV4, 141.0), ("ampere", NV3, 87.7)])
def test_ll_is_capped_per_generation_on_one_node(arch, intra, ceiling):
    fabric = _fabric(8, 1, intra, arch=arch)
    # ring LL: min(llMaxBw, busBw / 2); half of 370 or 232 GB/s is above both ceilings
    assert intra.bandwidth_Bps / 2 > ceiling * GBps
    assert _busbw("ring", "LL", fabric) == pytest.approx(ceiling * GBps, rel=1e-12)
    # the algorithm bandwidth a 1 GiB LL ring sustains: busBw R / (2(R-1))
    algbw = nccl.algorithm_bandwidth("all_reduce", "ring", "LL", 8, 1, fabric.busbw_Bps, 2 ** 30, fabric)
    assert algbw == pytest.approx(ceiling * GBps * 8 / 14, rel=1e-12)


@pytest.mark.parametrize("nodes, ceiling", [(2, 39.0), (4, 20.4), (16, 20.4)])
def test_ll_is_capped_per_node_count_across_nodes(nodes, ceiling):
    fabric = _fabric(8, nodes)
    assert _busbw("ring", "LL", fabric) == pytest.approx(ceiling * GBps, rel=1e-12)
    # tree LL: min(0.92 busBw (capped per channel) / 3.8, llMaxBw): 8 x 41.4 or 36 GB/s / 3.8 is below
    per_channel = 41.4 if nodes == 2 else 36.0
    assert _busbw("tree", "LL", fabric) == pytest.approx(min(8 * per_channel / 3.8, ceiling) * GBps, rel=1e-12)


def test_per_channel_caps():
    # Two H100 nodes, 8 channels: tree min(0.92 x 370, 8 x 41.4) = 331.2 GB/s; 16 nodes 8 x 36 = 288.
    assert _busbw("tree", "Simple", _fabric(8, 2)) == pytest.approx(331.2 * GBps, rel=1e-12)
    assert _busbw("tree", "Simple", _fabric(8, 16)) == pytest.approx(288.0 * GBps, rel=1e-12)
    # tree LL128 across more than two nodes: min(288 x 120/128, 8 x 29.0) = 232
    assert _busbw("tree", "LL128", _fabric(8, 16)) == pytest.approx(232.0 * GBps, rel=1e-12)
    # one node: tree LL128 min(0.92 x 370 x 7/9, 12 x 36.7) = 264.7 (the cap does not bind)
    assert _busbw("tree", "LL128", _fabric(8, 1)) == pytest.approx(0.92 * 370 * 7 / 9 * GBps, rel=1e-12)
    # ring LL128 on A100 nodes: min(0.92 x 232, 12 x 20) = 213.4; on two HDR nodes min(0.92 x 200, 8 x 20) = 160
    assert _busbw("ring", "LL128", _fabric(8, 1, NV3, arch="ampere")) == pytest.approx(0.92 * 232 * GBps, rel=1e-12)
    assert _busbw("ring", "LL128", _fabric(8, 2, NV3, HDR, arch="ampere")) == pytest.approx(160 * GBps, rel=1e-12)
    # Simple rings have no cap: the links' bus bandwidth
    assert _busbw("ring", "Simple", _fabric(8, 16)) == pytest.approx(370 * GBps, rel=1e-12)


def test_ceilings_slow_small_cross_node_messages():
    """Without the ceilings an LL ring across 16 nodes ran at 185 GB/s; NCCL's model caps it at 20.4."""
    fabric = _fabric(8, 16)
    t = nccl.estimate("all_reduce", "ring", 128, 16, 2 ** 20, fabric.busbw_Bps, protocols=("LL",),
                      intra_Bps=NV4.bandwidth_Bps, nic_Bps=NDR.bandwidth_Bps)
    latency = (6.6 + (254 - 30) * 1.0 + 30 * 2.7) * 1e-6      # base, 224 NVLink hops at the 1 us proxy floor, 30 net
    assert t.latency_s == pytest.approx(latency, rel=1e-12)
    assert t.bandwidth_s == pytest.approx(2 ** 20 / (20.4e9 * 128 / 254), rel=1e-12)
