"""An agent outside the platform (online mode): any process with the run key trains the policy.

    python examples/online_client.py runs/<run>/gateway.json

The run (``rollout.mode: online``) writes its gateway's URL and run key to ``gateway.json``. For
each task this client opens ``group_size`` sessions (the episodes the group baseline compares),
runs a small two-turn conversation in each with the ``openai`` package, and posts a reward. It
stops when the run's gateway goes away.
"""

import json
import sys
import time
from pathlib import Path

import httpx
import openai

TASKS = ["3+4=", "12-5=", "6*7=", "9+9="]


def open_session(http: httpx.Client, group: str | None, item: dict) -> dict:
    while True:
        resp = http.post("/rl/sessions", json={"group": group, "item": item})
        if resp.status_code == 429:  # the staleness bound admits no new group yet
            time.sleep(0.5)
            continue
        resp.raise_for_status()
        return resp.json()


def episode(session: dict, question: str) -> float:
    client = openai.OpenAI(base_url=session["base_url"], api_key=session["api_key"], max_retries=0)
    messages = [{"role": "user", "content": question}]
    text = ""
    for _ in range(2):
        reply = client.chat.completions.create(model="policy", messages=messages).choices[0].message
        text += reply.content or ""
        messages += [reply.model_dump(exclude_none=True), {"role": "user", "content": "Again."}]
    return sum(c.isdigit() for c in text) / max(len(text), 1)  # a toy reward: write digits


def main(path: str) -> None:
    while not Path(path).exists():  # the run writes it when its gateway is up
        time.sleep(0.5)
    info = json.loads(Path(path).read_text())
    http = httpx.Client(base_url=info["url"], timeout=120,
                        headers={"Authorization": f"Bearer {info['run_key']}"})
    done = 0
    try:
        while True:
            question = TASKS[done % len(TASKS)]
            first = open_session(http, None, {"question": question})
            sessions = [first] + [open_session(http, first["group"], {"question": question})
                                  for _ in range(first["group_size"] - 1)]
            for s in sessions:
                reward = episode(s, question)
                http.post(f"/rl/sessions/{s['id']}/reward", json={"reward": reward}).raise_for_status()
            done += 1
            print(f"group {first['group']} done", flush=True)
    except (httpx.TransportError, openai.APIConnectionError):
        print(f"the run's gateway closed after {done} groups", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
