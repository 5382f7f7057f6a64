"""Recovery: what a receiver does with what arrived, and what a sender does about what did not.

One policy per network (``recovery`` in ``NetworkSpec``; docs/semantics.md compares them):

- ``zero``: a lost packet contributes nothing (``receivers.combine``, applied by ``delivery``).
- ``rescale``: what arrives is divided by the probability that it arrives, hop by hop: an unbiased
  sum.
- ``hadamard``, ``hadamard+rescale``: every sender applies a randomized Hadamard transform (random
  signs, then an orthonormal Walsh-Hadamard transform over blocks of ``hadamard_block`` elements)
  to its contribution; the collective runs on the transformed messages with ``zero`` or
  ``rescale``, and every receiver inverts the transform. The transform is linear and the same on
  every rank, so it commutes with the sum: it sits once around the whole collective, whatever the
  algorithm. A lost packet becomes small noise spread over its block instead of a hole. The signs
  come from a stream keyed by (seed, call site, direction), drawn afresh every call.
- ``outliers``, ``outliers+hadamard``: every sender takes the ``outlier_fraction`` of its own
  contribution's elements of largest magnitude out of the message (zeros travel in their place) and
  sends them as (index, value) pairs by a reliable all-gather on a side path; the rest goes under
  ``zero`` (or ``hadamard``), and every receiver adds every rank's pairs to what arrived. The side
  path is real traffic: the network charges it as a retransmitted all-gather (``side_bytes``).
- ``stale``: a lost packet of a send is replaced by the last values that arrived on that send
  (the same step, link and packets of this call site and direction); nothing yet: zero.
- ``drop_token``: on an all-to-all (an expert's dispatch or combine), a row (one token's vector for one
  expert) with any lost packet is lost whole: the expert skips the token, as one over its capacity; on
  every other collective it is ``zero``.
- ``error_feedback``: a sender keeps what a send failed to deliver and adds it to what that send
  carries at the next call of the call site, so the sum over calls is conserved at every receiver.
  It feeds gradients back: on activations (direction ``fwd``) it is ``zero``.
- ``mask``: ``zero``'s holes, known to the receiver: context parallelism's attention leaves a key or
  value a lost packet touched out of the softmax (``lossysim.cp``); everywhere else it is ``zero``.

``zero``, ``rescale`` and the Hadamard policies act on what a whole collective delivers (its
``Delivery``); ``stale`` and ``error_feedback`` act on every send, so they run the schedule send by
send (``delivery.send_by_send``). What a policy keeps between calls (signs' stream, per-send
buffers) is a call site's ``Memory``, saved with the network. The compute a policy adds to a
collective is counted in FLOPs (``flops``); the network charges them at the compute model's rate.

A point-to-point send (``LossyNetwork.send``: one sender, one receiver, the whole message) is the
one-hop case of the same rules (``Policy.send``): ``zero`` leaves holes; ``rescale`` divides what
arrives by the probability that it arrives, so every element is an unbiased estimate of the message
(dropout's inverted scaling: with one sender there is no sum, but the rule is the one every hop of a
collective follows); the Hadamard policies transform the message before it leaves and invert it at
the receiver; ``stale`` fills a lost packet with what last arrived at the same place on that link at
that call site; ``error_feedback`` has the sender add what the link failed to deliver at the site's
previous call (gradients only). The ``outliers`` policies do not act on a send (their side path is an
all-gather beside an all-reduce): ``acts_on_sends``, ``SEND_POLICIES``.

The package, a module per family: ``base`` (``Memory``, ``Policy``: ``zero``, what every policy
declares it acts on), ``holes`` (``rescale``, ``drop_token``, ``mask``), ``hadamard``, ``outliers``,
``send_by_send`` (``stale``, ``error_feedback``) and ``registry`` (the names, ``policy``, ``require``).
"""
from .base import ACTIVATIONS, KINDS, ZERO, Memory, Policy, Watch
from .hadamard import (DEFAULT_HADAMARD_BLOCK, Hadamard, Transformed, blocks, check_block, hadamard_flops, inverse,
                       transform, walsh_hadamard)
from .holes import DROP_TOKEN, MASK, RESCALE, DropToken, Mask, Rescale
from .outliers import DEFAULT_OUTLIER_FRACTION, INDEX_BYTES, Outliers, check_fraction, outlier_count
from .registry import (EXCHANGE_POLICIES, KV_POLICIES, RECOVERY_POLICIES, SEND_POLICIES, SHARD_POLICIES, packets_of,
                       policy, require)
from .send_by_send import ERROR_FEEDBACK, STALE, ErrorFeedback, Hops, SendBySend, Stale

__all__ = ["ACTIVATIONS", "DEFAULT_HADAMARD_BLOCK", "DEFAULT_OUTLIER_FRACTION", "DROP_TOKEN", "ERROR_FEEDBACK",
           "EXCHANGE_POLICIES", "INDEX_BYTES", "KINDS", "KV_POLICIES", "MASK", "RECOVERY_POLICIES", "RESCALE",
           "SEND_POLICIES", "SHARD_POLICIES", "STALE", "ZERO", "DropToken", "ErrorFeedback", "Hadamard", "Hops",
           "Mask", "Memory", "Outliers", "Policy", "Rescale", "SendBySend", "Stale", "Transformed", "Watch",
           "blocks", "check_block", "check_fraction", "hadamard_flops", "inverse", "outlier_count", "packets_of",
           "policy", "require", "transform", "walsh_hadamard"]
