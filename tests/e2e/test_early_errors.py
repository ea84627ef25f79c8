"""A mistake is found before anything slow: every input train.py and eval.py can check without a model
(the data files and splits, the output folder or file, the checkpoint to resume, the engine, PPS's
batch, the PRM's folder, the settings) stops the run before a model is built or loaded, with one line
naming the file or key and nothing printed before it.

Each case runs twice. As `python train.py ...` / `python eval.py ...` (`test_the_command_prints_one_line_
and_exits_2`): the scripts' own `__main__`, in a process of their own (conftest's run_commands: forked,
after one interpreter imported them once: seconds for every case, not an import of torch each), with
model.name_or_path a folder that does not exist, so that a check made after the model is loaded fails
with the model's line instead. And in this process (conftest's run_main) with the default `builtin:tiny` and an
empty model cache ($PSPO_CACHE), where its builder is replaced by one that fails the test: a check that came after
the build fails at once. Three cases also run as the scripts with the real builder and an empty cache, forked
too (`test_the_script_prints_one_line_and_exits_2_with_the_cache_empty`): nothing is built.
"""
import json
import os

import pytest
import torch

from pspo.offline import tiny
from pspo.training.config import ConfigError
from pspo.training.run import check_writable

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LINE = '{"problem": "What is 1 + 1?", "answer": "2"}\n'


def bad_inputs(f) -> None:
    """The bad inputs, in folder `f`: data files, a file where a folder is expected, checkpoints that
    cannot resume."""
    (f / "empty.jsonl").write_text("")
    (f / "broken.jsonl").write_text(LINE + LINE + '{"problem": "What is 3 + 3?" "answer": "6"}\n')
    (f / "latin1.jsonl").write_bytes(LINE.encode() + b'{"problem": "caf\xe9?", "answer": "3"}\n')
    (f / "data.csv").write_text("problem,answer\n1+1,2\n")
    (f / "broken.parquet").write_text("not parquet")
    (f / "question.jsonl").write_text('{"question": "What is 1 + 1?", "answer": "2"}\n')
    (f / "bad_golds.jsonl").write_text('{"problem": "q", "answer": "\\\\frac{2}{"}\n' * 2)
    (f / "some_bad_golds.jsonl").write_text(LINE + '{"problem": "q", "answer": ""}\n')   # skipped: reported
    (f / "folder.jsonl").mkdir()
    (f / "empty_folder").mkdir()
    (f / "a_file").write_text("x")
    (f / "not_a_checkpoint").mkdir()
    state = {"step": 1, "scheduler": {}, "sampler": {}, "advantage": "grpo", "sampler_mode": "uniform", "ers": None}
    for name, changes in (("corrupt", None), ("reinforce_pp", {"advantage": "reinforce_pp"}),
                          ("pps", {"sampler_mode": "paper"}), ("lora", {})):
        ckpt = f / name / "checkpoint-1"
        ckpt.mkdir(parents=True)
        if changes is None:
            (ckpt / "trainer_state.pt").write_bytes(b"garbage")
        else:
            torch.save({**state, **changes}, ckpt / "trainer_state.pt")
    (f / "lora" / "checkpoint-1" / "adapter_config.json").write_text(
        json.dumps({"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"]}))


@pytest.fixture
def files(tmp_path):
    f = tmp_path / "in"
    f.mkdir()
    bad_inputs(f)
    return f


ADAPTER_OF = "adapters: resume with the settings it was trained with"
SAME = "; resume with the same setting"
# train.py: (overrides, the line after "error: "); {f} is the folder of `files`
TRAIN = [
    (["--data.train={f}/none.jsonl"], "{f}/none.jsonl: file not found"),
    (["--data.eval={f}/none.jsonl"], "{f}/none.jsonl: file not found"),
    (["--data.train={f}/empty.jsonl"], "{f}/empty.jsonl: the file is empty"),
    # line 3 '{"problem": "What is 3 + 3?" "answer": "6"}': 28 characters, a space, then '"' where ',' belongs
    (["--data.train={f}/broken.jsonl"], "{f}/broken.jsonl:3: not valid JSON (Expecting ',' delimiter, column 30); "
                                        "expected one JSON object per line"),
    # LINE is 45 bytes, then '{"problem": "caf' 16: the Latin-1 byte of "é" is byte 61 (from 0), on line 2
    (["--data.train={f}/latin1.jsonl"], "{f}/latin1.jsonl: not valid UTF-8 at byte 61 (line 2): byte 0xe9, invalid "
                                        "continuation byte; save the file as UTF-8"),
    (["--data.train={f}/data.csv"], "{f}/data.csv: expected a .jsonl, .json, .parquet file or a hub dataset name"),
    (["--data.train={f}/broken.parquet"], "{f}/broken.parquet: cannot read it as parquet (ArrowInvalid: Parquet "
                                          "magic bytes not found in footer."),
    (["--data.train={f}/folder.jsonl"], "{f}/folder.jsonl: a folder, expected a .jsonl, .json, .parquet file"),
    (["--data.train={f}/empty_folder"], "{f}/empty_folder: cannot load split 'train' (EmptyDatasetError: The "
                                        "directory at {f}/empty_folder doesn't contain any data files)"),
    (["--data.train={f}/nowhere"], "{f}/nowhere: no such file or folder, expected a .jsonl, .json, .parquet file, "
                                   "a folder of them or a hub dataset name"),
    (["--data.eval_split=validation"], "builtin:arithmetic: unknown split 'validation', expected one of train, test"),
    (["--data.train={f}/question.jsonl"], "{f}/question.jsonl: no field 'problem'; the fields are: question, answer"),
    (["--data.eval={f}/bad_golds.jsonl"], "data.eval {f}/bad_golds.jsonl: no rows left of 2 (2 without a usable "
                                          "gold answer)"),
    (["--data.train={f}/bad_golds.jsonl", "--data.bad_gold=error"],
     "data.train {f}/bad_golds.jsonl: row 0: gold answer '\\frac{{2}}{{' does not parse with math-verify "
     "(data.bad_gold=error; 'skip' leaves such rows out)"),
    # the train set's left-out row is reported only once every input passed: here nothing comes before the line
    (["--data.train={f}/some_bad_golds.jsonl", "--data.eval={f}/none.jsonl"], "{f}/none.jsonl: file not found"),
    (["--pps.enabled=true", "--train.prompts_per_step=12", "--data.max_train_examples=8"],
     "train.prompts_per_step: PPS draws 12 prompts per step (distinct), builtin:arithmetic has 8"),
    (["--reward.prm=0.5", "--prm.model={f}/absent"],
     "prm.model: '{f}/absent': no such folder (expected a sequence classifier's folder or hub id)"),
    (["--data.train_people=2,3"], "builtin:arithmetic: data.train_people keeps K&K puzzles by their number of "
                                  "people, but row 0's gold is not a K&K answer"),
    (["--train.output_dir={f}/a_file"], "train.output_dir: '{f}/a_file' is a file, expected a folder"),
    (["--train.output_dir={f}/a_file/run"], "train.output_dir: cannot create '{f}/a_file/run': '{f}/a_file' is a "
                                            "file, expected a folder"),
    (["--train.resume=/nonexistent/checkpoint-1"],
     "train.resume: '/nonexistent/checkpoint-1' is not a checkpoint folder (no trainer_state.pt)"),
    (["--train.resume={f}/not_a_checkpoint"],
     "train.resume: '{f}/not_a_checkpoint' is not a checkpoint folder (no trainer_state.pt)"),
    (["--train.resume={f}/corrupt/checkpoint-1"], "train.resume: cannot read {f}/corrupt/checkpoint-1/trainer_state.pt "
                                                  "(UnpicklingError: "),
    (["--train.output_dir={f}/reinforce_pp", "--train.resume=auto"],
     "algo.advantage: the checkpoint was trained with algo.advantage=reinforce_pp, this run has algo.advantage=grpo"
     + SAME),
    (["--train.resume={f}/pps/checkpoint-1"], "pps.enabled: the checkpoint was trained with pps.enabled=true, this "
                                              "run has pps.enabled=false" + SAME),
    (["--train.resume={f}/lora/checkpoint-1"], "train.resume: {f}/lora/checkpoint-1 holds a LoRA adapter; "
                                               "model.lora.rank 0 trains without " + ADAPTER_OF),
    (["--train.resume={f}/lora/checkpoint-1", "--model.lora.rank=4"],
     "model.lora.rank: the checkpoint {f}/lora/checkpoint-1 was trained with 8, this run has 4" + SAME),
    (["--model.lora.rank=4", "--model.lora.target_modules=q_proj;v_proj"],
     "model.lora.target_modules: expected all-linear or module names separated by commas (q_proj,v_proj), got "
     "'q_proj;v_proj'"),
    (["--rollout.temperature=0"], "rollout.temperature: expected > 0, got 0.0"),
    # the methods' settings
    (["--algo.advantage=rloo", "--rollout.num_generations=1"],
     "rollout.num_generations: expected G >= 2 (a group needs two samples; G = 1 is algo.advantage=single_stream's "
     "alone), got 1"),
    (["--algo.advantage=reinforce_pp", "--ers.enabled=true"],
     "ers.enabled: expected false with algo.advantage=reinforce_pp (ERS smooths a group baseline's mean and std: "),
    (["--rollout.is_correction=mask"],
     "rollout.is_correction: expected none | token | sequence | token_mask | sequence_mask | geo_mask, got 'mask'"),
    (["--rollout.is_correction=token_mask", "--rollout.is_floor=1.5"],
     "rollout.is_floor: expected a number in [0, 1) (C_low, the lower bound of π_old/π_engine), got 1.5"),
]
# eval.py
EVAL = [
    (["--data.eval={f}/none.jsonl"], "{f}/none.jsonl: file not found"),
    (["--data.eval_split=validation"], "builtin:arithmetic: unknown split 'validation', expected one of train, test"),
    (["--data.eval={f}/broken.jsonl"], "{f}/broken.jsonl:3: not valid JSON (Expecting ',' delimiter, column 30); "
                                       "expected one JSON object per line"),
    (["--data.eval={f}/data.csv"], "{f}/data.csv: expected a .jsonl, .json, .parquet file or a hub dataset name"),
    (["--data.eval={f}/empty_folder"], "{f}/empty_folder: cannot load split 'test' (EmptyDatasetError: The "
                                       "directory at {f}/empty_folder doesn't contain any data files)"),
    (["--data.eval={f}/bad_golds.jsonl"], "data.eval {f}/bad_golds.jsonl: no rows left of 2 (2 without a usable "
                                          "gold answer)"),
    (["--benchmarks=math500={f}/none.jsonl"], "{f}/none.jsonl: file not found"),
    (["--benchmarks=math5000"], "--benchmarks: unknown benchmark 'math5000'; expected "),
    (["--data.eval="], "data.eval: expected a dataset to evaluate on (or --benchmarks=...), got ''"),
    (["--eval.output={f}/a_file/out.json"], "eval.output: cannot create '{f}/a_file/out.json': '{f}/a_file' is a "
                                            "file, expected a folder"),
    (["--eval.output={f}/empty_folder"], "eval.output: '{f}/empty_folder' is a folder, expected a file"),
]


def arguments(script, out, overrides):
    run = [f"--train.output_dir={out}"] if script == "train" else []
    return ["--config", "configs/grpo.yaml", *run, "--train.progress=false", "--rollout.engine=hf", *overrides]


@pytest.fixture
def no_build(tmp_path, monkeypatch):
    """An empty model cache, and a tiny-model builder that fails the test: nothing may be built or loaded."""
    cache = tmp_path / "cache"
    cache.mkdir()
    monkeypatch.setenv("PSPO_CACHE", str(cache))

    def built(*args, **kwargs):
        raise AssertionError("a model was built before the mistake was found")
    monkeypatch.setattr(tiny, "ensure_tiny_model", built)
    return cache


@pytest.mark.parametrize("script, overrides, message", [("train", *case) for case in TRAIN]
                         + [("eval", *case) for case in EVAL])
def test_a_mistake_is_found_before_a_model_is_built(files, no_build, tmp_path, run_main, capsys, script, overrides,
                                                    message):
    # the error whose message the script prints after "error: ", nothing printed before it, no folder made
    import train
    out = tmp_path / "run"
    overrides = [o.format(f=files) for o in overrides]
    with pytest.raises((ConfigError, train.DataError, train.CheckpointError, train.LoraError)) as e:
        run_main(script, *arguments(script, out, overrides))
    assert str(e.value).startswith(message.format(f=files)) and "\n" not in str(e.value)
    assert capsys.readouterr() == ("", "")
    assert not out.exists() and os.listdir(no_build) == []


CASES = [("train", *case) for case in TRAIN] + [("eval", *case) for case in EVAL]
NO_MODEL = "no-model-here"           # model.name_or_path of the commands: loading it is refused with its own line


@pytest.fixture(scope="module")
def commands(tmp_path_factory, forked_commands):
    """Every case's command run once (conftest's run_commands, forked from a fresh interpreter): (results,
    files' folder, runs' folder, model cache)."""
    tmp = tmp_path_factory.mktemp("commands")
    f, runs, cache = tmp / "in", tmp / "runs", tmp / "cache"
    for folder in (f, runs, cache):
        folder.mkdir()
    bad_inputs(f)
    argvs = [[*arguments(script, runs / str(i), [o.format(f=f) for o in overrides]),
              f"--model.name_or_path={tmp / NO_MODEL}"] for i, (script, overrides, _) in enumerate(CASES)]
    results = forked_commands([[script, argv] for (script, _, _), argv in zip(CASES, argvs)], str(tmp),
                              env={**os.environ, "PSPO_CACHE": str(cache)})
    return results, f, runs, cache


@pytest.mark.slow
@pytest.mark.parametrize("case", range(len(CASES)), ids=[f"{s}:{' '.join(o)}" for s, o, _ in CASES])
def test_the_command_prints_one_line_and_exits_2(commands, case):
    # `python train.py|eval.py --config configs/grpo.yaml <the mistake>`: exit code 2, nothing on stdout, one
    # line on stderr naming the file or key; no run folder made, nothing built in the empty model cache
    results, f, runs, cache = commands
    script, _, message = CASES[case]
    r = results[case]
    lines = r["stderr"].splitlines()
    assert (r["exit"], r["stdout"], len(lines)) == (2, "", 1), r
    assert lines[0].startswith(f"error: {message.format(f=f)}"), lines[0]
    assert NO_MODEL not in lines[0]                   # the model was never loaded: its path is not the complaint
    assert not (runs / str(case)).exists() and os.listdir(cache) == []


# the real scripts with the real builder and the default builtin:tiny, its cache empty
WITH_THE_BUILDER = [
    ("train", ["--data.train={f}/none.jsonl"], TRAIN[0][1]),
    ("train", ["--data.train={f}/broken.jsonl"], TRAIN[3][1]),     # datasets' own report of it: not shown
    ("eval", ["--data.eval_split=validation"], EVAL[1][1]),
]
# `python -c WITH_CACHE CACHE SCRIPT ARGV...`: `python SCRIPT.py ARGV...` with PSPO_CACHE=CACHE, a new folder
WITH_CACHE = ("import os, runpy, sys; cache, script = sys.argv[1:3]; os.makedirs(cache); os.environ['PSPO_CACHE'] = "
              "cache; sys.argv = [script + '.py', *sys.argv[3:]]; runpy.run_path(script + '.py', run_name='__main__')")


@pytest.fixture(scope="module")
def with_the_builder(tmp_path_factory, forked_commands):
    """WITH_THE_BUILDER's commands, forked from one fresh interpreter (conftest's run_commands), each with an
    empty model cache of its own: (results, files' folder, runs' folder, caches' folder)."""
    tmp = tmp_path_factory.mktemp("builder")
    f, runs, caches = tmp / "in", tmp / "runs", tmp / "caches"
    for folder in (f, runs, caches):
        folder.mkdir()
    bad_inputs(f)
    commands = [[WITH_CACHE, [str(caches / str(i)), script,
                              *arguments(script, runs / str(i), [o.format(f=f) for o in overrides])]]
                for i, (script, overrides, _) in enumerate(WITH_THE_BUILDER)]
    return forked_commands(commands, str(tmp)), f, runs, caches


@pytest.mark.slow
@pytest.mark.parametrize("case", range(len(WITH_THE_BUILDER)),
                         ids=[f"{s}:{' '.join(o)}" for s, o, _ in WITH_THE_BUILDER])
def test_the_script_prints_one_line_and_exits_2_with_the_cache_empty(with_the_builder, case):
    # the real scripts, with the real builder: exit code 2, nothing on stdout, one line on stderr, and
    # the empty cache still empty (no build started)
    results, f, runs, caches = with_the_builder
    _, _, message = WITH_THE_BUILDER[case]
    r = results[case]
    assert (r["exit"], r["stdout"], r["stderr"].splitlines()) == (2, "", [f"error: {message.format(f=f)}"]), r
    assert os.listdir(caches / str(case)) == [] and not (runs / str(case)).exists()


def test_check_writable_names_the_key_and_what_it_expected(tmp_path, monkeypatch):
    (tmp_path / "a_file").write_text("x")
    check_writable(str(tmp_path / "new" / "deeper"), "train.output_dir", folder=True)    # made with its parents
    check_writable(str(tmp_path), "train.output_dir", folder=True)                     # an existing folder
    check_writable(str(tmp_path / "out.json"), "eval.output", folder=False)            # a new file
    check_writable(str(tmp_path / "a_file"), "eval.output", folder=False)              # overwritten
    with pytest.raises(ConfigError, match=r"^eval.output: cannot create '.*/new/out.json': '.*/new' does not "
                                          r"exist, expected a folder$"):
        check_writable(str(tmp_path / "new" / "out.json"), "eval.output", folder=False)  # eval.py makes no folder
    # a folder this process may not write in (as root, os.access says yes to everything: a stand-in for it)
    monkeypatch.setattr(os, "access", lambda path, mode: False)
    with pytest.raises(ConfigError, match=rf"^train.output_dir: cannot create '{tmp_path}/run': permission denied "
                                          rf"in '{tmp_path}'$"):
        check_writable(str(tmp_path / "run"), "train.output_dir", folder=True)
    with pytest.raises(ConfigError, match=rf"^train.output_dir: '{tmp_path}': permission denied, expected a folder "
                                          "this process can write$"):
        check_writable(str(tmp_path), "train.output_dir", folder=True)
