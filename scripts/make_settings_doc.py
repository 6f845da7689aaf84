"""Write docs/settings.md's table of `textgen serve` settings from service/settings/table.py's
Settings (the one table the flags, their environment forms and this page come from),
docs/launcher.md's table of TGI's launcher flags from service/settings/tgi_launcher.py's FLAGS,
and docs/models.md's tables of the model families from service/models/families.py."""

from __future__ import annotations

import re
from pathlib import Path

from textgen.service.models.families import models_table
from textgen.service.settings.table import settings_table
from textgen.service.settings.tgi_launcher import launcher_table

DOCS = Path(__file__).resolve().parents[1] / "docs"
BEGIN, END = "<!-- {} table: begin -->\n", "<!-- {} table: end -->\n"


def write(doc: Path, name: str, table: str) -> None:
    begin, end = BEGIN.format(name), END.format(name)
    text = doc.read_text()
    block = re.compile(re.escape(begin) + ".*?" + re.escape(end), re.DOTALL)
    doc.write_text(block.sub(lambda _: begin + table + end, text))


def main() -> None:
    write(DOCS / "settings.md", "settings", settings_table())
    write(DOCS / "launcher.md", "launcher", launcher_table())
    write(DOCS / "models.md", "models", models_table())


if __name__ == "__main__":
    main()
