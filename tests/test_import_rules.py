"""The layout's import rules, checked on every import in src/sluice: module level and inside functions,
`import a.b` and `from a import b`, absolute and relative. A lazy import is still an arrow: it only
moves the moment the circle or the upward dependency bites.

1. No circles: no module reaches itself through the imports of other modules.
2. Arrows point down: a module imports from its own package or from a lower row of LAYERS, never from a
   higher row nor from another package of its own row.
3. No private names across modules: no `from m import _x`, and no `m._x` on an imported sluice module.
4. Every other package src/sluice imports is declared in pyproject.toml: a dependency, or an extra for
   the few modules of OPTIONAL (which say which extra when it is missing).

The package root (sluice/__init__.py re-exports the public API) and __main__ are the top: they may
import anything, and nothing imports the root except for ROOT_NAMES.
"""

from __future__ import annotations

import ast
import functools
import importlib.metadata
import re
import sys
import tomllib
from pathlib import Path

# the repository root, wherever under tests/ this file sits
SRC = next(p for p in Path(__file__).resolve().parents if (p / "pyproject.toml").is_file()) / "src"

# Low to high. A package may import the packages of lower rows; packages in one row never import each other.
LAYERS = [
    ("sluice.errors",),
    ("sluice.model",),  # what a checkpoint becomes; model.hub finds a checkpoint's directory
    ("sluice.text",),  # tokenizer + chat template: reads the checkpoint directory model.hub resolves
    ("sluice.engine",),
    ("sluice.parallel", "sluice.training"),  # training gets the valve probe handed in by the CLI
    ("sluice.observatory", "sluice.llm"),  # the observatory measures what is below it, a rank model included
    ("sluice.server", "sluice.benchmarks", "sluice.demo"),
    ("sluice.cli",),  # every argparse parser
]
TOP = {"sluice", "sluice.__main__"}
ROOT_NAMES = {"__version__"}


def package_of(module: str) -> str:
    return ".".join(module.split(".")[:2])


def layer_of(module: str) -> int | None:
    return next((i for i, row in enumerate(LAYERS) if package_of(module) in row), None)


def private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def modules(src: Path = SRC) -> dict[str, tuple[Path, bool]]:
    """Dotted name -> (file, is a package's __init__)."""
    out = {}
    for path in sorted((src / "sluice").rglob("*.py")):
        parts = list(path.relative_to(src).with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        out[".".join(parts[:-1] if is_pkg else parts)] = (path, is_pkg)
    return out


def imports(module: str, path: Path, is_pkg: bool, known: set[str]):
    """(line, target module, name taken from it or None) for every sluice import in the file."""
    tree = ast.parse(path.read_text(), str(path))
    aliases = {}  # local name -> the sluice module it is bound to
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "sluice":
                    found.append((node.lineno, a.name, None))
                    aliases[a.asname or "sluice"] = a.name if a.asname else "sluice"
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: up from this module's package
                base = module.split(".") if is_pkg else module.split(".")[:-1]
                base = base[:len(base) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            if source.split(".")[0] != "sluice":
                continue
            for a in node.names:
                sub = f"{source}.{a.name}"
                if sub in known:  # `from pkg import module`
                    found.append((node.lineno, sub, None))
                    aliases[a.asname or a.name] = sub
                else:
                    found.append((node.lineno, source, a.name))
    for node in ast.walk(tree):  # `m._x` on a name bound to a sluice module
        if isinstance(node, ast.Attribute) and private(node.attr):
            root = node.value
            while isinstance(root, ast.Attribute):
                root = root.value
            if isinstance(root, ast.Name) and root.id in aliases:
                found.append((node.lineno, aliases[root.id], node.attr))
    return found


def check(src: Path = SRC) -> list[str]:
    """Every broken rule, one line each (empty: the layout holds)."""
    known = modules(src)
    problems, edges = [], {}
    for module, (path, is_pkg) in known.items():
        where = path.relative_to(src)
        for line, target, name in imports(module, path, is_pkg, known):
            if target not in known:
                problems.append(f"{where}:{line}: imports {target}, which is not a module of src/sluice")
                continue
            if target != module:
                edges.setdefault(module, {}).setdefault(target, line)
            if name is not None and private(name) and target != module:
                problems.append(f"{where}:{line}: takes the private name {name} from {target} "
                                "(make it public where it is a shared helper, or move it)")
            if module in TOP or target == module:
                continue
            if target == "sluice":
                if name not in ROOT_NAMES:
                    what = f"takes {name} from the package root" if name else "imports the package root"
                    problems.append(f"{where}:{line}: {what} (it re-exports the public API; only "
                                    f"{', '.join(sorted(ROOT_NAMES))} may be taken from it): import the module "
                                    "that defines it")
                continue
            mine, theirs = layer_of(module), layer_of(target)
            for m, layer in ((module, mine), (target, theirs)):
                if layer is None and m not in TOP:
                    problems.append(f"{where}:{line}: {package_of(m)} is in no row of LAYERS "
                                    "(tests/test_import_rules.py): give it its place")
            if mine is None or theirs is None or package_of(module) == package_of(target):
                continue
            if theirs >= mine:
                how = "a higher" if theirs > mine else "the same"
                problems.append(f"{where}:{line}: {module} imports {target}, from {how} layer "
                                f"({package_of(module)} is in row {mine} of LAYERS, {package_of(target)} in "
                                f"row {theirs}): arrows point down")
    problems += [f"import circle: {' -> '.join(c)}" for c in circles(edges)]
    return problems


def circles(edges: dict[str, dict[str, int]]) -> list[list[str]]:
    """One cycle per strongly connected component of more than one module (Tarjan)."""
    index, low, stack, on, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(cycle_in(sorted(comp), edges))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def cycle_in(comp: list[str], edges: dict[str, dict[str, int]]) -> list[str]:
    """A concrete path start -> ... -> start inside one strongly connected component (breadth first)."""
    members, start = set(comp), comp[0]
    came = {start: None}
    queue = [start]
    while queue:
        v = queue.pop(0)
        for w in sorted(edges.get(v, {})):
            if w == start:
                path = [v]
                while came[path[-1]] is not None:
                    path.append(came[path[-1]])
                return path[::-1] + [start]
            if w in members and w not in came:
                came[w] = v
                queue.append(w)
    return comp


def test_the_layout_keeps_its_import_rules():
    problems = check()
    assert not problems, "the import rules are broken:\n" + "\n".join(problems)


def write(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


def test_the_checker_sees_lazy_circles_upward_arrows_and_private_names(tmp_path):
    """The checker on a made-up tree: each kind of breakage, written the ways that slip past a reader."""
    src = write(tmp_path, {
        "sluice/__init__.py": "__version__ = '0'\n",
        "sluice/errors.py": "",
        "sluice/llm.py": "",
        "sluice/engine/__init__.py": "",
        "sluice/engine/runner.py": ("def f():\n    from ..llm import LLM\n"  # lazy, upward
                                    "from . import cache\nx = cache._slots\n"),  # a private name through the module
        "sluice/engine/cache.py": "def g():\n    from sluice.engine.runner import _step\n",  # private; a circle
        "sluice/model/__init__.py": "import sluice.text.tok\n",  # upward, as `import a.b`
        "sluice/text/__init__.py": "",
        "sluice/text/tok.py": "from .. import __version__\nfrom .. import llm\nimport sluice\n",
        "sluice/parallel/__init__.py": "",
        "sluice/training/__init__.py": "from ..parallel import group\n",  # sideways
        "sluice/bogus/__init__.py": "from ..errors import SluiceError\n",
    })
    problems = check(src)
    text = "\n".join(problems)
    for expected in ("sluice.engine.runner imports sluice.llm, from a higher layer",
                     "takes the private name _slots from sluice.engine.cache",
                     "takes the private name _step from sluice.engine.runner",
                     "sluice.model imports sluice.text.tok, from a higher layer",
                     "sluice.text.tok imports sluice.llm, from a higher layer",
                     "tok.py:3: imports the package root (it re-exports",
                     "sluice.training imports sluice.parallel, from the same layer",
                     "sluice.bogus is in no row of LAYERS",
                     "import circle: sluice.engine.cache -> sluice.engine.runner -> sluice.engine.cache"):
        assert expected in text, f"missing {expected!r} in:\n{text}"
    assert len(problems) == 9, text  # the root's __version__ is allowed


# Imported by src/sluice but not a dependency: the extra that brings it, and the only modules that may use it.
OPTIONAL = {"transformers": ("peers", {"sluice.benchmarks.speed_engines"}),
            "xarray": ("notebook", {"sluice.observatory.export"}),
            "pandas": ("notebook", {"sluice.observatory.export"})}
# Never installed by sluice: the llama.cpp peer runs this worker under its own interpreter (--llama-python).
ELSEWHERE = {"llama_cpp": {"sluice.benchmarks.lcpp_worker"}}


def requirement_name(req: str) -> str:
    return re.split(r"[\s\[<>=!~;]", req.strip(), maxsplit=1)[0].lower().replace("_", "-")


def distribution(top_module: str) -> str:
    """The distribution that installs an import name (the name itself when it is not installed here,
    e.g. tomli on Python 3.11+)."""
    dists = installed().get(top_module) or [top_module]
    return dists[0].lower().replace("_", "-")


@functools.cache
def installed() -> dict[str, list[str]]:
    return importlib.metadata.packages_distributions()  # reads every installed distribution: once


def test_every_third_party_import_is_declared():
    project = tomllib.loads((SRC.parent / "pyproject.toml").read_text())["project"]
    core = {requirement_name(r) for r in project["dependencies"]}
    extras = {k: {requirement_name(r) for r in v} for k, v in project["optional-dependencies"].items()}
    problems = []
    for module, (path, _) in modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module] if isinstance(node, ast.ImportFrom) and not node.level else [])
            for top in {n.split(".")[0] for n in names} - set(sys.stdlib_module_names) - {"sluice"}:
                where = f"{path.relative_to(SRC)}:{node.lineno}: {top}"
                if top in ELSEWHERE:
                    ok = module in ELSEWHERE[top]
                elif top in OPTIONAL:
                    extra, users = OPTIONAL[top]
                    ok = module in users and distribution(top) in extras.get(extra, set())
                else:
                    ok = distribution(top) in core
                if not ok:
                    problems.append(where)
    assert not problems, ("imports that pyproject.toml does not declare (or an optional one used outside "
                          "OPTIONAL):\n" + "\n".join(problems))
    # the tests' reference: the test extra brings it, by name or through an extra of sluice's own
    own = [r for r in project["optional-dependencies"]["test"] if requirement_name(r) == "sluice-llm"]
    pulled = {n for r in own for e in re.findall(r"\[(.*?)\]", r)[0].split(",") for n in extras[e.strip()]}
    assert "transformers" in extras["test"] | pulled

