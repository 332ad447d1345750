"""Prompt templates that ask for the answer in the form a family's reward extracts.

``data.prompt_template`` is either a format string over the row's fields (``{question}``) or one
of these names. Each pairs with a reward extractor (rewards/builtin.py):

    reasoning_gym  answer inside <answer>...</answer>   (builtin:reasoning_gym, extract answer_tag)
    math           answer inside \\boxed{...}            (builtin:math, extract boxed)
    gsm8k          final line "#### <number>"           (builtin:gsm8k, extract gsm8k)
"""

from __future__ import annotations

PROMPT_TEMPLATES: dict[str, str] = {
    "reasoning_gym": (
        "Solve the problem step by step. Then give only the final answer between <answer> and "
        "</answer> tags, for example <answer>42</answer>.\n\n{question}"),
    "math": "{question}\n\nReason step by step, and put your final answer within \\boxed{{}}.",
    "gsm8k": ("{question}\n\nSolve it step by step. Write the final answer on the last line as "
              "'#### <number>'."),
}


def prompt_template_text(template: str) -> str:
    """The format string for ``data.prompt_template``: a named template, or the format string
    itself (a template names at least one field, so it has a brace)."""
    if "{" in template:
        return template
    if template not in PROMPT_TEMPLATES:
        raise ValueError(f"data.prompt_template {template!r} is neither a format string with a "
                         "field (such as '{question}') nor a named template: "
                         f"{', '.join(PROMPT_TEMPLATES)}")
    return PROMPT_TEMPLATES[template]
