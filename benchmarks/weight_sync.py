"""Weight sync pause: ``distributed`` (SGLang's distributed weight update, a gloo broadcast from
the trainer) against ``disk`` (safetensors + /update_weights_from_disk), same trainer, same
embedded server, same weights, rounds interleaved, measured side by side in one run.

    python benchmarks/weight_sync.py [--quick] --out bench-results/weight_sync.json

For each model (the tiny test model and SmolLM2-135M), per round: perturb the trainer's weights,
export them (disk: write safetensors over the retired spare; disk_fresh: always a new file, as
before weight_files; distributed: take the tensors), then the pause the rollout servers see:
pause_generation -> the weight push -> continue_generation. Writes
{"models": {"tiny": {"disk_s": median pause, "distributed_s": ..., "ratio": distributed/disk,
"disk_export_s": ..., "disk_fresh_export_s": ..., "export_reuse_ratio": fresh/reuse,
"distributed_export_s": ..., "group_setup_s": ..., "bytes": ...}, "smollm2": {...}}}.
Aim (issue 10): ratio <= 1 on one machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from training_core.launch import start_embedded_fleet  # noqa: E402
from training_core.models.paths import resolve_model_dir  # noqa: E402
from training_core.trainer.deepspeed_trainer import DeepSpeedTrainer  # noqa: E402
from training_core.transport.rollout_client import RolloutClient  # noqa: E402
from training_core.transport.weight_sync import (  # noqa: E402
    DiskSync,
    DistributedSync,
    WeightSync,
    push_weights,
)


async def _pause_push_resume(client: RolloutClient, sync: WeightSync, version: int) -> float:
    start = time.perf_counter()
    assert await push_weights(client, sync, client.policy) == version
    return time.perf_counter() - start


def bench_model(name: str, rounds: int, work: Path) -> dict:
    model_dir = resolve_model_dir(name)
    fleet = start_embedded_fleet(str(model_dir), 1, work / name / "logs", dtype="float32")
    trainer = DeepSpeedTrainer(model_dir, lr=1e-4, weight_decay=0.0, grad_clip=1.0, zero_stage=0)
    client = RolloutClient(fleet.urls)
    loop = asyncio.new_event_loop()
    syncs: dict[str, WeightSync] = {"disk": DiskSync(work / name / "weights"),
                                    "disk_fresh": DiskSync(work / name / "fresh", reuse=False),
                                    "distributed": DistributedSync()}
    times: dict[str, dict[str, list[float]]] = {k: {"export": [], "pause": []} for k in syncs}
    try:
        start = time.perf_counter()
        loop.run_until_complete(syncs["distributed"].connect(client))
        setup = time.perf_counter() - start
        version = 0
        for _ in range(rounds):
            for kind, sync in syncs.items():  # interleaved: drift on a shared machine hits both
                version += 1
                with torch.no_grad():
                    for p in trainer.engine.module.parameters():
                        p.mul_(1.0 + 1e-4)
                start = time.perf_counter()
                sync.export(trainer, version)
                times[kind]["export"].append(time.perf_counter() - start)
                times[kind]["pause"].append(
                    loop.run_until_complete(_pause_push_resume(client, sync, version)))
        infos = loop.run_until_complete(client.weight_versions())
        assert infos == [str(version)], infos
        loop.run_until_complete(syncs["distributed"].close(client))
        loop.run_until_complete(client.aclose())
    finally:
        loop.close()
        fleet.stop()
    nbytes = sum(t.numel() * t.element_size() for t in trainer.weights().values())
    med = {k: {p: statistics.median(v) for p, v in d.items()} for k, d in times.items()}
    return {"disk_s": med["disk"]["pause"], "distributed_s": med["distributed"]["pause"],
            "ratio": med["distributed"]["pause"] / med["disk"]["pause"],
            "disk_export_s": med["disk"]["export"],
            "disk_fresh_export_s": med["disk_fresh"]["export"],
            "export_reuse_ratio": med["disk_fresh"]["export"] / med["disk"]["export"],
            "distributed_export_s": med["distributed"]["export"],
            "disk_total_s": med["disk"]["export"] + med["disk"]["pause"],
            "distributed_total_s": med["distributed"]["export"] + med["distributed"]["pause"],
            "group_setup_s": setup, "bytes": nbytes, "rounds": rounds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds")
    parser.add_argument("--out", default="bench-results/weight_sync.json")
    parser.add_argument("--models", default="tiny,smollm2")
    args = parser.parse_args()
    rounds = 3 if args.quick else 10
    result: dict = {"models": {}, "rounds": rounds, "torch_threads": torch.get_num_threads()}
    with tempfile.TemporaryDirectory(prefix="oolong-ws-bench-") as tmp:
        for name in args.models.split(","):
            r = bench_model(name, rounds, Path(tmp))
            result["models"][name] = r
            print(f"{name:8s} pause disk {r['disk_s'] * 1e3:7.1f} ms  distributed "
                  f"{r['distributed_s'] * 1e3:7.1f} ms  ratio {r['ratio']:.2f}  (export disk "
                  f"{r['disk_export_s'] * 1e3:.1f} ms, distributed "
                  f"{r['distributed_export_s'] * 1e3:.1f} ms, disk to a new file "
                  f"{r['disk_fresh_export_s'] * 1e3:.1f} ms; {r['bytes'] / 1e6:.1f} MB)", flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
