"""docs/FLAGS.md, rendered from the argument parser itself so the reference cannot drift from the flags:
`python -m hicache.cli_reference > docs/FLAGS.md` (`make docs`); tests/test_docs.py checks the file
equals what this renders."""

from __future__ import annotations

import argparse
import sys

from hicache.cli import build_parser

HEADER = """# hicache flags

Every flag of every `hicache` command, rendered from the argument parser (`make docs` writes this file;
a test fails when it differs from the flags). `hicache COMMAND --help` prints the same. Flags named like
SGLang's mean what SGLang's mean.
"""


def _subcommands(parser: argparse.ArgumentParser, prefix: str = "") -> list[tuple[str, str, argparse.ArgumentParser]]:
    """Every command under `parser`, nested ones (`bench report`) after their parent."""
    commands = []
    for sub in [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]:
        helps = {choice.dest: choice.help or "" for choice in sub._choices_actions}
        for name, command in sub.choices.items():
            commands.append((prefix + name, helps[name], command))
            commands += _subcommands(command, prefix + name + " ")
    return commands


def _default(action: argparse.Action) -> str:
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
        return "off" if action.default is False else "on"
    if action.default is None or action.default is argparse.SUPPRESS:
        return ""
    return f"`{action.default}`"


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _names(action: argparse.Action) -> str:
    names = action.option_strings or [action.dest]
    choices = f" {_cell('{' + ', '.join(map(str, action.choices)) + '}')}" if action.choices else ""
    return ", ".join(f"`{n}`" for n in names) + choices


def _table(actions: list[argparse.Action]) -> list[str]:
    rows = ["| flag | default | meaning |", "| --- | --- | --- |"]
    for action in actions:
        rows.append(f"| {_names(action)} | {_cell(_default(action))} | {_cell(action.help or '')} |")
    return rows


def _groups(command: argparse.ArgumentParser) -> list[tuple[str, list[argparse.Action]]]:
    """A command's argument groups with what they hold, --help left out."""
    groups = []
    for group in command._action_groups:
        actions = [
            a for a in group._group_actions if not isinstance(a, (argparse._HelpAction, argparse._SubParsersAction))
        ]
        if actions:
            groups.append((group.title or "options", actions))
    return groups


def render(parser: argparse.ArgumentParser | None = None) -> str:
    """The markdown reference: groups several commands share (the engine's) once, then each command's own."""
    commands = _subcommands(parser or build_parser())
    users: dict[tuple[str, tuple[str, ...]], list[str]] = {}
    for name, _, command in commands:
        for title, actions in _groups(command):
            users.setdefault((title, tuple(a.dest for a in actions)), []).append(name)
    shared = {key for key, names in users.items() if len(names) > 1}
    lines = [HEADER]
    rendered: set[tuple[str, tuple[str, ...]]] = set()
    for name, help_text, command in commands:
        lines += [f"## hicache {name}", "", _cell(help_text).rstrip(".") + ".", ""]
        seen_before = []
        for title, actions in _groups(command):
            key = (title, tuple(a.dest for a in actions))
            if key in rendered:
                seen_before.append(f'"{title}" (`hicache {users[key][0]}`)')
                continue
            if key in shared:
                rendered.add(key)
                title = f"{title} (shared by {', '.join(f'`{n}`' for n in users[key])})"
            lines += [f"### {title}", "", *_table(actions), ""]
        if seen_before:
            lines += [f"Also the groups {', '.join(seen_before)} above.", ""]
    return "\n".join(lines).rstrip() + "\n"


if __name__ == "__main__":
    sys.stdout.write(render())
