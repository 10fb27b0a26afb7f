"""The trainer service: GRPO on scored trajectories, checkpoints and policy versions."""
