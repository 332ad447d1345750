"""Built-in rewards: an answer *extractor* and a *scorer*, both named.

A real model rarely answers with the bare answer ("The answer is 42.", "... \\boxed{42}",
"<answer>42</answer>"), so each built-in first extracts the answer the way its task family
expects, then scores the extracted text against ``item['answer']``. Nothing extracted scores 0.

Extractors (``reward.extract``; ``auto`` picks the family's chain below):
    none         the completion as it is (stripped)
    answer_tag   the last ``<answer>...</answer>`` (reasoning-gym's convention and its prompts)
    boxed        the last ``\\boxed{...}`` (math)
    gsm8k        what follows the last ``####`` (GSM8K's solution format)
    last_number  the last number in the text
A chain tries its extractors in order and takes the first that finds something.

The extracted answer travels with each sample to the dashboard's trajectory view.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from training_core.data.synthetic import arithmetic_score

NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")
BOXED = re.compile(r"\\boxed\{((?:[^{}]|\{[^{}]*\})*)\}")
ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.S)

Extractor = Callable[[str], "str | None"]


def extract_none(completion: str) -> str | None:
    return completion.strip()


def extract_answer_tag(completion: str) -> str | None:
    found = ANSWER_TAG.findall(completion)
    return found[-1].strip() if found else None


def extract_boxed(completion: str) -> str | None:
    found = BOXED.findall(completion)
    return found[-1].strip() if found else None


def extract_gsm8k(completion: str) -> str | None:
    if "####" not in completion:
        return None
    rest = completion.rsplit("####", 1)[-1].strip()
    return rest.split()[0].rstrip(".") if rest else None


def extract_last_number(completion: str) -> str | None:
    numbers = NUMBER.findall(completion)
    return numbers[-1].rstrip(".") if numbers else None


EXTRACTORS: dict[str, Extractor] = {
    "none": extract_none,
    "answer_tag": extract_answer_tag,
    "boxed": extract_boxed,
    "gsm8k": extract_gsm8k,
    "last_number": extract_last_number,
}
EXTRACT_CHOICES = ("auto", *EXTRACTORS)


def _to_number(text: str) -> float | None:
    try:
        return float(text.replace(",", "").strip())
    except ValueError:
        return None


# ---- scorers: (extracted answer, item) -> reward ---------------------------------------------


def exact_match(answer: str, item: dict[str, Any]) -> float:
    return 1.0 if answer.strip() == str(item["answer"]).strip() else 0.0


def numeric_match(answer: str, item: dict[str, Any], rel_tol: float = 1e-6) -> float:
    gold = _to_number(str(item["answer"]))
    value = _to_number(answer)
    if value is None or gold is None:
        return 0.0
    return 1.0 if abs(value - gold) <= rel_tol * max(1.0, abs(gold)) else 0.0


def math_answer(answer: str, item: dict[str, Any]) -> float:
    """Symbolic equivalence with math-verify (fractions, LaTeX), numeric fallback."""
    from math_verify import parse, verify

    def latex(text: str) -> str:
        return text if "$" in text or "\\" in text else f"${text}$"

    gold, pred = parse(latex(str(item["answer"]))), parse(latex(answer))
    try:
        if gold and pred and verify(gold, pred):
            return 1.0
    except Exception:  # math-verify raises on exotic input: fall back to numbers
        pass
    return numeric_match(answer, item)


def reasoning_gym_answer(answer: str, item: dict[str, Any]) -> float:
    """The generator's own exact scorer (the row carries its entry and dataset name)."""
    import reasoning_gym

    entry = item.get("rg_entry")
    if entry is None:
        raise ValueError("reasoning_gym reward needs rows from a reasoning_gym data source")
    score_fn = reasoning_gym.get_score_answer_fn(item["rg_dataset"])
    return float(score_fn(answer=answer, entry=entry))


@dataclass(frozen=True)
class Builtin:
    score: Callable[[str, dict[str, Any]], float]
    auto: tuple[str, ...]  # the extractor chain that ``extract: auto`` means for this family


BUILTINS: dict[str, Builtin] = {
    # The demo's task: the tiny model answers with the bare comma-separated result.
    "arithmetic": Builtin(arithmetic_score, ("none",)),
    "exact": Builtin(exact_match, ("answer_tag", "none")),
    "numeric": Builtin(numeric_match, ("answer_tag", "gsm8k", "boxed", "last_number")),
    "math": Builtin(math_answer, ("boxed", "answer_tag", "last_number")),
    "gsm8k": Builtin(numeric_match, ("gsm8k", "answer_tag", "boxed", "last_number")),
    "reasoning_gym": Builtin(reasoning_gym_answer, ("answer_tag", "none")),
}


class BuiltinReward:
    """``reward(completion, item) -> float``, with ``extracted(completion)`` for display."""

    def __init__(self, name: str, extract: str = "auto"):
        if name not in BUILTINS:
            raise ValueError(f"reward.fn builtin:{name} is unknown; use one of {', '.join(BUILTINS)}")
        if extract not in EXTRACT_CHOICES:
            raise ValueError(f"reward.extract {extract!r} is unknown; use one of "
                             f"{', '.join(EXTRACT_CHOICES)}")
        self.name = name
        self.builtin = BUILTINS[name]
        self.chain = self.builtin.auto if extract == "auto" else (extract,)

    def extracted(self, completion: str) -> str | None:
        for name in self.chain:
            found = EXTRACTORS[name](completion)
            if found:
                return found
        return None

    def __call__(self, completion: str, item: dict[str, Any]) -> float:
        answer = self.extracted(completion)
        return 0.0 if answer is None else float(self.builtin.score(answer, item))
