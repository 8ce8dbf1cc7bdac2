"""Which decode workers serve which gated sampling fields (common/sampling_params.py
SPECULATION_GATED): a plain decode worker serves all; one running MTP speculative decoding those
its discovery record lists in speculative_sampling (an empty list, from the release before the
list, reads as what that release served: common/validation.py UNLISTED_SPECULATIVE_SAMPLING).
The router places requests by it (router/service.py) and `tandem top` shows it."""

from __future__ import annotations

from collections.abc import Sequence

from common.pb.tandem.v1 import discovery_pb2
from common.validation import UNLISTED_SPECULATIVE_SAMPLING


def speculative_sampling(inst: discovery_pb2.Instance) -> Sequence[str]:
    """The gated sampling fields a decode worker running MTP serves: its record's
    speculative_sampling, or where that is empty (a release before the list) what that release
    served (common/validation.py UNLISTED_SPECULATIVE_SAMPLING)."""
    return inst.speculative_sampling or UNLISTED_SPECULATIVE_SAMPLING


def decode_serves(inst: discovery_pb2.Instance, needs: Sequence[str]) -> bool:
    """Whether decode worker `inst` serves a request setting the gated sampling fields `needs`
    (SamplingParams.speculation_needs): a plain worker serves every field; one running MTP those
    of `speculative_sampling`."""
    return not inst.speculative_num_steps or all(n in speculative_sampling(inst) for n in needs)
