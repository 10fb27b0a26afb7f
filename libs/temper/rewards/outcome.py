"""Did a scored episode solve its task? The one definition behind every pass rate and
difficulty Temper records (``task_outcomes``) and the curriculum reads.

The verdict comes from the correctness component the task was scored with, in this
order: ``tests_passed`` (code and shell tasks: every hidden test passed), then
``answer_match`` (math: the final answer matched). A component that did not apply to
the task has no value and is passed over; one that applied but could not be measured
(``ok`` false) counts as a failure. A task scored by neither (only format, turn use or
other components) passes when its scalar reward reaches 1.
"""

from __future__ import annotations

from temper.events import RewardResult
from temper.rewards.models import ComponentName

CORRECTNESS = (ComponentName.tests_passed, ComponentName.answer_match)
EPSILON = 1e-9


def passed(result: RewardResult) -> bool:
    for name in CORRECTNESS:
        component = result.components.get(name)
        if component is not None and component.value is not None:
            return component.ok and component.value >= 1.0 - EPSILON
    return result.reward >= 1.0 - EPSILON
