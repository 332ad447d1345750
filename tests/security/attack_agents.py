"""Agents that attack the host through what they return or where they write (issue 47). Each is
copied into the jail as one file; each makes one chat completion first (an episode needs one)."""

import json
import os

import openai


def _one_turn(base_url, api_key, item):
    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    client.chat.completions.create(model="any", messages=[{"role": "user", "content": item["question"]}])


def returns_none_list(base_url, api_key, item):
    _one_turn(base_url, api_key, item)
    return [None]


def returns_huge(base_url, api_key, item):
    _one_turn(base_url, api_key, item)
    return 1e39


def returns_sum_to_inf(base_url, api_key, item):
    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    for _ in range(2):
        client.chat.completions.create(model="any", messages=[{"role": "user", "content": "x"}])
    return [9e5, 9e5]  # each within the bound; summed, over it (1e308 twice: inf)


def returns_nan_text(base_url, api_key, item):
    """Writes its own answer line with a NaN on the protocol's fd, then hangs."""
    _one_turn(base_url, api_key, item)
    os.write(3, b'{"result": NaN}\n')
    import time
    time.sleep(60)


def fill_scratch(base_url, api_key, item):
    """300 MB in one file and 20,000 files of 4 KB in /scratch; says how far it got."""
    _one_turn(base_url, api_key, item)
    found = {"cwd": os.getcwd(), "written_mb": 0, "files": 0, "errors": []}
    st = os.statvfs("/scratch")
    found["scratch_mb"] = st.f_blocks * st.f_frsize // 2**20
    block = b"x" * 2**20
    try:
        with open("/scratch/big", "wb") as fh:
            for _ in range(300):
                fh.write(block)
                fh.flush()
                found["written_mb"] += 1
    except OSError as exc:
        found["errors"].append(str(exc))
    try:
        os.remove("/scratch/big")
    except OSError:
        pass
    page = b"y" * 4096
    try:
        for i in range(20_000):
            with open(f"/scratch/f{i}", "wb") as fh:
                fh.write(page)
            found["files"] += 1
    except OSError as exc:
        found["errors"].append(str(exc))
    raise RuntimeError("FOUND" + json.dumps(found))
