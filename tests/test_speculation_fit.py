"""Which decode workers serve which sampling fields (router/service.py decode_serves,
common/validation.py refuse_under_speculation) and which open calls a failed worker keeps
(router/inflight.py OpenCalls.evict): plain workers serve every field, a current MTP worker
top log-probabilities and logit biases, an MTP worker of an earlier release (no
speculative_sampling in its record) none of the gated fields."""

from __future__ import annotations

import asyncio

import pytest

from common.pb.tandem.v1 import discovery_pb2
from common.sampling_params import SamplingParams
from common.validation import SPECULATIVE_SAMPLING, InvalidArgument, refuse_under_speculation
from router.inflight import OpenCalls
from router.service import decode_serves

PLAIN = discovery_pb2.Instance(instance_id="plain")
CURRENT = discovery_pb2.Instance(instance_id="mtp", speculative_num_steps=2, speculative_sampling=SPECULATIVE_SAMPLING)
EARLIER = discovery_pb2.Instance(instance_id="old", speculative_num_steps=2)
ASKS = {"top": SamplingParams(top_logprobs=3), "bias": SamplingParams(logit_bias=((5, 1.0),)),
        "penalty": SamplingParams(presence_penalty=0.5), "both": SamplingParams(top_logprobs=1, frequency_penalty=1.0),
        "greedy": SamplingParams(), "seeded": SamplingParams(temperature=0.8, top_p=0.9, seed=3)}


@pytest.mark.parametrize("ask", sorted(ASKS))
def test_who_serves_what(ask) -> None:
    needs = ASKS[ask].speculation_needs
    assert decode_serves(PLAIN, needs)
    assert decode_serves(CURRENT, needs) == (ask not in ("penalty", "both"))
    assert decode_serves(EARLIER, needs) == (ask in ("greedy", "seeded"))


def test_refusals_name_the_first_unserved_field() -> None:
    assert ASKS["both"].speculation_needs == ("top_logprobs", "frequency_penalty")
    with pytest.raises(InvalidArgument, match="^sampling.frequency_penalty: this worker runs speculative "
                       "decoding \\(MTP\\), which applies no penalties"):
        refuse_under_speculation(ASKS["both"], "this worker runs")
    with pytest.raises(InvalidArgument, match="^sampling.top_logprobs: every worker runs speculative decoding "
                       "\\(MTP\\), of an earlier release"):
        refuse_under_speculation(ASKS["both"], "every worker runs", EARLIER.speculative_sampling)
    with pytest.raises(InvalidArgument, match="^sampling.logit_bias: .* applies no logit bias"):
        refuse_under_speculation(ASKS["bias"], "every worker runs", ())
    for ask in ("top", "bias", "greedy"):
        refuse_under_speculation(ASKS[ask], "this worker runs")  # served: no error


def test_a_failed_worker_keeps_only_the_calls_no_other_worker_serves() -> None:
    async def main():
        calls = OpenCalls()
        with calls.open("w", ASKS["top"].speculation_needs) as top, calls.open("w") as plain, \
                calls.open("w", ASKS["penalty"].speculation_needs) as penalized:
            others = [EARLIER]  # another healthy worker: an MTP one of an earlier release
            n = calls.evict("w", "unhealthy", keep=lambda needs: not any(decode_serves(o, needs) for o in others))
            assert n == 1 and plain.done() and not top.done() and not penalized.done()
            others = [CURRENT]  # now a current MTP worker: it takes the top request, not the penalized one
            assert calls.evict("w", "unhealthy", keep=lambda needs: not any(decode_serves(o, needs) for o in others)) == 1
            assert top.result() == "unhealthy" and not penalized.done()
            assert calls.evict("w", "left discovery") == 1 and penalized.done()  # no keep: every call goes
        assert calls.workers() == []
    asyncio.run(main())
