"""The counters' numpy path adds at the slots a batch touches; the torch path bincounts the whole range.
Both must count the same runs, bursts and histogram."""
import numpy as np
import torch

from lossysim.net.stats import count_runs


def test_numpy_and_torch_count_the_same_runs():
    rng = np.random.default_rng(3)
    links, max_burst, rows = 50, 8, 6
    link_ids = np.sort(rng.choice(links, rows, replace=False))
    total = rng.integers(0, 400, rows)
    lost = [(r, p) for r in range(rows) for p in range(total[r]) if rng.random() < 0.2]
    row = np.array([r for r, _ in lost], dtype=np.int64)
    stream = np.array([p for _, p in lost], dtype=np.int64)
    slot = link_ids[row] + links * rng.integers(0, 3, len(row))
    open_run = rng.integers(0, 5, rows)
    out = {}
    for xp, conv in ((np, np.asarray), (torch, torch.as_tensor)):
        bursts, hist = xp.zeros(3 * links, dtype=xp.int64), xp.zeros(links * (max_burst + 1), dtype=xp.int64)
        after = count_runs(xp, conv(row), conv(stream), conv(total), conv(link_ids), conv(slot), conv(open_run),
                           max_burst, bursts, hist)
        out[xp.__name__] = [np.asarray(a).tolist() for a in (after, bursts, hist)]
    assert out["numpy"] == out["torch"]
    assert sum(out["numpy"][2]) > 0 and sum(out["numpy"][1]) > 0   # the case counts something
