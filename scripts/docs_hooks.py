"""MkDocs hook for the documentation site (``mkdocs.yml``).

The pages in ``docs/`` also read well in the repository, where a few of them link to files
outside ``docs/`` (``../examples/...``, ``../README.md``). Those files are not part of the
site, so on the site each such link becomes the file's path in backticks, relative to the
repository root, as the pages write paths elsewhere. A link to a file that does not exist
stops the build: the link is broken in the repository as well.
"""

from __future__ import annotations

import os
import posixpath
import re

from mkdocs.exceptions import PluginError

_LINK = re.compile(r"(?<!!)\[(?P<text>[^\]]+)\]\((?P<target>\.\./[^)\s#]+)(?P<anchor>#[^)\s]*)?\)")


def on_page_markdown(markdown: str, page, config, files) -> str:
    """Replace each link out of ``docs/`` by the path it names; refuse one to a missing file."""
    docs_dir = config["docs_dir"]
    root = os.path.dirname(os.path.abspath(config["config_file_path"]))
    page_dir = posixpath.dirname(page.file.src_uri)

    def outside(match: re.Match) -> str:
        target = posixpath.normpath(posixpath.join(page_dir, match["target"]))
        path = os.path.normpath(os.path.join(docs_dir, target))
        rel = os.path.relpath(path, root).replace(os.sep, "/")
        if rel.startswith("../"):
            raise PluginError(f"{page.file.src_uri}: link {match['target']!r} points outside the repository")
        if not os.path.exists(path):
            raise PluginError(f"{page.file.src_uri}: link {match['target']!r}: {rel} does not exist")
        text = match["text"].strip("`")
        if text in (rel, posixpath.dirname(rel) + "/"):
            return f"`{text}`"  # the link's text is the path: say it once
        return f"{match['text']} (`{rel}`)"

    return _LINK.sub(outside, markdown)
