"""``oolong``: train, resume, warm-start and serve from a terminal.

    oolong train --config run.yaml trainer.lr=1e-5 rollout.max_staleness=2
    oolong train --resume runs/demo-20261122-101500
    oolong sft --config run.yaml --out runs/demo/initial_model --seconds 30
    oolong serve --model-path DIR --port 30000      # the embedded rollout server
    oolong eval runs/demo-20261122-101500 --version 100 --samples 8   # a stored version
    oolong export runs/demo --version best --out models/demo-best   # a Hugging Face folder
    oolong runs create|list|watch|cancel|compare    # a remote Oolong server (REST API)
    oolong sweeps create|list|show|compare         # runs that differ in one or two fields
    oolong models export|list|show|alias|download  # exported versions in the web app's registry
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path


def _quiet_libraries() -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("DS_ACCELERATOR", "cpu" if not _has_cuda() else "cuda")
    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


def _has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


def _spec(args: argparse.Namespace):
    from training_core.config import SpecError, load_spec

    try:
        return load_spec(args.config, args.overrides)
    except SpecError as exc:
        print(exc, file=sys.stderr)
        raise SystemExit(2) from None


def cmd_train(args: argparse.Namespace) -> int:
    from training_core.config import load_spec
    from training_core.train import train
    from training_core.world import finish_distributed, rank_and_world

    if args.resume:
        spec_path = Path(args.resume) / "spec.yaml"
        if not spec_path.exists():
            print(f"--resume {args.resume}: no spec.yaml there (is it a run directory?)",
                  file=sys.stderr)
            return 2
        spec = load_spec(spec_path, args.overrides)
        result = train(spec, resume_dir=args.resume, progress=not args.no_progress)
    else:
        spec = _spec(args)
        result = train(spec, progress=not args.no_progress)
    world = rank_and_world()[1]
    finish_distributed()
    print(f"run directory: {result.run_dir}")
    if result.first_eval and result.last_eval:
        print(f"greedy eval accuracy: {result.first_eval['eval/accuracy']:.1%} -> "
              f"{result.last_eval['eval/accuracy']:.1%}")
    if world > 1:
        # A rank of a finished run leaves without the interpreter's teardown: a native thread
        # still joinable at exit (DeepSpeed's, gloo's) aborts it ("terminate called without an
        # active exception", seen on a loaded 2-core host) and torchrun then reports the
        # finished run as failed. Everything the run writes is closed by now.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return 0


def cmd_sft(args: argparse.Namespace) -> int:
    from training_core.sft import sft

    out = sft(_spec(args), args.out, steps=args.steps, seconds=args.seconds,
              progress=not args.no_progress)
    print(f"warm-started model: {out}")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from training_core.export import ExportError, export_version

    try:
        result = export_version(args.run, args.version, args.out, merge=args.merge)
    except ExportError as exc:
        print(exc, file=sys.stderr)
        return 2
    where = f"step {result.step}, " if result.step is not None else ""
    print(f"exported version {result.version} ({where}from the {result.source} weights) "
          f"to {result.out}")
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from training_core.rollout_server.server import main as serve_main

    serve_main(args.server_args)
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="oolong", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train", help="run asynchronous RL on this machine")
    t.add_argument("--config", help="run spec YAML")
    t.add_argument("--resume", help="continue the run in this run directory")
    t.add_argument("--no-progress", action="store_true")
    t.add_argument("overrides", nargs="*", help="dotted overrides, e.g. trainer.lr=1e-5")
    t.set_defaults(fn=cmd_train)
    s = sub.add_parser("sft", help="supervised warm start on the task's rows")
    s.add_argument("--config")
    s.add_argument("--out", required=True, help="folder for the warm-started model")
    s.add_argument("--steps", type=int, default=300)
    s.add_argument("--seconds", type=float, default=None)
    s.add_argument("--no-progress", action="store_true")
    s.add_argument("overrides", nargs="*")
    s.set_defaults(fn=cmd_sft)
    e = sub.add_parser("export", help="write one policy version of a run as a Hugging Face folder")
    e.add_argument("run", help="the run directory")
    e.add_argument("--version", default="latest",
                   help="a version number, 'latest' (the newest held) or 'best' (the best "
                        "held-out greedy accuracy recorded)")
    e.add_argument("--out", required=True, help="a new (or empty) folder to write")
    e.add_argument("--merge", action="store_true",
                   help="a LoRA run: write the base with the adapter merged in (default: the "
                        "adapter alone, in peft's layout)")
    e.set_defaults(fn=cmd_export)
    # The server parses its own flags (python -m training_core.rollout_server.server --help):
    # argparse's REMAINDER does not take a first argument that looks like an option, so
    # `oolong serve --model-path DIR` was "unrecognized arguments"; parse() hands them on.
    v = sub.add_parser("serve", help="the embedded rollout server (SGLang API); its flags: "
                       "oolong serve --help-server", add_help=False)
    v.add_argument("server_args", nargs=argparse.REMAINDER)
    v.set_defaults(fn=cmd_serve)
    from training_core.eval_cli import add_eval_parser
    from training_core.models_cli import add_models_parser
    from training_core.runs_cli import add_runs_parser, add_sweeps_parser

    add_eval_parser(sub)

    add_runs_parser(sub)
    add_sweeps_parser(sub)
    add_models_parser(sub)
    return p


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line as ``main`` runs it; nothing is executed (the documented forms are
    checked with it, tests/training_core/test_cli_docs.py)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["serve"]:  # everything after it is the server's own
        rest = ["--help" if a == "--help-server" else a for a in argv[1:]]
        return argparse.Namespace(command="serve", fn=cmd_serve, server_args=rest)
    return build_parser().parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    _quiet_libraries()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    args = parse(argv)
    if args.command in ("runs", "sweeps", "models"):
        from training_core.runs_cli import run_command

        return run_command(args.fn, args)
    return args.fn(args)


if __name__ == "__main__":
    raise SystemExit(main())
