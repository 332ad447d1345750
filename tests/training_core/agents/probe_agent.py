"""Test agents (copied into the jail as one file)."""

import socket

import openai


def digits(base_url, api_key, item):
    """Two turns through the gateway; rewarded by the share of digits the model writes."""
    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages = [{"role": "user", "content": item["question"]}]
    text = ""
    for _ in range(2):
        out = client.chat.completions.create(model="any", messages=messages)
        msg = out.choices[0].message
        text += msg.content or ""
        messages += [msg.model_dump(exclude_none=True), {"role": "user", "content": "more"}]
    return sum(c.isdigit() for c in text) / max(len(text), 1)


def per_turn(base_url, api_key, item):
    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages = [{"role": "user", "content": item["question"]}]
    rewards = []
    for _ in range(3):
        out = client.chat.completions.create(model="any", messages=messages)
        msg = out.choices[0].message
        rewards.append(float(len(msg.content or "")))
        messages += [msg.model_dump(exclude_none=True), {"role": "tool", "content": "1"}]
    return rewards


def probe(base_url, api_key, item):
    """What else can the agent reach? Each attempt that succeeds is named in the answer."""
    reached = []
    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    client.chat.completions.create(model="any", messages=[{"role": "user", "content": "1+1="}])
    targets = [("1.1.1.1", 80), ("8.8.8.8", 53), (item["host_ip"], item["host_port"]),
               ("127.0.0.1", item["host_port"])]
    for host, port in targets:
        try:
            socket.create_connection((host, port), timeout=2).close()
            reached.append(f"{host}:{port}")
        except OSError:
            pass
    for path in item["unix_paths"]:
        try:
            s = socket.socket(socket.AF_UNIX)
            s.connect(path)
            reached.append(path)
        except OSError:
            pass
    if reached:
        raise RuntimeError("reached " + ", ".join(reached))
    return 1.0


def crash(base_url, api_key, item):
    raise ValueError("the agent broke")


class Looper:
    """A class agent that never stops asking (hits the turn limit)."""

    def run(self, base_url, api_key, item):
        client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
        while True:
            client.chat.completions.create(model="any", messages=[{"role": "user", "content": "x"}])


def solved(base_url, api_key, item):
    """Two turns and every episode succeeds: a task with no signal (the group is uniform)."""
    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages = [{"role": "user", "content": item["question"]}]
    for _ in range(2):
        msg = client.chat.completions.create(model="any", messages=messages).choices[0].message
        messages += [msg.model_dump(exclude_none=True), {"role": "user", "content": "ok"}]
    return 1.0
