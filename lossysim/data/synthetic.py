"""The embedded synthetic NLI task: offline, learnable, and never passed off as MNLI."""
from __future__ import annotations

import random

from .examples import NUM_LABELS, Examples

SYNTHETIC_VERSION = 2                  # part of the cache key and of the generator seed
SYNTHETIC_SIZES = {"train": 50_000, "validation_matched": 5_000, "validation_mismatched": 5_000}
# The task: quantities. The premise gives a count with a tolerance ("Alice has about five books."),
# the hypothesis a lower bound ("Alice has more than 3 books."). Entailment: every count the
# premise allows satisfies the hypothesis; contradiction: none does; neutral: some do, some not.
# The label depends on both sides (premise-only or hypothesis-only guessing tops out near 60%,
# see synthetic_cue_accuracy) yet is a threshold of an additive score (count - bound -/+
# tolerance), which a 2-layer GPT-2 learns in a few hundred steps. Tasks needing exact token
# matching (is the hypothesis's place the premise's place?) stalled at chance for that long.
# Premise counts are words, hypothesis bounds digits: the roles are told by the tokens.
_SYN_TOLERANCE = {"exactly": 0, "about": 1, "roughly": 2}      # premise: count within +-tolerance
_SYN_BOUNDS = {"more than": 0, "at least": 1}                  # hypothesis: count > bound - shift
_SYN_COUNT_WORDS = ("one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten",
                    "eleven", "twelve")
_SYN_COUNTS = range(1, 13)             # premise counts (as words) and hypothesis bounds (as digits)
_SYN_NAMES = ("Alice", "Bob", "Carol", "Dave", "Erin", "Frank", "Grace", "Heidi", "Ivan", "Judy",
              "Ken", "Laura", "Mike", "Nina", "Oscar", "Peggy", "Quinn", "Rosa", "Sam", "Tina")
_SYN_THINGS = ("book", "apple", "coin", "cat", "pen", "shirt", "ticket", "stamp", "cup", "key", "map", "lamp")
_SYN_PLACES = ("kitchen", "garden", "library", "office", "museum", "school", "bakery", "garage")
# Like MNLI's genres: train and matched share sentence frames, mismatched premises use other
# frames around the same phrases (same vocabulary, different layout).
# Four training frames (not one) so the model finds the count by its words, not its position.
_SYN_TRAIN_FRAMES = ("{a} has {tol} {n} {t}.", "In the {p}, {a} keeps {tol} {n} {t}.",
                     "{a} stores {tol} {n} {t} at the {p}.", "At home {a} has {tol} {n} {t} in the {p}.")
_SYN_PREMISES = {
    "train": _SYN_TRAIN_FRAMES,
    "validation_matched": _SYN_TRAIN_FRAMES,
    "validation_mismatched": ("{a} keeps {tol} {n} {t} in the {p}.", "{a}'s {p} holds {tol} {n} {t}."),
}
_SYN_HYPOTHESES = ("{a} has {rel} {m} {t}.", "{a} owns {rel} {m} {t}.")


def _nli_label(count: int, tolerance: int, bound: int, shift: int) -> int:
    """Premise allows [count - tol, count + tol]; hypothesis claims > bound - shift."""
    low, high, threshold = count - tolerance, count + tolerance, bound - shift
    return 0 if low > threshold else 2 if high <= threshold else 1


def _synthetic_cases() -> list[list[tuple]]:
    """Every (tolerance word, count, bound phrase, bound), grouped by label (sample label first)."""
    by_label = [[], [], []]
    for tol, tolerance in _SYN_TOLERANCE.items():
        for rel, shift in _SYN_BOUNDS.items():
            for count in _SYN_COUNTS:
                for bound in _SYN_COUNTS:
                    by_label[_nli_label(count, tolerance, bound, shift)].append((tol, count, rel, bound))
    return by_label


def synthetic_cue_accuracy() -> dict[str, float]:
    """Best accuracy from the premise alone / the hypothesis alone (Bayes, exact): the task's floor
    for "did not compare the two"."""
    by_label = _synthetic_cases()
    def best(side) -> float:
        mass: dict = {}
        for label, cases in enumerate(by_label):
            for case in cases:
                key = side(case)
                mass.setdefault(key, [0.0] * NUM_LABELS)[label] += 1 / (NUM_LABELS * len(cases))
        return sum(max(v) for v in mass.values())
    return {"premise_only": best(lambda c: c[:2]), "hypothesis_only": best(lambda c: c[2:])}


def _plural(thing: str, count: int) -> str:
    return thing if count == 1 else thing + "s"


def synthetic_examples(split: str, n: int, seed: int) -> Examples:
    """``n`` examples of the synthetic NLI task, a pure function of (split, n, seed).

    Labels cycle 0, 1, 2 so any prefix is balanced; a larger ``n`` extends a smaller one.
    """
    rng = random.Random(f"lossysim-synthetic-nli/v{SYNTHETIC_VERSION}/{seed}/{split}")
    by_label = _synthetic_cases()
    out = Examples()
    for i in range(n):
        label = i % NUM_LABELS
        tol, count, rel, bound = rng.choice(by_label[label])
        slots = dict(a=rng.choice(_SYN_NAMES), t=rng.choice(_SYN_THINGS), p=rng.choice(_SYN_PLACES))
        thing = slots.pop("t")
        premise = rng.choice(_SYN_PREMISES[split]).format(tol=tol, n=_SYN_COUNT_WORDS[count - 1],
                                                          t=_plural(thing, count), **slots)
        hypothesis = rng.choice(_SYN_HYPOTHESES).format(rel=rel, m=bound, t=_plural(thing, bound), **slots)
        out.append(premise, hypothesis, label)
    return out
