"""The one launcher: every command line and environment of a run's processes (rollout servers,
embedded or SGLang; the trainer, one process or ``torch.distributed.run`` ranks on one or several
nodes), for ``oolong train``'s embedded fleet, the single-machine flow and placed runs alike.

The environment is always the allow-list of ``processes.process_env`` plus what the run adds
(its directory on ``PYTHONPATH``, its id, the GPUs a placed process owns). Their lifecycle
(spawn, health, restart, stop) is ``training_core/processes.py``."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
from pathlib import Path

from training_core import gpu_memory
from training_core.config import LoraSpec, RunSpec
from training_core.dtypes import precision, sglang_dtype
from training_core.ports import free_port
from training_core.processes import Fleet, ManagedProcess, process_env
from training_core.transport.server_auth import SERVER_KEY_ENV

SGLANG_PYTHON_ENV = "OOLONG_SGLANG_PYTHON"  # the interpreter of SGLang's own environment


def embedded_server_command(model_path: str, port: int, *, dtype: str, host: str = "127.0.0.1",
                            threads: int = 1, max_batch_size: int = 256, seed: int = 0,
                            weight_version: int = 0, parent_pid: int | None = None,
                            weights_root: Path | None = None) -> list[str]:
    """The embedded server; ``weights_root``: the only folder it loads weights from (the run's
    ``weights/``)."""
    cmd = [sys.executable, "-m", "training_core.rollout_server.server", "--model-path",
           str(model_path), "--host", host, "--port", str(port), "--threads", str(threads),
           "--max-batch-size", str(max_batch_size), "--seed", str(seed),
           "--weight-version", str(weight_version), "--dtype", precision(dtype).name]
    if weights_root is not None:
        cmd += ["--weights-root", str(weights_root)]
    return cmd + (["--parent-pid", str(parent_pid)] if parent_pid else [])


def sglang_python() -> str:
    """SGLang's interpreter: ``$OOLONG_SGLANG_PYTHON`` (its own environment, which cloud-init
    makes: SGLang pins a torch of its own), else this one."""
    return os.environ.get(SGLANG_PYTHON_ENV) or sys.executable


def sglang_server_command(model_path: str, port: int, *, dtype: str, host: str = "127.0.0.1",
                          tp: int = 1, mem_fraction: float | None = None, weight_version: int = 0,
                          config: Path | None = None, lora: LoraSpec | None = None,
                          extra: list[str] | None = None) -> list[str]:
    """The production rollout server. Flags per SGLang's server arguments (checked against the
    pinned release by tests/training_core/rollout_server/test_sglang_contract.py):

    - ``--dtype`` always: SGLang's ``auto`` serves an fp32 model folder (Oolong's conversions and
      warm starts) in fp16, so a bf16 run would train in bf16 and sample in fp16;
    - ``--mem-fraction-static`` only when given (a GPU shared with the trainer, or
      ``rollout.mem_fraction``); on a GPU of its own SGLang sizes itself;
    - ``--config``: the run's API key, in a file only the run's user reads (argv is world-readable
      in /proc);
    - it starts at a known ``weight_version`` (the trainer checks it through ``/model_info``), and
      binds loopback unless it is placed on a node (then the node's address);
    - ``lora`` (a LoRA run, issue 49): :func:`sglang_lora_flags`."""
    cmd = [sglang_python(), "-m", "sglang.launch_server", "--model-path", str(model_path),
           "--host", host, "--port", str(port), "--tp-size", str(tp), "--dtype", sglang_dtype(dtype),
           "--skip-tokenizer-init", "--weight-version", str(weight_version)]
    if mem_fraction is not None:
        cmd += ["--mem-fraction-static", str(mem_fraction)]
    if config is not None:
        cmd += ["--config", str(config)]
    if lora is not None:
        cmd += sglang_lora_flags(lora)
    return cmd + list(extra or [])


# Adapters one running batch may mix: the current version's, and the one before while requests
# that named it finish (the client unloads an adapter once no request names it).
SGLANG_LORAS_PER_BATCH = 2


def sglang_lora_flags(lora: LoraSpec) -> list[str]:
    """SGLang 0.5.23's LoRA server arguments for a run that loads its adapters as it trains
    (none at launch, so the release needs both the rank and the modules up front): LoRA on,
    ``--max-lora-rank`` the run's rank, ``--lora-target-modules`` its modules (their last name
    part, which is what SGLang matches), ``--max-loras-per-batch`` :data:`SGLANG_LORAS_PER_BATCH`
    (its memory pool holds that many adapters). ``--max-loaded-loras`` stays unset: with it the
    release evicts adapters by itself, and the client's list of what is loaded would be wrong.
    Names and types checked against the release's own parser
    (tests/training_core/rollout_server/test_sglang_contract.py)."""
    modules = list(dict.fromkeys(m.rsplit(".", 1)[-1] for m in lora.target_modules))
    return ["--enable-lora", "--max-lora-rank", str(lora.rank), "--lora-target-modules",
            *modules, "--max-loras-per-batch", str(SGLANG_LORAS_PER_BATCH)]


def new_server_key() -> str:
    """A run's rollout-server secret: every server of the run requires it, the trainer sends it."""
    return secrets.token_urlsafe(32)


def sglang_key_file(run_dir: Path, index: int, key: str) -> Path:
    """SGLang's ``--config`` for server ``index``: its API keys, readable by the run's user only.
    Written with O_NOFOLLOW: a link planted at this path is refused, not written through."""
    path = run_dir / f"sglang-server-{index}.yaml"
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as fh:
        # dashed keys: the release's merger turns each into "--<key>", and its flags are dashed
        fh.write(f"api-key: {key}\nadmin-api-key: {key}\n")
    return path


def server_command(spec: RunSpec, model_dir: str, port: int, index: int, *,
                   host: str | None = None, parent_pid: int | None = None,
                   run_dir: Path | None = None, server_key: str | None = None,
                   mem_fraction: float | None = None) -> list[str]:
    """Rollout server ``index`` of the run, SGLang or embedded as ``rollout.backend`` says (the
    one rule for which server a run has): SGLang with ``rollout.tp`` GPUs, the run's dtype, its
    key in a file under ``run_dir``, and ``mem_fraction`` (:func:`server_mem_fraction`); the
    embedded server takes its key from ``OOLONG_SERVER_KEY`` in its environment (``run_env``)
    and loads weights only from ``run_dir/weights``. Each binds loopback unless ``host`` is
    given."""
    where = {"host": host} if host else {}
    if spec.rollout.backend == "sglang":
        config = None
        if server_key is not None:
            if run_dir is None:
                raise ValueError("an SGLang server's key is written under the run directory")
            config = sglang_key_file(run_dir, index, server_key)
        return sglang_server_command(model_dir, port, dtype=spec.model.dtype, tp=spec.rollout.tp,
                                     mem_fraction=mem_fraction, config=config,
                                     lora=spec.model.lora, **where)
    return embedded_server_command(model_dir, port, dtype=spec.model.dtype,
                                   threads=spec.rollout.server_threads,
                                   max_batch_size=spec.rollout.max_batch_size,
                                   seed=spec.seed + index, parent_pid=parent_pid,
                                   weights_root=run_dir / "weights" if run_dir else None, **where)


def server_mem_fraction(spec: RunSpec, model_dir: str | Path, *, shares_trainer_gpu: bool,
                        gpu_index: int = 0, trainer_ranks: int = 1,
                        gpu_bytes: int | None = None) -> float | None:
    """SGLang's ``--mem-fraction-static`` for a server of this run: ``rollout.mem_fraction`` when
    set, else, on a GPU it shares with a trainer rank, what the trainer leaves
    (``gpu_memory.shared_fraction``: refused, naming the numbers, when the two cannot fit); on a
    GPU of its own, None (SGLang sizes itself). The embedded server takes no fraction."""
    explicit = spec.rollout.mem_fraction
    if spec.rollout.backend != "sglang" or not (shares_trainer_gpu or explicit is not None):
        return None
    if not shares_trainer_gpu:
        return explicit
    size = gpu_memory.model_size(model_dir)
    trainer = gpu_memory.trainer_need_bytes(
        size, dtype=spec.model.dtype, zero_stage=spec.trainer.zero_stage, ranks=trainer_ranks,
        micro_batch_tokens=spec.trainer.micro_batch_tokens,
        checkpointing=getattr(spec.trainer, "activation_checkpointing", False))
    total = gpu_bytes if gpu_bytes is not None else gpu_total_bytes(gpu_index)
    return gpu_memory.shared_fraction(
        gpu_bytes=total, trainer_bytes=trainer, explicit=explicit, where=f"GPU {gpu_index}",
        server_bytes=gpu_memory.server_weight_bytes(size, dtype=spec.model.dtype))


def gpu_total_bytes(index: int) -> int:
    """The memory of this machine's GPU ``index``, from nvidia-smi (this launcher never touches
    CUDA: a CUDA context here would take memory from the processes it starts)."""
    out = subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits",
                          "-i", str(index)], capture_output=True, text=True, timeout=30, check=True)
    return int(float(out.stdout.strip().splitlines()[0]) * (1 << 20))  # MiB


def single_machine_gpus(spec: RunSpec, gpus: int) -> tuple[tuple[int, ...], list[tuple[int, ...]]]:
    """One machine's GPUs when it cannot give every server GPUs of its own and the trainer the
    rest: the servers take disjoint GPUs (``rollout.tp`` each, lowest first) and the trainer a
    rank on every GPU, sharing theirs. No GPUs: nobody owns one. Refused when the servers
    alone need more GPUs than the machine has, or when a distributed weight push would put
    trainer rank 0 and a server rank of one NCCL group on one GPU (NCCL refuses that)."""
    if gpus == 0:
        return (), [() for _ in range(spec.rollout.num_servers)]
    need = spec.rollout.num_servers * spec.rollout.tp
    if need > gpus:
        raise ValueError(
            f"rollout.num_servers={spec.rollout.num_servers} with rollout.tp={spec.rollout.tp} "
            f"needs {need} GPUs and this machine has {gpus}: servers never share a GPU with each "
            "other. Lower rollout.num_servers or rollout.tp, or add GPUs")
    if spec.weight_sync == "distributed":
        raise ValueError(
            "weight_sync=distributed on one machine whose servers share the trainer's GPUs: "
            "trainer rank 0 and rollout server 0 would be two ranks of one NCCL group on GPU 0, "
            "which NCCL refuses. Use weight_sync=disk here (the servers read the trainer's "
            "files), or give the servers GPUs of their own")
    servers = [tuple(range(i * spec.rollout.tp, (i + 1) * spec.rollout.tp))
               for i in range(spec.rollout.num_servers)]
    return tuple(range(gpus)), servers


def server_env(spec: RunSpec, run_dir: Path, run_id: int | None = None,
               gpus: tuple[int, ...] | list[int] | None = None,
               server_key: str | None = None) -> dict[str, str]:
    """A rollout server's environment: ``run_env``; for an embedded server OpenMP's threads are
    its torch threads (``rollout.server_threads``); for SGLang its environment's ``bin/`` first
    on ``PATH`` (flashinfer compiles kernels at first use with the ninja and nvcc found there).
    With :func:`server_command`, the one mapping from a spec to a server process, whoever starts
    it (``start_fleet``, the flows)."""
    env = run_env(run_dir, run_id, gpus, server_key=server_key)
    if spec.rollout.backend == "embedded":
        env["OMP_NUM_THREADS"] = str(spec.rollout.server_threads)
    if spec.rollout.backend == "sglang":
        bin_dir = str(Path(sglang_python()).parent)
        env["PATH"] = os.pathsep.join(p for p in [bin_dir, env.get("PATH", "")] if p)
    return env


def nccl_version(python: str) -> tuple[int, ...] | None:
    """The NCCL ``python``'s torch loads, None without CUDA or NCCL (a CPU build)."""
    code = ("import json, torch\n"
            "v = None\n"
            "if torch.cuda.is_available():\n"
            "    v = torch.cuda.nccl.version()\n"
            "print(json.dumps(list(v) if isinstance(v, tuple) else v))")
    out = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=300)
    if out.returncode != 0:
        raise RuntimeError(f"{python} could not report its NCCL version: {out.stderr[-1500:]}")
    value = json.loads(out.stdout.strip().splitlines()[-1])
    if isinstance(value, int):  # older torch: one integer, 2.30.7 -> 23007
        value = [value // 10000, value // 100 % 100, value % 100]
    return tuple(value) if value else None


def check_nccl(spec: RunSpec) -> None:
    """Before SGLang servers start for a distributed weight push: both ends of the weight group
    must load one NCCL, which refuses ranks of different versions ("Mismatched NCCL version"),
    hours later and far from the cause. constraints-gpu.txt makes them equal; this checks the
    environments a node actually has, naming both versions."""
    if spec.rollout.backend != "sglang" or spec.weight_sync != "distributed":
        return
    trainer, server = nccl_version(sys.executable), nccl_version(sglang_python())
    if trainer != server:
        show = lambda v: ".".join(map(str, v)) if v else "none (no CUDA)"  # noqa: E731
        raise RuntimeError(
            f"NCCL {show(trainer)} in the trainer's environment ({sys.executable}) and "
            f"{show(server)} in SGLang's ({sglang_python()}): the weight-update group needs one "
            "version on both ends. Install both with the same torch (constraints-gpu.txt and "
            "constraints-sglang.txt pin it)")


def run_env(run_dir: Path, run_id: int | None = None,
            gpus: tuple[int, ...] | list[int] | None = None,
            server_key: str | None = None) -> dict[str, str]:
    """The allow-listed environment of a run's processes, with the run directory importable
    (user reward modules are written there), the run id that marks them, for a placed
    process the GPUs it owns (``CUDA_VISIBLE_DEVICES``: it sees those and no other), and the
    run's rollout-server secret (the servers require it, the trainer sends it)."""
    path = os.pathsep.join(p for p in [str(run_dir), os.environ.get("PYTHONPATH", "")] if p)
    extra = {"PYTHONPATH": path, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    if run_id is not None:
        extra["OOLONG_RUN_ID"] = str(run_id)
    if gpus:
        extra["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, gpus))
    if server_key is not None:
        extra[SERVER_KEY_ENV] = server_key
    return process_env(extra)


def train_args(spec_path: Path, server_urls: list[str], run_dir: Path, *,
               resume: bool = False, overrides: tuple[str, ...] = ()) -> list[str]:
    """``oolong train`` arguments for a flow-started trainer: the prepared spec (or the run
    directory on resume), the run's servers, status reported by the flow."""
    source = ["--resume", str(run_dir)] if resume else ["--config", str(spec_path)]
    return ["train", "--no-progress", *source,
            f"rollout.server_urls=[{','.join(server_urls)}]", "metrics.report_status=false",
            *overrides]


def trainer_command(spec_path: Path, server_urls: list[str], run_dir: Path, *, nproc: int = 1,
                    nnodes: int = 1, node_rank: int = 0, master: tuple[str, int] | None = None,
                    resume: bool = False, overrides: tuple[str, ...] = ()) -> list[str]:
    """The trainer on one node: ``nproc`` ranks (one per GPU it owns) of ``torch.distributed.run``,
    standalone on one node or joining ``master`` (rank 0's node) with ``nnodes`` nodes. One
    process on one node runs directly: no launcher, and the flow sees the trainer's own exit
    status (e.g. killed by SIGKILL)."""
    args = train_args(spec_path, server_urls, run_dir, resume=resume, overrides=overrides)
    if nproc == 1 and nnodes == 1:
        return [sys.executable, "-m", "training_core.cli", *args]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc)]
    if nnodes == 1:
        cmd.append("--standalone")
    else:
        if master is None:
            raise ValueError("a trainer on several nodes needs the rendezvous address (master)")
        cmd += ["--nnodes", str(nnodes), "--node_rank", str(node_rank), "--master_addr",
                master[0], "--master_port", str(master[1])]
    return [*cmd, "--module", "training_core.cli", *args]


def server_process(name: str, cmd: list[str], url: str, log: Path,
                   env: dict[str, str] | None = None) -> ManagedProcess:
    return ManagedProcess(name, cmd, log, env=env, health_url=url + "/health")


def start_fleet(spec: RunSpec, model_dir: str | Path, run_dir: Path, *, seed: int,
                gpus: int = 0, trainer_gpus: int = 1, server_key: str | None = None) -> Fleet:
    """``oolong train``'s own servers on this machine, SGLang or embedded as ``rollout.backend``
    says, each from :func:`server_command` (the one mapping from spec to server flags). With
    ``gpus``: the trainer's ranks hold GPUs ``0..trainer_gpus-1``; the servers take GPUs after
    them when there are enough, else disjoint GPUs shared with the trainer
    (:func:`single_machine_gpus`), their memory fraction sized to leave the trainer its share."""
    spec = spec.model_copy(update={"seed": seed})
    check_nccl(spec)
    width = spec.rollout.num_servers * spec.rollout.tp
    if gpus and gpus - trainer_gpus >= width:
        layout = [tuple(range(trainer_gpus + i * spec.rollout.tp,
                              trainer_gpus + (i + 1) * spec.rollout.tp))
                  for i in range(spec.rollout.num_servers)]
        shared = False
    else:
        _, layout = single_machine_gpus(spec, gpus)
        shared = bool(gpus)
    fleet = Fleet(urls=[])
    try:
        for i, owned in enumerate(layout):
            port = free_port()
            url = f"http://127.0.0.1:{port}"
            fraction = server_mem_fraction(spec, model_dir, shares_trainer_gpu=shared,
                                           gpu_index=owned[0] if owned else 0,
                                           trainer_ranks=trainer_gpus)
            cmd = server_command(spec, str(model_dir), port, i, parent_pid=os.getpid(),
                                 run_dir=run_dir, server_key=server_key, mem_fraction=fraction)
            env = server_env(spec, run_dir, gpus=owned, server_key=server_key)
            fleet.urls.append(url)
            fleet.servers.append(server_process(
                f"rollout server {i}", cmd, url, run_dir / "logs" / f"rollout-server-{i}.log",
                env).start())
        fleet.wait_healthy(600.0 if spec.rollout.backend == "sglang" else 180.0)
    except BaseException:
        fleet.stop()
        raise
    return fleet


def start_embedded_fleet(model_path: str, n: int, log_dir: str | Path, *, threads: int = 1,
                         max_batch_size: int = 256, seed: int = 0, weight_version: int = 0,
                         host: str = "127.0.0.1", dtype: str) -> Fleet:
    """Embedded servers without a run (benchmarks, tests): ``start_fleet`` serves runs."""
    log_dir = Path(log_dir)
    env = process_env({"OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false"})
    fleet = Fleet(urls=[])
    for i in range(n):
        port = free_port()
        url = f"http://{host}:{port}"
        cmd = embedded_server_command(model_path, port, host=host, threads=threads,
                                      max_batch_size=max_batch_size, seed=seed + i,
                                      weight_version=weight_version, parent_pid=os.getpid(),
                                      dtype=dtype)
        fleet.urls.append(url)
        fleet.servers.append(
            server_process(f"rollout server {i}", cmd, url, log_dir / f"rollout-server-{i}.log",
                           env).start())
    try:
        fleet.wait_healthy()
    except BaseException:
        fleet.stop()
        raise
    return fleet
