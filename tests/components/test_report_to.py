"""train.report_to: metrics.jsonl always, TensorBoard and Weights & Biases as asked (pspo/training/metrics.py),
a W&B run that a resumed run continues, and the setting validated in one line."""
import json
import os
import sys
import types

import pytest

from pspo.training.config import ConfigError, load_config
from pspo.training.metrics import MetricsLogger


class FakeWandb(types.ModuleType):
    """Records what the logger asks of wandb (init, log, finish)."""

    def __init__(self):
        super().__init__("wandb")
        self.calls = []

    def init(self, **kwargs):
        self.calls.append(("init", kwargs))
        return self

    def log(self, values, step):
        self.calls.append(("log", step, values))

    def finish(self):
        self.calls.append(("finish",))


def test_wandb_gets_every_metric_and_a_resumed_run_continues_it(tmp_path, monkeypatch):
    fake = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    out = str(tmp_path / "run")
    os.makedirs(out)
    logger = MetricsLogger(out, True, report_to="wandb", run_config={"optim": {"lr": 0.1}}, project="p")
    logger.log(1, {"loss": 0.5, "kl": float("nan")})
    logger.close()
    (_, init), (_, step, values), (finish,) = fake.calls
    assert init["project"] == "p" and init["config"] == {"optim": {"lr": 0.1}} and init["dir"] == out
    assert init["resume"] == "allow" and init["name"] == "run"
    assert (step, values, finish) == (1, {"loss": 0.5}, "finish")            # NaN: left out, as in TensorBoard
    assert not os.path.exists(os.path.join(out, "tb"))                      # report_to: wandb alone
    assert json.loads(open(os.path.join(out, "metrics.jsonl")).read())["loss"] == 0.5
    # a resumed run continues the same W&B run (its id kept in the output folder); a fresh run in the
    # same folder starts a new one
    again = MetricsLogger(out, True, resume_step=1, report_to="tensorboard,wandb")
    again.close()
    assert fake.calls[3][1]["id"] == init["id"] and os.path.isdir(os.path.join(out, "tb"))
    fresh = MetricsLogger(out, True, report_to="wandb")
    fresh.close()
    assert fake.calls[5][1]["id"] != init["id"]


def test_report_to_is_validated_in_one_line(monkeypatch):
    assert load_config(None, []).train.report_to == "tensorboard"
    assert load_config(None, ["--train.report_to=none"]).train.report_to == "none"
    for value in ("bogus", "none,wandb", "tensorboard,tb"):
        with pytest.raises(ConfigError, match="train.report_to: expected tensorboard, wandb"):
            load_config(None, [f"--train.report_to={value}"])
    import importlib.util
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(ConfigError, match=r"train.report_to: expected wandb installed to report to it \(pip install"):
        load_config(None, ["--train.report_to=tensorboard,wandb"])


def test_a_real_offline_wandb_run(tmp_path, monkeypatch):
    pytest.importorskip("wandb", reason="wandb is not installed (optional: pip install wandb)")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    out = str(tmp_path / "run")
    os.makedirs(out)
    logger = MetricsLogger(out, True, report_to="wandb", run_config={"train": {"seed": 0}})
    for step in (1, 2):
        logger.log(step, {"reward_mean": 0.25 * step})
    logger.close()
    runs = [d for d in os.listdir(os.path.join(out, "wandb")) if d.startswith("offline-run-")]
    assert len(runs) == 1 and any(f.endswith(".wandb") for f in os.listdir(os.path.join(out, "wandb", runs[0])))
