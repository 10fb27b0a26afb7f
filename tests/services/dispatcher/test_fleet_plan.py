"""The fleet's room per tick: water-filled by weight, and room a tenant leaves unused
goes to the others from the next tick on (services.dispatcher.fairshare.FleetShare)."""

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


def test_freed_room_goes_to_the_tenant_furthest_below_its_share():
    fleet = FleetShare(12)
    fleet.replan({"a", "b"}, active={"a": 8, "b": 1}, weights=W)  # three of b's finished
    assert dict(fleet.plan) == {"b": 3}
    assert (fill(fleet, "a"), fill(fleet, "b")) == (0, 3)


def test_room_a_tenant_does_not_ask_for_goes_to_the_others_the_tick_after():
    fleet = FleetShare(12)
    fleet.replan({"a", "b"}, active={"a": 4}, weights=W)
    assert dict(fleet.plan) == {"a": 4, "b": 4}
    assert fill(fleet, "a") == 4  # b's jobs wait on something else: b asks for nothing
    fleet.replan({"a", "b"}, active={"a": 8}, weights=W)
    assert fleet.idle == {"b"} and dict(fleet.plan) == {"a": 4}
    assert fill(fleet, "a") == 4
    # b asks again: refused while the fleet is full, and planned for from the next tick
    assert not fleet.admit("b", 1) and fleet.idle == set()
    fleet.replan({"a", "b"}, active={"a": 10}, weights=W)
    assert dict(fleet.plan) == {"b": 2}


def test_a_group_larger_than_the_free_room_waits():
    fleet = FleetShare(4)
    fleet.replan({"a"}, active={"b": 1}, weights=W)
    assert not fleet.admit("a", 4) and fleet.admit("a", 3)


def test_without_a_fleet_size_everything_is_admitted():
    fleet = FleetShare(None)
    assert all(fleet.admit("a", 64) for _ in range(100))
