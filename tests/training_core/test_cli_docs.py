"""Every ``oolong`` command the README and docs show parses as written (a dry run: nothing runs).

`oolong serve --model-path DIR --port P`, as the README, docs/engine.md and the CLI help wrote
it, exited with "unrecognized arguments" and nothing tested it."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from training_core import cli

pytestmark = pytest.mark.unit  # no process, network or database (conftest)

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def documented_commands() -> list[tuple[str, list[str]]]:
    """(where, argv) of each ``oolong ...`` line inside a fenced code block."""
    found = []
    for path in DOCS:
        inside, pending = False, ""
        for no, line in enumerate(path.read_text().splitlines(), 1):
            if line.lstrip().startswith("```"):
                inside, pending = not inside, ""
                continue
            if not inside:
                continue
            line = pending + line.split(" #")[0].rstrip()
            if line.endswith("\\"):
                pending = line[:-1] + " "
                continue
            pending = ""
            for part in line.split(";"):
                if re.match(r"\s*(\.venv/bin/)?oolong\s", part):
                    found.append((f"{path.relative_to(ROOT)}:{no}", shlex.split(part)[1:]))
    return found


COMMANDS = documented_commands()


def test_the_docs_show_commands_of_every_kind():
    kinds = {argv[0] + (" " + argv[1] if argv[0] in ("runs", "sweeps") else "")
             for _, argv in COMMANDS}
    assert {"train", "serve", "runs create", "sweeps create"} <= kinds


@pytest.mark.parametrize(("where", "argv"), COMMANDS, ids=[w for w, _ in COMMANDS])
def test_a_documented_command_parses_as_written(where, argv, monkeypatch):
    args = cli.parse(argv)
    assert args.command == argv[0]
    if args.command == "serve":  # the server's own parser takes the rest; stop before it starts
        from training_core.rollout_server import server

        class Parsed(Exception):
            pass

        def engine(**kwargs):
            raise Parsed(kwargs)

        monkeypatch.setattr(server, "EngineProcess", engine)
        with pytest.raises(Parsed):
            server.main(args.server_args)


def test_a_wrong_flag_is_still_refused():
    with pytest.raises(SystemExit):
        cli.parse(["train", "--no-such-flag"])
