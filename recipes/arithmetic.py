"""Templated arithmetic word problems with step-by-step solutions ending in "The answer is N".

Seeded and deterministic: `generate_problems(n, seed, max_operand=M)` gives the same list for the same
arguments. The held-out split is `heldout_problems(max_operand=M)` (seed 20261122); training streams skip any
question of the held-out splits of every limit in `HELDOUT_LIMITS` and of their own (`heldout_questions`): a
question of the operand-20 split can also be drawn at limit 50. `max_operand` sets the difficulty: additions of
two numbers in [2, M], subtractions from [10, M + 10], one-digit products, two-step problems with operands up to
0.6 M. Held-out questions differ from training questions; the arithmetic facts they use also occur in training
(this is a templated task).
"""

from __future__ import annotations

import random
import re

NAMES = ["Tom", "Anna", "Ben", "Lucy", "Sam", "Mia", "Leo", "Emma", "Max", "Zoe", "Omar", "Ivy"]
ITEMS = ["apples", "books", "coins", "pens", "cards", "stickers", "marbles", "shells", "stamps", "cookies"]
HELDOUT_SEED = 20261122
#: The operand limits of the held-out splits the bundled models are evaluated on (their stages train at 20 and 50).
HELDOUT_LIMITS = (20, 50)
ANSWER_RE = re.compile(r"The answer is (-?\d+)")


def _problem(rng: random.Random, max_operand: int) -> dict:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    kind = rng.choices(["add", "sub", "mul", "two_step"], weights=[3, 3, 2, 2])[0]
    if kind == "add":
        a, b = rng.randint(2, max_operand), rng.randint(2, max_operand)
        q = f"{name} has {a} {item}. {name} gets {b} more {item}. How many {item} does {name} have now?"
        s = f"{name} has {a} {item} and gets {b} more. {a} + {b} = {a + b}. The answer is {a + b}."
        ans = a + b
    elif kind == "sub":
        a = rng.randint(10, max_operand + 10)
        b = rng.randint(1, a - 1)
        q = f"{name} has {a} {item}. {name} gives away {b} {item}. How many {item} does {name} have left?"
        s = f"{name} has {a} {item} and gives away {b}. {a} - {b} = {a - b}. The answer is {a - b}."
        ans = a - b
    elif kind == "mul":
        a, b = rng.randint(2, 9), rng.randint(2, 9)
        q = f"{name} has {a} boxes. Each box holds {b} {item}. How many {item} does {name} have?"
        s = f"{name} has {a} boxes of {b} {item}. {a} * {b} = {a * b}. The answer is {a * b}."
        ans = a * b
    else:
        a, b = rng.randint(2, round(0.6 * max_operand)), rng.randint(2, round(0.6 * max_operand))
        c = rng.randint(1, a + b - 1)
        q = (f"{name} has {a} {item}. {name} gets {b} more {item} and then gives away {c}. "
             f"How many {item} does {name} have left?")
        s = f"{a} + {b} = {a + b}. {a + b} - {c} = {a + b - c}. The answer is {a + b - c}."
        ans = a + b - c
    return {"question": q, "solution": s, "answer": ans, "kind": kind}


def format_prompt(question: str) -> str:
    """The prompt the model sees: "Question: ...\\nAnswer:"."""
    return f"Question: {question}\nAnswer:"


def generate_problems(n: int, seed: int, exclude: set[str] | None = None, max_operand: int = 50) -> list[dict]:
    """`n` problems from `random.Random(seed)`, skipping questions in `exclude`."""
    rng, out = random.Random(seed), []
    while len(out) < n:
        p = _problem(rng, max_operand)
        if exclude and p["question"] in exclude:
            continue
        out.append(p)
    return out


def heldout_problems(n: int = 500, max_operand: int = 50) -> list[dict]:
    """The held-out evaluation split (never used for training)."""
    return generate_problems(n, HELDOUT_SEED, max_operand=max_operand)


def heldout_questions(*max_operands: int) -> set[str]:
    """The questions of the held-out splits of `max_operands` and of every limit in `HELDOUT_LIMITS`: what no
    training stream may contain (a split of a lower limit holds questions a higher limit can draw)."""
    return {p["question"] for limit in {*max_operands, *HELDOUT_LIMITS} for p in heldout_problems(max_operand=limit)}


def extract_answer(text: str) -> int | None:
    """The integer after the first "The answer is", or None."""
    m = ANSWER_RE.search(text)
    return int(m.group(1)) if m else None
