"""router/stall.py: a running stream's stall timeout is max(floor, factor × its worker's ITL EWMA
× its tokens-per-message EWMA)."""

from __future__ import annotations

import pytest

from router.stall import ALPHA, StallRule


def test_no_sample_gives_the_floor_and_zero_floor_turns_it_off():
    assert StallRule(2.0, 50.0).timeout_s("w") == 2.0
    off = StallRule(0.0, 50.0)
    off.observe("w", 1.0, 1)
    assert off.timeout_s("w") is None


@pytest.mark.parametrize("itl_s, expected", [(0.01, 2.0), (0.04, 2.0), (0.1, 5.0), (1.0, 50.0)])
def test_factor_times_itl_above_the_floor(itl_s, expected):
    rule = StallRule(2.0, 50.0)
    for _ in range(5):
        rule.observe("w", itl_s, 1)
    assert rule.timeout_s("w") == pytest.approx(expected)


def test_per_worker_per_token_ewma():
    rule = StallRule(1.0, 10.0)
    rule.observe("slow", 0.8, 4)  # four tokens in one message: 0.2 s each, 0.8 s between messages
    rule.observe("fast", 0.01, 1)
    assert rule.itl_s("slow") == pytest.approx(0.2) and rule.timeout_s("slow") == pytest.approx(8.0)
    assert rule.timeout_s("fast") == 1.0
    rule.observe("slow", 1.2, 1)  # one long gap moves the mean by ALPHA of the difference
    assert rule.itl_s("slow") == pytest.approx(0.2 + ALPHA * (1.2 - 0.2))
    rule.observe("slow", 5.0, 0)  # a message with no token (finish reason only) is no sample
    assert rule.itl_s("slow") == pytest.approx(0.2 + ALPHA * (1.2 - 0.2))


def test_factor_zero_is_the_fixed_floor_and_departed_workers_are_forgotten():
    rule = StallRule(3.0, 0.0)
    rule.observe("w", 10.0, 1)
    assert rule.timeout_s("w") == 3.0
    rule.forget_except(set())
    assert rule.itl_s("w") is None


@pytest.mark.parametrize("floor, factor, flag", [(-1.0, 1.0, "--token-stall-timeout"),
                                                  (1.0, -0.5, "--token-stall-itl-factor")])
def test_negative_values_name_the_flag(floor, factor, flag):
    with pytest.raises(ValueError, match=flag):
        StallRule(floor, factor)


def test_a_stream_interval_larger_than_the_factor_is_not_a_stall():
    # --stream-interval 64 at 0.6 s per token: 38.4 s between messages by design, beyond the
    # 30 s floor and 50 × the per-token latency; the bound follows the messages' size
    rule = StallRule(30.0, 50.0)
    for _ in range(20):
        rule.observe("w", 64 * 0.6, 64)
    assert rule.timeout_s("w") == pytest.approx(50 * 0.6 * 64)
    rule.observe("w", 0.6, 1)  # the last message of a stream, shorter: the mean moves by ALPHA
    assert rule.timeout_s("w") > 64 * 0.6
