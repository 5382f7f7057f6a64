"""Transports: whether a lost packet is repaired, and what the repair costs in time.

- ``drop``: a lost packet is gone; a collective takes its loss-free time.
- ``retransmit``: every lost packet is sent again until it arrives, as the NIC preset repairs it
  (``lossysim.timing.retransmission.Nic``); each resend is the link's next packet and goes through
  the link's loss chain, so it can be lost again. Tensors arrive exact; time grows. A packet still
  lost after the preset's retries fails the collective (the job restarts: the runner charges it).
  - selective repeat: round 0 sends the message; each later round resends what the previous one
    lost, once the loss is known: one round trip when a later packet on the same connection
    reveals the gap, the preset's timer when nothing behind it does (a *tail* loss).
    With RACK (TCP), a tail loss with an arrived packet behind it waits RACK's reordering timer;
    with a congestion window (TCP CUBIC), each send also pays for the window its round-0 losses cut.
  - go-back-N (RoCE NICs): the receiver drops everything after a gap; the sender keeps sending
    until the NAK arrives (the ``window`` packets in flight during a round trip are wasted), then
    resends from the lost packet; a tail loss waits for the timer.
- ``deadline``: selective repeat while the repairs fit the step's budget (``deadline`` times its
  share of the collective's loss-free time), then give up: what is still missing is lost, and the
  step ends at its budget (the bounded-time idea of OptiReduce). Its receiver keeps packets that
  arrive after a gap, as a bounded-time collective must: go-back-N would throw them away.

NCCL streams a collective's steps over persistent connections (one per peer per channel), so a
loss is a tail loss only at the very end of a connection's traffic in the collective: in the
last step a link sends (``final``), its last packets per channel (``tails``). A repair delays its
step by ``(transmissions - packets) * tau + waits``; a step's extra time is its slowest send's
(the loss-free time of the whole collective comes from ``lossysim.timing``). ``shadow`` is the
same repair under the ``ideal`` preset (every wait one round trip): the lower bound the report
shows beside the configured preset.

The package's modules, one a rule: ``dispatch`` (``Transport``, ``run_step``: which rule a step goes
through), ``sends`` (what a step hands a rule and gets back), ``selective`` (selective repeat and the
deadline's give-up; ``rounds``, its bookkeeping between two rounds compiled), ``tcp`` (TCP's RACK, probe,
RTO and congestion windows, within selective repeat), ``gobackn`` (go-back-N).
"""
from .dispatch import MODES, TRANSPORTS, Transport, run_step
from .selective import selective
from .sends import Count, Draw, HostSends, PositionsDraw, Result, Sends

__all__ = ["MODES", "TRANSPORTS", "Transport", "run_step", "selective", "Count", "Draw", "HostSends",
           "PositionsDraw", "Result", "Sends"]
