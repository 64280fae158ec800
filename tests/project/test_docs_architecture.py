"""docs/architecture.md against the code: every file path, module and name the page cites exists in
``src/fedproto`` (read with :mod:`ast`, nothing imported), every file named on a line of a call path
defines something that line names, and the module map lists every module of the package."""

from __future__ import annotations

import ast
import re
from functools import lru_cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src" / "fedproto"
DOC = ROOT / "docs" / "architecture.md"

USERS_OWN = ("mypackage/", "src/fedproto/data/blobs.py", "src/fedproto/models/mlp.py", "fedproto.data.blobs",
             "fedproto.models.mlp")
"""Files and modules of the page's examples (a user's package; the dataset and model it shows how to add)."""

EXTERNAL = {
    # Flower, torch, numpy, pydantic and Python names the page cites beside fedproto's
    "Array", "ArrayRecord", "ConfigRecord", "MetricRecord", "RecordDict", "Grid", "MessageType", "ServerApp",
    "ClientApp", "SuperNode", "SuperLink", "Conv2d", "Linear", "ReLU", "Flatten", "Field", "BaseModel",
    "reply_to_message_id",
}
"""Names that need not be defined in fedproto (the error classes are, and are checked like the rest)."""


@lru_cache(maxsize=1)
def _index() -> tuple[dict[str, set[str]], dict[str, list[tuple[set[str], list[str]]]], set[str]]:
    """(module -> its top-level names, class name -> [(its members, its bases' names)], every name
    defined anywhere (functions, classes, methods, assignments, attributes, arguments, and the
    strings the code uses as keys or option names))."""
    modules: dict[str, set[str]] = {}
    classes: dict[str, list[tuple[set[str], list[str]]]] = {}
    defined: set[str] = set()
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC.parent).with_suffix("")
        parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
        tree = ast.parse(path.read_text(encoding="utf-8"))
        top: set[str] = set()
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                top.add(node.name)
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                for t in node.targets if isinstance(node, ast.Assign) else [node.target]:
                    top.update(n.id for n in ast.walk(t) if isinstance(n, ast.Name))
            elif isinstance(node, ast.ImportFrom):
                top.update(a.asname or a.name for a in node.names)
            if isinstance(node, ast.Assign) and any(getattr(x, "id", "") == "__all__" for x in node.targets):
                top.update(n.value for n in ast.walk(node.value)  # names a module's __getattr__ provides
                           if isinstance(n, ast.Constant) and isinstance(n.value, str))
        modules[".".join(parts)] = top
        docstrings = {id(n.body[0].value) for n in ast.walk(tree)
                      if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                      and n.body and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                members = set()
                for item in node.body:
                    if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                        members.add(item.name)
                    elif isinstance(item, (ast.Assign, ast.AnnAssign)):
                        for t in item.targets if isinstance(item, ast.Assign) else [item.target]:
                            members.update(n.id for n in ast.walk(t) if isinstance(n, ast.Name))
                members.update(n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute)
                               and isinstance(n.value, ast.Name) and n.value.id == "self"
                               and isinstance(n.ctx, ast.Store))
                bases = [b.id if isinstance(b, ast.Name) else b.attr for b in node.bases
                         if isinstance(b, (ast.Name, ast.Attribute))]
                classes.setdefault(node.name, []).append((members, bases))
                defined.update(members)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                defined.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                defined.add(node.id)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                defined.add(node.attr)
            elif isinstance(node, ast.arg):
                defined.add(node.arg)
            elif isinstance(node, ast.keyword) and node.arg:
                defined.add(node.arg)
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
                defined.update(re.findall(r"[A-Za-z_][\w\-]*", node.value))
    return modules, classes, defined


def _members(cls: str, seen: frozenset = frozenset()) -> set[str]:
    """The members of every fedproto class named ``cls``, with those of its bases (by name)."""
    _, classes, _ = _index()
    out: set[str] = set()
    for members, bases in classes.get(cls, []):
        out |= members
        for b in bases:
            if b not in seen:
                out |= _members(b, seen | {cls})
    return out


def _doc() -> str:
    return DOC.read_text(encoding="utf-8")


def _blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", _doc(), flags=re.S)


def _prose() -> str:
    """The page without its code blocks."""
    return re.sub(r"```.*?```", "", _doc(), flags=re.S)


def _file(rel: str) -> Path | None:
    """The file a path of the page means: under src/fedproto, the repository, docs/ (a link), or
    (``observers/health.py``) the one file of src/fedproto whose path ends with it."""
    for base in (SRC, ROOT, DOC.parent):
        if (base / rel).exists():
            return base / rel
    hits = [p for p in SRC.rglob("*.py") if p.as_posix().endswith("/" + rel)]
    return hits[0] if len(hits) == 1 else None


PATH = re.compile(r"(?<![\w./<-])((?:[\w.-]+/)*[\w-]+\.(?:py|toml|md))\b")
CODE = re.compile(r"`([^`\n]+)`")
OUTPUT = re.compile(r"[\w-]+\.(?:pt|json|jsonl|npz|csv|png|log|db)\b")  # a run's files (summary.json)
NAME = re.compile(r"(?<![\w.])([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)")


def _cited_names() -> set[str]:
    """Names in backticks in the prose and in the ``text`` blocks (the call paths), without the
    paths and the words in brackets or quotes."""
    text = " ".join(CODE.findall(_prose())) + "\n" + "\n".join(_blocks("text"))
    text = OUTPUT.sub(" ", PATH.sub(" ", re.sub(r"[\w/]*\*[\w.]*", " ", text)))  # paths, globs, a run's files
    text = re.sub(r"\"[^\"\n]*\"|'[^'\n]*'", " ", text)
    return set(NAME.findall(text))


def _is_name(token: str) -> bool:
    """Tokens that are code, not English: a dotted name, an underscore, or a capital inside the word;
    not the reader's own names (``MyOptions``, ``my_server_step``) nor the examples' classes."""
    own = set(re.findall(r"^\s*(?:class|def)? ?(\w+)\s*[(:=]", "\n".join(_blocks("python")), flags=re.M))
    if token.split(".")[0] in own or token.startswith(("My", "my_")):
        return False
    return "." in token or "_" in token or bool(re.search(r"[a-z][A-Z]|^[A-Z][a-z]+[A-Z]", token))


def test_every_path_the_architecture_page_cites_exists():
    paths = {p for p in PATH.findall(_doc()) if not p.startswith(USERS_OWN)}
    assert len(paths) > 30  # the page cites its files
    missing = sorted(p for p in paths if _file(p) is None)
    assert not missing, f"docs/architecture.md cites files that do not exist: {missing}"


def test_every_module_the_architecture_page_names_exists():
    """Dotted ``fedproto.x.y`` names: a module, or a name defined at the top of one."""
    modules, _, _ = _index()
    cited = {m for m in re.findall(r"\bfedproto(?:\.\w+)+", _doc()) if not m.startswith(USERS_OWN)}
    assert len(cited) > 10
    missing = []
    for name in sorted(cited):
        mod, _, attr = name.rpartition(".")
        if name not in modules and not (mod in modules and attr in modules[mod]):
            missing.append(name)
    assert not missing, f"docs/architecture.md names modules or names that do not exist: {missing}"


def test_every_function_and_class_the_architecture_page_cites_is_defined():
    """A name in code font or on a call path (``run_rounds``, ``FlowerExecutor._discover``,
    ``RoundLoop.round``) is defined in src/fedproto; ``Class.member`` is a member of that class or of
    one of its bases."""
    modules, classes, defined = _index()
    names = {t for t in _cited_names() if _is_name(t) and not t.startswith(("fedproto.", "torch.", "np.", "numpy."))}
    assert {"RoundLoop.round", "run_rounds", "FlowerExecutor.train", "client_step"} <= names  # the extraction works
    short = {}  # a module's last name -> its top-level names (plugins.scope, privacy.secure_rng)
    for mod, top in modules.items():
        short.setdefault(mod.rpartition(".")[2], set()).update(top)
    missing = []
    for token in sorted(names):
        head, *rest = token.split(".")
        if head in EXTERNAL:
            continue
        if not rest and head in short:  # a module by its name (the layers table: cli_run)
            continue
        if head in classes:
            ok = not rest or rest[0] in _members(head)
        elif rest and f"fedproto.{token}" in modules:
            ok = True  # a module by its path in the package (flower.executor)
        elif rest and head in short and head not in defined:
            ok = rest[0] in short[head]
        elif rest:
            ok = head in defined and rest[0] in defined  # an attribute of a variable (state.checkpoint)
        else:
            ok = head in defined or (head.startswith("no_") and head[3:] in defined)  # an off switch (no_augment)
        if not ok:
            missing.append(token)
    assert not missing, f"docs/architecture.md cites names that src/fedproto does not define: {missing}"


def test_each_file_on_a_call_path_defines_a_name_of_its_line():
    """On the call paths (the ``text`` blocks), a line that names a file names something that file
    defines (a function, a class, a method of a class defined there), on that line or, for a
    wrapped line, on the line before."""
    wrong = []
    for block in _blocks("text"):
        lines = block.splitlines()
        for k, line in enumerate(lines):
            paths = [p for p in PATH.findall(line) if p.endswith(".py")]
            if not paths:
                continue
            near = PATH.sub(" ", " ".join(lines[max(0, k - 1):k + 1]))
            calls = set(re.findall(r"([A-Za-z_][\w.]*)\(", near))  # node(...), Simulation(...)
            calls |= set(re.findall(r"(\w+) →", near)) | set(re.findall(r"→ (\w+)", near))  # a → b: both called
            calls |= set(re.findall(r"\w:(\w+)", near))  # fedproto.cli.app:main
            names = {n for n in NAME.findall(near) if _is_name(n) or n in calls or n[:1].isupper()}
            for rel in paths:
                path = _file(rel)
                assert path is not None, f"{rel} (on the line {line.strip()!r}) does not exist"
                tree = ast.parse(path.read_text(encoding="utf-8"))
                here = {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef,
                                                                          ast.ClassDef))}
                here |= {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
                if not any(n.split(".")[0] in here or (len(n.split(".")) > 1 and n.split(".")[1] in here)
                           for n in names):
                    wrong.append(f"{rel}: {line.strip()}")
    assert not wrong, "lines of the call paths whose file defines none of their names:\n" + "\n".join(wrong)


def test_the_python_examples_of_the_architecture_page_import_what_exists():
    """``from fedproto.x import y`` in the page's Python examples: the module exists and defines y."""
    modules, _, _ = _index()
    imports = re.findall(r"^from (fedproto[\w.]*) import ([\w, ]+)$", "\n".join(_blocks("python")), flags=re.M)
    assert len(imports) > 5
    missing = [f"{mod}.{n.strip()}" for mod, names in imports for n in names.split(",")
               if not mod.startswith(USERS_OWN) and (mod not in modules or n.strip() not in modules[mod])]
    assert not missing, f"the page's examples import names that do not exist: {missing}"


def test_the_module_map_lists_every_module():
    """Every module and subpackage of fedproto, and every module of ``fedproto.flower`` and of the
    engine, has a row in the module map (alone, or with others: ``flower/local.py``, ``plots``)."""
    section = _doc().split("## Module map", 1)[1]
    cells = [row.split("|")[1] for row in section.splitlines() if row.startswith("| `")]
    listed = {c.strip() for cell in cells for c in re.findall(r"`([^`]+)`", cell)}
    listed |= {c.removesuffix(".py") for c in listed}
    want = {p.stem if p.is_file() else p.name for p in SRC.iterdir()
            if (p.suffix == ".py" or (p / "__init__.py").is_file()) and not p.name.startswith("__")}
    for pkg in ("flower", "engine", "engine/executors", "engine/observers"):
        want |= {f"{pkg}/{p.stem}" for p in (SRC / pkg).glob("*.py") if p.name != "__init__.py"}
    covered = {w for w in want if w in listed or any(x.startswith(w + "/") for x in listed)}
    assert not want - covered, f"modules missing from the module map of docs/architecture.md: {sorted(want - covered)}"


def test_the_import_layers_table_is_the_contract():
    """The page's table of import layers is the layers contract of pyproject.toml, layer by layer."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib
    config = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    contracts = config["tool"]["importlinter"]["contracts"]
    (layers,) = [c["layers"] for c in contracts if c["type"] == "layers"]
    want = [sorted(m.strip().removeprefix("fedproto.") for m in layer.split(":")) for layer in layers]
    section = _doc().split("## Import layers", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| (\d+) \| (.+) \|$", section, flags=re.M)
    assert [int(n) for n, _ in rows] == list(range(1, len(rows) + 1))
    assert [sorted(re.findall(r"`([\w.]+)`", cell)) for _, cell in rows] == want


def test_the_code_points_to_pages_and_sections_that_exist():
    """Docstrings and messages point to the project's own documents: every ``docs/<page>.md`` and every
    upper-case ``<NAME>.md`` (README.md, CONTRIBUTING.md) that src/fedproto names is in the repository,
    and every section of this page they quote (``docs/architecture.md, "Randomness"``) is one of its
    headings or bold labels."""
    text = "\n".join(p.read_text(encoding="utf-8") for p in sorted(SRC.rglob("*.py")))
    pages = set(re.findall(r"\bdocs/[\w-]+\.md\b", text)) | set(re.findall(r"(?<![\w/])[A-Z][A-Z_]+\.md\b", text))
    assert "docs/architecture.md" in pages
    assert not sorted(p for p in pages if not (ROOT / p).is_file()), "src/fedproto names documents that do not exist"
    sections = set(re.findall(r'docs/architecture\.md, "([^"]+)"', text))
    headings = re.findall(r"^#+ (.+?)(?: \(`[^`]+`\))?$", _doc(), flags=re.M)  # "Executor (`engine/...`)"
    labels = set(headings) | set(re.findall(r"\*\*([^*\n]+?)\.?\*\*", _doc()))
    assert len(sections) > 3
    lacking = sorted(sections - labels)
    assert not lacking, f"sections of docs/architecture.md the code quotes but the page lacks: {lacking}"
