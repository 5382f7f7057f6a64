"""``lossysim estimate --trace``: reading profiler traces (NCCL's fields, gloo's ops), mapping their process
groups onto the layout, the replay's clock in closed form, the command's files and its one-line refusals.

NCCL traces cannot be recorded on these machines (no GPU): the NCCL path is tested on traces written here
from the fields PyTorch's c10d records (``tests/nccl_trace.py``); the gloo path on traces PyTorch recorded
(``tests/data/traces``, ``record.py`` there)."""
import gzip
import json
from pathlib import Path

import pytest
import torch

from lossysim.cli import main
from lossysim.estimate import trace_replay as replays
from lossysim.estimate import trace as traces
from lossysim.estimate.workload import job_config
from lossysim.net import LossyNetwork
from nccl_trace import NcclCall, write_trace

DATA = Path(__file__).parent / "data" / "traces"
SLOW = "roce-100g,bw=10Gbps"     # links slow enough that a message's time shows on the clock


def _tp_dp_job(tmp_path, truncate=False):
    """tp 2 x dp 2 on 4 NCCL ranks: per step each TP group all-reduces twice (forward), each DP group
    all-reduces once and all-gathers once, the world all-reduces one element (a loss to log), and a
    collective c10d names that lossysim does not know."""
    groups = {"0": (0, 1, 2, 3), "1": (0, 1), "2": (2, 3), "3": (0, 2), "4": (1, 3)}
    folder = tmp_path / "tpdp"
    folder.mkdir()
    for rank in range(4):
        tp, dp = ("1", "3") if rank == 0 else ("1", "4") if rank == 1 else ("2", "3") if rank == 2 else ("2", "4")
        calls = [NcclCall("allreduce", 8192, 8192, tp, 100, 50), NcclCall("allreduce", 8192, 8192, tp, 300, 50),
                 NcclCall("allreduce", 100000, 100000, dp, 600, 200, dtype="Float"),
                 NcclCall("_allgather_base", 4096, 8192, dp, 900, 100),
                 NcclCall("allreduce", 1, 1, "0", 1100, 10, dtype="Float"),
                 NcclCall("allreduce_sparse", 10, 10, dp, 1200, 10)]
        write_trace(folder / f"rank{rank}.json.gz", rank, groups, [(0, 2000, calls)], [(0, 90), (400, 550)],
                    truncate_ranks=truncate)
    return folder


def test_nccl_fields_give_each_call_its_size_group_and_class(tmp_path):
    trace = traces.read(_tp_dp_job(tmp_path, truncate=True))
    calls = trace.ranks[3].calls[0]
    assert [(c.kind, c.numel, c.dtype, c.itemsize, c.group) for c in calls] == [
        ("all_reduce", 8192, "bfloat16", 2, "2"), ("all_reduce", 8192, "bfloat16", 2, "2"),
        ("all_reduce", 100000, "float32", 4, "4"), ("all_gather", 4096, "bfloat16", 2, "4"),
        ("all_reduce", 1, "float32", 4, "0")]
    assert calls[0].start == 100 and calls[0].end == 150     # the NCCL kernel's time, not the CPU event's
    assert trace.unknown == {"record_param_comms allreduce_sparse (collective not known)": 4}
    config = job_config(tp_size=2, dp_size=2, ranks_per_node=2, link_inter=SLOW)
    layout = replays.Layout(trace, config)
    assert layout.describe(trace) == {"0": "no axis of tp2 x pp1 x dp2 = 4 GPUs on 2 nodes", "1": "tp", "2": "tp",
                                      "3": "dp", "4": "dp"}
    row = replays.simulate_trace(trace, config, steps=2)
    # per step: 2 all-reduces on each of 2 TP groups; an all-reduce (dp) and an all-gather (fsdp) on each DP group
    assert (row["tp_calls"], row["dp_calls"], row["fsdp_calls"], row["pp_calls"]) == (4, 2, 2, 0)
    assert row["tp_bytes"] == 4 * 8192 * 2 and row["dp_bytes"] == 2 * 400000 and row["fsdp_bytes"] == 2 * 8192
    assert row["not_simulated_calls"] == 1 and "group is no axis's group" in row["not_simulated"]
    # every packet is the network's own count: the same message on the same group's network, twice a step
    settings = config.network_settings()
    for cls, spec, numel, dtype, collective, calls_per_step in (
            ("tp", config.mesh().network_spec("tp", 0, settings), 8192, "bfloat16", "all_reduce", 2),
            ("dp", config.mesh().network_spec("dp", 0, settings, ("bwd",)), 100000, "float32", "all_reduce", 1)):
        net = LossyNetwork(spec)
        for _ in range(calls_per_step):
            net.simulate("x", "bwd", numel, getattr(torch, dtype), collective)
        assert row[f"{cls}_packets_sent"] == 2 * net.totals()["sent"]


def _mirrored(tmp_path, numel, compute, call_start, call_end):
    """One NCCL rank of a dp 2 job whose peer mirrors it: one all-reduce, the compute kernels given."""
    path = tmp_path / f"rank0-{numel}.json"
    write_trace(path, 0, {"0": (0, 1)}, [(0, 10000, [NcclCall("allreduce", numel, numel, "0", call_start,
                                                              call_end - call_start)])], compute)
    return traces.read(path)


@pytest.mark.parametrize("numel", [1 << 22, 64])
def test_a_wait_resumes_when_the_simulated_call_ends(tmp_path, numel):
    """Compute 0-5 ms and 9-10 ms; an all-reduce issued at 1 ms ended at 8.5 ms in the trace and the
    stream resumed 0.5 ms later: on the replay's clock it resumes at max(5 ms, 1 ms + d + 0.5 ms) and the
    step ends 1 ms of compute later (d: the network's loss-free seconds for the message)."""
    trace = _mirrored(tmp_path, numel, [(0, 5000), (9000, 10000)], 1000, 8500)
    config = job_config(tp_size=1, dp_size=2, link_inter=SLOW)
    net = LossyNetwork(config.mesh().network_spec("dp", 0, config.network_settings(), ("bwd",)))
    net.simulate("x", "bwd", numel, torch.bfloat16)
    d = net.clock()["ideal_comm_s"]
    row = replays.simulate_trace(trace, config, steps=1)
    assert row["compute_s"] == pytest.approx(6e-3, abs=1e-12)
    assert row["loss_free_step_s"] == pytest.approx(max(5e-3, 1.5e-3 + d) + 1e-3, abs=1e-12)
    assert row["dp_comm_s"] == pytest.approx(d, rel=1e-12)
    assert row["trace_ranks"] == 1 and row["dp_calls"] == 1


def test_a_receiver_waits_for_its_sender_on_the_replays_clock(tmp_path):
    """A pipeline of 2 NCCL ranks whose clocks disagree: rank 0 computes 0-1 ms and sends at 1 ms; rank 1's
    receive (issued at 0) ended at 0.05 ms on its own clock, and it computed 0.1-1.1 ms. On the replay's
    one clock the message leaves at 1 ms: rank 1 computes from 1 ms + d + 0.05 ms, and the step ends 1 ms
    of compute later."""
    folder = tmp_path / "pp"
    folder.mkdir()
    groups = {"0": (0, 1)}
    write_trace(folder / "rank0.json", 0, groups, [(0, 1200, [NcclCall("send", 65536, 65536, "0", 1000, 200,
                                                                       peer=1)])], [(0, 1000)])
    write_trace(folder / "rank1.json", 1, groups, [(0, 1100, [NcclCall("recv", 65536, 65536, "0", 0, 50,
                                                                       peer=0)])], [(100, 1100)])
    config = job_config(tp_size=1, pp_size=2, link_inter=SLOW)
    net = LossyNetwork(config.mesh().network_spec("pp", 0, config.network_settings(), ("fwd", "bwd")))
    net.simulate("x", "fwd", 65536, torch.bfloat16, "send", pair=(0, 1))
    d = net.clock()["ideal_comm_s"]
    row = replays.simulate_trace(traces.read(folder), config, steps=1)
    assert row["pp_calls"] == 1 and row["pp_comm_s"] == pytest.approx(d, rel=1e-12)
    assert row["loss_free_step_s"] == pytest.approx(1e-3 + d + 0.05e-3 + 1e-3, abs=1e-12)


def test_same_seed_same_row_and_loss_costs_time():
    trace = traces.read(DATA / "ddp")
    config = job_config(tp_size=1, dp_size=2, loss="bernoulli:0.01", transport="retransmit", nic="tcp",
                        link_inter="roce-100g")
    first, again = (replays.simulate_trace(trace, config, steps=3) for _ in range(2))
    assert json.dumps(first) == json.dumps(again)
    assert first["dp_packets_lost"] > 0 and first["step_mean_s"] > first["loss_free_step_s"]
    assert first["stack_compute_s"] + first["stack_dp_s"] + first["stack_repair_s"] == \
        pytest.approx(first["step_mean_s"], rel=1e-9)


def test_the_command_writes_every_estimates_files_and_what_it_read(tmp_path, capsys):
    out = tmp_path / "out"
    code = main(["estimate", "--trace", str(DATA / "pp"), "--loss", "none", "--loss", "bernoulli:0.01",
                 "--transport", "retransmit", "--nic", "tcp", "--link-inter", "roce-100g", "--steps", "2",
                 "--no-progress", "--out", str(out)])
    assert code == 0
    err = capsys.readouterr().err
    assert "process group 0 [0, 1]: pp" in err and "not understood: none" in err
    assert sorted(p.name for p in out.iterdir()) == ["estimate.csv", "estimate.json", "slowdown.png",
                                                     "time_by_class.png", "trace_read.json"]
    rows = json.loads((out / "estimate.json").read_text())
    assert [r["loss"] for r in rows] == ["none", "bernoulli:0.01"] and rows[0]["layout"].startswith("tp1 x pp2")
    assert rows[0]["pp_calls"] == 8 and rows[0]["compute"] == "trace"
    read = json.loads((out / "trace_read.json").read_text())
    assert read["process_group_axes"] == {"0": "pp"} and read["ranks_traced"] == [0, 1]
    assert {r["collective"]: r["calls"] for r in read["calls_per_step"]} == {"send": 4, "recv": 4}
    assert read["per_class"] == {"pp": {"calls": 8, "bytes": 8 * 2 * 64 * 128 * 4}} and read["not_simulated"] == {}


def test_a_named_model_replaces_the_traces_compute(tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["estimate", "tiny-llama", "--trace", str(DATA / "fsdp"), "--seq", "64", "--micro-batch", "2",
                 "--dtype", "fp32", "--steps", "1", "--no-progress", "--out", str(out)]) == 0
    read = json.loads((out / "trace_read.json").read_text())
    row = json.loads((out / "estimate.json").read_text())[0]
    assert row["compute"].startswith("modelled (h100, tiny-llama)")
    assert row["compute_s"] == pytest.approx(read["compute_modelled_s"], rel=1e-9)


def _refused(capsys, tmp_path, *args):
    out = tmp_path / "refused"
    code = main(["estimate", *args, "--no-progress", "--out", str(out)])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert not out.exists()
    return err


def test_bad_traces_are_one_line_and_exit_2(tmp_path, capsys):
    whole = gzip.decompress((DATA / "fsdp" / "rank0.json.gz").read_bytes())
    cut = tmp_path / "cut.json"
    cut.write_bytes(whole[:len(whole) // 2])
    assert "not a profiler trace (truncated" in _refused(capsys, tmp_path, "--trace", str(cut))
    cut_gz = tmp_path / "cut.json.gz"
    cut_gz.write_bytes((DATA / "fsdp" / "rank0.json.gz").read_bytes()[:5000])
    assert "not a profiler trace (truncated" in _refused(capsys, tmp_path, "--trace", str(cut_gz))
    foreign = tmp_path / "foreign.json"
    foreign.write_text(json.dumps({"some": "thing"}))
    assert "no traceEvents" in _refused(capsys, tmp_path, "--trace", str(foreign))
    local = tmp_path / "local.json"
    local.write_text(json.dumps({"traceEvents": []}))
    assert "no distributedInfo" in _refused(capsys, tmp_path, "--trace", str(local))
    assert "give every rank's trace" in _refused(capsys, tmp_path, "--trace", str(DATA / "pp" / "rank0.json.gz"))
    assert "the trace's world is 2 ranks" in _refused(capsys, tmp_path, "--trace", str(DATA / "ddp"),
                                                      "--dp-size", "4")
    assert "no such file" in _refused(capsys, tmp_path, "--trace", str(tmp_path / "nothing"))
    assert "name a model" in _refused(capsys, tmp_path)
