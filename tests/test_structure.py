"""The runtime package's modules form a DAG (module-level and lazy imports alike), and it
never imports the build side."""

import ast
from pathlib import Path

import sparseforge

PACKAGE = Path(sparseforge.__file__).resolve().parent


def module_names() -> dict[str, Path]:
    names = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


def runtime_imports() -> dict[str, set[str]]:
    """{module: sparseforge modules it imports anywhere in its body}. `from P import m` of a
    submodule m counts as importing P.m (P's own __init__ runs first, as for every module of
    P); `from P import name` of anything else counts as importing P."""
    names = module_names()
    graph = {}
    for name, path in names.items():
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module:
                subs = {f"{node.module}.{alias.name}" for alias in node.names}
                found |= subs & names.keys()
                if subs - names.keys():
                    found.add(node.module)
        graph[name] = {m for m in found if m in names and m != name}
    return graph


def test_runtime_modules_form_a_dag():
    graph = runtime_imports()
    state = {}

    def visit(name, path):
        if state.get(name) == "done":
            return
        assert state.get(name) != "open", "import cycle: " + " -> ".join([*path, name])
        state[name] = "open"
        for dep in sorted(graph[name]):
            visit(dep, [*path, name])
        state[name] = "done"

    for name in sorted(graph):
        visit(name, [])


def test_contributing_lists_the_layers():
    """CONTRIBUTING.md's listing: each module at 1 + the highest layer it imports from."""
    graph = runtime_imports()
    layer = {}

    def layer_of(name):
        if name not in layer:
            layer[name] = 1 + max((layer_of(dep) for dep in graph[name]), default=-1)
        return layer[name]

    want = {}
    for name in graph:
        short = name.removeprefix("sparseforge.") if name != "sparseforge" else "__init__"
        want.setdefault(layer_of(name), set()).add(short)
    text = (Path(__file__).resolve().parents[1] / "CONTRIBUTING.md").read_text()
    listing = text[text.index("```\n0  ") + 4 :].split("```")[0]
    listed = {int(n): set(mods) for n, *mods in (line.split() for line in listing.splitlines())}
    assert listed == want


def test_runtime_never_imports_the_build_side():
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.module:
                names.append(node.module)
            assert not [n for n in names if n.split(".")[0] in ("generator", "cutlass")], path


def test_planner_and_sparsity_are_pure_torch():
    """Neither reaches the kernels: the planner imports nothing of ours, sparsity only the
    argument checks and the planner's host-size facts."""
    graph = runtime_imports()
    assert graph["sparseforge.planner"] == set()
    assert graph["sparseforge.sparsity"] <= {"sparseforge.checks", "sparseforge.planner"}


def test_no_plain_cache_holds_a_choice_of_variant():
    """A function that calls families.choose is cached, if at all, with
    families.launch_cache: the choice depends on SPARSEFORGE_VARIANT, which
    functools.cache / lru_cache do not see (a later forced variant would run the first)."""
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.FunctionDef):
                continue
            plain = [d for d in node.decorator_list if "functools" in ast.unparse(d)]
            chooses = any(
                isinstance(c, ast.Call)
                and isinstance(c.func, ast.Attribute)
                and c.func.attr == "choose"
                for c in ast.walk(node)
            )
            assert not (plain and chooses), f"{path.name}: {node.name}"
