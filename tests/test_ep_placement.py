"""Expert placement and redundant-expert planning (engine/ep_placement.py)."""

from __future__ import annotations

import pytest

from engine.ep_placement import ExpertPlacement, plan_redundant, rank_loads


def test_contiguous_and_validation():
    p = ExpertPlacement.contiguous(8, 2)
    assert p.local_experts(0) == [0, 1, 2, 3] and p.local_experts(1) == [4, 5, 6, 7]
    assert p.slots()[:2] == [(0, 0), (0, 1)] and len(p.slots()) == 8
    with pytest.raises(ValueError, match="--ep-size 3"):
        ExpertPlacement.contiguous(8, 3)
    with pytest.raises(ValueError, match="hold no expert"):
        ExpertPlacement((0, 0, 0, 0), 2)
    with pytest.raises(ValueError, match="repeated"):
        ExpertPlacement((0, 1), 2, ((0, 0),))


def test_plan_copies_hot_experts_to_the_cold_rank(tmp_path):
    base = ExpertPlacement.contiguous(8, 2)
    load = [40, 30, 5, 5, 5, 5, 5, 5]  # rank 0 serves 80, rank 1 20
    plan = plan_redundant(load, base, n_redundant=2)
    assert plan.owner == base.owner and plan.replicas[0] == (0, 1)
    before, after = max(rank_loads(load, base)), max(rank_loads(load, plan))
    assert after < before and after <= 0.65 * sum(load)
    assert plan.holders(0) == [0, 1] and 0 in plan.local_experts(1)
    f = tmp_path / "placement.json"
    f.write_text(plan.to_json())
    assert ExpertPlacement.from_file(str(f), 8, 2) == plan
    with pytest.raises(ValueError, match="--ep-placement"):
        ExpertPlacement.from_file(str(f), 8, 4)


def test_plan_leaves_a_balanced_placement_alone():
    base = ExpertPlacement.contiguous(4, 2)
    assert plan_redundant([1, 1, 1, 1], base, n_redundant=3).replicas == ()
