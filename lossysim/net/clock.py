"""A network's clock: the simulated seconds its traffic took, loss-free (``ideal``), what repairs added
under the configured NIC and under the ideal one (``repairs``, on the tensors' device: no host sync per
call), and what the recovery policy's compute added (``recovery_s``)."""
from __future__ import annotations

from typing import Optional

import torch


class Clock:
    def __init__(self, compute):
        self.compute = compute                         # the GPU a policy's compute is charged at
        self.repairs: Optional[torch.Tensor] = None   # seconds repairs added: configured nic, ideal nic
        self.ideal = 0.0                               # all the traffic without loss
        self.recovery_s = 0.0                          # the recovery policy's compute
        # on a fabric with shared cables, training multiplies each call's loss-free seconds by its class's
        # collision factor (``run.fabric_record.stretch_clocks``), as the estimate does; 1.0 otherwise
        self.stretch = 1.0
        self._policy_s: dict[tuple, float] = {}        # per policy and message shape: seconds per call

    def charge_policy(self, policy, transfer, collective: str, numel: int, dtype: torch.dtype) -> None:
        """Add the compute a recovery policy adds to one all-reduce or send (its FLOPs at the GPU's rate)."""
        if not (policy.computes and collective in ("all_reduce", "send")):
            return
        key = (policy.name, collective, numel, dtype)
        seconds = self._policy_s.get(key)
        if seconds is None:
            flops = policy.flops(transfer.sched, transfer.per_packet, numel)
            seconds = self._policy_s[key] = self.compute.seconds(flops)
        self.recovery_s += seconds

    def tick(self, repairs: torch.Tensor) -> None:
        """Add a call's repair time (and the same repairs under the ideal preset)."""
        self.repairs = repairs.clone() if self.repairs is None else self.repairs + repairs

    def seconds(self, side: Optional[dict] = None) -> dict:
        """``LossyNetwork.clock``'s figures (syncs); ``side``: a side path's clock, whose loss-free time
        is the policy's (a loss-free run sends none) and whose repairs are repairs."""
        repairs = self.repairs.tolist() if self.repairs is not None else [0.0, 0.0]
        recovery_s = self.recovery_s
        if side is not None:
            recovery_s += side["ideal_comm_s"]
            repairs = [repairs[0] + side["retransmit_s"], repairs[1] + side["comm_s_ideal_nic"] - side["ideal_comm_s"]]
        return {"comm_s": self.ideal + repairs[0] + recovery_s, "ideal_comm_s": self.ideal,
                "retransmit_s": repairs[0], "recovery_s": recovery_s,
                "comm_s_ideal_nic": self.ideal + repairs[1] + recovery_s}

    def reset(self) -> None:
        self.repairs, self.ideal, self.recovery_s = None, 0.0, 0.0

    def state_dict(self) -> dict:
        return {"repairs_s": None if self.repairs is None else self.repairs.cpu().clone(),
                "ideal_comm_s": self.ideal, "recovery_s": self.recovery_s}

    def load_state_dict(self, clock: dict, device) -> None:
        if "repairs_s" in clock:
            repairs = clock["repairs_s"]
        else:  # written by 0.2: its clock kept the loss-free and the repaired steps apart
            comm = clock["fixed_comm_s"] + (float(clock["comm_s"]) if clock["comm_s"] is not None else 0.0)
            extra = comm - clock["ideal_comm_s"]
            repairs = torch.tensor([extra, extra], dtype=torch.float64) if extra > 0 else None
        self.repairs = None if repairs is None else repairs.to(device)
        self.ideal = clock["ideal_comm_s"]
        self.recovery_s = clock.get("recovery_s", 0.0)
