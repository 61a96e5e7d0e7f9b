"""The commands of `pagoda chat`, and which lines typed in it are commands.

A line is a command when its first word is "/" and a name: a letter, then letters, digits,
"-" or "_" (`/reset`, `/exit`). A known command runs (they take no arguments); an unknown
one is reported with the list of commands, and nothing goes to the model. Any other line is
text for the model, even one that starts with "/": a "/" before a space, a digit or a sign
("/ hello", "/2"), or a first word with a second "/" (a path: "/usr/bin is ..."). A line that
starts with "//" is text without its first "/": "//etc holds" sends "/etc holds".
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# name -> what it does, in the order /help lists them.
COMMANDS = {
    "/help": "list these commands",
    "/reset": "clear the history (the --system prompt stays)",
    "/exit": "end the chat (also /quit, or Ctrl-D)",
    "/quit": "end the chat",
}
_COMMAND_WORD = re.compile(r"/[A-Za-z][A-Za-z0-9_-]*")


@dataclass(frozen=True)
class ChatLine:
    """One typed line: `command` (a known command's name), `error` (what to tell the user
    instead of running anything), or `text` (the turn for the model); all None: a blank line."""

    command: str | None = None
    error: str | None = None
    text: str | None = None


def help_text() -> str:
    """The commands and the rule for text that starts with "/", as /help and --help show it."""
    width = max(map(len, COMMANDS))
    lines = [f"  {name:<{width}}  {what}" for name, what in COMMANDS.items()]
    rule = [
        'Other lines are text for the model, also those starting with "/" but no command word',
        '("/ hello", "/usr/bin is ..."); a line starting with "//" is sent without its first "/".',
    ]
    return "\n".join(["Commands (a line whose first word is /name):", *lines, *rule])


def parse_chat_line(line: str) -> ChatLine:
    stripped = line.strip()
    if not stripped:
        return ChatLine()
    if stripped.startswith("//"):
        return ChatLine(text=line.replace("/", "", 1))
    word, *rest = stripped.split(maxsplit=1)
    if not _COMMAND_WORD.fullmatch(word):
        return ChatLine(text=line)
    if word not in COMMANDS:
        known = ", ".join(COMMANDS)
        return ChatLine(
            error=f"unknown command {word}: the commands are {known} (start the line with "
            f'"//" to send it to the model as text)'
        )
    if rest:
        return ChatLine(
            error=f'{word} takes no arguments (start the line with "//" to send it to the model '
            "as text)"
        )
    return ChatLine(command=word)
