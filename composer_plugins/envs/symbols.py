"""The source surgery of ``feature_deletion`` tasks: find deletable definitions, delete one, splice an answer's back."""

from __future__ import annotations

import ast
import contextlib
import os
import textwrap
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from composer_plugins.envs.code_env import _FENCE
from composer_plugins.envs.sandbox import LEAKY_DIRS

__all__ = ["Symbol", "delete_symbol", "find_symbols", "splice_completion"]


_TEST_DIRS = {"tests", "test", "testing"}


@dataclass(frozen=True)
class Symbol:
    """A deletable definition in a repository file."""

    file: str
    qualname: str
    kind: Literal["function", "class", "method"]
    lineno: int
    end_lineno: int
    indent: str

    @property
    def name(self) -> str:
        """The last component of :attr:`qualname`."""
        return self.qualname.rsplit(".", 1)[-1]

    @property
    def spec(self) -> str:
        """``file::qualname`` (how symbols are chosen in config)."""
        return f"{self.file}::{self.qualname}"


def _is_test_path(rel: str) -> bool:
    parts = Path(rel).parts
    name = parts[-1]
    return (
        any(p in _TEST_DIRS for p in parts[:-1])
        or name.startswith("test_")
        or name.endswith("_test.py")
        or name == "conftest.py"
    )


def _python_files(repo: Path) -> list[str]:
    out = []
    for dirpath, dirnames, filenames in os.walk(repo):
        dirnames[:] = sorted(
            d
            for d in dirnames
            if d not in LEAKY_DIRS
            and not d.startswith(".")
            and d not in ("build", "dist", "docs", "venv", "examples", "fixtures")
        )
        for f in sorted(filenames):
            if f.endswith(".py"):
                out.append(os.path.relpath(os.path.join(dirpath, f), repo))
    return out


def _start_line(node: ast.AST) -> int:
    decos = getattr(node, "decorator_list", None) or []
    return min([d.lineno for d in decos] + [node.lineno])  # type: ignore[attr-defined]


def _symbol(rel: str, qualname: str, kind: Literal["function", "class", "method"], node: ast.stmt) -> Symbol:
    return Symbol(rel, qualname, kind, _start_line(node), node.end_lineno or node.lineno, " " * node.col_offset)


def _deletable(node: ast.AST, min_body_lines: int) -> bool:
    body = getattr(node, "body", [])
    if not body or body[0].lineno == node.lineno:  # type: ignore[attr-defined]
        return False  # one-line definitions
    stmts = body[1:] if _docstring_node(node) is not None else body
    if not stmts:
        return False
    return stmts[-1].end_lineno - stmts[0].lineno + 1 >= min_body_lines


def _docstring_node(node: ast.AST) -> ast.Expr | None:
    first = next(iter(getattr(node, "body", [])), None)
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
        return first
    return None


def find_symbols(repo: str | os.PathLike[str], *, min_body_lines: int = 2) -> list[Symbol]:
    """Public top-level functions and classes, and the public methods and ``__init__`` of those classes (no tests)."""
    repo_p = Path(repo)
    out: list[Symbol] = []
    for rel in _python_files(repo_p):
        if _is_test_path(rel) or Path(rel).name in ("setup.py", "conftest.py", "noxfile.py"):
            continue
        try:
            tree = ast.parse((repo_p / rel).read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError):
            continue
        for node in tree.body:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                if node.name.startswith("_"):
                    continue
                kind: Literal["function", "class"] = "class" if isinstance(node, ast.ClassDef) else "function"
                if _deletable(node, min_body_lines):
                    out.append(_symbol(rel, node.name, kind, node))
                if isinstance(node, ast.ClassDef):
                    for sub in node.body:
                        if (
                            isinstance(sub, ast.FunctionDef | ast.AsyncFunctionDef)
                            and (sub.name == "__init__" or not sub.name.startswith("_"))
                            and _deletable(sub, 1)
                        ):
                            out.append(_symbol(rel, f"{node.name}.{sub.name}", "method", sub))
    return out


def _locate(tree: ast.Module, qualname: str) -> tuple[ast.AST, ast.ClassDef | None]:
    parts = qualname.split(".")
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) and node.name == parts[0]:
            if len(parts) == 1:
                return node, None
            if isinstance(node, ast.ClassDef):
                for sub in node.body:
                    if isinstance(sub, ast.FunctionDef | ast.AsyncFunctionDef) and sub.name == parts[1]:
                        return sub, node
    raise KeyError(qualname)


def delete_symbol(
    source: str, qualname: str, mode: Literal["body", "symbol"] = "body", keep_docstring: bool = True
) -> tuple[str, dict[str, Any]]:
    """Delete ``qualname`` from ``source``. Returns the new source and where the definition goes back.

    ``mode``: docs/envs.md, "``feature_deletion``", step 2.
    The info dict has ``span`` (1-based inclusive lines of the stub in the new source, body mode),
    ``insert_at`` (0-based line index, symbol mode), ``indent``, ``class_line`` (for methods),
    and ``original`` (the deleted definition's source).
    """
    lines = source.splitlines(keepends=True)
    node, cls = _locate(ast.parse(source), qualname)
    start, end = _start_line(node), node.end_lineno or node.lineno  # type: ignore[attr-defined]
    indent = " " * node.col_offset  # type: ignore[attr-defined]
    original = "".join(lines[start - 1 : end])
    info: dict[str, Any] = {"indent": indent, "original": original, "mode": mode}
    if cls is not None:
        info["class_line"] = _start_line(cls)
    if mode == "symbol":
        before, after = lines[: start - 1], lines[end:]
        # drop the blank lines the definition leaves behind
        while after and not after[0].strip():
            after = after[1:]
        if cls is not None and not any(s is not node for s in cls.body if s is not _docstring_node(cls)):
            after = [f"{indent}pass\n", *after]  # the class would be empty
        new_lines = [*before, *(["\n"] if before and after else []), *after]
        info["insert_at"] = len(before)
        return "".join(new_lines), info
    body = node.body  # type: ignore[attr-defined]
    doc = _docstring_node(node) if keep_docstring else None
    body_indent = " " * body[0].col_offset
    head = lines[start - 1 : body[0].lineno - 1]
    doc_lines = lines[doc.lineno - 1 : doc.end_lineno] if doc is not None else []
    filler = "pass" if isinstance(node, ast.ClassDef) else "raise NotImplementedError"
    stub = [*head, *doc_lines, f"{body_indent}{filler}\n"]
    new_lines = [*lines[: start - 1], *stub, *lines[end:]]
    info["span"] = [start, start + len(stub) - 1]
    return "".join(new_lines), info


def splice_completion(deleted_source: str, task: Mapping[str, Any], completion: str) -> str:
    """Put the completion's definition of the task's symbol back into ``deleted_source``.

    New imports and helpers the completion defines at module level go just before the
    definition (or before its class, for a method). Raises ``ValueError`` when the
    completion defines no such symbol and ``SyntaxError`` when it does not parse.
    """
    parts = str(task["symbol"]).split(".")
    name = parts[-1]
    blocks = [m.group(1) for m in _FENCE.finditer(completion)]
    code = textwrap.dedent(blocks[-1] if blocks else completion)
    for b in reversed(blocks):  # prefer the block that defines the symbol
        with contextlib.suppress(SyntaxError):
            if any(getattr(n, "name", None) == name for n in ast.walk(ast.parse(textwrap.dedent(b)))):
                code = textwrap.dedent(b)
                break
    tree = ast.parse(code)
    is_method = task.get("kind") == "method"
    target: ast.AST | None = None
    for n in tree.body:
        if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) and n.name == name:
            target = n
        if is_method and isinstance(n, ast.ClassDef) and n.name == parts[0]:
            for sub in n.body:
                if isinstance(sub, ast.FunctionDef | ast.AsyncFunctionDef) and sub.name == name:
                    target = sub
    if target is None:
        raise ValueError(f"the answer does not define `{name}`")
    code_lines = code.splitlines(keepends=True)
    t_start, t_end = _start_line(target), target.end_lineno  # type: ignore[attr-defined]
    definition = textwrap.dedent("".join(code_lines[t_start - 1 : t_end]))
    indent = str(task.get("indent", ""))
    definition = textwrap.indent(definition, indent, lambda line: True) if indent else definition
    if not definition.endswith("\n"):
        definition += "\n"
    existing = {getattr(n, "name", None) for n in ast.parse(deleted_source).body}
    extras = []
    for n in tree.body:
        if n is target or (is_method and isinstance(n, ast.ClassDef) and n.name == parts[0]):
            continue
        if isinstance(n, ast.Import | ast.ImportFrom):
            extras.append(ast.get_source_segment(code, n) or "")
        elif isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) and n.name not in existing:
            extras.append(textwrap.dedent("".join(code_lines[_start_line(n) - 1 : n.end_lineno])))
        elif isinstance(n, ast.Assign) and all(isinstance(t, ast.Name) and t.id not in existing for t in n.targets):
            extras.append(ast.get_source_segment(code, n) or "")
    extra_text = "".join(e if e.endswith("\n") else e + "\n" for e in extras if e)
    lines = deleted_source.splitlines(keepends=True)
    if task.get("mode") == "symbol":
        at = int(task["insert_at"])
        new = [*lines[:at], definition, *(["\n"] if at < len(lines) else []), *lines[at:]]
    else:
        s, e = task["span"]
        at = int(s) - 1
        new = [*lines[:at], definition, *lines[e:]]
    if extra_text:
        anchor = int(task["class_line"]) - 1 if is_method else at
        # for body mode the stub was replaced in place, so line numbers before it are unchanged
        new = [*new[:anchor], extra_text, "\n\n", *new[anchor:]]
    result = "".join(new)
    ast.parse(result)
    return result
