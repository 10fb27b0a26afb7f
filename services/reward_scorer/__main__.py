"""``python -m services.reward_scorer``: the reward scorer on port 8003."""

from services.reward_scorer.app import create_app
from temper.runtime import run_service

if __name__ == "__main__":
    run_service(create_app, "reward-scorer", default_port=8003)
