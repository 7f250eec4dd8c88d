"""Counts of the library's layout that its architecture promises, read from the source tree.

    python scripts/architecture_counts.py [--root offloadkit] [--json]

Each count is found by reading the code (Python's ``ast``), not by a registry the code keeps,
so a new side stream or a second copy of the copy choreography shows up here:

- side streams created outside ``transfer/``: calls to ``torch.cuda.Stream(...)``;
- files that mutate an ``Entry``: assignments to an attribute only ``Entry`` has (its
  backward-state and merge fields), through any name but ``self``;
- keep/offload decision sites: modules that return a keep reason or record one as a literal
  (``note_kept("...")``) other than ``engine/decide.py``;
- copies of the copy choreography: functions that order a stream (``wait_stream`` or
  ``wait_event``), queue a copy and record its event;
- prefetch schedulers: classes with a look-ahead loop: a ``for`` loop that queues a fetch or
  load (a call named ``fetch``, ``load``, ``_queue_in`` or ``prefetch...``, with or without a
  leading underscore) and stops on a condition (``break``/``return`` inside it), whatever the
  method is called;
- step-timeline hook sites outside ``transfer/timeline.py``: calls that arm a backward point
  (a grad_fn ``register_prehook``) or queue an end-of-backward callback
  (``queue_engine_callback``): each transfer client must get them from the one timeline;
- product modules importing the test helpers (``offloadkit.testing``).

The test helpers themselves (``offloadkit/testing``) are not product code and are skipped.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import sys

KEEP_REASONS = {"closed", "backward", "excluded", "unsupported", "device", "small", "parameter", "budget"}
# Fields of engine.spans.Entry that no other class of the library has.
ENTRY_ONLY_FIELDS = {
    "gpu_ready",
    "gpu_guard",
    "gpu_stream",
    "merged_into",
    "span_start",
    "span_end",
    "src_stream",
    "waiting",
    "born",
}


def _modules(root: str):
    for folder, _, files in os.walk(root):
        if os.path.relpath(folder, root).split(os.sep)[0] == "testing":
            continue
        for name in sorted(files):
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                with open(path, encoding="utf-8") as f:
                    yield os.path.relpath(path, os.path.dirname(os.path.abspath(root))), ast.parse(f.read())


def _is_call_to(node: ast.AST, attr: str) -> bool:
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == attr


def _side_streams(path: str, tree: ast.AST) -> int:
    if "/transfer/" in f"/{path}":
        return 0
    return sum(1 for n in ast.walk(tree) if _is_call_to(n, "Stream"))


def _mutates_entry(tree: ast.AST) -> bool:
    """Assigns an Entry-only field: through ``self`` inside ``class Entry``, through any other
    name anywhere."""
    inside_entry = set()
    for cls in ast.walk(tree):
        if isinstance(cls, ast.ClassDef) and cls.name == "Entry":
            inside_entry |= {id(n) for n in ast.walk(cls)}
    for n in ast.walk(tree):
        targets = n.targets if isinstance(n, ast.Assign) else [n.target] if isinstance(n, ast.AugAssign) else []
        for t in targets:
            for leaf in ast.walk(t):
                if not (isinstance(leaf, ast.Attribute) and leaf.attr in ENTRY_ONLY_FIELDS):
                    continue
                through_self = isinstance(leaf.value, ast.Name) and leaf.value.id == "self"
                if not through_self or id(n) in inside_entry:
                    return True
    return False


def _decides(path: str, tree: ast.AST) -> bool:
    if path.endswith(os.path.join("engine", "decide.py")):
        return False
    for n in ast.walk(tree):
        if isinstance(n, ast.Return) and isinstance(n.value, ast.Constant) and n.value.value in KEEP_REASONS:
            return True
        if _is_call_to(n, "note_kept") and n.args and isinstance(n.args[0], ast.Constant):
            return True
    return False


def _choreographies(tree: ast.AST) -> list[str]:
    out = []
    for fn in ast.walk(tree):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        calls = [n for n in ast.walk(fn) if isinstance(n, ast.Call)]
        names = {c.func.attr if isinstance(c.func, ast.Attribute) else getattr(c.func, "id", "") for c in calls}
        copies = bool(names & {"copy_", "copy_on", "_enqueue"})
        if copies and "record_event" in names and names & {"wait_stream", "wait_event"}:
            out.append(fn.name)
    return out


_FETCHES = {"fetch", "load", "queue_in"}


def _fetch_call(node: ast.AST) -> bool:
    if not isinstance(node, ast.Call):
        return False
    name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
    name = name.lstrip("_")
    return name in _FETCHES or name.startswith("prefetch")


def _prefetchers(tree: ast.AST) -> list[str]:
    out = []
    for cls in ast.walk(tree):
        if not isinstance(cls, ast.ClassDef):
            continue
        for loop in ast.walk(cls):
            if not isinstance(loop, ast.For):
                continue
            inner = [n for stmt in loop.body for n in ast.walk(stmt)]
            if any(_fetch_call(n) for n in inner) and any(isinstance(n, (ast.Break, ast.Return)) for n in inner):
                out.append(cls.name)
                break
    return out


def _timeline_hooks(path: str, tree: ast.AST) -> int:
    if path.endswith(os.path.join("transfer", "timeline.py")):
        return 0
    return sum(
        1
        for n in ast.walk(tree)
        if _is_call_to(n, "register_prehook")
        or (isinstance(n, ast.Call) and getattr(n.func, "id", getattr(n.func, "attr", "")) == "queue_engine_callback")
    )


def _imports_testing(tree: ast.AST) -> bool:
    for n in ast.walk(tree):
        if isinstance(n, ast.ImportFrom) and (n.module or "").startswith("offloadkit.testing"):
            return True
        if isinstance(n, ast.Import) and any(a.name.startswith("offloadkit.testing") for a in n.names):
            return True
    return False


def counts(root: str) -> dict:
    """The counts for the package at ``root``, each with where it was found."""
    found: dict[str, list[str]] = {
        "side streams created outside transfer/": [],
        "files that mutate an Entry": [],
        "keep/offload decision sites outside engine/decide.py": [],
        "copies of the copy choreography": [],
        "prefetch schedulers": [],
        "step-timeline hook sites outside transfer/timeline.py": [],
        "product modules importing test helpers": [],
    }
    for path, tree in _modules(root):
        found["side streams created outside transfer/"] += [path] * _side_streams(path, tree)
        if _mutates_entry(tree):
            found["files that mutate an Entry"].append(path)
        if _decides(path, tree):
            found["keep/offload decision sites outside engine/decide.py"].append(path)
        found["copies of the copy choreography"] += [f"{path}:{name}" for name in _choreographies(tree)]
        found["prefetch schedulers"] += [f"{path}:{name}" for name in _prefetchers(tree)]
        found["step-timeline hook sites outside transfer/timeline.py"] += [path] * _timeline_hooks(path, tree)
        if _imports_testing(tree):
            found["product modules importing test helpers"].append(path)
    return {k: {"count": len(v), "where": v} for k, v in found.items()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", default=os.path.join(os.path.dirname(__file__), "..", "offloadkit"))
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = parser.parse_args(argv)
    result = counts(args.root)
    if args.json:
        print(json.dumps(result, indent=1))
        return 0
    for name, item in result.items():
        print(f"{item['count']:3d}  {name}" + (f": {', '.join(item['where'])}" if item["where"] else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
