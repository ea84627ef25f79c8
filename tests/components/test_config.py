"""Config: YAML + overrides with CLI > YAML > defaults, and one-line errors naming the key."""
import os
import subprocess
import sys

import pytest

from pspo.training.config import Config, ConfigError, load_config, save_config

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_precedence_cli_over_yaml_over_defaults(tmp_path):
    path = write(tmp_path, "c.yaml", "optim:\n  lr: 3.0e-4\ntrain:\n  max_steps: 7\n")
    cfg = load_config(path, ["--train.max_steps=9", "--algo.scale_rewards=false"])
    assert cfg.optim.lr == 3e-4                  # YAML over default 1e-6
    assert cfg.train.max_steps == 9              # CLI over YAML 7
    assert cfg.algo.scale_rewards is False       # CLI over default True
    assert cfg.rollout.num_generations == Config().rollout.num_generations  # default kept


def test_base_inheritance_and_presets():
    grpo = load_config(os.path.join(ROOT, "configs/grpo.yaml"))
    dr = load_config(os.path.join(ROOT, "configs/dr_grpo.yaml"))
    assert (grpo.algo.scale_rewards, grpo.algo.aggregation) == (True, "grpo")
    assert (dr.algo.scale_rewards, dr.algo.aggregation, dr.algo.beta) == (False, "dr_grpo", 0.0)
    assert dr.rollout.max_new_tokens == grpo.rollout.max_new_tokens          # inherited
    for name in ("grpo", "dr_grpo"):
        gpu = load_config(os.path.join(ROOT, f"configs/qwen2.5-math-1.5b/{name}.yaml"))
        assert gpu.rollout.num_generations == 6 and gpu.optim.lr == 1e-6 and gpu.rollout.max_new_tokens == 3584
    # the PSPO presets and ablations switch ERS / PPS on top of the same GRPO settings, here and on GPU
    for folder in ("configs", "configs/qwen2.5-math-1.5b"):
        base = load_config(os.path.join(ROOT, folder, "grpo.yaml"))
        for name, ers, pps in (("grpo", False, False), ("ers", True, False), ("pps", False, True),
                               ("pspo", True, True)):
            c = load_config(os.path.join(ROOT, folder, f"{name}.yaml"))
            assert (c.ers.enabled, c.pps.enabled) == (ers, pps), (folder, name)
            assert (c.algo, c.optim, c.rollout, c.data) == (base.algo, base.optim, base.rollout, base.data)
            assert name in c.train.output_dir


@pytest.mark.parametrize("yaml_text, overrides, message", [
    ("optim:\n  learning_rate: 1\n", [], "optim.learning_rate: unknown key"),
    ("optimizer:\n  lr: 1\n", [], "optimizer.lr: unknown section"),
    ("train:\n  max_steps: ten\n", [], "train.max_steps: expected int, got 'ten'"),
    ("algo:\n  scale_rewards: 3\n", [], "algo.scale_rewards: expected bool"),
    ("", ["--algo.aggregation=mean"], "algo.aggregation: expected grpo | token_mean | dr_grpo"),
    ("", ["--rollout.num_generations=1"], "rollout.num_generations: expected G >= 2"),
    ("", ["--rollout.top_p=0"], "rollout.top_p: expected in (0, 1]"),
    ("", ["train.max_steps=3"], "overrides look like --section.key=value"),
    ("", ["--reward.accuracy=0"], "reward: expected at least one non-zero weight"),
    ("", ["--reward.prm=nan"], "reward.prm: expected a finite weight, got nan"),
    ("ers:\n  alpha: 0\n", [], "ers.alpha: expected in (0, 1], got 0.0"),
    ("", ["--pps.priority=last"], "pps.priority: expected mean_abs | max_abs | last_abs | learnability | thompson | "
     "single_stream, got 'last'"),
    ("", ["--pps.beta_end=-0.5"], "pps.beta_end: expected >= 0, or -1 for a constant β"),
    ("", ["--pps.eps=0"], "pps.eps: expected > 0"),
    ("", ["--pps.is_norm=max"], "pps.is_norm: expected batch_max | mean | none, got 'max'"),
    ("pps:\n  enabled: maybe\n", [], "pps.enabled: expected bool"),
    ("", ["--data.train_people=2,9"], "data.train_people: expected K&K numbers of people in 2..8"),
    ("data:\n  train_people: two\n", [], "data.train_people: expected K&K numbers of people in 2..8"),
    ("rollout:\n  sync_check_tol: 0.02\n", [], "rollout.sync_check_tol: removed: the sync check compares exact "
     "per-row weight checksums, with no tolerance"),
])
def test_errors_name_the_key(tmp_path, yaml_text, overrides, message):
    path = write(tmp_path, "c.yaml", yaml_text)
    with pytest.raises(ConfigError) as e:
        load_config(path, overrides)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_batch_must_divide_over_ranks(tmp_path):
    path = write(tmp_path, "c.yaml", "train:\n  prompts_per_step: 6\n")
    load_config(path, [], world_size=2)
    with pytest.raises(ConfigError, match="train.prompts_per_step: expected a multiple of the 4 ranks, got 6"):
        load_config(path, [], world_size=4)


def test_missing_and_invalid_files(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(str(tmp_path / "nope.yaml"))
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(write(tmp_path, "bad.yaml", "train: [1,\n"))


def test_reference_names_of_the_released_code_refused(tmp_path):
    # "reference" is the KL reference model only: the released code's mode, split and presets are "released",
    # and each old name is refused in one line naming the new
    renamed = "'reference' is now 'released' (the paper's released code; 'reference' is the KL reference model only)"
    for overrides, key in ((["--pps.mode=reference"], "pps.mode"), (["--prm.split=reference"], "prm.split")):
        with pytest.raises(ConfigError) as e:
            load_config(None, overrides)
        assert str(e.value) == f"{key}: {renamed}"
    old = os.path.join(ROOT, "configs", "qwen2.5-math-1.5b", "pspo_reference.yaml")
    with pytest.raises(ConfigError) as e:
        load_config(old)
    assert str(e.value) == f"config file not found: {old} (the preset is now pspo_released.yaml: {renamed})"
    with pytest.raises(ConfigError) as e:                   # a name that never was a preset: the plain line
        load_config(str(tmp_path / "nope.yaml"))
    assert str(e.value) == f"config file not found: {tmp_path / 'nope.yaml'}"


def test_resolved_config_round_trips(tmp_path):
    cfg = load_config(None, ["--train.seed=5", "--data.system_prompt=be brief"])
    save_config(cfg, str(tmp_path / "resolved.yaml"))
    again = load_config(str(tmp_path / "resolved.yaml"))
    assert again == cfg


def test_a_system_prompt_of_one_unknown_word_is_a_mistyped_name():
    # "R1" would otherwise become the system message "R1" in every prompt
    for typo in ("R1", "r-1", " deepseek "):
        with pytest.raises(ConfigError, match=r"data.system_prompt: expected a prompt name \(r1\)"):
            load_config(None, [f"--data.system_prompt={typo}"])
    for fine in ("r1", "", "be brief", "Answer in one word."):
        assert load_config(None, [f"--data.system_prompt={fine}"]).data.system_prompt == fine


@pytest.mark.slow
def test_train_py_reports_one_line_and_exit_code_2(tmp_path):
    # A user mistake must not produce a traceback: one line, exit status 2.
    proc = subprocess.run([sys.executable, "train.py", "--config", "configs/grpo.yaml", "--optim.lr=fast"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    out = (proc.stdout + proc.stderr).strip().splitlines()
    assert out == ["error: optim.lr: expected float, got 'fast'"]


def test_rloo_with_the_std_is_refused_in_one_line_and_its_presets_load():
    # grpo.yaml divides by the group std (scale_rewards: true); RLOO over it would be GRPO's advantage times
    # G/(G-1), which AdamW cancels: the run is refused before anything starts, naming the key and the way out
    with pytest.raises(ConfigError) as e:
        load_config(os.path.join(ROOT, "configs/grpo.yaml"), ["--algo.advantage=rloo"])
    line = str(e.value)
    assert line.startswith("algo.scale_rewards: expected false with algo.advantage=rloo (") and "\n" not in line
    assert "G/(G-1)" in line and "algo.advantage=grpo" in line and line.endswith("got True")
    for preset in ("rloo.yaml", "knights/rloo.yaml", "qwen2.5-math-1.5b/rloo.yaml"):
        cfg = load_config(os.path.join(ROOT, "configs", preset))
        assert (cfg.algo.advantage, cfg.algo.scale_rewards) == ("rloo", False), preset


@pytest.mark.parametrize("advantage, allowed", [
    ("grpo", True), ("rloo", True), ("maxrl", True), ("reinforce_pp_baseline", True),   # a group baseline: ERS
    ("reinforce_pp", False), ("spo_chain", False), ("spo_tree", False),      # none: one line refuses
])
def test_ers_goes_with_every_group_baseline_and_no_other(advantage, allowed):
    over = [f"--algo.advantage={advantage}", "--ers.enabled=true", "--algo.beta=0",
            f"--algo.scale_rewards={advantage != 'rloo'}"]
    over += ["--rollout.num_generations=6", "--spo.segment_tokens=3"] if advantage == "spo_tree" else []
    if allowed:
        assert load_config(None, over).ers.enabled
        return
    with pytest.raises(ConfigError) as e:
        load_config(None, over)
    assert str(e.value) == (f"ers.enabled: expected false with algo.advantage={advantage} (ERS smooths a group "
                            "baseline's mean and std: grpo, rloo, maxrl, reinforce_pp_baseline have one, "
                            f"{advantage} has none), got True")


@pytest.mark.parametrize("yaml_text, overrides, message", [
    ("", ["--pps.mode=bogus"], "pps.mode: expected paper | released, got 'bogus'"),
    ("", ["--pps.uniform_mix=1"], "pps.uniform_mix: expected in [0, 1), got 1.0"),
    ("", ["--pps.uniform_mix=-0.1"], "pps.uniform_mix: expected in [0, 1), got -0.1"),
    ("", ["--pps.posterior_decay=0"], "pps.posterior_decay: expected in (0, 1], got 0.0"),
    ("", ["--pps.skip_rho=1.5"], "pps.skip_rho: expected in (0, 1], got 1.5"),
    ("", ["--pps.skip_min=0"], "pps.skip_min: expected in (0, 1], got 0.0"),
    ("pps:\n  skip: sometimes\n", [], "pps.skip: expected bool"),
    # pps.mode=released is the released code's fixed procedure: the §3b options are refused
    ("pps:\n  mode: released\n", ["--pps.is_norm=mean"],
     "pps.is_norm: expected batch_max (unset) with pps.mode=released"),
    ("", ["--pps.mode=released", "--pps.skip=true"], "pps.skip: expected False (unset) with pps.mode=released"),
    ("", ["--pps.mode=released", "--pps.uniform_mix=0.1"],
     "pps.uniform_mix: expected 0.0 (unset) with pps.mode=released"),
    ("", ["--pps.mode=released", "--pps.priority=learnability"],
     "pps.priority: expected mean_abs (unset) with pps.mode=released"),
    ("", ["--pps.mode=released", "--pps.beta_end=1"], "pps.beta_end: expected -1.0 (unset) with pps.mode=released"),
    ("", ["--pps.replacement=true", "--pps.skip=true"], "pps.replacement: expected false with pps.skip"),
    ("", ["--pps.mode=released", "--pps.replacement=true"],
     "pps.replacement: expected False (unset) with pps.mode=released"),
])
def test_pps_option_errors_name_the_key(tmp_path, yaml_text, overrides, message):
    path = write(tmp_path, "c.yaml", yaml_text)
    with pytest.raises(ConfigError) as e:
        load_config(path, overrides)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_pps_options_load_and_released_presets():
    cfg = load_config(None, ["--pps.priority=learnability", "--pps.posterior_decay=0.5", "--pps.uniform_mix=0.1",
                             "--pps.skip=true", "--pps.skip_rho=0.25", "--pps.skip_min=0.05"])
    p = cfg.pps
    assert (p.mode, p.priority, p.posterior_decay, p.uniform_mix, p.skip, p.skip_rho, p.skip_min) == \
        ("paper", "learnability", 0.5, 0.1, True, 0.25, 0.05)
    d = Config().pps                                       # the §3b options are off by default: the paper's method
    assert (d.mode, d.uniform_mix, d.skip, d.priority, d.is_norm) == ("paper", 0.0, False, "mean_abs", "batch_max")
    # pspo_released: the pspo preset with pps.mode=released, here and on GPU
    for folder in ("configs", "configs/qwen2.5-math-1.5b"):
        ref = load_config(os.path.join(ROOT, folder, "pspo_released.yaml"))
        pspo = load_config(os.path.join(ROOT, folder, "pspo.yaml"))
        assert ref.pps.mode == "released" and ref.pps.enabled and ref.ers == pspo.ers
        assert (ref.pps.alpha, ref.pps.beta) == (0.6, 0.4)
        assert (ref.algo, ref.optim, ref.rollout, ref.data) == (pspo.algo, pspo.optim, pspo.rollout, pspo.data)
        assert "released" in ref.train.output_dir


TREE = ["--algo.advantage=spo_tree", "--algo.beta=0", "--rollout.num_generations=6", "--spo.segment_tokens=3"]


@pytest.mark.parametrize("overrides, message", [
    (["--rollout.max_sampling_rounds=0"], "rollout.max_sampling_rounds: expected >= 1 (the first round included), "
     "got 0"),
    (["--rollout.max_sampling_rounds=9"], "rollout.max_sampling_rounds: expected 4 (the default) with rollout."
     "dynamic_sampling=false (there are no extra rounds), got 9"),
    (["--rollout.dynamic_sampling=true", *TREE], "rollout.dynamic_sampling: expected false with algo.advantage="
     "spo_tree (it trains edges replayed from earlier steps, not the step's groups), got True"),
    (["--algo.overlong_filter=true", *TREE], "algo.overlong_filter: expected false with algo.advantage=spo_tree "
     "(it trains tree edges, which keep no truncation flag), got True"),
    (["--reward.overlong_cache=16"], "reward.overlong_cache: expected L_cache in [0, rollout.max_new_tokens = 16) "
     "tokens (0 = off), got 16"),
    (["--reward.overlong_cache=-1"], "reward.overlong_cache: expected L_cache in [0, rollout.max_new_tokens = 16)"),
    (["--reward.overlong_cache=4", "--algo.advantage=spo_chain", "--algo.beta=0"], "reward.overlong_cache: expected "
     "0 with algo.advantage=spo_chain (its continuations are scored from their text alone, without their token "
     "counts), got 4"),
])
def test_dapo_settings_are_refused_in_one_line_where_they_have_no_meaning(overrides, message):
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_dapo_parts_load_with_every_other_method():
    for advantage in ("grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "spo_chain"):
        cfg = load_config(None, [f"--algo.advantage={advantage}", "--algo.beta=0", "--rollout.dynamic_sampling=true",
                                 "--algo.overlong_filter=true", "--rollout.max_sampling_rounds=3",
                                 f"--algo.scale_rewards={advantage != 'rloo'}"])
        assert cfg.rollout.dynamic_sampling and cfg.algo.overlong_filter and cfg.rollout.max_sampling_rounds == 3


ASYNC = ["--rollout.mode=async", "--rollout.is_correction=token"]


@pytest.mark.parametrize("overrides, key, why", [
    (["--rollout.mode=later"], "rollout.mode", "sync | async"),
    (["--rollout.mode=async"], "rollout.is_correction", "without the IS weight the update is the gradient of "
     "another policy"),
    (["--rollout.mode=async", "--rollout.is_correction=sequence"], "rollout.is_correction", "token | token_mask "
     "with rollout.mode=async at rollout.lag=1"),
    (["--rollout.mode=async", "--rollout.is_correction=sequence_mask"], "rollout.is_correction",
     "caps or drops nearly every completion"),
    ([*ASYNC, "--rollout.lag=2"], "rollout.lag", "0 or 1 (a fixed lag of one step"),
    ([*ASYNC, "--rollout.engines=0"], "rollout.engines", ">= 1"),
    ([*ASYNC, "--rollout.engine_timeout_s=600"], "rollout.engine_timeout_s", "in (0, 600) seconds"),
    ([*ASYNC, "--rollout.engine_cores=a"], "rollout.engine_cores", "integers separated by commas"),
    ([*ASYNC, "--rollout.engines=2", "--rollout.engine_gpus=3"], "rollout.engine_gpus", "one CUDA index per engine"),
    ([*ASYNC, "--rollout.engines=2", "--rollout.engine_gpus=3,3"], "rollout.engine_gpus", "distinct indices"),
    ([*ASYNC, "--algo.advantage=spo_chain", "--algo.beta=0"], "algo.advantage", "must come from π_old"),
    ([*ASYNC, "--rollout.dynamic_sampling=true"], "rollout.dynamic_sampling", "would need the engines mid-step"),
    ([*ASYNC, "--rollout.sleep=true"], "rollout.sleep", "cannot generate during the update"),
    ([*ASYNC, "--rollout.top_p=0.9"], "rollout.top_p", "renormalised over the nucleus"),
])
def test_async_refusals_are_one_line_naming_the_key(overrides, key, why):
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    line = str(e.value)
    assert line.startswith(f"{key}: expected") and why in line and "\n" not in line


def test_async_accepts_lag_0_without_a_correction():
    # lag 0 is the synchronous schedule through the engine processes: nothing to correct, and a sequence-level
    # ratio is the engine's rounding gap again, as in sync mode
    cfg = load_config(None, ["--rollout.mode=async", "--rollout.lag=0"])
    assert (cfg.rollout.mode, cfg.rollout.lag, cfg.rollout.is_correction) == ("async", 0, "none")
    for mode in ("sequence", "sequence_mask"):
        assert load_config(None, ["--rollout.mode=async", "--rollout.lag=0", f"--rollout.is_correction={mode}"])
        assert load_config(None, [f"--rollout.is_correction={mode}"]).rollout.mode == "sync"
    for mode in ("token", "token_mask"):
        assert load_config(None, ["--rollout.mode=async", f"--rollout.is_correction={mode}"]).rollout.lag == 1


def test_engine_gpus_count_the_gpus_the_trainer_sees():
    # rollout.engine_gpus are indices among the visible GPUs, as LOCAL_RANK is; each engine gets the entry they
    # name as its CUDA_VISIBLE_DEVICES (engines/schedule.py: engine_devices)
    from pspo.engines.schedule import engine_devices
    # a job given GPUs 4-7, two trainer ranks on its 0 and 1 (physical 4, 5): its 2 and 3 are physical 6 and 7
    assert engine_devices("2,3", visible="4,5,6,7", device_count=4, trainer_gpus=2) == ("6", "7")
    assert engine_devices("3,2", visible=" 4, 5,6 ,7", device_count=4, trainer_gpus=2) == ("7", "6")
    # unset: every GPU of the machine, index i is GPU i
    assert engine_devices("4,5,6,7", visible=None, device_count=8, trainer_gpus=4) == ("4", "5", "6", "7")
    # UUIDs pass through as written (CUDA reads them in the engine as it did in the trainer)
    assert engine_devices("1", visible="GPU-8a1b,MIG-77c2", device_count=2, trainer_gpus=1) == ("MIG-77c2",)
    assert engine_devices("", visible="4,5", device_count=2, trainer_gpus=1) == ()
    for gpus, visible, count, trainer, why in [
        ("4", "4,5,6,7", 4, 2, "among the 4 GPUs this process sees (0..3; CUDA_VISIBLE_DEVICES=4,5,6,7), got '4'"),
        ("2,6", "4,5,6,7", 4, 2, "among the 4 GPUs this process sees (0..3; CUDA_VISIBLE_DEVICES=4,5,6,7), "
                                  "got '2,6'"),
        ("2", None, 2, 1, "among the 2 GPUs this process sees (0..1; CUDA_VISIBLE_DEVICES unset), got '2'"),
        # a list naming more devices than CUDA found (one that is not there): only those found count
        ("3", "4,5,6,7", 3, 2, "among the 3 GPUs this process sees (0..2; CUDA_VISIBLE_DEVICES=4,5,6,7), got '3'"),
        ("1", "", 0, 1, "among the 0 GPUs this process sees (none; CUDA_VISIBLE_DEVICES=), got '1'"),
        ("1,2", "4,5,6,7", 4, 2, ">= 2 (GPUs 0..1 hold the trainer ranks), got '1,2'"),
    ]:
        with pytest.raises(ConfigError) as e:
            engine_devices(gpus, visible=visible, device_count=count, trainer_gpus=trainer)
        assert str(e.value) == "rollout.engine_gpus: expected indices " + why


def test_async_devices_are_checked_against_the_machine_in_one_line():
    # checked at start-up, before any engine starts or the model is read (engines/schedule.py)
    import torch
    from pspo.engines.schedule import engine_rollouts, pin_cores
    from pspo.training.distributed import Dist
    allowed = sorted(os.sched_getaffinity(0))
    with pytest.raises(ConfigError, match=r"^rollout.engine_cores: expected cores among .* that leave the trainer "
                                          r"at least one, got '999'$"):
        pin_cores("999")
    with pytest.raises(ConfigError, match="^rollout.engine_cores: .* leave the trainer at least one"):
        pin_cores(",".join(map(str, allowed)))
    assert os.sched_getaffinity(0) == set(allowed) and pin_cores("") == ()      # refused: nothing pinned
    cfg = load_config(None, ["--rollout.mode=async", "--rollout.is_correction=token", "--rollout.engine_gpus=1"])
    dist_ = Dist(rank=0, world_size=2, device=torch.device("cpu"))
    message = ("rollout.engine_gpus: expected empty on a machine without CUDA, got '1'" if not torch.cuda.is_available()
               else "rollout.engine_gpus: expected indices >= 2 (GPUs 0..1 hold the trainer ranks), got '1'")
    with pytest.raises(ConfigError) as e:
        engine_rollouts(cfg, dist_, policy=None, model_path="", train_ids=[], sampling=None, count=None, kind="hf",
                        max_len=0, cores=(), compile=False, resumed=None)
    assert str(e.value) == message
