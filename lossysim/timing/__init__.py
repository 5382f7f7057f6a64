"""The time model: links, collectives on them, retransmission and compute (docs/time_model.md).

One implementation of every time formula: the network charges what these functions compute,
and the tests hold the network's clock against the closed forms here.
"""
from .collectives import (BUSBW_FACTORS, SendTime, algbw, busbw, direct_all_gather_time, direct_all_reduce_time,
                          packet_count, ring_all_gather_time, ring_all_reduce_time, send_times, step_time,
                          tree_all_reduce_time)
from .compute import DEFAULT_MFU, GPU_PRESETS, MEASURED, Compute, Measured, parse_compute
from .links import IB_HEADER_BYTES, LINK_PRESETS, ROCE_HEADER_BYTES, Link, parse_link
from .retransmission import (DEFAULT_NIC, IB_RETRY_COUNT, IB_TIMEOUT_DEFAULT, NIC_PRESETS, TCP_RTO_MIN_S, Nic,
                             expected_repair_s, go_back_n_transmissions, ib_timeout_s, parse_nic, selective_repeat_transmissions,
                             window_packets)

__all__ = ["Link", "LINK_PRESETS", "ROCE_HEADER_BYTES", "IB_HEADER_BYTES", "parse_link", "packet_count", "SendTime", "send_times", "step_time",
           "ring_all_reduce_time", "ring_all_gather_time", "tree_all_reduce_time", "direct_all_reduce_time",
           "direct_all_gather_time", "BUSBW_FACTORS", "algbw", "busbw", "selective_repeat_transmissions", "expected_repair_s",
           "go_back_n_transmissions", "window_packets", "TCP_RTO_MIN_S", "IB_TIMEOUT_DEFAULT", "IB_RETRY_COUNT", "ib_timeout_s", "Nic", "NIC_PRESETS", "DEFAULT_NIC",
           "parse_nic",
           "Compute", "GPU_PRESETS", "DEFAULT_MFU", "Measured", "MEASURED", "parse_compute"]
