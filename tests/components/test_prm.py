"""PSPO*'s process reward model (pspo/related/prm.py, docs/related.md §C) on the offline tiny PRM
(pspo/offline/tiny_prm.py):
start-up checks and their one-line errors, the frozen model, pair encoding and truncation, batched
scoring equal to one-at-a-time scoring, the reward and its metrics, the config section, the rewards'
sum, the memory plan's PRM rows; and (slow) the real loop with the PRM reward under two advantage
methods, and train.py's one-line error on a PRM that cannot serve (runs of train.py in this process:
conftest's run_main)."""
import functools
import json
import math
import os
import shutil

import pytest
import torch
from transformers import (AutoModelForSequenceClassification, BertModel, PreTrainedTokenizerFast, Qwen2Config,
                          Qwen2ForSequenceClassification)

from pspo.training import plan
from pspo.related import prm as prm_module
from pspo.offline.builtin import TINY_PRM, resolve_model_path
from pspo.training.config import ConfigError, load_config
from pspo.training.plan import GiB, PRMArch
from pspo.related.prm import load_prm, prm_metrics
from pspo.related.process_reward import geometric_mean, shaped_reward, split_lines, step_pairs
from pspo.rewards import score_completions
from pspo.offline.tiny_prm import build_prm_tokenizer, ensure_tiny_prm

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CPU = torch.device("cpu")
WRITTEN_OUT = "<think></think><answer>(1) Aaron is a knave\n(2) Zoey is a knight</answer>"
MALFORMED = "<think></think><answer>(1) Aaron is a knave\n(2) Zoey</answer>"
FIVE = ("<answer>(1) Aaron is a knave\n(2) Zoey is a knight\n(3) Mia is a knave\n(4) Leo is a knight\n"
        "(5) Ivy is a knave")


@pytest.fixture(scope="module")
def tiny_prm_path() -> str:
    return _tiny_prm()


@functools.cache
def _tiny_prm() -> str:
    """The tiny PRM's folder, built (or found in the cache) once per test process."""
    return ensure_tiny_prm()


def prm_config(*overrides: str, model: str = TINY_PRM):
    return load_config(None, ["--reward.prm=1", f"--prm.model={model}", "--prm.split=lines", *overrides])


@pytest.fixture(scope="module")
def tiny_prm(tiny_prm_path):
    return load_prm(prm_config(), CPU)


# ---- start-up ----

def test_no_prm_without_its_weight():
    assert load_prm(load_config(None, ["--prm.model=does/not/matter"]), CPU) is None


def test_the_prm_is_frozen_and_has_the_released_labels(tiny_prm):
    model = tiny_prm.model
    assert not model.training and all(not p.requires_grad for p in model.parameters())
    assert model.config.id2label == {0: "-1", 1: "0", 2: "1"}
    assert next(model.parameters()).dtype == torch.float32                         # bf16 on a GPU only


@pytest.mark.parametrize("overrides, message", [
    (["--prm.split=sentences"], "prm.split: expected released | lines, got 'sentences'"),
    (["--prm.shaping=linear"], "prm.shaping: expected wrs | weibull | none, got 'linear'"),
    (["--prm.label=-1"], "prm.label: expected >= 0"),
    (["--prm.max_tokens=4"], "prm.max_tokens: expected >= 8, got 4"),
    (["--prm.batch_tokens=100"], "prm.batch_tokens: expected >= prm.max_tokens = 512, got 100"),
    (["--prm.model="], "prm.model: expected a sequence-classifier folder or hub id"),
    (["--reward.prm=many"], "reward.prm: expected float, got 'many'"),
])
def test_config_errors_name_the_key(overrides, message):
    with pytest.raises(ConfigError) as e:
        prm_config(*overrides)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_a_prm_alone_is_a_reward():
    cfg = load_config(None, ["--reward.accuracy=0", "--reward.prm=1", "--prm.model=x"])
    assert cfg.reward.prm == 1.0                                      # "at least one non-zero weight"


def decoder_classifier(path) -> str:
    """A 1-layer Qwen2 classifier whose tokenizer has no sep token (a decoder PRM), saved at `path`."""
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=build_prm_tokenizer().backend_tokenizer,
                                        unk_token="[UNK]", pad_token="[PAD]")
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, num_labels=3,
                         max_position_embeddings=512, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    Qwen2ForSequenceClassification(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def test_a_prm_that_cannot_serve_stops_with_one_line(tmp_path, tiny_prm_path):
    (tmp_path / "empty").mkdir()
    absent = str(tmp_path / "absent")
    cases = [(prm_config(model=absent), f"prm.model: '{absent}': no such folder"),
             (prm_config(model=str(tmp_path / "empty")), "prm.model: cannot load"),
             (prm_config("--prm.label=3"), "prm.label: expected an index below the PRM's 3 labels"),
             (prm_config("--prm.max_tokens=600", "--prm.batch_tokens=600"),
              "prm.max_tokens: expected at most the PRM's 512 positions, got 600"),
             (prm_config(model=decoder_classifier(tmp_path / "decoder")), "prm.separator: ")]
    unpadded = tmp_path / "unpadded"                     # the tiny PRM with a tokenizer that has no pad (nor eos)
    shutil.copytree(tiny_prm_path, unpadded)
    settings = json.loads((unpadded / "tokenizer_config.json").read_text())
    (unpadded / "tokenizer_config.json").write_text(json.dumps({**settings, "pad_token": None}))
    cases.append((prm_config(model=str(unpadded)), "tokenizer has neither a pad nor an eos token"))
    encoder = tmp_path / "encoder"                       # the PRM's encoder without its classification head
    base = AutoModelForSequenceClassification.from_pretrained(tiny_prm_path)
    BertModel(base.config).save_pretrained(encoder)
    build_prm_tokenizer().save_pretrained(encoder)
    cases.append((prm_config(model=str(encoder)), "has no trained classification head (classifier.bias"))
    for cfg, message in cases:
        with pytest.raises(ConfigError) as e:
            load_prm(cfg, CPU)
        assert message in str(e.value) and "\n" not in str(e.value), str(e.value)


# ---- scoring ----

def test_pair_encoding_and_truncation(tiny_prm):
    tok = tiny_prm.tokenizer
    alone, pair = tiny_prm.encode([(None, "(1) Zoey is a knave"), ("(1) Zoey is a knave", "(2) Mia")])
    cls, sep = tok.cls_token_id, tok.sep_token_id
    ids = tok.convert_tokens_to_ids
    assert alone["input_ids"] == [cls, *ids(["(", "1", ")", "zoey", "is", "a", "knave"]), sep]
    # the tokenizer's pair encoding: [CLS] previous [SEP] step [SEP], the step in token type 1
    assert pair["input_ids"] == alone["input_ids"] + [*ids(["(", "2", ")", "mia"]), sep]
    assert pair["token_type_ids"] == [0] * 9 + [1] * 5
    # a text separator (the released code's " </s><s>"): one text, one token type
    text = load_prm(prm_config("--prm.separator= </s><s>"), CPU)
    (joined,) = text.encode([("a", "b")])
    assert joined["input_ids"] == tok("a </s><s>b")["input_ids"] and set(joined["token_type_ids"]) == {0}
    # truncation: an input of 600 words keeps prm.max_tokens = 512 tokens
    (long,) = tiny_prm.encode([("zoey " * 300, "mia " * 300)])
    assert len(long["input_ids"]) == 512


@pytest.mark.parametrize("batch_tokens", [16384, 600, 40])
def test_batched_scoring_equals_one_at_a_time(tiny_prm, batch_tokens):
    pairs = [p for text in (WRITTEN_OUT, MALFORMED, FIVE, "foo bar\nbaz qux zoey is a knight") for p in
             step_pairs(split_lines(text))] + [(None, "zoey " * 40)]
    one_at_a_time = [tiny_prm.step_scores([p])[0] for p in pairs]
    tiny_prm.cfg.batch_tokens = batch_tokens              # 40: about one row a forward; 600: a few
    try:
        batched = tiny_prm.step_scores(pairs)
    finally:
        tiny_prm.cfg.batch_tokens = 16384
    assert batched == pytest.approx(one_at_a_time, abs=1e-6)


def test_batched_scoring_of_a_decoder_classifier(tmp_path):
    # right padding: the decoder classifier reads its last real token, found by the pad id
    prm = load_prm(prm_config("--prm.separator= | ", model=decoder_classifier(tmp_path / "d")), CPU)
    pairs = [(None, "a"), ("(1) Zoey is a knave", "(2) Mia is a knight and more words"), ("x", "y z")]
    assert prm.step_scores(pairs) == pytest.approx([prm.step_scores([p])[0] for p in pairs], abs=1e-6)


def test_the_reward_and_its_metrics(tiny_prm):
    texts = [WRITTEN_OUT, MALFORMED, FIVE, "one line only", ""]
    tiny_prm.take()
    rewards = tiny_prm(texts)
    scores = [tiny_prm.step_scores(step_pairs(split_lines(t))) for t in texts[:3]]
    assert rewards == pytest.approx([shaped_reward(s, "wrs") for s in scores] + [0.0, 0.0])
    # the tiny PRM (pspo/offline/tiny_prm.py) scores "(k) Name is a role" lines near 1 and "(2) Zoey" near 0:
    # R = g²·e for 2 lines, so a written-out answer gets ~2.5, the malformed one ~0.1
    assert min(scores[0] + scores[2]) > 0.8 and scores[1][1] < 0.2
    assert rewards[0] > 2.0 > 0.5 > rewards[1] and rewards[2] > 6.0
    # metrics over 5 completions: steps 2 + 2 + 5 + 1 + 0 = 10 -> 2.0 a completion; 3 of them have >= 2
    metrics = prm_metrics(tiny_prm, CPU, 10.0)           # a step of 10 s so far: prm_share = prm_s / 10
    g = [geometric_mean(s) for s in scores]
    assert metrics["prm_steps"] == 2.0 and metrics["prm_scored_frac"] == pytest.approx(0.6)
    assert metrics["prm_score"] == pytest.approx(sum(g) / 3) and metrics["prm_s"] > 0
    assert metrics["prm_share"] == pytest.approx(metrics["prm_s"] / 10.0)
    empty = prm_metrics(tiny_prm, CPU, 10.0)              # taken: nothing since
    assert empty["prm_steps"] == 0.0 and math.isnan(empty["prm_score"])
    assert prm_metrics(None, CPU, 10.0) == {}


def test_score_completions_sums_the_process_reward():
    # R + 0.5·prm: completion 0 correct (1 + 0.5·2.0 = 2.0), completion 1 wrong (0 + 0.5·4.0 = 2.0)
    prompts, golds = ["q", "q"], ["2", "2"]
    completions = ["\\boxed{2}", "\\boxed{3}"]
    result = score_completions(prompts, completions, golds, weights={"accuracy": 1.0, "prm": 0.5},
                               prm=lambda texts: [2.0, 4.0])
    assert result.components["prm"].tolist() == [2.0, 4.0]
    assert result.rewards.tolist() == [2.0, 2.0] and "prm" not in result.failures
    with pytest.raises(ValueError, match="needs a process reward model"):
        score_completions(prompts, completions, golds, weights={"prm": 1.0})


# ---- the memory plan ----

def test_plan_counts_the_prm(tiny_prm_path):
    # the tiny PRM: hidden 32, intermediate 64; weights bf16 2 B each; the forward of prm.batch_tokens
    # 16384 tokens: 16384 x 2 B x (6·32 + 2·64) = 10485760 B
    cfg = prm_config("--rollout.engine=hf", "--algo.beta=0")
    arch, why = plan.load_prm_arch(cfg, local_only=True, resolve=resolve_model_path)
    model = AutoModelForSequenceClassification.from_pretrained(tiny_prm_path)
    assert why == "" and arch == PRMArch(sum(p.numel() for p in model.parameters()), 32, 64)
    a = plan.arch_from_config(Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, vocab_size=100))
    without = plan.make_plan(cfg, a, gpus=1, gpu_bytes=80 * GiB, engine="hf")
    rows = {key: (b, phase)
            for key, _, b, phase in plan.make_plan(cfg, a, gpus=1, gpu_bytes=80 * GiB, engine="hf", prm=arch).rows}
    assert rows["prm"] == (2 * arch.params, "both") and rows["prm_acts"] == (10485760, "generation")
    assert "prm" not in {key for key, *_ in without.rows}
    absent, why = plan.load_prm_arch(prm_config(model="no/such-prm"), local_only=True,
                                     resolve=resolve_model_path)
    assert absent is None and "prm.model 'no/such-prm': not counted" in why


def test_plan_command_on_the_gpu_preset_says_what_it_did_not_count(tmp_path):
    preset = os.path.join(ROOT, "configs", "qwen2.5-math-1.5b", "pspo_star.yaml")
    text = plan.plan_cli(["--config", preset, "--plan", f"--train.output_dir={tmp_path}"],
                         resolve=resolve_model_path)
    assert "prm.model 'pspo-prm': not counted" in text
    counted = plan.plan_cli(["--config", preset, "--plan", f"--prm.model={TINY_PRM}"],
                            resolve=resolve_model_path)
    assert "process reward model (0.0M, bf16" in counted and "PRM forward, 16384 tokens" in counted


# ---- the real loop (slow) ----

@pytest.fixture
def train(run_main, hub_offline):
    def train(tmp_path, knights_path: str, *overrides: str):
        return run_main("train", "--config", "configs/knights/pspo_star.yaml",
                        f"--model.name_or_path={knights_path}", "--train.max_steps=2", "--train.prompts_per_step=2",
                        "--rollout.max_new_tokens=32", "--rollout.engine=hf", "--data.eval=", "--train.progress=false",
                        f"--train.output_dir={tmp_path / 'run'}", *overrides)
    return train


@pytest.mark.slow
@pytest.mark.parametrize("method", ["grpo", "reinforce_pp"])
def test_the_loop_with_the_process_reward(tmp_path, knights_standin_path, tiny_prm_path, train, method):
    # the K&K preset on the untrained K&K twin (random text: its fixed-text tokens hold newlines, so some
    # completions have two or more lines, i.e. steps); 2 prompts x 8 completions, 2 steps
    train(tmp_path, knights_standin_path, f"--algo.advantage={method}")
    with open(tmp_path / "run" / "metrics.jsonl") as f:
        rows = [json.loads(line) for line in f]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["prm_steps"] > 0 and 0 < r["prm_scored_frac"] <= 1 and 0 <= r["prm_score"] <= 1
        assert 0 < r["prm_s"] <= r["reward_s"] and math.isfinite(r["loss"])
    saved = os.listdir(tmp_path / "run" / "checkpoint-2")                  # the policy's files only
    assert not any("prm" in name or "classifier" in name for name in saved)


@pytest.mark.slow
def test_train_py_stops_on_a_prm_that_cannot_serve(tmp_path, knights_standin_path, train):
    # a ConfigError: train.py prints its one line and exits 2
    with pytest.raises(ConfigError) as e:
        train(tmp_path, knights_standin_path, f"--prm.model={tmp_path / 'absent'}")
    absent = tmp_path / "absent"
    assert f"error: {e.value}".splitlines() == [
        f"error: prm.model: '{absent}': no such folder (expected a sequence classifier's folder or hub id)"]


def test_scoring_bench_runs_and_agrees(capsys):
    # bench/prm_scoring.py with the 2-layer stand-in: 3 completions x 3 lines = 9 steps, batched scores
    # equal to one-at-a-time ones (the table's last column), on CPU without the peak-memory column
    import importlib.util
    spec = importlib.util.spec_from_file_location("prm_bench", os.path.join(ROOT, "bench", "prm_scoring.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert [len(c.split("\n")) for c in bench.completions(3, 3)] == [3, 3, 3]
    bench.main(["--small", "--completions", "3", "--steps", "3"])
    row = capsys.readouterr().out.strip().splitlines()[-1].strip("|").split("|")
    assert int(row[0]) == 9 and float(row[-1]) < 1e-6


class _FixedLogits(torch.nn.Module):
    """A stand-in step classifier: every input gets the logits [0, ln 3, 0, ln 5] (b, 4)."""

    def __init__(self):
        super().__init__()
        self.anchor = torch.nn.Parameter(torch.zeros(1))          # the device PRM reads off the parameters

    def forward(self, input_ids, attention_mask=None, **kwargs):
        logits = torch.tensor([0.0, math.log(3), 0.0, math.log(5)]).expand(input_ids.shape[0], 4)
        return type("Out", (), {"logits": logits})()


def test_step_score_is_the_softmax_at_the_label_hand_worked():
    # s_j = softmax(logits)[prm.label]: softmax([0, ln 3, 0, ln 5]) = [1, 3, 1, 5] / 10, so label 1 -> .3,
    # label 3 -> .5, label 0 -> .1, for every step whatever its text (the stand-in ignores it)
    from pspo.related.prm import PRM
    for label, want in ((1, 0.3), (3, 0.5), (0, 0.1)):
        cfg = load_config(None, ["--reward.prm=1", "--prm.model=x", "--prm.split=lines", f"--prm.label={label}"]).prm
        prm = PRM(_FixedLogits(), build_prm_tokenizer(), cfg)
        scores = prm.step_scores([(None, "Zoey is a knight"), ("Zoey is a knight", "Mia is a knave")])
        assert scores == pytest.approx([want, want], abs=1e-6)
