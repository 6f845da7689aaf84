"""Write docs/settings.md's table of `textgen serve` settings from service/config.py's
Settings (the one table the flags, their environment forms and this page come from)."""

from __future__ import annotations

import re
from pathlib import Path

from textgen.service.config import settings_table

DOC = Path(__file__).resolve().parents[1] / "docs" / "settings.md"
BEGIN, END = "<!-- settings table: begin -->\n", "<!-- settings table: end -->\n"


def main() -> None:
    text = DOC.read_text()
    block = re.compile(re.escape(BEGIN) + ".*?" + re.escape(END), re.DOTALL)
    DOC.write_text(block.sub(lambda _: BEGIN + settings_table() + END, text))


if __name__ == "__main__":
    main()
