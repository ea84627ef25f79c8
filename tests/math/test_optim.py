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


def test_grad_clip_then_adamw_step_hand_worked():
    # gradients [3, 4]: global norm 5, clipped to optim.max_grad_norm 1 -> [.6, .8] (the norm returned is 5,
    # before clipping). AdamW's first step (β1 .9, β2 .999): m = .1 g, v = .001 g², bias-corrected m̂ = g,
    # v̂ = g², so the step is lr · g / (|g| + 1e-8) = lr · sign(g); decoupled weight decay first multiplies
    # θ by 1 - lr · wd. θ = [1, 2], lr .1, wd .01: θ' = [.999 - .1, 1.998 - .1] = [.899, 1.898].
    import torch
    from pspo.training.optim import build_optimizer
    from pspo.update import _clip_grad_norm
    cfg = load_config(None, ["--optim.lr=0.1", "--optim.weight_decay=0.01", "--optim.max_grad_norm=1",
                             "--optim.warmup_steps=0", "--optim.adam_beta1=0.9", "--optim.adam_beta2=0.999"])
    model = torch.nn.Linear(2, 1, bias=False)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[1.0, 2.0]]))
    model.weight.grad = torch.tensor([[3.0, 4.0]])
    optimizer, _ = build_optimizer(model, cfg)
    assert _clip_grad_norm(model, cfg.optim.max_grad_norm) == pytest.approx(5.0)
    torch.testing.assert_close(model.weight.grad, torch.tensor([[0.6, 0.8]]))
    optimizer.step()
    torch.testing.assert_close(model.weight.detach(), torch.tensor([[0.899, 1.898]]), atol=1e-6, rtol=0)
