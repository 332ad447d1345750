"""An agent outside the platform (online mode): one URL and the run key, nothing of Oolong.

    python examples/online_client.py runs/<run>/gateway.json

The run (``rollout.mode: online``) writes its gateway's URL and run key to ``gateway.json`` (the
run page shows both). This client points the ``openai`` package at ``<url>/v1`` with the run key,
runs a small two-turn conversation per episode and posts a reward for the episode's last answer.
The server finds each request's episode from its conversation and groups the episodes of one
task (docs/agents.md, section 3): the client runs a task's episodes until the server says its
group is complete. It stops when the run's gateway goes away.
"""

import json
import sys
import time
from pathlib import Path

import httpx
import openai

TASKS = ["3+4=", "12-5=", "6*7=", "9+9="]


def episode(client: openai.OpenAI, question: str) -> tuple[str, float]:
    """(the last answer's id, the reward)."""
    messages = [{"role": "user", "content": question}]
    text = ""
    for _ in range(2):
        while True:
            try:
                reply = client.chat.completions.create(model="policy", messages=messages)
                break
            except openai.RateLimitError:  # the staleness bound admits no new group yet
                time.sleep(0.5)
        message = reply.choices[0].message
        text += message.content or ""
        messages += [message.model_dump(exclude_none=True), {"role": "user", "content": "Again."}]
    return reply.id, sum(c.isdigit() for c in text) / max(len(text), 1)  # a toy reward: digits


def main(path: str) -> None:
    while not Path(path).exists():  # the run writes it when its gateway is up
        time.sleep(0.5)
    info = json.loads(Path(path).read_text())
    client = openai.OpenAI(base_url=info["url"] + "/v1", api_key=info["run_key"], max_retries=0)
    http = httpx.Client(base_url=info["url"], timeout=120,
                        headers={"Authorization": f"Bearer {info['run_key']}"})
    done = 0
    try:
        while True:
            question = TASKS[done % len(TASKS)]
            while True:  # the task's episodes, until its group is complete
                answer_id, reward = episode(client, question)
                resp = http.post("/rl/reward", json={"response_id": answer_id, "reward": reward})
                resp.raise_for_status()
                if resp.json()["group_complete"]:
                    break
            done += 1
            print(f"group {resp.json()['group']} done", flush=True)
    except (httpx.TransportError, openai.APIConnectionError):
        print(f"the run's gateway closed after {done} groups", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
