"""reward-scorer: consumes ``reward.requests``, scores each submission in fresh
sandboxes, produces ``reward.results``."""
