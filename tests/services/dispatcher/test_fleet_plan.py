"""The fleet's room per tick (services.dispatcher.fairshare.FleetShare): admitted in
proportion to weight, no tenant past 1.25 times its share while others wait, and room a
tenant leaves unused goes to the others from the next tick on."""

from __future__ import annotations

from services.dispatcher.fairshare import FleetShare

W = {"a": 2.0, "b": 1.0}


def fill(fleet: FleetShare, tenant: str) -> int:
    """Groups of one that ``tenant`` starts until it is refused."""
    n = 0
    while fleet.admit(tenant, 1):
        n += 1
    return n


def test_an_empty_fleet_is_planned_two_to_one_and_fills_no_further():
    fleet = FleetShare(12)
    fleet.replan({"a", "b"}, active={}, weights=W)
    assert dict(fleet.plan) == {"a": 8, "b": 4}
    assert (fill(fleet, "b"), fill(fleet, "a")) == (4, 8)  # b, scheduled first, takes no more
    assert fleet.free == 0 and not fleet.admit("a", 1)


def test_freed_room_follows_the_admitted_counts_not_who_finished_first():
    fleet = FleetShare(12)
    fleet.replan({"a", "b"}, active={}, weights=W)
    assert (fill(fleet, "a"), fill(fleet, "b")) == (8, 4)
    # three of b's episodes finished, none of a's: a is owed two of every three admissions
    fleet.replan({"a", "b"}, active={"a": 8, "b": 1}, weights=W)
    assert dict(fleet.plan) == {"a": 2, "b": 1}
    assert (fill(fleet, "a"), fill(fleet, "b")) == (2, 1)
    assert fleet.admitted == {"a": 10, "b": 5}


def test_a_tenant_whose_episodes_never_end_holds_at_most_a_quarter_over_its_share():
    fleet = FleetShare(8)
    even = {"slow": 1.0, "fast": 1.0}
    fleet.replan({"slow", "fast"}, active={}, weights=even)
    held = {"slow": fill(fleet, "slow"), "fast": fill(fleet, "fast")}
    for _ in range(10):  # fast's episodes all finish between ticks, slow's never do
        fleet.replan({"slow", "fast"}, active={"slow": held["slow"]}, weights=even)
        held = {"slow": held["slow"] + fill(fleet, "slow"), "fast": fill(fleet, "fast")}
        assert held["slow"] <= 5 and held["slow"] + held["fast"] == 8, held
    assert fleet.admitted["fast"] > 3 * fleet.admitted["slow"]


def test_room_a_tenant_does_not_ask_for_goes_to_the_others_the_tick_after():
    fleet = FleetShare(12)
    fleet.replan({"a", "b"}, active={"a": 4}, weights=W)
    assert dict(fleet.plan) == {"a": 5, "b": 3}
    assert fill(fleet, "a") == 5  # b's jobs wait on something else: b asks for nothing
    fleet.replan({"a", "b"}, active={"a": 9}, weights=W)
    assert fleet.idle == {"b"} and dict(fleet.plan) == {"a": 3}
    assert fill(fleet, "a") == 3
    # b asks again: refused while the fleet is full; from the next tick it is planned for,
    # level with a (nothing banked from the ticks it sat out)
    assert not fleet.admit("b", 1) and fleet.idle == set()
    fleet.replan({"a", "b"}, active={"a": 10}, weights=W)
    assert fleet.served["b"] == fleet.served["a"] and dict(fleet.plan) == {"b": 2}


def test_a_group_larger_than_the_free_room_waits():
    fleet = FleetShare(4)
    fleet.replan({"a"}, active={"b": 1}, weights=W)
    assert not fleet.admit("a", 4) and fleet.admit("a", 3)


def test_without_a_fleet_size_everything_is_admitted():
    fleet = FleetShare(None)
    assert all(fleet.admit("a", 64) for _ in range(100))
