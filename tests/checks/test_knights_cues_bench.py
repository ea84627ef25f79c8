"""bench/knights_cues.py: the surface-cue yardstick for K&K, on hand-made puzzles."""
import importlib.util
import os

from pspo.tasks.knights import Puzzle, builtin_knights
from pspo.tasks.knights_reward import knights_people

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
spec = importlib.util.spec_from_file_location("knights_cues", os.path.join(ROOT, "bench", "knights_cues.py"))
cues = importlib.util.module_from_spec(spec)
spec.loader.exec_module(cues)


def _p(statements, solution) -> Puzzle:
    return Puzzle(("Zoey", "Aaron"), tuple(statements), tuple(solution), (0, 0))


# train (fit only counts statements and roles, so these need not be consistent puzzles)
TRAIN = [_p([("or", (0, True), (1, False)), ("claim", (0, False))], [True, False]),   # A
         _p([("or", (0, True), (1, True)), ("claim", (0, True))], [True, True]),      # B
         _p([("and", (1, True), (0, True)), ("claim", (0, False))], [False, True])]   # C
TEST = [_p([("or", (0, True), (1, True)), ("claim", (0, False))], [True, True]),      # T1
        _p([("and", (1, False), (0, True)), ("claim", (0, True))], [False, True]),    # T2
        _p([("and", (1, True), (0, False)), ("or", (1, True), (0, True))], [False, True])]   # T3


def test_cue_shapes_read_the_speakers_own_statement():
    # C's person 0 says "Aaron is a knight and Zoey is a knight": first claim not about self, knight
    assert cues.cue(TRAIN[2], 0, "op") == ("and", False, True)
    assert cues.cue(TRAIN[2], 0, "full") == ("and", (False, True), (True, True))
    assert cues.cue(TRAIN[0], 1, "full") == ("claim", (False, False))


def test_fit_takes_the_majority_role_per_cue_and_ties_go_to_knight():
    # op cues: A0, B0 ("or", T, T) -> knight twice; A1 ("claim", F, F) knave + C1 knight -> tie -> knight;
    # B1 ("claim", F, T) -> knight; C0 ("and", F, T) -> knave
    assert cues.fit(TRAIN, "op") == {("or", True, True): True, ("claim", False, False): True,
                                     ("claim", False, True): True, ("and", False, True): False}


def test_exact_match_needs_every_person_right_and_unseen_cues_say_knight():
    # op: T1 (knight, knight) right; T2 person 0's ("and", F, F) is unseen -> knight, but is a knave: wrong;
    # T3 ("and", F, T) -> knave, ("or", T, T) -> knight: right.  2 of 3
    assert cues.exact_match(cues.fit(TRAIN, "op"), TEST, "op") == 2 / 3
    # full: T1 person 0 = B0's shape -> knight, person 1 = the tied claim -> knight: right; T2 wrong as
    # above; T3 person 0's ("and", (F, T), (T, F)) differs from C0's ("and", (F, T), (T, T)) -> unseen ->
    # knight, wrong.  1 of 3
    assert cues.exact_match(cues.fit(TRAIN, "full"), TEST, "full") == 1 / 3


def test_splits_are_builtin_knights_streams():
    train, test = cues.splits(3, test_per_size=4, train_per_size=6)
    assert len(train) == 6 and len(test) == 4
    for split, mine in (("train", train), ("test", test)):
        rows = builtin_knights(split, test_per_size=4, train_per_size=6)
        assert [p.example() for p in mine] == [ex for ex in rows if knights_people(ex.answer) == 3]
