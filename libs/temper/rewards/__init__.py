"""Reward components and the scorer: hidden tests, compilation, coverage, efficiency,
answer matching, format and turn use, each recorded separately; a job's weights give
the scalar reward. See docs/tasks-and-rewards.md."""

from temper.rewards.components import Component, FunctionComponent, ScoreContext, Skip, component_of
from temper.rewards.models import CandidateRun, ComponentName, Submission, TestOutcome
from temper.rewards.outcome import passed
from temper.rewards.runner import ScoringError, TestRunner
from temper.rewards.scorer import Scorer, combine

__all__ = [
    "CandidateRun",
    "Component",
    "FunctionComponent",
    "ComponentName",
    "ScoreContext",
    "Scorer",
    "ScoringError",
    "Skip",
    "Submission",
    "TestOutcome",
    "TestRunner",
    "combine",
    "component_of",
    "passed",
]
