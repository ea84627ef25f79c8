"""Tasks and data: datasets and their rows (data.py, example.py), benchmark files (benchmarks.py),
gold answers (golds.py), the knights-and-knaves task (knights.py, knights_reward.py), and the
workers that run reward functions under a time limit (reward_pool.py)."""
