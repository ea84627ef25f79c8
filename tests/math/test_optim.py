"""The learning-rate schedule (pspo/training/optim.py): warm-up + cosine, by hand-worked numbers."""
import pytest

from pspo.training.config import load_config
from pspo.training.optim import lr_lambda


def test_warmup_then_cosine_hand_worked():
    # warmup 2, 6 optimizer steps: warm-up factors (s+1)/2 = .5, 1; then progress p = (s-2)/4 and
    # factor .5(1 + cos(pi p)): s=2 p=0 -> 1; s=3 p=.25 -> .85355; s=4 p=.5 -> .5; s=5 -> .14645; s=6 -> 0
    cfg = load_config(None, ["--train.max_steps=6", "--optim.warmup_steps=2"])
    f = lr_lambda(cfg)
    assert [round(f(s), 5) for s in range(7)] == [0.5, 1.0, 1.0, 0.85355, 0.5, 0.14645, 0.0]


def test_floor_and_iterations():
    # min_lr_ratio .1 -> .1 + .9 * cosine; num_iterations 2 doubles the optimizer steps (total 8):
    # s=4: p = 4/8 = .5 -> .1 + .9 * .5 = .55; the end s=8 -> .1
    cfg = load_config(None, ["--train.max_steps=4", "--algo.num_iterations=2", "--optim.min_lr_ratio=0.1"])
    f = lr_lambda(cfg)
    assert f(0) == pytest.approx(1.0) and f(4) == pytest.approx(0.55) and f(8) == pytest.approx(0.1)
