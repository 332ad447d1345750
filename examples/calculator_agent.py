"""A tool-using arithmetic agent, written with the `openai` package and nothing of Oolong.

Train it by pointing a run at it (examples/calculator_agent.yaml):

    rollout:
      workflow: agent:examples/calculator_agent.py:run

Oolong calls ``run(base_url, api_key, item)`` once per episode, inside its jail, with a
``base_url`` that reaches only this episode's session of the gateway. The same function works
against any OpenAI-compatible server (try it against a local vLLM or SGLang).
"""

import ast
import json
import operator
import re

import openai

CALCULATOR = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression with + - * / and parentheses.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                       "required": ["expression"]},
    },
}
OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
       ast.Div: operator.truediv, ast.USub: operator.neg}


def calculate(expression: str) -> str:
    """Arithmetic only (no eval): numbers, + - * /, parentheses."""

    def ev(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, int | float):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in OPS:
            return OPS[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in OPS:
            return OPS[type(node.op)](ev(node.operand))
        raise ValueError("only arithmetic is allowed")

    try:
        value = ev(ast.parse(expression, mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError) as exc:
        return f"error: {exc}"
    return str(int(value)) if float(value).is_integer() else f"{value:.6g}"


def run(base_url: str, api_key: str, item: dict, max_turns: int = 4) -> float:
    client = openai.OpenAI(base_url=base_url, api_key=api_key)
    messages = [
        {"role": "system", "content": "Use the calculator tool, then give the final number."},
        {"role": "user", "content": f"What is {item['question'].rstrip('=')}?"},
    ]
    for _ in range(max_turns):
        reply = client.chat.completions.create(model="policy", messages=messages,
                                               tools=[CALCULATOR]).choices[0].message
        # Send the assistant message back as received: the gateway continues from the exact
        # tokens it sampled.
        messages.append(reply.model_dump(exclude_none=True))
        if not reply.tool_calls:
            numbers = re.findall(r"-?\d+(?:\.\d+)?", reply.content or "")
            return 1.0 if numbers and float(numbers[-1]) == float(item["answer"]) else 0.0
        for call in reply.tool_calls:
            try:
                expression = json.loads(call.function.arguments).get("expression", "")
            except ValueError:
                expression = ""
            messages.append({"role": "tool", "tool_call_id": call.id,
                             "content": calculate(str(expression))})
    return 0.0
