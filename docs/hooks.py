"""mkdocs hooks (mkdocs.yml ``hooks:``): the site also serves ``format-spec/`` and the package's
sources, so that the docs' links to them (``../format-spec/format.md``, ``../ckptstore/dcp.py``:
relative paths that work when reading the Markdown in the repository) resolve and are checked
by ``mkdocs build --strict`` like any other link."""

from __future__ import annotations

import os
import re

from mkdocs.structure.files import File

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: top-level folders of the repository the docs link into, and the files of each served
_SERVED = {"format-spec": (".md", ".json"), "ckptstore": (".py", ".c")}
_LINK = re.compile(r"\]\(\.\./(" + "|".join(map(re.escape, _SERVED)) + r")/")


def on_files(files, config):
    for top, suffixes in _SERVED.items():
        for dirpath, dirnames, filenames in os.walk(os.path.join(_ROOT, top)):
            dirnames[:] = sorted(d for d in dirnames if not d.startswith((".", "__")))
            for name in sorted(filenames):
                if name.endswith(suffixes):
                    rel = os.path.relpath(os.path.join(dirpath, name), _ROOT)
                    files.append(File(rel, _ROOT, config["site_dir"], config["use_directory_urls"]))
    return files


def on_page_markdown(markdown, page, config, files):
    # a page of docs/ links ../format-spec/x.md; on the site format-spec/ sits beside it
    if "/" not in page.file.src_uri and not page.file.src_uri.startswith(tuple(_SERVED)):
        markdown = _LINK.sub(r"](\1/", markdown)
    return markdown
