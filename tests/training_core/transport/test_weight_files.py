"""Weight folders written over a retired version's file (training_core/transport/weight_files.py), and
the shared lock that keeps a file whose mapped tensors still serve from being written over: real
files, real flocks, the real embedded engine on the tiny model, the real DeepSpeed trainer."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from training_core.checkpoint import pushed_weights
from training_core.rollout_server.generation_engine import GenerationEngine
from training_core.transport import weight_files
from training_core.transport.weight_sync import SPARE, DiskSync


def _state(seed: int, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"a.weight": torch.randn(64, 32, generator=g, dtype=dtype),
            "b.bias": torch.randn(7, generator=g, dtype=dtype),
            "c.norm": torch.randn(3, 5, 2, generator=g, dtype=dtype)}


def _inode(folder: Path) -> int:
    return os.stat(folder / weight_files.FILE).st_ino


def test_a_spare_of_the_same_tensors_is_written_over_in_place_and_cast_on_the_way(tmp_path):
    weight_files.save(tmp_path / "old", _state(0), dtype=torch.bfloat16)
    spare_inode = _inode(tmp_path / "old")
    state = _state(1)  # fp32: the writer casts into the bf16 file
    weight_files.save(tmp_path / "new", state, dtype=torch.bfloat16, spare=tmp_path / "old")
    assert not (tmp_path / "old").exists() and _inode(tmp_path / "new") == spare_inode
    got = load_file(str(tmp_path / "new" / weight_files.FILE))
    assert got.keys() == state.keys()
    for k, v in state.items():
        assert got[k].dtype == torch.bfloat16 and torch.equal(got[k], v.to(torch.bfloat16))
    # bit for bit what safetensors' own writer gives for the same tensors
    save_file({k: v.to(torch.bfloat16) for k, v in state.items()}, str(tmp_path / "ref.st"))
    ref = load_file(str(tmp_path / "ref.st"))
    assert all(torch.equal(got[k], ref[k]) for k in ref)


def _raw_safetensors(path: Path, entries: dict[str, tuple[str, list[int], list[int]]],
                     data: bytes, start: int = 0) -> None:
    """A safetensors file written by hand: name -> (dtype, shape, data_offsets); its data
    begins ``start`` bytes past a multiple of 8."""
    header = json.dumps({k: {"dtype": d, "shape": s, "data_offsets": o}
                         for k, (d, s, o) in entries.items()}).encode()
    header += b" " * ((start - 8 - len(header)) % 8)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(len(header).to_bytes(8, "little") + header + data)


@pytest.mark.parametrize("change", ["shape", "dtype", "names", "garbage", "empty", "offsets",
                                    "misaligned", "overlapping"])
def test_a_spare_laid_out_for_other_tensors_is_left_alone_and_a_new_file_written(tmp_path, change):
    spare = tmp_path / "spare"
    state = _state(2)
    if change == "shape":
        weight_files.save(spare, {**state, "b.bias": torch.zeros(8)})
    elif change == "dtype":
        weight_files.save(spare, state, dtype=torch.bfloat16)
    elif change == "names":
        weight_files.save(spare, {**state, "extra": torch.zeros(1)})
    elif change in ("misaligned", "overlapping"):
        sizes = {k: v.numel() * 4 for k, v in state.items()}
        entries, edge = {}, 0
        for k, v in state.items():
            entries[k] = ("F32", list(v.shape), [edge, edge + sizes[k]])
            edge += sizes[k] if change == "misaligned" or k != "a.weight" else 0
        if change == "misaligned":  # the data 2 bytes past an 8-byte boundary: no fp32 view
            _raw_safetensors(spare / weight_files.FILE, entries, bytes(edge), start=2)
        else:  # a.weight and b.bias start at the same byte
            _raw_safetensors(spare / weight_files.FILE, entries, bytes(edge))
    else:
        weight_files.save(spare, state)
        raw = (spare / weight_files.FILE).read_bytes()
        if change == "garbage":
            raw = os.urandom(len(raw))
        elif change == "empty":
            raw = b""
        else:  # a header whose offsets point past the file's end
            raw = raw.replace(b'"data_offsets":[0,', b'"data_offsets":[9,', 1)
        (spare / weight_files.FILE).write_bytes(raw)
    before = (spare / weight_files.FILE).read_bytes()
    weight_files.save(tmp_path / "v", state, spare=spare)
    assert (spare / weight_files.FILE).read_bytes() == before  # untouched, still where it was
    got = load_file(str(tmp_path / "v" / weight_files.FILE))
    assert all(torch.equal(got[k], v) for k, v in state.items())


def test_a_file_whose_tensors_serve_is_never_written_over(tmp_path):
    weight_files.save(tmp_path / "v1", _state(3))
    tensors, held = weight_files.load(tmp_path / "v1")
    first = {k: v.clone() for k, v in tensors.items()}
    weight_files.save(tmp_path / "v2", _state(4), spare=tmp_path / "v1")
    assert (tmp_path / "v1").exists() and _inode(tmp_path / "v2") != _inode(tmp_path / "v1")
    assert all(torch.equal(tensors[k], first[k]) for k in first)  # the mapped bytes kept
    held.release()
    inode = _inode(tmp_path / "v1")
    weight_files.save(tmp_path / "v3", _state(5), spare=tmp_path / "v1")
    assert _inode(tmp_path / "v3") == inode


def test_a_reader_in_another_process_holds_the_file_too(tmp_path):
    weight_files.save(tmp_path / "v1", _state(6))
    code = ("import sys, time; from training_core.transport import weight_files; "
            "s, held = weight_files.load(sys.argv[1]); print('held', flush=True); time.sleep(60)")
    reader = subprocess.Popen([sys.executable, "-c", code, str(tmp_path / "v1")],
                              stdout=subprocess.PIPE, text=True, cwd=Path(__file__).parents[3])
    try:
        assert reader.stdout.readline().strip() == "held"
        assert not weight_files.overwrite(tmp_path / "v1" / weight_files.FILE, _state(7))
    finally:
        reader.kill()
        reader.wait()
    assert weight_files.overwrite(tmp_path / "v1" / weight_files.FILE, _state(7))


def test_the_engine_holds_the_file_it_serves_until_the_next_load(tiny_model_dir, tmp_path):
    """The engine's parameters map the loaded file (assign=True): while they serve, a new version
    goes to a new file; once the engine loads another version, the old file is free."""
    from training_core.trainer.deepspeed_trainer import DeepSpeedTrainer

    trainer = DeepSpeedTrainer(tiny_model_dir, lr=1e-3, weight_decay=0.0, grad_clip=1.0,
                               zero_stage=0)
    engine = GenerationEngine(str(tiny_model_dir))
    try:
        trainer.save_weights(tmp_path / "v1")
        assert engine.update_weights(str(tmp_path / "v1"), "1")["success"]
        served = engine.model.model.embed_tokens.weight.clone()
        with torch.no_grad():
            for p in trainer.engine.module.parameters():
                p.add_(0.5)
        trainer.save_weights(tmp_path / "v2", spare=tmp_path / "v1")
        assert (tmp_path / "v1").exists()  # held: not reused
        assert torch.equal(engine.model.model.embed_tokens.weight, served)
        assert engine.update_weights(str(tmp_path / "v2"), "2")["success"]
        inode = _inode(tmp_path / "v1")
        trainer.save_weights(tmp_path / "v3", spare=tmp_path / "v1")  # v1 no longer serves
        assert _inode(tmp_path / "v3") == inode
        assert torch.equal(load_file(str(tmp_path / "v3" / weight_files.FILE))["model.norm.weight"],
                           trainer.engine.module.state_dict()["model.norm.weight"])
        assert engine.update_weights(str(tmp_path / "v3"), "3")["success"]
        assert torch.equal(engine.model.model.norm.weight,
                           trainer.engine.module.state_dict()["model.norm.weight"])
    finally:
        engine.shutdown()


class _Receiver:
    """What DiskSync.push calls on the rollout client: loads into a real engine."""

    def __init__(self, engine: GenerationEngine):
        self.engine = engine

    async def update_weights_from_disk(self, path: str, version: int) -> None:
        assert self.engine.update_weights(path, str(version))["success"]


def test_disk_sync_keeps_two_versions_and_writes_the_third_over_the_spare(tiny_model_dir, tmp_path):
    from training_core.trainer.deepspeed_trainer import DeepSpeedTrainer

    trainer = DeepSpeedTrainer(tiny_model_dir, lr=1e-3, weight_decay=0.0, grad_clip=1.0,
                               zero_stage=0)
    engine = GenerationEngine(str(tiny_model_dir))
    sync, receiver, inodes = DiskSync(tmp_path / "weights"), _Receiver(engine), {}
    try:
        for version in range(1, 6):
            with torch.no_grad():
                trainer.engine.module.model.norm.weight.fill_(float(version))
            sync.export(trainer, version)
            inodes[version] = _inode(sync.path(version))
            asyncio.run(sync.push(receiver, version))
            kept = [v for v in (version - 1, version) if v >= 1]
            assert [v for v, _ in pushed_weights(tmp_path)] == kept
            assert engine.model.model.norm.weight.eq(float(version)).all()
        # v1-v3 went to new files (no spare before the push of v3); v4 reuses v1, v5 v2
        assert len({inodes[1], inodes[2], inodes[3]}) == 3
        assert inodes[4] == inodes[1] and inodes[5] == inodes[2]
        assert (tmp_path / "weights" / SPARE).exists()
    finally:
        engine.shutdown()


def test_a_refused_load_holds_nothing(tiny_model_dir, tmp_path):
    engine = GenerationEngine(str(tiny_model_dir))
    try:
        bad = {"model.norm.weight": torch.ones(3)}  # the tiny model's norm is wider
        weight_files.save(tmp_path / "bad", bad)
        result = engine.update_weights(str(tmp_path / "bad"), "1")
        assert not result["success"] and "shape mismatch" in result["message"]
        assert weight_files.overwrite(tmp_path / "bad" / weight_files.FILE, bad)
    finally:
        engine.shutdown()


def test_a_partial_load_keeps_the_old_file_held_and_shutdown_lets_all_go(tiny_model_dir, tmp_path):
    """Parameters a partial update leaves alone still map the old file: it stays held until a
    whole load replaces them, and every file is free once the engine shuts down."""
    engine = GenerationEngine(str(tiny_model_dir))
    whole = {k: v.clone() for k, v in engine.model.state_dict().items() if k != "lm_head.weight"}
    if not engine.model.config.tie_word_embeddings:
        whole["lm_head.weight"] = engine.model.lm_head.weight.clone()
    v1, part, v2 = (tmp_path / n for n in ("v1", "part", "v2"))
    weight_files.save(v1, whole)
    weight_files.save(part, {"model.norm.weight": whole["model.norm.weight"] + 1})
    weight_files.save(v2, whole)
    try:
        assert engine.update_weights(str(v1), "1")["success"]
        assert engine.update_weights(str(part), "2")["success"]
        assert not weight_files.overwrite(v1 / weight_files.FILE, whole)  # embeddings map v1
        assert not weight_files.overwrite(part / weight_files.FILE, {
            "model.norm.weight": whole["model.norm.weight"]})
        assert engine.update_weights(str(v2), "3")["success"]
        assert weight_files.overwrite(v1 / weight_files.FILE, whole)
        assert weight_files.overwrite(part / weight_files.FILE, {
            "model.norm.weight": whole["model.norm.weight"]})
        assert not weight_files.overwrite(v2 / weight_files.FILE, whole)
    finally:
        engine.shutdown()
    assert weight_files.overwrite(v2 / weight_files.FILE, whole)


def test_a_resumed_export_starts_the_folders_afresh(tiny_model_dir, tmp_path):
    from training_core.trainer.deepspeed_trainer import DeepSpeedTrainer

    trainer = DeepSpeedTrainer(tiny_model_dir, lr=1e-3, weight_decay=0.0, grad_clip=1.0,
                               zero_stage=0)
    sync = DiskSync(tmp_path / "weights")
    for version in (3, 4, 5):
        sync.export(trainer, version)
    (tmp_path / "weights" / SPARE).mkdir()
    (tmp_path / "weights" / "v9.tmp").mkdir()
    sync.export(trainer, 4, resumed=True)  # a checkpoint of version 4
    assert sorted(p.name for p in (tmp_path / "weights").iterdir()) == ["v4"]
    asyncio.run(sync.close(None))


def test_without_flock_readers_copy_and_no_file_is_written_over(tmp_path, monkeypatch):
    """A file system that refuses flock (ENOLCK: NFSv3 without a lock daemon) cannot exist on
    this machine, so flock is made to refuse as it would there."""
    import errno

    weight_files.save(tmp_path / "v1", _state(8))

    def refuse(*_):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(weight_files.fcntl, "flock", refuse)
    tensors, held = weight_files.load(tmp_path / "v1")
    first = {k: v.clone() for k, v in tensors.items()}
    assert not weight_files.overwrite(tmp_path / "v1" / weight_files.FILE, _state(9))
    raw = bytearray((tmp_path / "v1" / weight_files.FILE).read_bytes())
    raw[-64:] = bytes(64)  # the file changed behind the reader's back
    with open(tmp_path / "v1" / weight_files.FILE, "r+b") as f:
        f.write(raw)
    assert all(torch.equal(tensors[k], first[k]) for k in first)  # copies, not the mapped file
    held.release()
