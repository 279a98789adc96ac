"""A seeded generator of GSM8K-format arithmetic word problems with known answers.

Hubs are not always reachable (CI, air-gapped clusters), so ``gsm8k`` defaults to these: a question, a worked
solution ending in ``#### <answer>`` (optionally with ``<<a+b=c>>`` annotations) and the answer. What each level
(:data:`DIFFICULTIES`) asks and keeps out of train (question text, what is computed:
:func:`composer_plugins.envs.steps.computation_key`, or numbers: :func:`column_numbers`), with the measured
overlaps: docs/envs.md, "Generator levels". The same ``(n, difficulty, split, seed)`` gives the same problems.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["DIFFICULTIES", "ArithProblem", "dropped_carry", "generate_problems", "resolve_difficulty"]

DIFFICULTIES: dict[str, int] = {
    "trivial": 0,
    "easy": 1,
    "medium": 2,
    "two_step": 3,
    "multi_step": 4,
    "hard": 5,
    "chain": 6,
    "columns": 7,
    "long_columns": 8,
}
#: The operand lengths of the column levels (both operands of a problem have the same length).
COLUMN_DIGITS: dict[int, tuple[int, ...]] = {7: (3,), 8: (3, 4, 5)}
#: The highest level.
MAX_LEVEL = max(DIFFICULTIES.values())
#: Levels split by computation (operands and operators), not question text.
COMPUTATION_SPLIT_LEVELS = frozenset({6})

_NAMES_SMALL = ["Tom", "Ann", "Ben", "Mia", "Sam", "Eva"]
_ITEMS_SMALL = ["apples", "books", "pens", "cards", "eggs", "balls"]
_NAMES = [
    *_NAMES_SMALL,
    "Liam",
    "Noah",
    "Olivia",
    "Emma",
    "Lucas",
    "Zoe",
    "Omar",
    "Priya",
    "Kenji",
    "Sofia",
    "Diego",
    "Aisha",
    "Leo",
    "Nora",
    "Ivan",
    "Grace",
]
_ITEMS = [
    *_ITEMS_SMALL,
    "stickers",
    "marbles",
    "cookies",
    "shells",
    "stamps",
    "pencils",
    "cupcakes",
    "beads",
    "toy cars",
    "oranges",
    "coins",
    "bottles",
]
_FRIENDS = ["her brother", "his sister", "a friend", "the teacher", "a neighbor", "the class"]
_HE = {"Tom", "Ben", "Sam", "Liam", "Noah", "Lucas", "Omar", "Kenji", "Diego", "Leo", "Ivan"}


def _pron(name: str) -> str:
    return "He" if name in _HE else "She"


def resolve_difficulty(difficulty: int | str) -> int:
    """Map a level name or number to 0..MAX_LEVEL."""
    if isinstance(difficulty, str):
        key = difficulty.strip().lower().replace("-", "_")
        if key.isdigit():
            difficulty = int(key)
        elif key in DIFFICULTIES:
            return DIFFICULTIES[key]
        else:
            raise ValueError(
                f"unknown difficulty {difficulty!r}; use 0-{MAX_LEVEL} or one of {', '.join(DIFFICULTIES)}"
            )
    d = int(difficulty)
    if not 0 <= d <= MAX_LEVEL:
        raise ValueError(f"difficulty must be between 0 and {MAX_LEVEL}, got {d}")
    return d


@dataclass(frozen=True)
class ArithProblem:
    """One generated problem."""

    question: str
    solution: str
    answer: int
    difficulty: int


def _calc(expr: str, value: int, annotate: bool) -> str:
    """``a + b = c`` or, annotated like GSM8K, ``a + b = <<a+b=c>>c``."""
    if annotate:
        return f"{expr} = <<{expr.replace(' ', '')}={value}>>{value}"
    return f"{expr} = {value}"


class _Story:
    """Builds a question and its solution one step at a time."""

    def __init__(self, rng: random.Random, annotate: bool, small: bool) -> None:
        self.rng = rng
        self.annotate = annotate
        self.name = rng.choice(_NAMES_SMALL if small else _NAMES)
        self.item = rng.choice(_ITEMS_SMALL if small else _ITEMS)
        self.he = _pron(self.name)
        self.q: list[str] = []
        self.s: list[str] = []
        self.value = 0

    def calc(self, expr: str, value: int) -> str:
        return _calc(expr, value, self.annotate)


def _step_add(st: _Story, lo: int, hi: int) -> None:
    x = st.rng.randint(lo, hi)
    verb = st.rng.choice(["buys", "finds", "gets"])
    st.q.append(f"{st.he} {verb} {x} more {st.item}.")
    new = st.value + x
    st.s.append(f"After that {st.name} has {st.calc(f'{st.value} + {x}', new)} {st.item}.")
    st.value = new


def _step_sub(st: _Story, lo: int, hi: int) -> None:
    if st.value < 2:
        return _step_add(st, lo, hi)
    x = st.rng.randint(1, min(st.value - 1, max(1, hi)))
    st.q.append(f"{st.he} gives {x} {st.item} to {st.rng.choice(_FRIENDS)}.")
    new = st.value - x
    st.s.append(f"After giving some away {st.name} has {st.calc(f'{st.value} - {x}', new)} {st.item}.")
    st.value = new


def _step_groups(st: _Story, lo: int, hi: int) -> None:
    k, m = st.rng.randint(2, 9), st.rng.randint(2, max(2, min(hi, 12)))
    box = st.rng.choice(["boxes", "bags", "packs"])
    st.q.append(f"{st.he} buys {k} {box} with {m} {st.item} in each.")
    got = k * m
    st.s.append(f"The {box} hold {st.calc(f'{k} * {m}', got)} {st.item}.")
    new = st.value + got
    st.s.append(f"Now {st.name} has {st.calc(f'{st.value} + {got}', new)} {st.item}.")
    st.value = new


def _step_times(st: _Story, lo: int, hi: int) -> None:
    k = st.rng.choice([2, 3]) if st.value > 50 else st.rng.randint(2, 4)
    word = {2: "doubles", 3: "triples", 4: "quadruples"}[k]
    st.q.append(f"Then {st.he.lower()} {word} the number of {st.item}.")
    new = st.value * k
    st.s.append(f"{st.name} now has {st.calc(f'{st.value} * {k}', new)} {st.item}.")
    st.value = new


def _step_percent(st: _Story, lo: int, hi: int) -> None:
    options = [p for p in (10, 20, 25, 50, 75) if st.value * p % 100 == 0 and st.value * p // 100 > 0]
    if not options:
        return _step_add(st, lo, hi)
    p = st.rng.choice(options)
    sold = st.value * p // 100
    st.q.append(f"{st.he} sells {p}% of the {st.item}.")
    st.s.append(f"{st.he} sells {st.calc(f'{st.value} * {p} / 100', sold)} {st.item}.")
    new = st.value - sold
    st.s.append(f"{st.he} keeps {st.calc(f'{st.value} - {sold}', new)} {st.item}.")
    st.value = new


_STEPS: dict[str, Callable[[_Story, int, int], None]] = {
    "add": _step_add,
    "sub": _step_sub,
    "groups": _step_groups,
    "times": _step_times,
    "percent": _step_percent,
}


def _how_many(st: _Story) -> str:
    return f"How many {st.item} does {st.name} have now?"


def _level01(rng: random.Random, difficulty: int, annotate: bool) -> ArithProblem:
    small = difficulty == 0
    lo, hi = (1, 9) if small else (1, 99)
    name = rng.choice(_NAMES_SMALL)
    item = rng.choice(_ITEMS_SMALL)
    he = _pron(name)
    a, b = rng.randint(lo, hi), rng.randint(lo, hi)
    c = a + b
    calc = _calc(f"{a} + {b}", c, annotate)
    templates = [
        (
            f"{name} has {a} {item}. {he} buys {b} more {item}. How many {item} does {name} have now?",
            f"{name} has {calc} {item} now.",
        ),
        (
            f"{name} had {a} {item}. {he} found {b} more {item}. How many {item} does {name} have in total?",
            f"In total {name} has {calc} {item}.",
        ),
        (
            f"There are {a} {item} in a basket. {name} puts {b} more {item} in the basket. "
            f"How many {item} are in the basket now?",
            f"The basket has {calc} {item} now.",
        ),
    ]
    q, s = templates[0] if small else rng.choice(templates)
    return ArithProblem(q, f"{s}\n#### {c}", c, difficulty)


def _level2(rng: random.Random, annotate: bool) -> ArithProblem:
    st = _Story(rng, annotate, small=False)
    op = rng.choice(["add", "sub", "times", "share"])
    st.value = rng.randint(2, 99)
    if op == "share":
        k, per = rng.randint(2, 9), rng.randint(1, 11)
        st.q.append(f"{st.name} has {k * per} {st.item}.")
        st.q.append(f"{st.he} shares them equally among {k} friends. How many {st.item} does each friend get?")
        st.s.append(f"Each friend gets {st.calc(f'{k * per} / {k}', per)} {st.item}.")
        return ArithProblem(" ".join(st.q), "\n".join(st.s) + f"\n#### {per}", per, 2)
    if op == "times":
        st.value = rng.randint(2, 30)
    st.q.append(f"{st.name} has {st.value} {st.item}.")
    _STEPS[op](st, 1, 99)
    st.q.append(_how_many(st))
    return ArithProblem(" ".join(st.q), "\n".join(st.s) + f"\n#### {st.value}", st.value, 2)


def _multi(rng: random.Random, difficulty: int, annotate: bool) -> ArithProblem:
    st = _Story(rng, annotate, small=False)
    if difficulty == 3:
        n_steps, ops, lo, hi, start = 2, ["add", "sub", "groups", "times"], 1, 40, (5, 60)
    elif difficulty == 4:
        n_steps, ops, lo, hi, start = 3, ["add", "sub", "groups", "times", "percent"], 1, 60, (10, 120)
    else:
        n_steps, ops, lo, hi, start = rng.randint(4, 5), ["add", "sub", "groups", "times", "percent"], 5, 250, (40, 500)
    st.value = rng.randint(*start)
    st.q.append(f"{st.name} has {st.value} {st.item}.")
    for _ in range(n_steps - (1 if difficulty >= 4 and rng.random() < 0.5 else 0)):
        _STEPS[rng.choice(ops)](st, lo, hi)
    if difficulty >= 4 and len(st.s) and rng.random() < 0.5:
        price = rng.randint(2, 9 if difficulty == 4 else 25)
        st.q.append(f"Each of the {st.item} is worth ${price}. How much money are all of {st.name}'s {st.item} worth?")
        total = st.value * price
        st.s.append(f"They are worth {st.calc(f'{st.value} * {price}', total)} dollars.")
        return ArithProblem(" ".join(st.q), "\n".join(st.s) + f"\n#### {total}", total, difficulty)
    st.q.append(_how_many(st))
    return ArithProblem(" ".join(st.q), "\n".join(st.s) + f"\n#### {st.value}", st.value, difficulty)


def _chain(rng: random.Random, annotate: bool) -> ArithProblem:
    """Level 6: ``a``, then two operations on the running quantity, one equation per line."""
    name, item = rng.choice(_NAMES_SMALL), rng.choice(_ITEMS_SMALL)
    he = _pron(name)
    value = rng.randint(1, 9)
    q = [f"{name} has {value} {item}."]
    s: list[str] = []
    for step in range(2):
        ops = ["add", "times"] if step == 0 else ["add", "sub"]
        if step == 0 and value >= 2:
            ops.append("sub")
        op = rng.choice(ops)
        if op == "sub" and value < 2:
            op = "add"  # nothing to give away
        if op == "add":
            x = rng.randint(1, 9)
            q.append(f"{he} {rng.choice(['buys', 'finds', 'gets'])} {x} more.")
            expr, new = f"{value} + {x}", value + x
        elif op == "sub":
            x = rng.randint(1, min(9, value - 1))
            q.append(f"{he} gives {x} away.")
            expr, new = f"{value} - {x}", value - x
        else:
            k = rng.randint(2, 4)
            q.append(f"Then {he.lower()} {({2: 'doubles', 3: 'triples', 4: 'quadruples'})[k]} them.")
            expr, new = f"{value} * {k}", value * k
        s.append(_calc(expr, new, annotate))
        value = new
    q.append(f"How many {item} does {name} have now?")
    return ArithProblem(" ".join(q), "\n".join(s) + f"\n#### {value}", value, 6)


def column_numbers(a: int, b: int) -> dict[str, tuple[int, ...]]:
    """The numbers adding ``a`` and ``b`` column by column involves, by role (docs/envs.md, "Generator levels")."""
    inter = tuple(a % 10**k + b % 10**k for k in range(2, len(str(max(a, b)))))
    return {"operands": (a, b), "intermediate": inter, "answer": (a + b,)}


def _columns(rng: random.Random, want: str, frac: float, level: int) -> ArithProblem:
    """``a + b`` (same length) with every number of the problem held out (test) or none (train)."""
    held = want == "test"
    lengths = COLUMN_DIGITS[level]
    digits = lengths[0] if len(lengths) == 1 else rng.choice(lengths)  # before the draw: test lengths as train's
    while True:
        a, b = (rng.choice(_held_pool(frac, held, digits)) for _ in range(2))
        rest = column_numbers(a, b)
        if all((split_of(f"n{n}", frac) == "test") == held for n in (*rest["intermediate"], *rest["answer"])):
            break
    lines, carry = [], 0
    for da, db in zip(reversed(str(a)), reversed(str(b)), strict=True):
        total = int(da) + int(db) + carry
        lines.append(f"{da}+{db}+{carry}={total}")
        carry = total // 10
    return ArithProblem(f"Add {a} and {b}.", "\n".join(lines) + f"\n#### {a + b}", a + b, level)


def dropped_carry(solution: str) -> str | None:
    """``solution`` (a column level's worked solution) with its final carry dropped from the answer, else ``None``.

    ``None`` when the last column does not carry, or when ``solution`` is not a column solution. The slip
    ``sft.slip_rate`` trains a warm start on: docs/training.md.
    """
    *lines, last = solution.rstrip("\n").split("\n")
    if not lines or not last.strip().startswith("#### "):
        return None
    cols = []
    for line in lines:
        left, eq, total = line.strip().partition("=")
        terms = left.split("+")
        if not eq or len(terms) != 3 or not all(t.isdigit() and len(t) == 1 for t in terms) or not total.isdigit():
            return None
        cols.append(int(total))
    answer = last.strip()[5:].strip()
    if cols[-1] < 10 or not answer.isdigit() or answer[0] != "1" or len(answer) != len(cols) + 1:
        return None
    return "\n".join(lines) + f"\n#### {answer[1:]}"


_POOLS: dict[tuple[float, bool, int], list[int]] = {}


def _held_pool(frac: float, held: bool, digits: int) -> list[int]:
    """The ``digits``-digit numbers the hash holds out (``held``) or leaves to train."""
    key = (frac, held, digits)
    if key not in _POOLS:
        span = range(10 ** (digits - 1), 10**digits)
        _POOLS[key] = [n for n in span if (split_of(f"n{n}", frac) == "test") == held]
    return _POOLS[key]


def _make(rng: random.Random, difficulty: int, annotate: bool) -> ArithProblem:
    if difficulty == 6:
        return _chain(rng, annotate)
    if difficulty <= 1:
        return _level01(rng, difficulty, annotate)
    if difficulty == 2:
        return _level2(rng, annotate)
    return _multi(rng, difficulty, annotate)


def split_of(key: str, test_fraction: float = 0.1) -> str:
    """``train`` or ``test``: a stable hash of ``key`` (the question text, or its computation at ``chain``) decides."""
    h = int.from_bytes(hashlib.sha1(key.encode()).digest()[:4], "big")
    return "test" if h % 1000 < int(test_fraction * 1000) else "train"


def generate_problems(
    n: int,
    difficulty: int | str = 1,
    seed: int = 0,
    split: str = "train",
    annotations: bool | None = None,
    test_fraction: float | None = None,
) -> list[ArithProblem]:
    """``n`` problems of ``difficulty`` for ``split``, deterministic in ``seed``.

    ``annotations`` adds GSM8K's ``<<a+b=c>>`` calculator annotations; by default only at
    difficulties 2-5 (the lowest levels and ``chain`` stay short so a tiny model can learn them).
    ``test_fraction`` (default 0.1, 0.2 at ``chain`` and ``columns``) is the share of keys assigned to test.
    """
    from composer_plugins.envs.steps import computation_key

    d = resolve_difficulty(difficulty)
    if split not in ("train", "test", "validation"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    want = "test" if split != "train" else "train"
    annotate = 2 <= d < 6 if annotations is None else annotations
    by_computation = d in COMPUTATION_SPLIT_LEVELS
    frac = (0.2 if by_computation or d in COLUMN_DIGITS else 0.1) if test_fraction is None else float(test_fraction)
    rng = random.Random(f"arith|{d}|{want}|{seed}")
    out: list[ArithProblem] = []
    seen: set[str] = set()
    attempts = 0
    while len(out) < n:
        attempts += 1
        if d in COLUMN_DIGITS:  # drawn for the split: no hash to check
            p = _columns(rng, want, frac, d)
        else:
            p = _make(rng, d, annotate)
            key = computation_key(p.solution) if by_computation else p.question
            if split_of(key, frac) != want:
                continue
        unique = key if by_computation and want == "test" else p.question
        if unique in seen and attempts < 50 * (n + 10):
            continue
        seen.add(unique)
        out.append(p)
    return out
