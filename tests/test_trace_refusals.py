"""``lossysim estimate --trace``'s refusals of traces it must not estimate from: a call of an absurd size,
ranks of two jobs in one folder, a trace of which no call is understood, and a flag that does nothing
with a trace. Each is one line and exit 2 before any work; the bad traces are the recorded ones
(``tests/data/traces``) edited here."""
import gzip
import json
import shutil
from pathlib import Path

import pytest

from lossysim.cli import main
from lossysim.estimate import trace as traces
from nccl_trace import NcclCall, write_trace

DATA = Path(__file__).parent / "data" / "traces"
BUCKET = 274816      # the DDP trace's first bucket (elements, float32)


def _refused(capsys, tmp_path, *args) -> str:
    out = tmp_path / "refused"
    code = main(["estimate", *args, "--steps", "1", "--no-progress", "--out", str(out)])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert not out.exists()
    return err


def _ddp(edit=None) -> dict:
    data = json.loads(gzip.decompress((DATA / "ddp" / "rank0.json.gz").read_bytes()))
    for event in data["traceEvents"]:
        if edit:
            edit(event)
    return data


def _write(folder: Path, name: str, data: dict) -> Path:
    folder.mkdir(exist_ok=True)
    (folder / name).write_text(json.dumps(data))
    return folder


def _bucket_of(numel):
    """An edit making the DDP trace's first bucket (its c10d::allreduce_ and its gloo:all_reduce) ``numel``."""
    def edit(event):
        dims = event.get("args", {}).get("Input Dims")
        if event.get("name") == "c10d::allreduce_" and dims[0] == [[BUCKET]]:
            dims[0] = [[numel]]
        if event.get("name") == "gloo:all_reduce" and dims[0] == [BUCKET]:
            dims[0] = [numel]
    return edit


@pytest.mark.parametrize("numel, why", [(10**15, "more than one call can move (288 GB"),
                                        (-BUCKET, "a negative size")])
def test_a_gloo_call_of_an_absurd_size_is_refused_naming_its_event(tmp_path, capsys, numel, why):
    folder = _write(tmp_path / "bad", "rank0.json", _ddp(_bucket_of(numel)))
    err = _refused(capsys, tmp_path, "--trace", str(folder))
    assert f"{folder / 'rank0.json'}: event c10d::allreduce_ at ts" in err
    assert f"moves {numel} float32 elements" in err and why in err and "payload_bytes" not in err


def test_an_nccl_call_is_refused_past_the_bound_and_read_up_to_it(tmp_path):
    limit = traces.MAX_CALL_BYTES // 2        # bfloat16 elements

    def read(numel):
        path = tmp_path / f"rank0-{numel}.json"
        write_trace(path, 0, {"0": (0, 1)}, [(0, 1000, [NcclCall("allreduce", numel, numel, "0", 100, 50)])],
                    [(0, 90)])
        return traces.read(path)
    assert read(limit).ranks[0].calls[0][0].bytes == traces.MAX_CALL_BYTES
    with pytest.raises(ValueError, match=r"rank0-%d\.json: event record_param_comms at ts 95 us moves %d "
                                         r"bfloat16 elements" % (limit + 1, limit + 1)):
        read(limit + 1)


def test_ranks_of_two_jobs_are_refused_naming_both_files(tmp_path, capsys):
    """Rank 0 of the DDP trace beside rank 1 of the pipeline's: the same world and process groups, but
    rank 0 all-reduces on group 0 and rank 1 only sends and receives."""
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    shutil.copy(DATA / "ddp" / "rank0.json.gz", mixed / "rank0.json.gz")
    shutil.copy(DATA / "pp" / "rank1.json.gz", mixed / "rank1.json.gz")
    err = _refused(capsys, tmp_path, "--trace", str(mixed))
    assert f"{mixed / 'rank1.json.gz'} and {mixed / 'rank0.json.gz'} are not one job's traces" in err
    assert "on process group 0 rank 1 makes no collective, rank 0 all_reduce, broadcast" in err


def test_a_send_nobody_receives_and_another_backend_are_two_jobs(tmp_path, capsys):
    folder = tmp_path / "p2p"
    folder.mkdir()
    for rank in (0, 1):      # each sends to the other; neither receives
        write_trace(folder / f"rank{rank}.json", rank, {"0": (0, 1)},
                    [(0, 1000, [NcclCall("send", 64, 64, "0", 100, 50, peer=1 - rank)])], [(0, 90)])
    err = _refused(capsys, tmp_path, "--trace", str(folder))
    assert "rank0.json and" in err and "rank1.json are not one job's traces: rank 0 sends to rank 1, which " \
                                       "never receives from it" in err
    other = tmp_path / "backends"
    other.mkdir()
    shutil.copy(DATA / "pp" / "rank0.json.gz", other / "rank0.json.gz")
    nccl = json.loads(gzip.decompress((DATA / "pp" / "rank1.json.gz").read_bytes()))
    nccl["distributedInfo"]["backend"] = "nccl"
    _write(other, "rank1.json", nccl)
    err = _refused(capsys, tmp_path, "--trace", str(other))
    assert "rank1.json and" in err and "rank0.json.gz are not one job's traces: backend nccl against gloo" in err


def test_a_trace_of_which_no_call_is_understood_gives_no_estimate(tmp_path, capsys):
    def backwards(event):    # every event's duration negative: no gloo run can have run a call
        if "dur" in event:
            event["dur"] = -abs(event["dur"]) - 1
    folder = _write(tmp_path / "negative", "rank0.json", _ddp(backwards))
    err = _refused(capsys, tmp_path, "--trace", str(folder))
    assert f"--trace {folder}: not one communication call understood, nothing to estimate" in err
    assert "c10d::allreduce_ (no gloo:all_reduce ran it) x2" in err
    silent = _ddp()
    silent["traceEvents"] = [e for e in silent["traceEvents"] if not e.get("name", "").startswith(("c10d::", "gloo:"))]
    folder = _write(tmp_path / "silent", "rank0.json", silent)
    assert "the trace holds no communication events" in _refused(capsys, tmp_path, "--trace", str(folder))


def test_sampled_groups_is_refused_with_a_trace(tmp_path, capsys):
    """The replay simulates every traced group (its row's sampled_groups is 0): the flag would do nothing."""
    err = _refused(capsys, tmp_path, "--trace", str(DATA / "ddp"), "--sampled-groups", "2")
    assert err.startswith("lossysim estimate: error: --sampled-groups 2:") and "drop --sampled-groups" in err
