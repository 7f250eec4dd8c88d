"""The layout the architecture promises, read from the source tree by
``scripts/architecture_counts.py``: a new side stream outside ``transfer/``, a second copy of
the copy choreography, a keep rule outside ``engine/decide.py`` or a product import of the
test helpers fails here; so does an import cycle among the package's modules, an import of the
planner by the runtime, or two commands importing each other (the import graph, read with
``ast`` below)."""

import ast
import importlib.util
import os

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")


def _counts():
    spec = importlib.util.spec_from_file_location(
        "architecture_counts", os.path.join(ROOT, "scripts", "architecture_counts.py")
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.counts(os.path.join(ROOT, "offloadkit"))


def test_one_transfer_layer_one_decision_module_no_test_helpers_in_the_product():
    counts = _counts()
    assert counts["side streams created outside transfer/"]["count"] == 0, counts
    assert counts["copies of the copy choreography"]["where"] == ["offloadkit/transfer/copy.py:queue_copy"]
    assert counts["keep/offload decision sites outside engine/decide.py"]["count"] == 0, counts
    assert counts["product modules importing test helpers"]["count"] == 0, counts
    assert counts["files that mutate an Entry"]["where"] == ["offloadkit/engine/spans.py"]
    assert counts["prefetch schedulers"]["where"] == ["offloadkit/transfer/prefetch.py:PrefetchScheduler"]
    assert counts["step-timeline hook sites outside transfer/timeline.py"]["count"] == 0, counts


# -- the import graph ------------------------------------------------------------------------
#
# Every ``import`` and ``from ... import`` of every module of the package, at the top of the
# module or inside a function (a lazy import is an arrow all the same: it only hides a cycle
# until the function runs). Imports under ``if TYPE_CHECKING:`` never run and make no cycle.
# An arrow goes to the most specific module named (``from offloadkit.a import b`` is
# ``offloadkit.a.b`` when that is a module, else ``offloadkit.a``), not to the packages above
# it, whose ``__init__`` also runs: those re-export their modules, and an arrow to each would
# put every module in a cycle through ``offloadkit/__init__.py``.

PACKAGE = os.path.join(ROOT, "offloadkit")

# Import cycles among modules that remain, each with why: none.
KNOWN_CYCLES: dict[frozenset[str], str] = {}

# Modules that may import the planner: the planner itself, the commands, the benchmarks, and
# what composes a run from a plan.
MAY_PLAN = ("offloadkit.planning", "offloadkit.cli", "offloadkit.bench", "offloadkit.integrations")
MAY_PLAN_MODULES = ("offloadkit.compose", "offloadkit.components")
# The runtime's component packages: they never import the planner (it imports them).
RUNTIME_PACKAGES = (
    "engine",
    "transfer",
    "storage",
    "checkpointing",
    "longctx",
    "layers",
    "optim",
    "runtime",
    "models",
    "parallel",
    "data",
)
# Other imports of the planner that remain, each with why.
KNOWN_PLANNER_IMPORTS: dict[tuple[str, str], str] = {
    ("offloadkit.config", "offloadkit.planning.options"): (
        "the config reads every component's options, among them the planner's (offload_plan, seq_len, "
        "batch_size), declared in planning/options.py"
    ),
}


def _package_modules() -> dict[str, str]:
    """Module name -> file, for every module of the package."""
    found = {}
    for folder, _, files in os.walk(PACKAGE):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                parts = os.path.relpath(path, os.path.dirname(PACKAGE))[: -len(".py")].split(os.sep)
                if parts[-1] == "__init__":
                    parts = parts[:-1]
                found[".".join(parts)] = path
    return found


def _type_checking_only(tree: ast.AST) -> set[int]:
    """Nodes inside ``if TYPE_CHECKING:`` blocks."""
    inside: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            inside |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    return inside


def _imports(name: str, path: str, modules: dict[str, str], type_checking: bool = False) -> dict[str, int]:
    """The package modules ``name`` imports (at any depth of its code), with the first line
    that does; ``type_checking``: with the imports under ``if TYPE_CHECKING:`` too."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    skipped = set() if type_checking else _type_checking_only(tree)
    package = name if path.endswith("__init__.py") else name.rpartition(".")[0]

    def known(target: str) -> str:
        while target and target not in modules:
            target = target.rpartition(".")[0]
        return target

    out: dict[str, int] = {}
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
        else:
            continue
        for target in targets:
            target = known(target) if target.split(".")[0] == "offloadkit" else ""
            if target and target != name:
                out.setdefault(target, node.lineno)
    return out


def _graph(type_checking: bool = False) -> dict[str, dict[str, int]]:
    modules = _package_modules()
    return {name: _imports(name, path, modules, type_checking) for name, path in modules.items()}


def _cycles(graph: dict[str, dict[str, int]]) -> list[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[frozenset[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(frozenset(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _describe(graph: dict[str, dict[str, int]], component: frozenset[str]) -> str:
    return "; ".join(
        f"{a} -> {b} (line {line})" for a in sorted(component) for b, line in sorted(graph[a].items()) if b in component
    )


def test_the_import_graph_reads_lazy_imports_and_skips_type_checking_ones():
    graph = _graph()
    # A function-level import is an arrow: Budgets.measure imports the rate probes when called.
    assert "offloadkit.planning.rates" in graph["offloadkit.planning.budgets"]
    # ``from offloadkit.longctx.footprint import (...)``: the module, not the package.
    assert "offloadkit.longctx.footprint" in graph["offloadkit.planning.memory"]
    assert "offloadkit.longctx" not in graph["offloadkit.planning.memory"]
    # A component's record names the runtime it builds into only for the type checker.
    typed = _graph(type_checking=True)
    assert "offloadkit.compose" in typed["offloadkit.longctx.component"]
    assert "offloadkit.compose" not in graph["offloadkit.longctx.component"]


def test_no_import_cycle_among_the_packages_modules():
    graph = _graph()
    new = [c for c in _cycles(graph) if c not in KNOWN_CYCLES]
    assert not new, "import cycles (lazy imports count):\n" + "\n".join(_describe(graph, c) for c in new)


def test_the_runtime_does_not_import_the_planner():
    """The planner imports the runtime's figures and rules (``tests/cpu/
    test_planner_runtime_constants.py``); no arrow points back, from the runtime's component
    packages or from anything else but the commands, the benchmarks and what composes a run."""
    graph = _graph(type_checking=True)
    found = {}
    for name, targets in graph.items():
        if name.startswith(tuple(p + "." for p in MAY_PLAN)) or name in MAY_PLAN + MAY_PLAN_MODULES:
            continue
        for target, line in targets.items():
            if target == "offloadkit.planning" or target.startswith("offloadkit.planning."):
                found[(name, target)] = line
    runtime = [k for k in found if k[0].split(".")[1] in RUNTIME_PACKAGES and k not in KNOWN_PLANNER_IMPORTS]
    assert not runtime, f"runtime component packages import the planner: {runtime}"
    new = {k: line for k, line in found.items() if k not in KNOWN_PLANNER_IMPORTS}
    assert not new, f"modules import the planner (module, planner module): line: {new}"


def test_the_commands_do_not_import_each_other_in_a_circle():
    graph = _graph()
    cli = {
        name: {t: n for t, n in targets.items() if t.startswith("offloadkit.cli.")} for name, targets in graph.items()
    }
    cli = {name: targets for name, targets in cli.items() if name.startswith("offloadkit.cli.")}
    assert not _cycles(cli), [_describe(cli, c) for c in _cycles(cli)]
    # What the run and the plain run it is compared with both need lives in cli/build.py.
    assert "offloadkit.cli.train" not in graph["offloadkit.cli.compare"]
    assert "offloadkit.cli.build" in graph["offloadkit.cli.compare"]


def test_a_config_key_is_spelled_where_its_option_is_declared_and_in_the_flat_config():
    """Code that writes a config from options (a plan, a bench mode) asks the options class for
    the key (``Options.config_keys``): a key appears in its options class, ``OffloadConfig``
    and at most two more product files."""
    import re

    for key in ("keep_attention_outputs", "attention_head_groups"):
        pattern = re.compile(rf"\b{key}\b")
        files = []
        for path in _package_modules().values():
            with open(path, encoding="utf-8") as f:
                if pattern.search(f.read()):
                    files.append(os.path.relpath(path, ROOT))
        assert len(files) <= 4, (key, files)


def test_config_keys_are_read_from_the_options_fields():
    import pytest

    from offloadkit.checkpointing.options import CheckpointOptions
    from offloadkit.longctx.options import LongContextOptions

    assert CheckpointOptions.config_keys(enabled=True, keep_attention=2) == {
        "gradient_checkpointing": True,
        "keep_attention_outputs": 2,
    }
    assert LongContextOptions.config_keys(head_groups=4) == {"attention_head_groups": 4}
    with pytest.raises(ValueError, match="no field set by a config key named keep_attention_outputs"):
        CheckpointOptions.config_keys(keep_attention_outputs=True)
