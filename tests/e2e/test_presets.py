"""Every shipped config, rehearsed on CPU, so a broken recipe fails here rather than on a GPU node
after an hour in the queue.

Each `configs/**/*.yaml` (globbed: a new preset is covered without editing this file) runs as
`python train.py --config X` would (train.main in this process: conftest's run_main, the hub
offline) for one step plus the final eval, with only what a 2-core CPU cannot do replaced:
- the model: the arithmetic presets' tiny model stays (conftest's cached copy); the K&K presets'
  `builtin:tiny-knights-quick` (or `builtin:tiny-knights`, the study's) becomes the builds' untrained
  twin (pspo/offline/tiny_knights.py: the same tokenizer, so the same prompt lengths against
  data.max_prompt_tokens, and architecture; random weights, built in seconds where the quick base
  takes about a minute, and tests/components/test_tiny_knights.py builds and checks it); a GPU recipe's model
  becomes the stand-in built from the real config.json shipped beside it as model_config.json
  (pspo/offline/standin.py: the real positions, tied embeddings and GQA ratio, widths shrunk), its
  vocabulary cut to REHEARSAL_VOCAB ids (below);
- the data: a hub dataset becomes its local real-format sample in data/samples/;
- the process reward model: a PRM folder or hub id (reward.prm != 0) becomes builtin:tiny-prm (built in
  seconds, pspo/offline/tiny_prm.py);
- the size: one step (what carries from step to step, ERS, PPS, the resume, has end-to-end tests of its own) of at
  most 2 prompts (the arithmetic presets' 64 prompts x 8 completions made the update most of a rehearsal's
  time), 8 new tokens for a model with random weights (a GPU recipe's stand-in, the K&K twin; SPO-tree's
  segments 2 tokens each, its trees b0-2-2; DAPO's L_cache its share of them), the first 4 eval problems
  (7 puzzles, one of each size, when the eval set is builtin:knights);
- the hf engine, no progress bar, the output under tmp_path.
Everything else is the config's own: bf16 autocast, gradient checkpointing, rewards, ERS/PPS,
optimizer, system prompt, max_prompt_tokens. The resolved config the run saved is compared with
the file's plus exactly these overrides.
"""
import glob
import json
import math
import os

import pytest
import torch
import yaml
from transformers import AutoConfig, AutoModelForCausalLM

from pspo.training.config import load_config, to_dict
from pspo.offline.standin import ensure_standin_model, standin_config
from pspo.offline.standin import main as standin_main
from pspo.offline.builtin import KNIGHTS_MODELS, TINY_KNIGHTS_QUICK, TINY_MODEL, TINY_PRM, resolve_model_path

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIGS = sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "configs", "**", "*.yaml"),
                                                               recursive=True))
SAMPLES = {                                  # hub dataset -> local copy in the same format
    "knoveleng/open-rs": "data/samples/open-rs.jsonl",
    "HuggingFaceH4/MATH-500": "data/samples/math500.jsonl",
}
STEPS = 1
# The GPU recipes' stand-ins keep every limit of the real config.json but its vocabulary, cut to 1024 ids (above the
# stand-in tokenizer's 405): the real 151936 (152064 untied, the 7B's) made the head, the sampler's noise over it,
# AdamW's step and the checkpoint most of a rehearsal's time (~5x), and a recipe's settings do not depend on it. The
# real vocabulary runs through train.py in the GPU check's --small recipe (tests/checks/test_gpu_check.py: the
# 1.5B's grpo.yaml) and through eval.py in test_eval_benchmarks_on_gpu_recipe here.
REHEARSAL_VOCAB = 1024


def _sample(name: str) -> str:
    assert name in SAMPLES, f"{name}: no local sample in data/samples/ to rehearse it with (add one to SAMPLES)"
    path = os.path.join(ROOT, SAMPLES[name])
    assert os.path.isfile(path), f"{path}: missing"
    return path


def standin(real_config: str, folder: str, vocab: int | None) -> str:
    """The stand-in (ensure_standin_model) of a real config.json with `vocab` ids (None: its own vocabulary), built
    from a copy of the config written in `folder` (the stand-in's cache key is the config's content)."""
    if vocab is None:
        return ensure_standin_model(real_config)
    with open(real_config) as f:
        real = json.load(f)
    path = os.path.join(folder, f"vocab{vocab}-{os.path.basename(real_config)}")
    with open(path, "w") as f:
        json.dump({**real, "vocab_size": vocab}, f)
    return ensure_standin_model(path)


def rehearsal_overrides(config: str, output_dir: str, tiny_path: str, knights_path: str,
                        vocab: int | None = REHEARSAL_VOCAB) -> dict[str, str]:
    """The few overrides that fit `config` on a 2-core CPU (see the module docstring); a GPU recipe's stand-in with
    `vocab` ids (None: the real vocabulary)."""
    cfg = load_config(os.path.join(ROOT, config))
    over = {"train.max_steps": str(STEPS), "train.progress": "false", "rollout.engine": "hf",
            "train.output_dir": output_dir, "train.prompts_per_step": str(min(cfg.train.prompts_per_step, 2)),
            "data.max_eval_examples": "7" if cfg.data.eval == "builtin:knights" else "4"}
    if cfg.reward.prm and not cfg.prm.model.startswith("builtin:"):
        over["prm.model"] = TINY_PRM
    if cfg.model.name_or_path == TINY_MODEL:
        over["model.name_or_path"] = tiny_path
        return over
    if cfg.model.name_or_path in KNIGHTS_MODELS:
        over["model.name_or_path"] = knights_path
        return over | _short_completions(cfg)
    real_config = os.path.join(ROOT, os.path.dirname(config), "model_config.json")
    assert os.path.isfile(real_config), f"{config}: a GPU recipe needs its model's config.json beside it " \
                                        "as model_config.json (the stand-in is built from it)"
    over["model.name_or_path"] = standin(real_config, os.path.dirname(output_dir), vocab)
    over.update(_short_completions(cfg))
    for key in ("train", "eval"):
        name = getattr(cfg.data, key)
        if name and not name.startswith("builtin:"):
            over[f"data.{key}"] = _sample(name)
    return over


def _short_completions(cfg) -> dict[str, str]:
    """8 new tokens, for a model with random weights: it never stops early, and every token is
    uncertain, so SPO-chain would cut at every K-th of max_new_tokens (K&K's 80: 27 cuts x 4
    continuations a rollout, two minutes for 2 steps); SPO-tree's segments shrink to fit."""
    over = {"rollout.max_new_tokens": "8"}
    if cfg.reward.overlong_cache:                      # DAPO's L_cache at its share of the 8 tokens
        over["reward.overlong_cache"] = str(max(1, round(8 * cfg.reward.overlong_cache / cfg.rollout.max_new_tokens)))
    if cfg.algo.advantage == "spo_tree":               # segments that fit in the 8 tokens, trees of b0 + 2 b0 + 4 b0
        over["spo.segment_tokens"] = "2"
        over["spo.branching"] = f"{cfg.spo.branch_factors[0]},2,2"
    return over


def _values(cfg, keys) -> dict:
    """{"section.key": the loaded config's value} for each dotted key."""
    return {key: getattr(getattr(cfg, key.split(".")[0]), key.split(".")[1]) for key in keys}


@pytest.fixture
def run(run_main, hub_offline):
    """run(script, config, overrides, *flags): train.py or eval.py on a config with these overrides."""
    def run(script: str, config: str, overrides: dict[str, str], *flags: str):
        return run_main(script, "--config", os.path.join(ROOT, config), *flags,
                        *[f"--{k}={v}" for k, v in overrides.items()])
    return run


# the presets on a tiny K&K build: rehearsed on the builds' untrained twin (module docstring)
KNIGHTS = [c for c in CONFIGS if load_config(os.path.join(ROOT, c)).model.name_or_path in KNIGHTS_MODELS]


def test_a_first_run_of_an_offline_preset_builds_only_quick_models():
    # every preset that names a built-in model names one built in about a minute on 2 CPU cores (README,
    # "Offline models"): builtin:tiny or the K&K quick base, never the K&K study's (~16-20 minutes);
    # the only built-in PRM, builtin:tiny-prm, builds in seconds
    models = {load_config(os.path.join(ROOT, c)).model.name_or_path for c in CONFIGS}
    assert {m for m in models if m.startswith("builtin:")} == {TINY_MODEL, TINY_KNIGHTS_QUICK}
    # and every K&K preset is rehearsed on the twin (test_knights_config_rehearsal)
    assert KNIGHTS == [c for c in CONFIGS if c.startswith("configs/knights/")] and KNIGHTS


@pytest.mark.slow
@pytest.mark.parametrize("config", [c for c in CONFIGS if c not in KNIGHTS])
def test_config_rehearsal(config, tmp_path, tiny_model_path, run):
    rehearse(run, config, str(tmp_path / "run"), tiny_model_path, "")


@pytest.mark.slow
@pytest.mark.parametrize("config", KNIGHTS)
def test_knights_config_rehearsal(config, tmp_path, tiny_model_path, knights_standin_path, run):
    rehearse(run, config, str(tmp_path / "run"), tiny_model_path, knights_standin_path)


def rehearse(run, config: str, out: str, tiny_model_path: str, knights_path: str) -> None:
    over = rehearsal_overrides(config, out, tiny_model_path, knights_path)
    run("train", config, over)                                   # an error raises: the test fails with it

    # the run used the file's values plus exactly the overrides above
    with open(os.path.join(out, "config.yaml")) as f:
        saved = yaml.safe_load(f)
    assert saved == to_dict(load_config(os.path.join(ROOT, config), [f"--{k}={v}" for k, v in over.items()]))

    with open(os.path.join(out, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    train_steps = [r["step"] for r in rows if "reward_mean" in r]
    assert train_steps == list(range(1, STEPS + 1))
    final = next(r for r in rows if r["step"] == STEPS and "reward_mean" in r)
    assert 0.0 <= final["eval_accuracy"] <= 1.0
    assert math.isfinite(final["loss"]) and math.isfinite(final["grad_norm"])

    # the final checkpoint is a plain transformers folder with the model's limits
    model_path = over["model.name_or_path"]
    ckpt = AutoModelForCausalLM.from_pretrained(os.path.join(out, f"checkpoint-{STEPS}"), dtype=torch.float32)
    base = AutoConfig.from_pretrained(model_path)
    for key in ("vocab_size", "max_position_embeddings", "tie_word_embeddings", "num_hidden_layers"):
        assert getattr(ckpt.config, key) == getattr(base, key), key


@pytest.mark.slow
def test_knights_preset_on_the_base_it_names(tmp_path, run):
    # what a new user runs: configs/knights/grpo.yaml on builtin:tiny-knights-quick itself (built here once,
    # as train.py would; tests/components/test_tiny_knights.py checks it), its own 80 new tokens, 2 steps of 2 puzzles
    resolve_model_path(TINY_KNIGHTS_QUICK)
    out = tmp_path / "run"
    over = {"train.max_steps": "2", "train.progress": "false", "rollout.engine": "hf",
            "train.output_dir": str(out), "train.prompts_per_step": "2", "data.max_eval_examples": "7"}
    run("train", "configs/knights/grpo.yaml", over)                # an error raises: the test fails with it
    with open(out / "config.yaml") as f:
        assert yaml.safe_load(f)["model"]["name_or_path"] == TINY_KNIGHTS_QUICK
    with open(out / "metrics.jsonl") as f:
        steps = [r for r in map(json.loads, f) if "reward_mean" in r]
    # K&K rewards are 3, -0.5, -1 (layout right, answer unparsable) or -3 (layout wrong). The base writes
    # the layout, so the 2 x 16 rollouts average above -2 (more than half earn the format's +1), where
    # the untrained twin's are all -3
    assert [r["step"] for r in steps] == [1, 2]
    assert sum(r["reward_mean"] for r in steps) / len(steps) > -2.0, steps


# The values docs/gpu.md's "Compared with the released configuration" table lists as the released code's own: the PSPO
# code's recipes/1.5B/*.yaml on TRL 0.18. Batch: 2 GPUs x 4 per device x 6 accumulation steps = 48
# completions = 8 prompts of G = 6; warm-up: warmup_ratio 0.1 x 50 steps = 5.
RELEASED = {
    "data.max_prompt_tokens": 512, "data.system_prompt": "r1", "rollout.num_generations": 6,
    "rollout.temperature": 0.7, "rollout.top_p": 1.0, "rollout.max_new_tokens": 3584,
    "reward.accuracy": 0.0, "reward.format": 1.0, "reward.cosine": 2.0, "algo.eps_low": 0.2, "algo.eps_high": 0.28,
    "algo.num_iterations": 1, "optim.lr": 1e-6, "optim.adam_beta1": 0.9, "optim.adam_beta2": 0.999,
    "optim.weight_decay": 0.0, "optim.warmup_steps": 5, "optim.min_lr_ratio": 0.1, "optim.max_grad_norm": 1.0,
    "train.seed": 2025, "train.max_steps": 50, "train.prompts_per_step": 8, "train.micro_batch_size": 4,
    "train.save_steps": 50, "model.bf16": True,
}


SINGLE_STREAM = {"rollout.num_generations": 1, "train.prompts_per_step": 48, "reward.accuracy": 1.0,
                 "reward.format": 0.0, "reward.cosine": 0.0}
# an objective preset's own values, its paper's (tests/math/test_objectives.py checks them): its ε, its optimizer
# steps per rollout batch and the warm-up scaled to them
OBJECTIVE_KEYS = ("algo.eps_low", "algo.eps_high", "algo.num_iterations", "optim.warmup_steps")


@pytest.mark.parametrize("config", [c for c in CONFIGS if c.startswith("configs/qwen2.5-math-1.5b/")])
def test_gpu_recipe_matches_released(config):
    cfg = load_config(os.path.join(ROOT, config))
    # the LoRA recipe keeps every value but the learning rate, 10x full fine-tuning's (its header says why); Single-
    # stream PO's, but its group of one, B and reward (tests/components/test_single_stream_config.py)
    want = dict(RELEASED, **({"optim.lr": 1e-5} if cfg.model.lora.rank else {}),
                **(SINGLE_STREAM if cfg.algo.advantage == "single_stream" else {}),
                **(_values(cfg, OBJECTIVE_KEYS) if cfg.algo.objective != "ppo_clip" else {}))
    assert _values(cfg, RELEASED) == want
    # the released code recomputes every layer; ours the least the memory plan fits (the same numbers)
    assert cfg.model.gradient_checkpointing == "auto"
    with open(os.path.join(ROOT, os.path.dirname(config), "model_config.json")) as f:
        positions = json.load(f)["max_position_embeddings"]
    assert cfg.data.max_prompt_tokens + cfg.rollout.max_new_tokens == positions     # 512 + 3584 = 4096


# PaddleNLP's llm/config/qwen/reinforce_plus_plus_argument.yaml, in our keys (docs/gpu.md, "Preset:
# REINFORCE++ on K&K"): global_batch_size 8 prompts x rollout_n 8, per_device_train_batch_size 8,
# kl_coeff 1e-3, kl_loss_coeff 0, clip_range_ratio 0.2/0.2, clip_range_score 10, constant lr 5e-7.
SEED_7B = {
    "model.name_or_path": "Qwen/Qwen2.5-7B-Instruct-1M", "data.max_prompt_tokens": 512,
    "rollout.num_generations": 8, "rollout.temperature": 0.7, "rollout.top_p": 1.0, "rollout.max_new_tokens": 4096,
    "reward.knights": 1.0, "reward.accuracy": 0.0, "algo.advantage": "reinforce_pp", "algo.kl_coef": 1e-3,
    "algo.beta": 0.0, "algo.clip_score": 10.0, "algo.whiten": "bessel", "algo.aggregation": "token_mean",
    "algo.eps_low": 0.2, "algo.eps_high": 0.2, "algo.num_iterations": 1, "optim.lr": 5e-7,
    "optim.weight_decay": 0.01, "optim.adam_beta1": 0.9, "optim.adam_beta2": 0.999, "optim.warmup_steps": 0,
    "optim.min_lr_ratio": 1.0, "optim.max_grad_norm": 1.0, "train.seed": 42, "train.max_steps": 3600,
    "train.prompts_per_step": 8, "train.micro_batch_size": 8, "train.eval_steps": 20, "train.save_steps": 300,
    "model.bf16": True,
}


@pytest.mark.parametrize("folder, heads, kv_heads, hidden", [
    ("qwen2.5-math-1.5b", 6, 1, 192),          # 12 / 2 = ratio 6: 6 heads of 32 = hidden 192, as asked
    ("qwen2.5-7b-instruct-1m", 7, 1, 224),     # 28 / 4 = ratio 7: 6 heads rounded up to 7 -> 7 x 32 = 224
])
def test_standin_keeps_the_gqa_ratio(folder, heads, kv_heads, hidden):
    with open(os.path.join(ROOT, "configs", folder, "model_config.json")) as f:
        real = json.load(f)
    small = standin_config(real)
    assert (small["num_attention_heads"], small["num_key_value_heads"], small["hidden_size"]) == (heads, kv_heads, hidden)
    assert small["num_attention_heads"] // small["num_key_value_heads"] == \
        real["num_attention_heads"] // real["num_key_value_heads"]
    for key in ("vocab_size", "max_position_embeddings", "tie_word_embeddings", "rope_theta"):
        assert small[key] == real[key]


def test_7b_preset_matches_the_seed():
    cfg = load_config(os.path.join(ROOT, "configs/qwen2.5-7b-instruct-1m/reinforce_pp.yaml"))
    assert _values(cfg, SEED_7B) == SEED_7B
    assert cfg.model.gradient_checkpointing == "auto"             # the released code's: full (the same numbers)


@pytest.mark.slow
def test_eval_benchmarks_on_gpu_recipe(tmp_path, tiny_model_path, run):
    # eval.py --benchmarks on the PSPO recipe, MATH-500 from its local sample, the stand-in model with the real
    # vocabulary (151936: the rehearsals' stand-ins cut it)
    config = "configs/qwen2.5-math-1.5b/pspo.yaml"
    keep = ("model.name_or_path", "rollout.engine", "rollout.max_new_tokens", "train.progress")
    over = {k: v for k, v in rehearsal_overrides(config, str(tmp_path / "run"), tiny_model_path, "", vocab=None).items()
            if k in keep}
    assert AutoConfig.from_pretrained(over["model.name_or_path"]).vocab_size == 151936
    over["eval.output"] = str(tmp_path / "bench.json")
    math500 = _sample("HuggingFaceH4/MATH-500")
    run("eval", config, over, f"--benchmarks=math500={math500}")
    with open(tmp_path / "bench.json") as f:
        results = json.load(f)
    with open(math500) as f:
        rows = sum(1 for line in f if line.strip())
    bench = results["benchmarks"]["math500"]
    assert bench["n"] >= 1 and bench["n"] + bench["skipped"] == rows          # every row evaluated or reported
    assert 0.0 <= bench["greedy_accuracy"] <= 1.0


def test_random_model_at_real_width_with_fewer_layers(tmp_path, capsys):
    # the GPU check's model (scripts/gpu_check.sh): real widths kept, only the first 2 of 4 layers
    real = {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "vocab_size": 1000, "hidden_size": 64,
            "intermediate_size": 96, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
            "max_position_embeddings": 256, "max_window_layers": 3, "layer_types": ["full_attention"] * 4,
            "tie_word_embeddings": True, "torch_dtype": "bfloat16"}
    path = tmp_path / "real.json"
    path.write_text(json.dumps(real))
    out = tmp_path / "model"
    standin_main([str(path), str(out), "--full", "--layers", "2", "--seed", "3"])
    cfg = AutoConfig.from_pretrained(out)
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads, cfg.num_key_value_heads) == (64, 96, 4, 2)
    assert (cfg.num_hidden_layers, cfg.max_window_layers, len(cfg.layer_types)) == (2, 2, 2)
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.dtype == torch.bfloat16
    # 1000 x 64 tied embedding + 2 layers x (q 64x64+64, k,v 64x32+32 each, o 64x64, MLP 3 x 64x96, 2 norms 64) + norm 64
    per_layer = (64 * 64 + 64) + 2 * (64 * 32 + 32) + 64 * 64 + 3 * 64 * 96 + 2 * 64
    assert sum(p.numel() for p in model.parameters()) == 1000 * 64 + 2 * per_layer + 64
    capsys.readouterr()
    for argv, why in (([str(path), str(out)], "exists"), ([str(tmp_path), str(tmp_path / "x")], str(tmp_path)),
                      ([str(path), str(tmp_path / "y"), "--full", "--layers", "5"], "expected 1 to the model's"),
                      ([str(path), str(tmp_path / "z"), "--layers", "0"], "--layers 0: expected 1 to the model's num_hidden_layers (4)")):
        with pytest.raises(SystemExit) as e:
            standin_main(argv)
        err = capsys.readouterr().err.strip()
        assert e.value.code == 2 and why in err and "\n" not in err
