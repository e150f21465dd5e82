"""Stream one question to several models at once and show the answers side by side.

On a terminal the panel is redrawn as tokens arrive (columns if the terminal is wide enough,
stacked blocks otherwise); when the output is not a terminal it is printed once at the end.
"""

from __future__ import annotations

import asyncio
import shutil
import sys
import textwrap
from typing import TextIO

from loraplex.clients import AsyncLoraplexClient

BASE = "base model"


def layout(answers: dict[str, str], width: int) -> list[str]:
    """The panel's lines: one column per model when each gets >= 24 characters, else stacked."""
    names = list(answers)
    col = (width - 3 * (len(names) - 1)) // len(names)
    if col >= 24:
        wrapped = [[name.upper(), "-" * min(col, len(name))] + textwrap.wrap(answers[name], col) for name in names]
        height = max(len(w) for w in wrapped)
        return [" | ".join((w[i] if i < len(w) else "").ljust(col) for w in wrapped).rstrip() for i in range(height)]
    lines: list[str] = []
    for name in names:
        body = textwrap.wrap(answers[name], max(20, width - 14)) or [""]
        lines += [f"{name[:12]:>12}: {body[0]}"] + [" " * 14 + rest for rest in body[1:]]
    return lines


class Panel:
    """Redraws the panel in place on a terminal; otherwise prints it once when asked."""

    def __init__(self, out: TextIO, live: bool) -> None:
        self.out, self.live, self.drawn = out, live, 0
        self.width = min(shutil.get_terminal_size((120, 40)).columns, 160)

    def draw(self, answers: dict[str, str], final: bool = False) -> None:
        if not self.live and not final:
            return
        lines = layout(answers, self.width)
        if self.live and self.drawn:
            self.out.write(f"\x1b[{self.drawn}F\x1b[J")  # back to the panel's first line, clear below
        self.out.write("\n".join(lines) + "\n")
        self.out.flush()
        self.drawn = len(lines)


async def ask(client: AsyncLoraplexClient, question: str, models: dict[str, str | None], max_new_tokens: int,
              out: TextIO = sys.stdout, raw_prompt: str | None = None) -> dict[str, str]:
    """Stream ``question`` to every model concurrently (name -> adapter id, None = base); return the
    answers. ``raw_prompt``: send this text (ended at the first newline) instead of a chat message,
    for a model without a chat template."""
    answers = {name: "" for name in models}
    panel = Panel(out, live=out.isatty())
    request = (dict(prompt=raw_prompt, stop=["\n"]) if raw_prompt is not None
               else dict(messages=[{"role": "user", "content": question}]))

    async def one(name: str, adapter: str | None) -> None:
        async for event in client.generate(**request, adapter=adapter, max_new_tokens=max_new_tokens):
            answers[name] += event.text
            panel.draw(answers)

    await asyncio.gather(*(one(name, adapter) for name, adapter in models.items()))
    panel.draw({k: v.strip() for k, v in answers.items()}, final=True)
    return answers
