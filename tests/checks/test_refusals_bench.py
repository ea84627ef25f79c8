"""bench/refusals.py: one case's table row (a real train.py run with an empty model cache), and its
refusal of an --only that matches no case."""
import importlib.util
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
spec = importlib.util.spec_from_file_location("refusals", os.path.join(ROOT, "bench", "refusals.py"))
refusals = importlib.util.module_from_spec(spec)
spec.loader.exec_module(refusals)


@pytest.mark.slow
def test_a_case_is_one_row_of_the_table(capsys):
    assert refusals.main(["--only", "missing train file"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| missing")]
    # exit 2, seconds, nothing on stdout, one stderr line, no model built in the empty cache
    assert len(rows) == 1 and re.fullmatch(r"\| missing train file \| 2 \| \d+\.\d \| 0 \| 1 \| no \| "
                                           r"error: IN/none.jsonl: file not found \|", rows[0]), rows


def test_an_only_that_matches_nothing_is_one_line_and_exit_2(capsys):
    assert refusals.main(["--only", "no such case"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --only: no case matches ['no such case']; the cases: bad value")
