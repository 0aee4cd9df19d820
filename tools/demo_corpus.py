"""Offline, redistributable training text for the bundled demo model.

The corpus is CPython's own documentation (PSF License): the reference-manual topics that
`help()` shows (``pydoc_data.topics``) and the docstrings of the standard library, read with
``ast`` so nothing is imported or executed. Every document is a short "help page":

    Help on function join in module posixpath:

    join(a, *p)

    Join two or more pathname components, inserting '/' as needed. ...

Several documents share the same header (one per paragraph of an object's docstring), so
prompts taken from the corpus share real text prefixes that prefix caching can find, and
each document is short enough that a model trained on them learns to stop (EOS) within a
few dozen tokens.
"""

from __future__ import annotations

import ast
import hashlib
import importlib
import inspect
import re
import sys
import sysconfig
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

# Bodies are split into chunks of at most this many characters (about 60 tokens), so most
# answers end well inside a 64-token generation budget.
MAX_CHUNK_CHARS = 280
# A single sentence or code line longer than this is dropped rather than kept as a long doc.
MAX_UNIT_CHARS = 420
MIN_BODY_CHARS = 12
MAX_BODY_REPEATS = 2
# Directories of the stdlib whose docstrings are test scaffolding or vendored, not docs.
SKIP_DIRS = frozenset({"site-packages", "test", "tests", "idle_test", "__phello__", "turtledemo"})
MAX_SIGNATURE_CHARS = 100

_UNDERLINE = re.compile(r"^\s*([*=~\-^\"'#+])\1{2,}\s*$")
_SENTENCE_END = re.compile(r"(?<=[.!?:;])\s+(?=[A-Z\"'(`*])")


@dataclass(frozen=True)
class Document:
    """One training document: a help-page header plus one short body chunk."""

    header: str
    body: str

    @property
    def text(self) -> str:
        return f"{self.header}\n\n{self.body}"

    def is_heldout(self, percent: int) -> bool:
        """Deterministic split on the body alone, so a paragraph repeated under several
        headers (the same docstring in two modules) never lands on both sides."""
        digest = hashlib.blake2b(self.body.encode(), digest_size=8).digest()
        return int.from_bytes(digest, "little") % 100 < percent


def _first_param(match: re.Match[str]) -> str:
    """Argument Clinic marks the bound first parameter with '$'; show it as Python would."""
    name = {"self": "self", "type": "cls"}.get(match.group(1))
    return f"({name}{match.group(2)}" if name else "("


_TEXT_SIG_FIRST = re.compile(r"^\(\$(\w+)(,\s*|(?=\)))")
# "($module, /)" leaves "(/)": a positional-only marker with nothing before it.
_LONE_SLASH = re.compile(r"^\(/(,\s*|(?=\)))")


def _is_code_paragraph(lines: list[str]) -> bool:
    """Code, doctests, grammar and bullet lists keep their lines; prose is reflowed."""
    return any(line.startswith((" ", "\t", ">>>", "- ", "* ", "+ ")) for line in lines)


def _units(paragraph: str) -> list[str]:
    """Split a paragraph into sentences (prose, reflowed) or lines (code, kept verbatim)."""
    lines = [line for line in paragraph.splitlines() if not _UNDERLINE.match(line)]
    if not lines:
        return []
    if _is_code_paragraph(lines):
        return [line.rstrip() for line in lines if line.strip()]
    prose = " ".join(line.strip() for line in lines)
    return [s.strip() for s in _SENTENCE_END.split(prose) if s.strip()]


def chunk_text(text: str, max_chars: int = MAX_CHUNK_CHARS) -> Iterator[str]:
    """Yield paragraph chunks of at most ``max_chars``: whole paragraphs when they fit,
    otherwise greedy groups of consecutive sentences (or code lines)."""
    text = inspect.cleandoc(text.expandtabs(8))
    for paragraph in re.split(r"\n\s*\n", text):
        units = _units(paragraph)
        if not units:
            continue
        code = _is_code_paragraph(paragraph.splitlines())
        sep = "\n" if code else " "
        group: list[str] = []
        for unit in units:
            if len(unit) > MAX_UNIT_CHARS:
                if group:
                    yield sep.join(group)
                group = []
                continue
            if group and len(sep.join([*group, unit])) > max_chars:
                yield sep.join(group)
                group = []
            group.append(unit)
        if group:
            yield sep.join(group)


def topic_documents() -> Iterator[Document]:
    """Reference-manual sections, as ``help('assert')`` prints them."""
    from pydoc_data.topics import topics

    for key in sorted(topics):
        header = f"Help on topic {key}:"
        for body in chunk_text(topics[key]):
            yield Document(header, body)


def _signature(node: ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) -> str:
    if isinstance(node, ast.ClassDef):
        bases = ", ".join(ast.unparse(b) for b in node.bases)
        sig = f"class {node.name}({bases})" if bases else f"class {node.name}"
    else:
        sig = f"{node.name}({ast.unparse(node.args)})"
    return sig if len(sig) <= MAX_SIGNATURE_CHARS else ""


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _walk(node: ast.AST, module: str, prefix: str) -> Iterator[Document]:
    for child in ast.iter_child_nodes(node):
        if not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        qualname = f"{prefix}{child.name}"
        if isinstance(child, ast.ClassDef):
            kind = "class"
        else:
            kind = "method" if prefix else "function"
        doc = ast.get_docstring(child, clean=False)
        if doc:
            header = f"Help on {kind} {qualname} in module {module}:"
            sig = _signature(child)
            if sig:
                header = f"{header}\n\n{sig}"
            for body in chunk_text(doc):
                yield Document(header, body)
        if isinstance(child, ast.ClassDef):
            yield from _walk(child, module, f"{qualname}.")


def docstring_documents(stdlib: Path | None = None) -> Iterator[Document]:
    """Docstrings of modules, classes, functions and methods, in sorted file order."""
    root = Path(stdlib or sysconfig.get_paths()["stdlib"])
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if SKIP_DIRS.intersection(rel.parts) or rel.parts[0].startswith("config-"):
            continue
        try:
            tree = ast.parse(path.read_bytes(), filename=str(path))
        except (SyntaxError, ValueError):
            continue
        module = _module_name(path, root)
        doc = ast.get_docstring(tree, clean=False)
        if doc:
            for body in chunk_text(doc):
                yield Document(f"Help on module {module}:", body)
        yield from _walk(tree, module, "")


def builtin_documents() -> Iterator[Document]:
    """Docstrings of the modules compiled into the interpreter (``builtins``, ``sys``,
    ``itertools``, ...): the C-level API has no ``.py`` source for ``ast`` to read, and
    importing these modules has no side effects."""
    for module_name in sorted(sys.builtin_module_names):
        module = importlib.import_module(module_name)
        yield from _object_documents(module, "module", module_name, module_name)
        for name, obj in sorted(vars(module).items()):
            if name.startswith("_") or getattr(obj, "__module__", module_name) != module_name:
                continue
            if inspect.isclass(obj):
                yield from _object_documents(obj, "class", name, module_name)
                for attr, member in sorted(vars(obj).items()):
                    if not attr.startswith("_") and callable(member):
                        yield from _object_documents(member, "method", f"{name}.{attr}", module_name)
            elif callable(obj):
                yield from _object_documents(obj, "function", name, module_name)


def _object_documents(obj: object, kind: str, qualname: str, module: str) -> Iterator[Document]:
    doc = obj.__doc__ if isinstance(getattr(obj, "__doc__", None), str) else None
    if not doc:
        return
    header = f"Help on module {module}:" if kind == "module" else f"Help on {kind} {qualname} in module {module}:"
    text_signature = getattr(obj, "__text_signature__", None)
    if text_signature and kind != "module":
        name = qualname.rsplit(".", 1)[-1]
        params = _TEXT_SIG_FIRST.sub(_first_param, text_signature, count=1)
        sig = name + _LONE_SLASH.sub("(", params, count=1)
        if len(sig) <= MAX_SIGNATURE_CHARS:
            header = f"{header}\n\n{sig}"
    for body in chunk_text(doc):
        yield Document(header, body)


def build_documents(stdlib: Path | None = None) -> list[Document]:
    """All documents in a deterministic order, without exact duplicates, and with any one
    body (boilerplate such as "Internal function.") kept at most ``MAX_BODY_REPEATS`` times."""
    seen: set[str] = set()
    body_count: Counter[str] = Counter()
    docs: list[Document] = []
    for doc in (*topic_documents(), *builtin_documents(), *docstring_documents(stdlib)):
        if len(doc.body) < MIN_BODY_CHARS or doc.text in seen or body_count[doc.body] >= MAX_BODY_REPEATS:
            continue
        seen.add(doc.text)
        body_count[doc.body] += 1
        docs.append(doc)
    return docs
