"""Built-in rewards. Each is ``fn(completion, item) -> float`` with ``item['answer']`` the gold."""

from __future__ import annotations

import re
from typing import Any

from training_core.data.synthetic import arithmetic_score

NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")
BOXED = re.compile(r"\\boxed\{((?:[^{}]|\{[^{}]*\})*)\}")


def _to_number(text: str) -> float | None:
    try:
        return float(text.replace(",", "").strip())
    except ValueError:
        return None


def extract_final_answer(completion: str) -> str | None:
    """GSM8K ``#### N`` first, then the last ``\\boxed{...}``, then the last number."""
    if "####" in completion:
        return completion.split("####")[-1].strip().split()[0] if completion.split("####")[-1].strip() else None
    boxed = BOXED.findall(completion)
    if boxed:
        return boxed[-1].strip()
    numbers = NUMBER.findall(completion)
    return numbers[-1] if numbers else None


def exact_match(completion: str, item: dict[str, Any]) -> float:
    return 1.0 if completion.strip() == str(item["answer"]).strip() else 0.0


def numeric_match(completion: str, item: dict[str, Any], rel_tol: float = 1e-6) -> float:
    pred = extract_final_answer(completion)
    gold = _to_number(str(item["answer"]))
    value = _to_number(pred) if pred is not None else None
    if value is None or gold is None:
        return 0.0
    return 1.0 if abs(value - gold) <= rel_tol * max(1.0, abs(gold)) else 0.0


def math_answer(completion: str, item: dict[str, Any]) -> float:
    """Symbolic equivalence with math-verify (\\boxed{}, fractions, LaTeX), numeric fallback."""
    from math_verify import parse, verify

    gold_text = str(item["answer"])
    gold = parse(gold_text if "$" in gold_text or "\\" in gold_text else f"${gold_text}$")
    pred = parse(completion)
    try:
        if gold and pred and verify(gold, pred):
            return 1.0
    except Exception:  # math-verify raises on exotic input: fall back to numbers
        pass
    return numeric_match(completion, item)


def gsm8k_answer(completion: str, item: dict[str, Any]) -> float:
    return numeric_match(completion, item)


def reasoning_gym_answer(completion: str, item: dict[str, Any]) -> float:
    """Use the generator's own exact scorer (the row carries its entry and dataset name)."""
    import reasoning_gym

    entry = item.get("rg_entry")
    if entry is None:
        raise ValueError("reasoning_gym reward needs rows from a reasoning_gym data source")
    score_fn = reasoning_gym.get_score_answer_fn(item["rg_dataset"])
    return float(score_fn(answer=completion.strip(), entry=entry))


BUILTINS = {
    "arithmetic": arithmetic_score,
    "exact": exact_match,
    "numeric": numeric_match,
    "math": math_answer,
    "gsm8k": gsm8k_answer,
    "reasoning_gym": reasoning_gym_answer,
}
