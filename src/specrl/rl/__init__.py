"""RL pieces that are pure functions: tasks, verifiers/rewards, group advantages."""
