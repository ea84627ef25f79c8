"""How long train.py and eval.py take to refuse a bad input, and what they print before the refusal.

    python bench/refusals.py                                  # every case, each with an empty model cache
    python bench/refusals.py --only "broken JSON" --repeats 3
    python bench/refusals.py --root OTHER_CHECKOUT --cache ~/.cache/pspo   # another commit, a built model

Each case is the command a user types (`python train.py --config configs/grpo.yaml` plus the bad
setting) with one mistake in it, run as a fresh process. With the default `--cache empty` each run gets
an empty $PSPO_CACHE, where `builtin:tiny` is built (a minute or more) before anything that needs the
model: a refusal that comes after that build takes minutes and leaves the model in the cache. The
table gives per case the exit code, the wall time (median over --repeats), the lines printed on stdout
and on stderr, whether a model was built, and the last stderr line. `bad value` fails in the config,
right after the imports: the floor every other case is measured against.
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LINE = '{"problem": "What is 1 + 1?", "answer": "2"}\n'

# name -> (script, overrides); {f}: the folder of bad inputs
CASES = {
    "bad value": ("train", ["--rollout.temperature=0"]),
    "missing train file": ("train", ["--data.train={f}/none.jsonl"]),
    "missing eval file": ("train", ["--data.eval={f}/none.jsonl"]),
    "empty file": ("train", ["--data.train={f}/empty.jsonl"]),
    "broken JSON line": ("train", ["--data.train={f}/broken.jsonl"]),
    "non-UTF-8 file": ("train", ["--data.train={f}/latin1.jsonl"]),
    "CSV file": ("train", ["--data.train={f}/data.csv"]),
    "broken parquet": ("train", ["--data.train={f}/broken.parquet"]),
    "folder as data": ("train", ["--data.train={f}/empty_folder"]),
    "missing eval split": ("train", ["--data.eval_split=validation"]),
    "no problem field": ("train", ["--data.train={f}/question.jsonl"]),
    "rows left out, then a missing eval file": ("train", ["--data.train={f}/some_bad_golds.jsonl",
                                                          "--data.eval={f}/none.jsonl"]),
    "PPS batch above the rows": ("train", ["--pps.enabled=true", "--train.prompts_per_step=12",
                                           "--data.max_train_examples=8"]),
    "PRM folder missing": ("train", ["--reward.prm=0.5", "--prm.model={f}/nowhere"]),
    "ERS without a group baseline": ("train", ["--algo.advantage=reinforce_pp", "--ers.enabled=true"]),
    "output dir is a file": ("train", ["--train.output_dir={f}/a_file"]),
    "output dir under a file": ("train", ["--train.output_dir={f}/a_file/run"]),
    "resume path missing": ("train", ["--train.resume={f}/nowhere/checkpoint-1"]),
    "resume not a checkpoint": ("train", ["--train.resume={f}/empty_folder"]),
    "LoRA targets' syntax": ("train", ["--model.lora.rank=4", "--model.lora.target_modules=q_proj;v_proj"]),
    "eval.py: missing eval file": ("eval", ["--data.eval={f}/none.jsonl"]),
    "eval.py: missing eval split": ("eval", ["--data.eval_split=validation"]),
    "eval.py: broken JSON line": ("eval", ["--data.eval={f}/broken.jsonl"]),
    "eval.py: CSV file": ("eval", ["--data.eval={f}/data.csv"]),
    "eval.py: missing benchmark file": ("eval", ["--benchmarks=math500={f}/none.jsonl"]),
    "eval.py: output under a file": ("eval", ["--eval.output={f}/a_file/out.json"]),
}


def bad_inputs(folder: str) -> None:
    """The files and folders the cases point at."""
    files = {"empty.jsonl": b"", "broken.jsonl": (LINE + LINE + '{"problem": "3+3" "answer": "6"}\n').encode(),
             "latin1.jsonl": LINE.encode() + b'{"problem": "caf\xe9?", "answer": "3"}\n',
             "data.csv": b"problem,answer\n1+1,2\n", "broken.parquet": b"not parquet",
             "question.jsonl": b'{"question": "1+1", "answer": "2"}\n',
             "some_bad_golds.jsonl": (LINE + '{"problem": "q", "answer": ""}\n').encode(), "a_file": b"x"}
    for name, content in files.items():
        with open(os.path.join(folder, name), "wb") as f:
            f.write(content)
    os.makedirs(os.path.join(folder, "empty_folder"))


def run_case(root: str, script: str, overrides: list[str], folder: str, cache: str) -> dict:
    """One refusal in a fresh process: its exit code, seconds, stdout and stderr lines, whether it built."""
    own_cache = cache == "empty"
    cache_dir = tempfile.mkdtemp(prefix="cache-", dir=folder) if own_cache else cache
    out = tempfile.mkdtemp(prefix="out-", dir=folder)
    run = [f"--train.output_dir={out}/run"] if script == "train" else []
    cmd = [sys.executable, f"{script}.py", "--config", "configs/grpo.yaml", *run, "--train.progress=false",
           "--rollout.engine=hf", *[o.format(f=folder) for o in overrides]]
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=root, env={**os.environ, "PSPO_CACHE": cache_dir}, capture_output=True,
                          text=True)
    seconds = time.perf_counter() - start
    built = bool(os.listdir(cache_dir)) if own_cache else None
    if own_cache:
        shutil.rmtree(cache_dir)
    shutil.rmtree(out)
    err = proc.stderr.strip().splitlines()
    return {"exit": proc.returncode, "seconds": seconds, "stdout": len(proc.stdout.strip().splitlines()),
            "stderr": len(err), "built": built, "last": err[-1] if err else ""}


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", default=ROOT, help="the checkout whose train.py / eval.py run (default: this one)")
    ap.add_argument("--cache", default="empty", help="$PSPO_CACHE: 'empty' (a new empty folder per run) or a path")
    ap.add_argument("--only", nargs="*", default=[], help="the cases whose name contains one of these")
    ap.add_argument("--repeats", type=int, default=1, help="runs per case; the table gives the median time")
    args = ap.parse_args(argv)
    cases = {name: case for name, case in CASES.items() if not args.only or any(o in name for o in args.only)}
    if not cases:
        print(f"error: --only: no case matches {args.only}; the cases: {', '.join(CASES)}", file=sys.stderr)
        return 2
    print(f"root {args.root}, cache {args.cache}, {args.repeats} run(s) per case, median seconds\n")
    print("| case | exit | seconds | stdout lines | stderr lines | model built | stderr's last line |")
    print("|---|---|---|---|---|---|---|")
    folder = tempfile.mkdtemp(prefix="pspo-refusals-")
    try:
        bad_inputs(folder)
        for name, (script, overrides) in cases.items():
            runs = [run_case(args.root, script, overrides, folder, args.cache) for _ in range(args.repeats)]
            r = runs[-1]
            built = "-" if r["built"] is None else "yes" if r["built"] else "no"
            last = r["last"].replace(folder, "IN").replace("|", "\\|")[:120]
            print(f"| {name} | {r['exit']} | {statistics.median(x['seconds'] for x in runs):.1f} | {r['stdout']} | "
                  f"{r['stderr']} | {built} | {last} |", flush=True)
    finally:
        shutil.rmtree(folder)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
