"""A source check for the device bugs a CPU-only suite cannot see (used by ``test_gpu_source_check.py``).

It reads Python source (AST, nothing is imported) and reports, per function:

* ``numpy``: ``x.numpy()`` where ``x`` may live on a GPU. A receiver is known to be on the CPU when its
  call chain passes ``.cpu()`` or ``.to("cpu")`` / ``.to(device="cpu")`` / ``.to(torch.device("cpu"))``,
  or starts at a CPU-only constructor (``torch.frombuffer``, ``torch.from_numpy``, or a tensor factory
  called without ``device=``), or is a local name every assignment of which is such an expression.
  Anything else (a parameter, an attribute, the result of a model) may hold a CUDA tensor: on CUDA
  ``.numpy()`` raises ``TypeError: can't convert cuda:0 device type tensor to numpy``.
* ``asarray``: ``np.asarray(x)`` / ``np.array(x)`` of an expression that is visibly a tensor (its chain
  calls a tensor method such as ``.detach()`` / ``.float()`` / ``.to(...)``, or it is a local name
  assigned from a ``torch.`` call or such a chain) and does not pass through the CPU first.
* ``cross_device``: a tensor factory called without ``device=`` (``torch.arange``, ``torch.zeros``,
  ``torch.tensor([...])`` ...: a CPU tensor) used directly as an operand of arithmetic or a comparison, or
  as an argument of an op that needs both tensors on one device (``torch.where``, ``torch.cat``,
  ``index_select`` ...) together with a tensor that comes from elsewhere (on CUDA: ``RuntimeError: Expected
  all tensors to be on the same device``); or a tensor provably on the CPU indexed by a visible tensor that
  may be on a GPU (``cpu[cuda_idx]``: ``indices should be either on cpu or on the same device``). A CUDA
  tensor indexed by CPU indices is fine (PyTorch moves them), and so is 0-dim ``torch.tensor(<number>)``
  in arithmetic (PyTorch moves CPU scalars) and the host-side ``.item()`` / ``.tolist()``.
* ``default_device``: a call of one of the project's helpers whose ``device`` defaults to ``"cpu"``
  (``tokenize_prompts``, ``left_pad``) without a device: its tensors then meet a policy on the GPU.

The rules look at one function at a time and follow simple local assignments only; what they cannot
prove CPU-side they report, so an offender that is not a bug is marked in the code it is in with a
``# device-ok: <why>`` comment on the reported line.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

#: Tensor factories that allocate on the CPU unless given ``device=``.
FACTORIES = frozenset(
    {
        "arange",
        "zeros",
        "ones",
        "empty",
        "full",
        "rand",
        "randn",
        "randint",
        "randperm",
        "linspace",
        "logspace",
        "eye",
        "tensor",
        "as_tensor",
    }
)
#: Constructors whose result is always on the CPU.
CPU_CONSTRUCTORS = frozenset({"frombuffer", "from_numpy"})
#: Methods that show their receiver is a tensor (for the ``asarray`` rule).
TENSOR_METHODS = frozenset(
    {
        "detach",
        "float",
        "double",
        "half",
        "bfloat16",
        "to",
        "contiguous",
        "clone",
        "view",
        "reshape",
        "flatten",
        "squeeze",
        "unsqueeze",
        "softmax",
        "log_softmax",
        "sum",
        "mean",
        "abs",
        "exp",
        "log",
        "sigmoid",
        "clamp",
        "long",
        "int",
        "bool",
        "nonzero",
        "argmax",
        "argmin",
        "cumsum",
        "masked_fill",
        "expand_as",
        "repeat_interleave",
    }
)
#: Ops whose tensor arguments must share one device.
SAME_DEVICE_OPS = frozenset(
    {
        "where",
        "cat",
        "stack",
        "maximum",
        "minimum",
        "gather",
        "index_select",
        "masked_fill",
        "masked_select",
        "index_put",
        "scatter",
        "scatter_add",
        "take_along_dim",
        "matmul",
        "mm",
        "bmm",
        "addmm",
        "dot",
        "einsum",
        "lerp",
        "clamp",
        "add",
        "sub",
        "mul",
        "div",
        "round",
        "abs",
        "exp",
        "log",
        "sqrt",
        "sign",
    }
)
#: The project's helpers whose ``device`` parameter defaults to the CPU: name -> its positional index.
DEFAULT_CPU_HELPERS = {"tokenize_prompts": 3, "left_pad": 2}
ALLOW_COMMENT = "# device-ok:"


@dataclass(frozen=True)
class Finding:
    """One reported pattern: ``path:line`` in ``function``, which ``rule``, and the source line."""

    path: str
    line: int
    function: str
    rule: str
    code: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line} in {self.function}: [{self.rule}] {self.code.strip()}"


def _is_cpu_device(node: ast.AST) -> bool:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value == "cpu" or node.value.startswith("cpu:")
    if isinstance(node, ast.Call) and _attr_name(node.func) == "device" and node.args:
        return _is_cpu_device(node.args[0])
    return False


def _attr_name(node: ast.AST) -> str | None:
    if isinstance(node, ast.Attribute):
        return node.attr
    if isinstance(node, ast.Name):
        return node.id
    return None


def _is_torch_call(node: ast.Call, names: frozenset[str]) -> bool:
    """``torch.<name>(...)`` (or ``<name>`` imported from torch, as ``torch.X`` is how this code base writes it)."""
    f = node.func
    return isinstance(f, ast.Attribute) and f.attr in names and isinstance(f.value, ast.Name) and f.value.id == "torch"


def _has_device_kw(node: ast.Call) -> bool:
    return any(k.arg == "device" for k in node.keywords)


def _is_factory_without_device(node: ast.AST) -> bool:
    return isinstance(node, ast.Call) and _is_torch_call(node, FACTORIES) and not _has_device_kw(node)


def _is_scalar_tensor(node: ast.Call) -> bool:
    """``torch.tensor(<number>)``: a 0-dim CPU tensor, which PyTorch moves to the other operand's device."""
    return (
        _attr_name(node.func) in ("tensor", "as_tensor")
        and bool(node.args)
        and isinstance(node.args[0], ast.Constant | ast.UnaryOp)
    )


class _Function:
    """Local assignments of one function body: name -> the expressions assigned to it (in source order)."""

    def __init__(self, fn: ast.AST) -> None:
        self.assigned: dict[str, list[tuple[int, ast.AST]]] = {}
        for node in ast.walk(fn):
            if isinstance(node, ast.Assign):
                for t in node.targets:
                    if isinstance(t, ast.Name):
                        self.assigned.setdefault(t.id, []).append((node.lineno, node.value))
            elif isinstance(node, ast.AnnAssign | ast.AugAssign) and isinstance(node.target, ast.Name):
                if node.value is not None:
                    self.assigned.setdefault(node.target.id, []).append((node.lineno, node.value))

    def values(self, name: str, before: int) -> list[tuple[int, ast.AST]]:
        """``(line, value)`` of each assignment to ``name`` on a line up to ``before``."""
        return [(line, v) for line, v in self.assigned.get(name, []) if line <= before]


#: Project functions that return their tensor only if it is on the CPU (they raise otherwise) or move it there.
HOST_GUARDS = frozenset({"host_tensor", "to_host"})


def _on_cpu(node: ast.AST, fn: _Function, line: int, depth: int = 0) -> bool:
    """Whether ``node`` (a tensor expression) is provably on the CPU."""
    if depth > 16:
        return False
    while True:
        if isinstance(node, ast.IfExp):  # ``a if c else b``: on the CPU when both branches are
            return _on_cpu(node.body, fn, line, depth + 1) and _on_cpu(node.orelse, fn, line, depth + 1)
        if isinstance(node, ast.Call):
            f = node.func
            if isinstance(f, ast.Name) and f.id in HOST_GUARDS:
                return True
            if isinstance(f, ast.Attribute) and f.attr == "pad" and node.args:  # F.pad(x, ...): where x is
                return _on_cpu(node.args[0], fn, line, depth + 1)
            if isinstance(f, ast.Attribute):
                if f.attr == "cpu":
                    return True
                if f.attr == "to":
                    dev = [a for a in node.args if not isinstance(a, ast.Attribute)]  # .to(torch.float32) is a dtype
                    dev += [k.value for k in node.keywords if k.arg == "device"]
                    if any(_is_cpu_device(d) for d in dev):
                        return True
                if isinstance(f.value, ast.Name) and f.value.id == "torch":
                    if f.attr in CPU_CONSTRUCTORS:
                        return True
                    if f.attr in FACTORIES:
                        return not _has_device_kw(node) or any(
                            _is_cpu_device(k.value) for k in node.keywords if k.arg == "device"
                        )
                    if f.attr.endswith("_like") and node.args and not _has_device_kw(node):  # where its input is
                        return _on_cpu(node.args[0], fn, line, depth + 1)
                    if f.attr in SAME_DEVICE_OPS:  # torch.cat([a, b]): where its tensors are
                        args = _flat_args(node)
                        return bool(args) and all(_on_cpu_or_number(a, fn, line, depth + 1) for a in args)
                    return False
                node = f.value
                continue
            return False
        if isinstance(node, ast.Subscript):
            node = node.value
            continue
        if isinstance(node, ast.BinOp | ast.Compare):
            ops = [node.left, node.right] if isinstance(node, ast.BinOp) else [node.left, *node.comparators]
            return all(_on_cpu_or_number(o, fn, line, depth + 1) for o in ops)
        if isinstance(node, ast.Name):
            vals = fn.values(node.id, line)
            # an assignment's value is read as of the line before it (``x = torch.cat([x, y])``)
            return bool(vals) and all(_on_cpu(v, fn, ln - 1, depth + 1) for ln, v in vals)
        return False


def _on_cpu_or_number(node: ast.AST, fn: _Function, line: int, depth: int) -> bool:
    if isinstance(node, ast.Constant):
        return True
    if isinstance(node, ast.UnaryOp):
        return _on_cpu_or_number(node.operand, fn, line, depth)
    return _on_cpu(node, fn, line, depth)


def _flat_args(node: ast.Call) -> list[ast.AST]:
    """The positional arguments of ``node``, a leading list or tuple flattened (``torch.cat([a, b], 1)``)."""
    args = list(node.args)
    if args and isinstance(args[0], ast.List | ast.Tuple):
        args = list(args[0].elts) + args[1:]
    return args


def _looks_like_tensor(node: ast.AST, fn: _Function, line: int, depth: int = 0) -> bool:
    """Whether ``node`` is visibly a tensor: a chain through a tensor method or a ``torch.`` call."""
    if depth > 16:
        return False
    cur = node
    while True:
        if isinstance(cur, ast.Call):
            f = cur.func
            if isinstance(f, ast.Attribute):
                if isinstance(f.value, ast.Name) and f.value.id == "torch":
                    return True
                if f.attr in TENSOR_METHODS:
                    return True
                cur = f.value
                continue
            return False
        if isinstance(cur, ast.Subscript | ast.Attribute):
            cur = cur.value
            continue
        if isinstance(cur, ast.BinOp):
            return _looks_like_tensor(cur.left, fn, line, depth + 1) or _looks_like_tensor(
                cur.right, fn, line, depth + 1
            )
        if isinstance(cur, ast.Name):
            return any(_looks_like_tensor(v, fn, ln - 1, depth + 1) for ln, v in fn.values(cur.id, line))
        return False


def _foreign(node: ast.AST, fn: _Function, line: int) -> bool:
    """An operand not provably on the CPU (nor a constant): it may be a CUDA tensor."""
    return not _on_cpu_or_number(node, fn, line, 0)


def _functions(tree: ast.AST) -> Iterator[tuple[str, ast.AST]]:
    """Every function (qualified name) and, for module-level code, ``<module>``."""

    def visit(node: ast.AST, prefix: str) -> Iterator[tuple[str, ast.AST]]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                name = f"{prefix}{child.name}"
                yield name, child
                yield from visit(child, name + ".")
            elif isinstance(child, ast.ClassDef):
                yield from visit(child, f"{prefix}{child.name}.")

    yield from visit(tree, "")


def _own_nodes(fn: ast.AST) -> Iterator[ast.AST]:
    """The nodes of ``fn``'s body, not those of functions nested in it (they are checked on their own)."""
    stack = list(ast.iter_child_nodes(fn))
    while stack:
        node = stack.pop()
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef | ast.Lambda):
            continue
        yield node
        stack.extend(ast.iter_child_nodes(node))


def check_source(text: str, path: str = "<source>") -> list[Finding]:
    """Every finding of the four rules in ``text`` (the source of one module)."""
    tree = ast.parse(text, filename=path)
    lines = text.splitlines()
    found: list[Finding] = []

    def report(node: ast.AST, function: str, rule: str) -> None:
        code = lines[node.lineno - 1] if 0 < node.lineno <= len(lines) else ""
        if ALLOW_COMMENT in code:
            return
        found.append(Finding(path, node.lineno, function, rule, code))

    for name, fn_node in _functions(tree):
        fn = _Function(fn_node)
        for node in _own_nodes(fn_node):
            if isinstance(node, ast.Call) and _attr_name(node.func) in DEFAULT_CPU_HELPERS:
                at = DEFAULT_CPU_HELPERS[str(_attr_name(node.func))]
                if len(node.args) <= at and not _has_device_kw(node):
                    report(node, name, "default_device")
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                f = node.func
                # rule 1: .numpy() of a tensor that may be on a GPU
                if f.attr == "numpy" and not node.args and not node.keywords:
                    if not _on_cpu(f.value, fn, node.lineno):
                        report(node, name, "numpy")
                # rule 2: np.asarray / np.array of a visible tensor
                elif (
                    f.attr in ("asarray", "array")
                    and isinstance(f.value, ast.Name)
                    and f.value.id in ("np", "numpy")
                    and node.args
                    and _looks_like_tensor(node.args[0], fn, node.lineno)
                    and not _on_cpu(node.args[0], fn, node.lineno)
                ):
                    report(node, name, "asarray")
                # rule 3b: a CPU factory handed to a same-device op with another tensor
                elif f.attr in SAME_DEVICE_OPS:
                    if isinstance(f.value, ast.Name) and f.value.id == "torch":
                        args = _flat_args(node)
                    else:
                        args = [f.value, *node.args]  # x.index_select(0, torch.arange(n))
                    cpu = [a for a in args if _is_factory_without_device(a) and not _is_scalar_tensor(a)]
                    if cpu and any(_foreign(a, fn, node.lineno - 1) for a in args if a not in cpu):
                        report(node, name, "cross_device")
            # rule 3a: a CPU factory as an arithmetic / comparison operand next to another tensor
            elif isinstance(node, ast.BinOp):
                pair = (node.left, node.right)
                cpu = [a for a in pair if _is_factory_without_device(a) and not _is_scalar_tensor(a)]  # type: ignore[arg-type]
                if cpu and any(_foreign(a, fn, node.lineno - 1) for a in pair if a not in cpu):
                    report(node, name, "cross_device")
            elif isinstance(node, ast.Compare):
                ops = [node.left, *node.comparators]
                cpu = [a for a in ops if _is_factory_without_device(a) and not _is_scalar_tensor(a)]  # type: ignore[arg-type]
                if cpu and any(_foreign(a, fn, node.lineno - 1) for a in ops if a not in cpu):
                    report(node, name, "cross_device")
            elif isinstance(node, ast.Subscript) and _on_cpu(node.value, fn, node.lineno - 1):
                index = list(node.slice.elts) if isinstance(node.slice, ast.Tuple) else [node.slice]
                line = node.lineno - 1
                if any(_looks_like_tensor(i, fn, line) and _foreign(i, fn, line) for i in index):
                    report(node, name, "cross_device")
    return sorted(found, key=lambda f: (f.path, f.line))


def check_tree(root: Path, files: Iterable[Path] | None = None) -> list[Finding]:
    """:func:`check_source` over every ``*.py`` under ``root`` (paths reported relative to ``root.parent``)."""
    out: list[Finding] = []
    for p in sorted(files if files is not None else root.rglob("*.py")):
        rel = p.relative_to(root.parent).as_posix()
        out += check_source(p.read_text(encoding="utf-8"), rel)
    return out
