"""``python -m services.reward_scorer``: the reward scorer on port 8003."""

from temper.runtime import run_service

from services.reward_scorer.app import create_app

if __name__ == "__main__":
    run_service(create_app, "reward-scorer", default_port=8003)
