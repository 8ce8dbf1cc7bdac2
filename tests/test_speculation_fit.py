"""Which decode workers serve which sampling fields (router/speculation.py decode_serves,
common/validation.py refuse_under_speculation) and which open calls a failed worker keeps
(router/inflight.py OpenCalls.evict): plain workers serve every field, an MTP worker those its
record lists (a current one top log-probabilities and logit biases; one that lists none, of the
release before the list, the same), never penalties."""

from __future__ import annotations

import asyncio

import pytest

from common.pb.tandem.v1 import discovery_pb2
from common.sampling_params import SamplingParams
from common.validation import SPECULATIVE_SAMPLING, InvalidArgument, refuse_under_speculation
from router.inflight import OpenCalls
from router.speculation import decode_serves

PLAIN = discovery_pb2.Instance(instance_id="plain")
CURRENT = discovery_pb2.Instance(instance_id="mtp", speculative_num_steps=2, speculative_sampling=SPECULATIVE_SAMPLING)
EARLIER = discovery_pb2.Instance(instance_id="old", speculative_num_steps=2)  # lists none
BIAS_ONLY = discovery_pb2.Instance(instance_id="bias", speculative_num_steps=1, speculative_sampling=["logit_bias"])
ASKS = {"top": SamplingParams(top_logprobs=3), "bias": SamplingParams(logit_bias=((5, 1.0),)),
        "penalty": SamplingParams(presence_penalty=0.5), "both": SamplingParams(top_logprobs=1, frequency_penalty=1.0),
        "greedy": SamplingParams(), "seeded": SamplingParams(temperature=0.8, top_p=0.9, seed=3)}


@pytest.mark.parametrize("ask", sorted(ASKS))
def test_who_serves_what(ask) -> None:
    needs = ASKS[ask].speculation_needs
    assert decode_serves(PLAIN, needs)
    assert decode_serves(CURRENT, needs) == (ask not in ("penalty", "both"))
    assert decode_serves(EARLIER, needs) == (ask not in ("penalty", "both"))
    assert decode_serves(BIAS_ONLY, needs) == (ask in ("bias", "greedy", "seeded"))


def test_refusals_name_the_first_unserved_field() -> None:
    assert ASKS["both"].speculation_needs == ("top_logprobs", "frequency_penalty")
    with pytest.raises(InvalidArgument, match="^sampling.frequency_penalty: this worker runs speculative "
                       "decoding \\(MTP\\), which applies no penalties"):
        refuse_under_speculation(ASKS["both"], "this worker runs")
    with pytest.raises(InvalidArgument, match="^sampling.top_logprobs: every worker runs speculative decoding "
                       "\\(MTP\\), which reports no top log-probabilities"):
        refuse_under_speculation(ASKS["both"], "every worker runs", BIAS_ONLY.speculative_sampling)
    with pytest.raises(InvalidArgument, match="^sampling.logit_bias: .* applies no logit bias"):
        refuse_under_speculation(ASKS["bias"], "every worker runs", ())
    for ask in ("top", "bias", "greedy"):
        refuse_under_speculation(ASKS[ask], "this worker runs")  # served: no error


def test_a_failed_worker_keeps_only_the_calls_no_other_worker_serves() -> None:
    async def main():
        calls = OpenCalls()
        with calls.open("w", ASKS["top"].speculation_needs) as top, calls.open("w") as plain, \
                calls.open("w", ASKS["penalty"].speculation_needs) as penalized:
            others = [BIAS_ONLY]  # another healthy worker: an MTP one without the tops
            n = calls.evict("w", "unhealthy", keep=lambda needs: not any(decode_serves(o, needs) for o in others))
            assert n == 1 and plain.done() and not top.done() and not penalized.done()
            others = [CURRENT]  # now a current MTP worker: it takes the top request, not the penalized one
            assert calls.evict("w", "unhealthy", keep=lambda needs: not any(decode_serves(o, needs) for o in others)) == 1
            assert top.result() == "unhealthy" and not penalized.done()
            assert calls.evict("w", "left discovery") == 1 and penalized.done()  # no keep: every call goes
        assert calls.workers() == []
    asyncio.run(main())


class _Records:
    """WorkerSet.candidates over fixed decode records (all serving)."""

    def __init__(self, *records: discovery_pb2.Instance) -> None:
        self.records = records

    def candidates(self, role, serving_only: bool = True):
        return list(self.records)

    def instance(self, instance_id: str):
        return next((r for r in self.records if r.instance_id == instance_id), None)


def _unfit(records: _Records, params: SamplingParams, context=None, **kw) -> frozenset[str]:
    from types import SimpleNamespace

    from router.service import FrontendServicer
    return asyncio.run(FrontendServicer._unfit_decoders(SimpleNamespace(workers=records), params, context, **kw))


def test_requests_go_where_every_field_they_set_is_served() -> None:
    """The unfit decode workers per request: those running MTP that do not serve a field it sets
    (a biased request goes to any worker serving the bias: the MTP graphs apply it)."""
    records = _Records(PLAIN, CURRENT, BIAS_ONLY, discovery_pb2.Instance(instance_id="strict", speculative_num_steps=1,
                                                                         speculative_sampling=["top_logprobs"]))
    assert _unfit(records, ASKS["bias"]) == {"strict"}
    assert _unfit(records, ASKS["top"]) == {"bias"}
    assert _unfit(records, ASKS["penalty"]) == {"mtp", "bias", "strict"}
    assert _unfit(records, ASKS["greedy"]) == frozenset()


class _Aborted(Exception):
    pass


class _Context:
    """grpc.aio.ServicerContext.abort, recorded."""

    async def abort(self, code, details):
        raise _Aborted(code, details)


def test_the_refusal_names_a_field_no_worker_serves() -> None:
    """Every decode worker unfit: INVALID_ARGUMENT naming a field that none of them serves, so the
    client's next try does not come back for another."""
    strict = discovery_pb2.Instance(instance_id="a", speculative_num_steps=1, speculative_sampling=["top_logprobs"])
    both = SamplingParams(top_logprobs=2, logit_bias=((3, 1.0),), presence_penalty=0.5)
    with pytest.raises(_Aborted, match="sampling.presence_penalty: every decode worker here runs"):
        _unfit(_Records(strict, BIAS_ONLY), both, context=_Context())
    with pytest.raises(_Aborted, match="sampling.logit_bias: every decode worker here runs .* no logit bias"):
        _unfit(_Records(strict), SamplingParams(top_logprobs=2, logit_bias=((3, 1.0),)), context=_Context())
    # each lacks another field, none lacks both: the first worker's (by instance id) is named
    with pytest.raises(_Aborted, match="sampling.logit_bias: "):
        _unfit(_Records(BIAS_ONLY, strict), SamplingParams(top_logprobs=2, logit_bias=((3, 1.0),)), context=_Context())


def test_unavailable_says_why_an_excluded_worker_was_not_used() -> None:
    """The only plain decode worker draining (not a candidate) beside an MTP one: the
    UNAVAILABLE message for a penalized request names the field and the MTP worker's reason."""
    from types import SimpleNamespace

    from router.service import FrontendServicer
    me = SimpleNamespace(workers=_Records(PLAIN, CURRENT, BIAS_ONLY))
    note = FrontendServicer._unserved_note(me, ASKS["penalty"], frozenset({"mtp", "bias"}))
    assert note == ("; sampling.presence_penalty: bias runs speculative decoding (MTP), which applies no penalties: "
                    "use 0, or retry once a decode worker that serves it is up")
    assert FrontendServicer._unserved_note(me, ASKS["top"], frozenset({"mtp", "bias"})).startswith(
        "; sampling.top_logprobs: bias runs")  # mtp serves the tops: not named
    assert FrontendServicer._unserved_note(me, ASKS["greedy"], frozenset({"mtp"})) == ""
    assert FrontendServicer._unserved_note(me, None, frozenset({"mtp"})) == ""
