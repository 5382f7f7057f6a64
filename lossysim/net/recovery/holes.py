"""The policies that leave a lost packet a hole, as ``zero`` does, and differ only in what they make of
the holes: ``rescale`` weighs what arrived by 1 / P(delivery) so a sum stays unbiased; ``drop_token``
widens a hole in an all-to-all to the whole row it hit; ``mask`` lets context parallelism's attention
know where they are. None keeps anything between calls or adds compute.
"""
from __future__ import annotations

from .base import Policy


class Rescale(Policy):
    """What arrives, divided by the probability that it arrives."""
    name = "rescale"
    rescale = True
    acts_on_exchanges = False   # (an all-to-all's rows are no sum to keep unbiased; not modelled)
    acts_on_keys = False    # all-gathered keys are no sums (zeros where lost): the ring's would differ from them


class DropToken(Policy):
    """An all-to-all's row (one token's vector for one expert: a message's last dimension) with any lost
    packet is lost whole. Dispatch: the expert skips the token, as it skips one over its capacity;
    combine: the token gets nothing from that expert; backward: the row's gradient is zero. On every
    other collective it is ``zero``."""
    name = "drop_token"
    drops_rows = True
    only_on = "all_to_all"
    acts_on_keys = False    # a key/value exchange has no token rows to drop: ``zero`` there


class Mask(Policy):
    """``zero``'s holes, and a receiver that knows where they are: context parallelism's attention leaves a key
    whose packet was lost out of the softmax of the queries that would have read it (``lossysim.cp``). On
    every other message (all-reduces, pipeline sends, gradients) there is no softmax to leave it out of: it
    is ``zero``."""
    name = "mask"
    masks_keys = True
    acts_on_exchanges = False   # an all-to-all has no softmax to leave a row out of: ``zero`` there


RESCALE, DROP_TOKEN, MASK = Rescale(), DropToken(), Mask()
