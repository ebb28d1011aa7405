"""Every `flashdraft` command line in the guides' code blocks parses: an option renamed or removed in the code leaves
no command behind that a reader would copy and see refused. Only the parsing is checked (nothing runs); words in
capitals (DRAFT, RUNS/...) are placeholders and parse as the strings they are."""

import contextlib
import io
import re
import shlex
from pathlib import Path

import pytest

from flashdraft.cli import build_parser

REPOSITORY = Path(__file__).resolve().parents[1]
GUIDES = ("README.md", "BENCHMARKS.md", "docs/*.md", "benchmarks/**/*.md")  # docs/history/ records what was
FENCED = re.compile(r"^```[\w-]*\n(.*?)^```", re.S | re.M)
# A command starts a line or follows a shell operator; it ends at the next operator, redirection or comment.
COMMAND = re.compile(r"(?:^|&&|\|\||;|\$\()\s*(flashdraft\s[^&;|()>#\n]*)", re.M)


def documented_commands(text: str) -> list[str]:
    """The `flashdraft ...` command lines in the fenced code blocks of `text`, continuation lines joined."""
    found = []
    for block in FENCED.findall(text):
        joined = re.sub(r"\s*\\\n\s*", " ", block)
        found += [match.strip() for match in COMMAND.findall(joined) if "[" not in match]  # "[--opt N]": a synopsis
    return found


def parse_error(parser, command: str) -> str | None:
    """argparse's complaint about `command`, or None when it parses."""
    errors = io.StringIO()
    try:
        with contextlib.redirect_stderr(errors), contextlib.redirect_stdout(io.StringIO()):
            parser.parse_args(shlex.split(command)[1:])
    except SystemExit as stop:
        if stop.code:
            return errors.getvalue().strip().splitlines()[-1]
    return None


def guides() -> list[Path]:
    return sorted({path for pattern in GUIDES for path in REPOSITORY.glob(pattern)
                   if "history" not in path.parts})


def test_every_documented_command_line_parses():
    parser = build_parser()
    commands = [(path, command) for path in guides() for command in documented_commands(path.read_text())]
    assert len(commands) > 50  # the extraction still finds the guides' commands
    refused = [f"{path.relative_to(REPOSITORY)}: {command}\n    {error}" for path, command in commands
               if (error := parse_error(parser, command)) is not None]
    assert refused == [], "documented commands the command line refuses:\n" + "\n".join(refused)


def test_the_extraction_joins_continued_lines_and_stops_at_operators_and_comments():
    text = ("Prose with `flashdraft inline` is not a block.\n```bash\n"
            "pip install x && flashdraft generate --max-new-tokens 8 \\\n    \"a prompt\" # a comment\n"
            "python -c 'from flashdraft import thing'\n"
            "flashdraft corpus train-folder DIR [--records N]\n"
            "time flashdraft bench --replay | tee out.txt\n```\n")
    assert documented_commands(text) == ['flashdraft generate --max-new-tokens 8 "a prompt"']


@pytest.mark.parametrize("command, problem", [
    ("flashdraft generate --max-tokens 8 hi", "unrecognized arguments: --max-tokens"),
    ("flashdraft draft nonesuch", "invalid choice: 'nonesuch'"),
])
def test_a_stale_option_or_command_is_reported(command, problem):
    assert problem in parse_error(build_parser(), command)
