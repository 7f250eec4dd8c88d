"""The documentation site's config (``mkdocs.yml``) and the pages in ``docs/`` agree: every
page is in the nav, every nav entry is a page, and the build is strict. These read the YAML
only; ``bash scripts/test.sh`` runs the build itself (``mkdocs build --strict``)."""

import importlib.util
import os
import types

import pytest

yaml = pytest.importorskip("yaml")

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _config() -> dict:
    with open(os.path.join(REPO, "mkdocs.yml")) as f:
        return yaml.safe_load(f)


def _nav_files(nav) -> list[str]:
    """Every page a nav names, in order: entries are "page.md", {title: "page.md"} or
    {title: [entries]} (sections); external links are not pages."""
    out: list[str] = []
    for entry in nav:
        if isinstance(entry, dict):
            for value in entry.values():
                out.extend(_nav_files(value) if isinstance(value, list) else _nav_files([value]))
        elif isinstance(entry, str) and "://" not in entry:
            out.append(entry)
    return out


def _pages(docs_dir: str) -> list[str]:
    pages = []
    for root, _dirs, files in os.walk(docs_dir):
        for name in files:
            if name.endswith(".md"):
                pages.append(os.path.relpath(os.path.join(root, name), docs_dir).replace(os.sep, "/"))
    return sorted(pages)


def test_the_build_is_strict_and_checks_anchors_and_omitted_pages():
    cfg = _config()
    assert cfg["strict"] is True
    assert cfg.get("docs_dir", "docs") == "docs"
    for key in ("omitted_files", "anchors"):
        assert cfg["validation"][key] == "warn", key  # a warning, so strict fails on it


def test_every_page_is_in_the_nav_and_every_nav_entry_is_a_page():
    cfg = _config()
    docs_dir = os.path.join(REPO, cfg.get("docs_dir", "docs"))
    nav = _nav_files(cfg["nav"])
    pages = _pages(docs_dir)
    assert pages, "no pages in docs/"
    missing_from_nav = sorted(set(pages) - set(nav))
    assert not missing_from_nav, f"pages in docs/ that mkdocs.yml's nav leaves out: {missing_from_nav}"
    missing_files = [entry for entry in nav if not os.path.isfile(os.path.join(docs_dir, entry))]
    assert not missing_files, f"nav entries with no file in docs/: {missing_files}"
    assert len(nav) == len(set(nav)), "a page is in the nav twice"


def test_nav_files_reads_sections_and_titles():
    nav = [{"Home": "index.md"}, {"Tasks": ["a.md", {"B": "sub/b.md"}]}, {"Site": "https://example.org/"}]
    assert _nav_files(nav) == ["index.md", "a.md", "sub/b.md"]


def test_the_api_page_documents_the_package():
    with open(os.path.join(REPO, "docs", "api.md")) as f:
        assert "::: offloadkit\n" in f.read()  # mkdocstrings renders the names in offloadkit.__all__


def test_site_dir_is_ignored():
    with open(os.path.join(REPO, ".gitignore")) as f:
        assert "/site/" in f.read().split()


def _hook() -> types.ModuleType:
    spec = importlib.util.spec_from_file_location("docs_hooks", os.path.join(REPO, "scripts", "docs_hooks.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _page(src_uri: str):
    return types.SimpleNamespace(file=types.SimpleNamespace(src_uri=src_uri))


def test_links_out_of_docs_become_paths_and_a_missing_target_stops_the_build():
    pytest.importorskip("mkdocs")
    from mkdocs.exceptions import PluginError

    hook = _hook()
    config = {"docs_dir": os.path.join(REPO, "docs"), "config_file_path": os.path.join(REPO, "mkdocs.yml")}
    text = (
        "A config: [examples/quickstart-cpu.yaml](../examples/quickstart-cpu.yaml); all of them in "
        "[examples/](../examples/README.md); the [README](../README.md); [a page](planner.md#x)."
    )
    out = hook.on_page_markdown(text, page=_page("disk-tier.md"), config=config, files=None)
    assert out == (
        "A config: `examples/quickstart-cpu.yaml`; all of them in `examples/`; the README (`README.md`); "
        "[a page](planner.md#x)."
    )
    with pytest.raises(PluginError, match="examples/no-such.yaml does not exist"):
        hook.on_page_markdown("[x](../examples/no-such.yaml)", page=_page("a.md"), config=config, files=None)
