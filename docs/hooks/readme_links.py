"""MkDocs hook: the site's front page is README.md and its changelog page is
CHANGELOG.md, so that each is written once.

``docs/index.md`` and ``docs/changelog.md`` are stubs that point to those
files; at build time their Markdown is replaced by the file's, with the
README's repository-relative links (``docs/semantics.md``) made relative to
the site (``semantics.md``). ``--strict`` then checks every link of the
README as a page of the site."""

from __future__ import annotations

import re
from pathlib import Path

SOURCES = {"index.md": "README.md", "changelog.md": "CHANGELOG.md"}


def on_page_markdown(markdown, page, config, files):
    source = SOURCES.get(page.file.src_uri)
    if source is None:
        return markdown
    text = (Path(config["config_file_path"]).parent / source).read_text(encoding="utf-8")
    text = re.sub(r"\]\(docs/", "](", text)
    return text.replace("](CHANGELOG.md)", "](changelog.md)")
