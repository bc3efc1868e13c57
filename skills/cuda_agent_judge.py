"""The judge: checks and times a candidate without ever running its code.

The judge makes every input, keeps the expected outputs, compares and keeps the clock. The
candidate runs in a worker process (cuda_agent_worker.py); the reference runs, eagerly and under
torch.compile, in a second worker that the judge starts itself. Inputs reach each worker through
a region only that worker and the judge share; outputs come back through the worker's own
region (a file on CPU, the output's memory by CUDA IPC handle on GPU). The judge times each call
with its own clock from the request to the reply, and checks the output of every timed call.

Used by evaluate.py (the server's final evaluation, candidate worker started by the server under
its own uid) and by verify.py and profile.py (the agent's tools, which start the candidate
worker themselves). docs/EVALUATION.md has the threat model and the protocol.
"""

from __future__ import annotations

import ast
import builtins
import json
import math
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import cuda_agent_harness as h
import torch

WORKER = Path(__file__).resolve().parent / "cuda_agent_worker.py"

# The input set moved off the task's distribution is compared at this multiple of the task's
# tolerance (see Judge.check_off_distribution).
OFF_DISTRIBUTION_TOLERANCE = 10.0

# ---------------------------------------------------------------------------------------------
# The static check: the candidate's sources read (never run) for constructs that reach into the
# evaluation or hand the work to PyTorch's own compiler. Python is judged on its syntax tree:
# comments, docstrings and string literals are not code, and an `if __name__ == "__main__":`
# guard reaches nothing. Names are resolved through imports and aliases (`import time as t`,
# `_t = torch`), through getattr/setattr/importlib/__import__ with names built from constant
# strings ("get" + "frame"), and through exec/eval of constant code. String literals are data,
# but data that names the evaluation's internals, frame or collector internals, another
# process's memory or ATen's per-device kernels (C++ source embedded for load_inline) is
# refused as well. Other files under kernels/ (C++, CUDA) are matched as text, comments left out.

# What each rule says; the message names the construct the check saw.
STATIC_RULES = {
    "compile": "hands the forward to torch.compile",
    "dispatch": "hooks PyTorch's dispatcher",
    "frames": "inspects the caller's stack frames",
    "gc": "walks the garbage collector's objects",
    "memory": "reads or writes another process's memory",
    "modules": "reaches into the evaluation's modules",
    "rebind": "rebinds a library function",
    "patch": "patches library code",
    "numpy": "computes outside its kernels through numpy",
    "aten": "calls PyTorch's kernels around its dispatcher",
    "precision": "changes PyTorch's precision settings",
    "exec": "runs code built at run time",
}

# Text patterns for sources that are not Python (C++, CUDA; their comments removed first), and
# for Python files that do not parse (they cannot run as Python, but could be read as text).
FORBIDDEN_SOURCE = [
    (r"\btorch\s*\.\s*compile\b|\btorch\s*\.\s*_dynamo\b|\btorch\s*\.\s*_inductor\b", "compile"),
    (r"TorchDispatchMode|TorchFunctionMode|__torch_dispatch__|__torch_function__|_python_dispatch", "dispatch"),
    (r"\bsys\s*\.\s*_getframe\b|\binspect\s*\.\s*(stack|currentframe|getouterframes)\b|\bf_back\b|\bf_locals\b|\bf_globals\b", "frames"),
    (r"\bgc\s*\.\s*(get_objects|get_referrers|get_referents)\b", "gc"),
    (r"/proc/[^\"']*/(mem|environ)\b|process_vm_(readv|writev)|\bptrace\b", "memory"),
    (r"cuda_agent_(harness|judge|worker)|\b__main__\b|\bsys\s*\.\s*modules\b", "modules"),
    (r"(?m)^\s*(?:time|torch|F|np|numpy|os|sys|builtins|math|random|gc|threading|subprocess)(?:\s*\.\s*(?!backends\b)\w+)+\s*=(?!=)", "rebind"),
    (r"\bsetattr\s*\(\s*(?:time|torch|F|np|numpy|os|sys|builtins|math|random)\b|\b__code__\b|\b__globals__\b|\b__closure__\b", "patch"),
    (r"\.numpy\s*\(|\bfrom_numpy\b", "numpy"),
    # Entry points straight into ATen's per-device kernels (invisible to the dispatcher trace).
    # at::cuda:: is not listed: its streams, handles and guards are what CUDA kernels need.
    (r"#\s*include\s*[<\"]ATen/(?:CPUFunctions|CUDAFunctions|Composite\w*Functions|ops/\w+_(?:cpu|cuda)_dispatch|native/)|\bat\s*::\s*(?:cpu|native)\s*::", "aten"),
    (r"allow_tf32\s*=\s*True|set_float32_matmul_precision|allow_(fp16|bf16)_reduced_precision_reduction\s*=\s*True"
     r"|setAllowTF32CuBLAS|setAllowTF32CuDNN|setFloat32MatmulPrecision|setAllow(?:FP16|BF16)ReductionCuBLAS", "precision"),
]

# Patterns matched on the value of every Python string literal that is not a docstring (after
# joining the constant parts of a built string): names no honest data holds.
STRING_PATTERNS = [
    (r"/proc/[^\"']*/(mem|environ)\b|process_vm_(readv|writev)|\bptrace\b", "memory", False),
    (r"cuda_agent_(harness|judge|worker)|\b__main__\b", "modules", True),
    (r"\b_getframe\b|\b_current_frames\b|\bf_back\b|\bf_locals\b|\bf_globals\b", "frames", True),
    (r"\bget_objects\b|\bget_referrers\b|\bget_referents\b", "gc", True),
    (r"TorchDispatchMode|TorchFunctionMode|__torch_dispatch__|__torch_function__|_python_dispatch", "dispatch", True),
    (r"\b__code__\b|\b__globals__\b|\b__closure__\b", "patch", True),
    (r"#\s*include\s*[<\"]ATen/(?:CPUFunctions|CUDAFunctions|Composite\w*Functions|ops/\w+_(?:cpu|cuda)_dispatch|native/)|\bat\s*::\s*(?:cpu|native)\s*::", "aten", True),
    (r"setAllowTF32CuBLAS|setAllowTF32CuDNN|setFloat32MatmulPrecision|setAllow(?:FP16|BF16)ReductionCuBLAS", "precision", True),
]

# Modules whose attributes a candidate must not rebind (torch.backends' flags excepted).
LIBRARY_ROOTS = {"time", "torch", "numpy", "os", "sys", "builtins", "math", "random", "gc", "threading", "subprocess", "inspect", "importlib", "ctypes"}

# Qualified names (and everything under them) and the rule each breaks.
FORBIDDEN_NAMES = {
    "torch.compile": "compile", "torch._dynamo": "compile", "torch._inductor": "compile", "torch.compiler.compile": "compile",
    "torch.utils._python_dispatch": "dispatch", "torch.overrides.TorchFunctionMode": "dispatch",
    "sys._getframe": "frames", "sys._current_frames": "frames", "inspect.stack": "frames", "inspect.currentframe": "frames",
    "inspect.getouterframes": "frames", "inspect.getinnerframes": "frames", "inspect.trace": "frames", "traceback.walk_stack": "frames",
    "gc.get_objects": "gc", "gc.get_referrers": "gc", "gc.get_referents": "gc",
    "sys.modules": "modules", "__main__": "modules", "cuda_agent_harness": "modules", "cuda_agent_judge": "modules", "cuda_agent_worker": "modules",
    "torch.from_numpy": "numpy", "torch.set_float32_matmul_precision": "precision",
    "builtins.exec": "exec", "builtins.eval": "exec", "builtins.compile": "exec",
}

# Attribute names refused whatever they are read from (a frame, a function, a class).
FORBIDDEN_ATTRS = {
    "__torch_dispatch__": "dispatch", "__torch_function__": "dispatch", "TorchDispatchMode": "dispatch", "TorchFunctionMode": "dispatch",
    "_python_dispatch": "dispatch",
    "f_back": "frames", "f_locals": "frames", "f_globals": "frames", "_getframe": "frames", "_current_frames": "frames",
    "get_objects": "gc", "get_referrers": "gc", "get_referents": "gc",
    "__code__": "patch", "__globals__": "patch", "__closure__": "patch",
    "ptrace": "memory", "process_vm_readv": "memory", "process_vm_writev": "memory",
    "from_numpy": "numpy", "set_float32_matmul_precision": "precision",
}

EXEC_NAMES = {"builtins.exec", "builtins.eval", "builtins.compile"}

PRECISION_FLAGS = {"allow_tf32", "allow_fp16_reduced_precision_reduction", "allow_bf16_reduced_precision_reduction"}

# Rules a `__main__` guard's body is spared (a self-test comparing with numpy or timing
# torch.compile never runs in the evaluation, where the module is not __main__), unless some
# file of the candidate could make it run (see StaticCheck.guard_can_run).
GUARD_SPARED = {"compile", "numpy"}

_UNKNOWN = "\x00"  # a part of a built string the check cannot know
MAX_FOLD = 4096  # characters of a built string the check follows


def _strip_c_comments(text: str) -> str:
    """C/C++ source without its comments (string literals kept; line numbers kept)."""
    out, i, n = [], 0, len(text)
    while i < n:
        c = text[i]
        if c in "\"'":
            j = i + 1
            while j < n and text[j] != c and text[j] != "\n":
                j += 2 if text[j] == "\\" else 1
            out.append(text[i:j + 1])
            i = j + 1
        elif text.startswith("//", i):
            j = text.find("\n", i)
            i = n if j < 0 else j
        elif text.startswith("/*", i):
            j = text.find("*/", i + 2)
            j = n if j < 0 else j + 2
            out.append("\n" * text.count("\n", i, j))
            i = j
        else:
            out.append(c)
            i += 1
    return "".join(out)


def _is_docstring(node) -> bool:
    return isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, (str, bytes))


class StaticCheck:
    """One candidate's sources: the Python files' syntax trees, the names they bind, then the
    walk that refuses. Raises RuleBreak("forbidden_source", "<file>:<line>: `<construct>` <what>")."""

    def __init__(self, candidate_dir: Path):
        self.dir = candidate_dir
        files = [candidate_dir / "model_new.py"]
        if (candidate_dir / "kernels").is_dir():
            files += sorted((candidate_dir / "kernels").rglob("*"))
        self.files = [f for f in files if f.is_file() and not f.is_symlink()]
        self.trees: dict = {}
        self.text: dict = {}
        for f in self.files:
            raw = f.read_bytes()
            self.text[f] = raw.decode(errors="replace")
            if f.suffix == ".py":
                try:
                    # From bytes: a coding declaration is honoured as the interpreter would.
                    self.trees[f] = ast.parse(raw, filename=str(f))
                except (SyntaxError, ValueError, RecursionError, MemoryError):
                    pass  # cannot run as Python: matched as text below

    def run(self) -> None:
        for f in self.files:
            if f in self.trees:
                _PyFile(self, f, self.trees[f]).check()
            else:
                self.check_text(f, _strip_c_comments(self.text[f]))

    def refuse(self, f: Path, line: int, construct: str, rule: str, resolved: str | None = None):
        construct = " ".join(str(construct).split())
        if len(construct) > 120:
            construct = construct[:117] + "..."
        seen = f" (that is `{resolved}`)" if resolved and resolved not in construct else ""
        raise h.RuleBreak("forbidden_source", f"{f.relative_to(self.dir)}:{line}: `{construct}`{seen} {STATIC_RULES[rule]}")

    def check_text(self, f: Path, text: str) -> None:
        for pattern, rule in FORBIDDEN_SOURCE:
            m = re.search(pattern, text)
            if m:
                self.refuse(f, text.count("\n", 0, m.start()) + 1, m.group(0), rule)

    def guard_can_run(self) -> bool:
        """Whether any file could make a `__main__` guard's body run: by rebinding `__name__`,
        by reaching module globals or a module's loader, or by running code from a string."""
        for tree in self.trees.values():
            for node in ast.walk(tree):
                if isinstance(node, ast.Name) and node.id in ("globals", "vars", "locals", "__import__", "exec", "eval", "compile", "__spec__", "__loader__", "__builtins__"):
                    return True
                if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("setattr", "delattr"):
                    # setattr(self, "scale", v) is common; a name not written out could be __name__.
                    name = node.args[1] if len(node.args) >= 2 else None
                    if not (isinstance(name, ast.Constant) and isinstance(name.value, str) and name.value != "__name__"):
                        return True
                if isinstance(node, ast.Name) and node.id == "__name__" and not isinstance(node.ctx, ast.Load):
                    return True
                if isinstance(node, ast.Attribute) and node.attr in ("__name__", "__dict__", "__spec__", "__loader__", "pythonapi", "ModuleType", "exec_module", "load_module", "run_path", "run_module", "reload"):
                    if not (node.attr == "__name__" and isinstance(node.ctx, ast.Load)):
                        return True
                if isinstance(node, (ast.Import, ast.ImportFrom)):
                    names = [a.name for a in node.names] + ([node.module] if isinstance(node, ast.ImportFrom) and node.module else [])
                    if any(n.split(".")[0] in ("importlib", "runpy", "types", "model_new", "builtins") for n in names):
                        return True
                if isinstance(node, ast.Constant) and node.value == "__name__":
                    return True
        return False


class _PyFile:
    """The walk over one Python file."""

    def __init__(self, check: StaticCheck, path: Path, tree: ast.AST, line_offset: int = 0, depth: int = 0):
        self.c, self.path, self.tree, self.offset, self.depth = check, path, tree, line_offset, depth
        self.aliases: dict[str, set] = {}
        self.consts: dict[str, str] = {}
        self.bound: set = set()
        self.skip_strings: set = set()  # the "__main__" of a guard's comparison
        self.spared: set = set()  # nodes inside a __main__ guard's body
        self.docstrings: set = set()

    # -- set-up ---------------------------------------------------------------------------

    def check(self) -> None:
        for node in ast.walk(self.tree):
            if _is_docstring(node):
                self.docstrings.add(id(node.value))
            if isinstance(node, ast.Compare) and len(node.ops) == 1 and isinstance(node.ops[0], (ast.Eq, ast.NotEq)):
                sides = [node.left, node.comparators[0]]
                if any(isinstance(s, ast.Name) and s.id == "__name__" for s in sides):
                    for s in sides:
                        if isinstance(s, ast.Constant) and s.value == "__main__":
                            self.skip_strings.add(id(s))
            for t in self._bound_names(node):
                self.bound.add(t)
        if self.depth == 0 and isinstance(self.tree, ast.Module) and not self.c.guard_can_run():
            for stmt in self.tree.body:
                if self._is_main_guard(stmt):
                    for sub in stmt.body:
                        for n in ast.walk(sub):
                            self.spared.add(id(n))
        # Aliases and constant strings, to a fixed point (a later alias of an earlier one).
        for _ in range(4):
            before = (sum(len(v) for v in self.aliases.values()), len(self.consts))
            self._collect()
            if (sum(len(v) for v in self.aliases.values()), len(self.consts)) == before:
                break
        for node in ast.walk(self.tree):
            self._visit(node)

    @staticmethod
    def _is_main_guard(stmt) -> bool:
        if not isinstance(stmt, ast.If) or not isinstance(stmt.test, ast.Compare):
            return False
        t = stmt.test
        if len(t.ops) != 1 or not isinstance(t.ops[0], ast.Eq):
            return False
        sides = {type(s).__name__: s for s in (t.left, t.comparators[0])}
        name, const = sides.get("Name"), sides.get("Constant")
        return name is not None and name.id == "__name__" and const is not None and const.value == "__main__"

    @staticmethod
    def _bound_names(node):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            yield node.name
        elif isinstance(node, ast.Name) and not isinstance(node.ctx, ast.Load):
            yield node.id
        elif isinstance(node, ast.arg):
            yield node.arg
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for a in node.names:
                yield (a.asname or a.name).split(".")[0]

    def _collect(self) -> None:
        assigned: dict[str, list] = {}
        for node in ast.walk(self.tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.asname:
                        self._alias(a.asname, a.name)
                    else:
                        top = a.name.split(".")[0]
                        self._alias(top, top)
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                for a in node.names:
                    if a.name != "*":
                        self._alias(a.asname or a.name, f"{node.module}.{a.name}")
            elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.NamedExpr)) and getattr(node, "value", None) is not None:
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for t in targets:
                    for name, value in self._pairs(t, node.value):
                        assigned.setdefault(name, []).append(value)
                        q = self.qual(value)
                        if q:
                            self._alias(name, q)
            elif isinstance(node, (ast.For, ast.comprehension)) and isinstance(node.target, ast.Name):
                # `for m in (torch, time): m.x = ...`: the loop name stands for each element.
                if isinstance(node.iter, (ast.Tuple, ast.List, ast.Set)):
                    for elt in node.iter.elts:
                        q = self.qual(elt)
                        if q:
                            self._alias(node.target.id, q)
                        s = self.fold(elt)
                        if s is not None and s[1]:
                            assigned.setdefault(node.target.id, []).append(elt)
                            assigned.setdefault(node.target.id, []).append(elt)  # several values: never one constant
            elif isinstance(node, ast.withitem) and isinstance(node.optional_vars, ast.Name):
                q = self.qual(node.context_expr)
                if q:
                    self._alias(node.optional_vars.id, q)
        for name, values in assigned.items():
            if len(values) == 1:
                s = self.fold(values[0])
                if s is not None and s[1]:
                    self.consts[name] = s[0]

    @staticmethod
    def _pairs(target, value):
        if isinstance(target, ast.Name):
            yield target.id, value
        elif isinstance(target, (ast.Tuple, ast.List)) and isinstance(value, (ast.Tuple, ast.List)) and len(target.elts) == len(value.elts):
            for t, v in zip(target.elts, value.elts):
                yield from _PyFile._pairs(t, v)

    def _alias(self, name: str, qual: str) -> None:
        self.aliases.setdefault(name, set()).add(qual)

    # -- names and strings ----------------------------------------------------------------

    def qual(self, node, depth: int = 0) -> str | None:
        """The dotted name an expression stands for (`torch.compile`), or None."""
        if depth > 12:
            return None
        if isinstance(node, ast.Name):
            if node.id in self.aliases:
                quals = sorted(self.aliases[node.id])
                library = [q for q in quals if q.split(".")[0] in LIBRARY_ROOTS or _forbidden_name(q)]
                return (library or quals)[0]
            if node.id == "__builtins__":
                return "builtins"
            if node.id not in self.bound and hasattr(builtins, node.id):
                return f"builtins.{node.id}"
            return None
        if isinstance(node, ast.Attribute):
            base = self.qual(node.value, depth + 1)
            return f"{base}.{node.attr}" if base else None
        if isinstance(node, ast.Call):
            f = self.qual(node.func, depth + 1)
            if f in ("builtins.getattr", "builtins.object.__getattribute__", "builtins.type.__getattribute__") and len(node.args) >= 2:
                base, name = self.qual(node.args[0], depth + 1), self.fold(node.args[1])
                return f"{base}.{name[0]}" if base and name and name[1] else None
            if f in ("builtins.__import__", "importlib.import_module") and node.args:
                name = self.fold(node.args[0])
                if name and name[1]:
                    fromlist = len(node.args) >= 4 or any(k.arg == "fromlist" for k in node.keywords)
                    return name[0] if f == "importlib.import_module" or fromlist else name[0].split(".")[0]
            if f == "builtins.vars" and node.args:
                return self.qual(node.args[0], depth + 1)
            return None
        if isinstance(node, ast.Subscript):
            # vars(torch)["compile"], torch.__dict__["compile"], __builtins__["exec"]
            key = self.fold(node.slice)
            if key and key[1]:
                v = node.value
                if isinstance(v, ast.Attribute) and v.attr == "__dict__":
                    base = self.qual(v.value, depth + 1)
                else:
                    base = self.qual(v, depth + 1)
                    if base == "sys.modules":
                        return key[0]
                    if base not in ("builtins",) and not (isinstance(v, ast.Call) and self.qual(v.func, depth + 1) == "builtins.vars"):
                        return None
                return f"{base}.{key[0]}" if base else None
        return None

    def fold(self, node, depth: int = 0) -> tuple[str, bool] | None:
        """The value of a string expression built from constants: (text, exact); parts that
        cannot be known read as _UNKNOWN, with exact False. None for what is not a string.
        Kept to MAX_FOLD characters at every step (a string multiplied in a loop of products
        must not cost the judge its memory)."""
        r = self._fold(node, depth)
        if r is not None and len(r[0]) > MAX_FOLD:
            return r[0][:MAX_FOLD] + _UNKNOWN, False
        return r

    def _fold(self, node, depth: int) -> tuple[str, bool] | None:
        if depth > 24:
            return None
        if isinstance(node, ast.Constant):
            if isinstance(node.value, str):
                return node.value, True
            if isinstance(node.value, bytes):
                return node.value.decode("latin-1"), True
            return None
        if isinstance(node, ast.Name):
            if node.id in self.consts:
                return self.consts[node.id], True
            return None
        if isinstance(node, ast.BinOp):
            left, right = self.fold(node.left, depth + 1), self.fold(node.right, depth + 1)
            if isinstance(node.op, ast.Add) and (left or right):
                left, right = left or (_UNKNOWN, False), right or (_UNKNOWN, False)
                return left[0] + right[0], left[1] and right[1]
            if isinstance(node.op, ast.Mult):
                for s, n in ((left, node.right), (right, node.left)):
                    if s and isinstance(n, ast.Constant) and type(n.value) is int and 0 <= n.value <= 64:
                        return s[0] * n.value, s[1]
            if isinstance(node.op, ast.Mod) and left:
                return re.sub(r"%[-#0 +]*\d*(?:\.\d+)?[a-zA-Z%]", _UNKNOWN, left[0]), False
            return None
        if isinstance(node, ast.JoinedStr):
            parts, exact = [], True
            for v in node.values:
                s = self.fold(v.value if isinstance(v, ast.FormattedValue) else v, depth + 1)
                if isinstance(v, ast.FormattedValue) and (v.format_spec is not None or v.conversion not in (-1, ord("s"))):
                    s = None
                parts.append(s[0] if s else _UNKNOWN)
                exact = exact and bool(s and s[1])
            return "".join(parts), exact
        if isinstance(node, ast.Subscript):
            s = self.fold(node.value, depth + 1)
            if s and s[1]:
                sl = node.slice
                def const_int(b):
                    if isinstance(b, ast.UnaryOp) and isinstance(b.op, ast.USub):
                        v = const_int(b.operand)
                        return None if v is None else -v
                    return b.value if isinstance(b, ast.Constant) and type(b.value) is int else None

                try:
                    if isinstance(sl, ast.Slice):
                        bounds = [None if b is None else const_int(b) for b in (sl.lower, sl.upper, sl.step)]
                        if all(b is not None or p is None for b, p in zip(bounds, (sl.lower, sl.upper, sl.step))):
                            return s[0][slice(*bounds)], True
                    elif const_int(sl) is not None:
                        return s[0][const_int(sl)], True
                except (ValueError, IndexError):
                    return None
            return None
        if isinstance(node, ast.Call):
            return self._fold_call(node, depth)
        return None

    def _fold_call(self, node: ast.Call, depth: int):
        func = node.func
        if isinstance(func, ast.Attribute):
            base = self.fold(func.value, depth + 1)
            if func.attr == "join" and base is not None and len(node.args) == 1:
                items = self._fold_items(node.args[0], depth + 1)
                if items is None:
                    return base[0] + _UNKNOWN, False
                return base[0].join(s for s, _ in items), base[1] and all(e for _, e in items)
            if base is not None and func.attr in ("decode", "encode") and not node.args:
                return base
            if base is not None and func.attr in ("lower", "upper", "strip", "lstrip", "rstrip", "title", "capitalize", "casefold") and not node.args:
                return getattr(base[0], func.attr)(), base[1]
            if base is not None and func.attr == "replace" and len(node.args) == 2:
                a, b = self.fold(node.args[0], depth + 1), self.fold(node.args[1], depth + 1)
                if a and b and a[1] and b[1]:
                    return base[0].replace(a[0], b[0]), base[1]
                return base[0], False
            if base is not None and func.attr == "format":
                return re.sub(r"\{[^{}]*\}", _UNKNOWN, base[0]), False
            if func.attr == "fromhex" and node.args:
                s = self.fold(node.args[0], depth + 1)
                if s and s[1]:
                    try:
                        return bytes.fromhex(s[0]).decode("latin-1"), True
                    except ValueError:
                        return None
        if isinstance(func, ast.Name) and func.id not in self.bound:
            if func.id == "chr" and len(node.args) == 1 and isinstance(node.args[0], ast.Constant) and type(node.args[0].value) is int:
                try:
                    return chr(node.args[0].value), True
                except (ValueError, OverflowError):
                    return None
            if func.id == "str" and len(node.args) == 1:
                return self.fold(node.args[0], depth + 1)
            if func.id in ("bytes", "bytearray") and len(node.args) == 1:
                if isinstance(node.args[0], (ast.List, ast.Tuple)) and len(node.args[0].elts) <= MAX_FOLD:
                    try:
                        return bytes(ast.literal_eval(node.args[0])).decode("latin-1"), True
                    except (ValueError, TypeError, SyntaxError):
                        return None
                return self.fold(node.args[0], depth + 1)
        return None

    def _fold_items(self, node, depth: int):
        """The strings an iterable given to str.join holds, in order."""
        if isinstance(node, (ast.List, ast.Tuple)):
            items = [self.fold(e, depth + 1) or (_UNKNOWN, False) for e in node.elts]
            return items
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id not in self.bound:
            if node.func.id in ("reversed", "list", "tuple") and len(node.args) == 1:
                items = self._fold_items(node.args[0], depth + 1)
                return None if items is None else (items[::-1] if node.func.id == "reversed" else items)
            if node.func.id == "map" and len(node.args) == 2 and isinstance(node.args[0], ast.Name) and node.args[0].id in ("chr", "str"):
                if not isinstance(node.args[1], (ast.List, ast.Tuple)) or len(node.args[1].elts) > MAX_FOLD:
                    return None
                try:
                    vals = ast.literal_eval(node.args[1])
                    return [((chr(v) if node.args[0].id == "chr" else str(v)[:MAX_FOLD]), True) for v in vals]
                except (ValueError, TypeError, SyntaxError, OverflowError):
                    return None
        s = self.fold(node, depth + 1)
        if s is not None:
            return [(ch, s[1]) for ch in s[0]]
        return None

    # -- the rules ------------------------------------------------------------------------

    def refuse(self, node, construct: str, rule: str, resolved: str | None = None) -> None:
        if id(node) in self.spared and rule in GUARD_SPARED:
            return
        self.c.refuse(self.path, getattr(node, "lineno", 1) + self.offset, construct, rule, resolved)

    def source(self, node) -> str:
        try:
            return ast.unparse(node)
        except Exception:  # noqa: BLE001 - only for the message
            return type(node).__name__

    def check_qual(self, node, q: str | None) -> None:
        if not q:
            return
        rule = _forbidden_name(q)
        if rule:
            self.refuse(node, self.source(node), rule, q)
        for part in q.split(".")[1:]:
            if part in FORBIDDEN_ATTRS:
                self.refuse(node, self.source(node), FORBIDDEN_ATTRS[part], q)

    def check_attr_name(self, node, base_q: str | None, name: str) -> None:
        """An attribute named `name` read from, written to or defined on something."""
        if name in FORBIDDEN_ATTRS:
            self.refuse(node, self.source(node), FORBIDDEN_ATTRS[name], f"{base_q}.{name}" if base_q else name)
        if base_q:
            self.check_qual(node, f"{base_q}.{name}")
        if name.startswith("cuda_agent_"):
            self.refuse(node, self.source(node), "modules")

    def check_string(self, node) -> None:
        if id(node) in self.docstrings or id(node) in self.skip_strings:
            return
        s = self.fold(node)
        if s is None:
            return
        text = s[0]
        for pattern, rule, strip in STRING_PATTERNS:
            m = re.search(pattern, _strip_c_comments(text) if strip else text)
            if m:
                self.refuse(node, self.source(node) if not isinstance(node, ast.Constant) else repr(m.group(0)), rule)

    def check_module(self, node, name: str) -> None:
        """An import of `name` (a statement, __import__ or importlib)."""
        self.check_qual(node, name)
        for part in name.split("."):
            if part in FORBIDDEN_ATTRS or part == "__main__" or part.startswith("cuda_agent_"):
                self.refuse(node, self.source(node), FORBIDDEN_ATTRS.get(part, "modules"), name)

    def _library(self, q: str | None) -> bool:
        return bool(q) and q.split(".")[0] in LIBRARY_ROOTS

    def check_store(self, node, target) -> None:
        """A name written: library attributes are not the candidate's to rebind."""
        if isinstance(target, (ast.Tuple, ast.List)):
            for t in target.elts:
                self.check_store(node, t.value if isinstance(t, ast.Starred) else t)
            return
        if isinstance(target, ast.Attribute):
            q = self.qual(target)
            if target.attr in PRECISION_FLAGS:
                value = getattr(node, "value", None)
                if not (isinstance(value, ast.Constant) and value.value is False):
                    self.refuse(node, self.source(target), "precision")
            if self._library(q) and not q.startswith("torch.backends."):
                self.refuse(node, self.source(target) + " =", "rebind", q)
            if target.attr == "__dict__":
                self.refuse(node, self.source(target), "patch")
        elif isinstance(target, ast.Subscript):
            v = target.value
            base = v.value if isinstance(v, ast.Attribute) and v.attr == "__dict__" else None
            if base is not None and self._library(self.qual(base)):
                self.refuse(node, self.source(target), "patch", self.qual(base))
            if isinstance(v, ast.Call) and self.qual(v.func) == "builtins.vars" and v.args and self._library(self.qual(v.args[0])):
                self.refuse(node, self.source(target), "patch")

    def _visit(self, node) -> None:
        if isinstance(node, (ast.Constant, ast.JoinedStr, ast.BinOp)) or (isinstance(node, ast.Call) and self.fold(node) is not None):
            if not (isinstance(node, ast.Constant) and not isinstance(node.value, (str, bytes))):
                self.check_string(node)
        if isinstance(node, ast.Import):
            for a in node.names:
                self.check_module(node, a.name)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            self.check_module(node, node.module)
            for a in node.names:
                self.check_module(node, f"{node.module}.{a.name}")
                if a.name in FORBIDDEN_ATTRS:
                    self.refuse(node, self.source(node), FORBIDDEN_ATTRS[a.name], f"{node.module}.{a.name}")
        elif isinstance(node, ast.Attribute):
            base_q = self.qual(node.value)
            self.check_attr_name(node, base_q, node.attr)
            if node.attr == "__dict__" and self._library(base_q):
                self.refuse(node, self.source(node), "patch", f"{base_q}.__dict__")
            if base_q == "sys" and node.attr == "modules":
                self.refuse(node, self.source(node), "modules", "sys.modules")
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load):
            q = self.qual(node)
            if q in EXEC_NAMES:
                pass  # checked below: allowed only when called on code the check can read
            elif q and q != node.id:
                self.check_qual(node, q)
            elif node.id.startswith("cuda_agent_") or node.id in FORBIDDEN_ATTRS and node.id not in self.bound:
                self.refuse(node, node.id, FORBIDDEN_ATTRS.get(node.id, "modules"))
            if q in EXEC_NAMES and not self._called_with_constant(node):
                self.refuse(node, node.id, "exec", q)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            if node.name in FORBIDDEN_ATTRS and FORBIDDEN_ATTRS[node.name] == "dispatch":
                self.refuse(node, f"def {node.name}" if not isinstance(node, ast.ClassDef) else f"class {node.name}", "dispatch")
        elif isinstance(node, ast.Call):
            self._visit_call(node)
        elif isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            for t in (node.targets if isinstance(node, ast.Assign) else [node.target]):
                if not isinstance(node, ast.AnnAssign) or node.value is not None:
                    self.check_store(node, t)
        elif isinstance(node, ast.Delete):
            for t in node.targets:
                self.check_store(node, t)
        elif isinstance(node, (ast.For, ast.AsyncFor, ast.With, ast.AsyncWith, ast.comprehension)):
            targets = [node.target] if hasattr(node, "target") else [i.optional_vars for i in node.items if i.optional_vars is not None]
            for t in targets:
                self.check_store(node, t)
        elif isinstance(node, ast.NamedExpr):
            self.check_store(node, node.target)

    def _called_with_constant(self, name_node) -> bool:
        """Whether this exec/eval/compile is called directly on code the check can read (that
        code is then checked as part of this file)."""
        for call in ast.walk(self.tree):
            if isinstance(call, ast.Call) and call.func is name_node and call.args:
                s = self.fold(call.args[0])
                return bool(s and s[1])
        return False

    def _visit_call(self, node: ast.Call) -> None:
        f = self.qual(node.func)
        self.check_qual(node, self.qual(node))
        if f in ("builtins.getattr", "builtins.setattr", "builtins.delattr", "builtins.hasattr", "builtins.object.__getattribute__",
                 "builtins.object.__setattr__", "builtins.type.__setattr__", "builtins.type.__getattribute__", "operator.attrgetter"):
            args = node.args
            if f == "operator.attrgetter":
                names = [self.fold(a) for a in args]
                base_q = None
            else:
                names = [self.fold(args[1])] if len(args) >= 2 else []
                base_q = self.qual(args[0]) if args else None
            for s in names:
                if s and s[1] and s[0] == "numpy" and f != "operator.attrgetter":
                    self.refuse(node, self.source(node), "numpy")
                if s and s[1]:
                    for part in s[0].split("."):
                        self.check_attr_name(node, base_q, part)
                        base_q = f"{base_q}.{part}" if base_q else None
            if f.endswith(("setattr", "delattr", "__setattr__")) and args:
                target_q = self.qual(args[0])
                if self._library(target_q) and not target_q.startswith("torch.backends"):
                    self.refuse(node, self.source(node), "patch", target_q)
                if names and names[0] and names[0][1] and names[0][0] in PRECISION_FLAGS:
                    self.refuse(node, self.source(node), "precision")
        elif f in ("builtins.__import__", "importlib.import_module", "importlib.__import__") and node.args:
            s = self.fold(node.args[0])
            if s and s[1]:
                self.check_module(node, s[0])
        elif f in EXEC_NAMES and node.args:
            s = self.fold(node.args[0])
            if not (s and s[1]):
                self.refuse(node, self.source(node), "exec", f)
            if self.depth > 4:
                self.refuse(node, self.source(node), "exec", f)
            try:
                tree = ast.parse(s[0])
            except (SyntaxError, ValueError, RecursionError, MemoryError):
                self.refuse(node, self.source(node), "exec", f)
            inner = _PyFile(self.c, self.path, tree, line_offset=node.lineno - 1 + self.offset, depth=self.depth + 1)
            # The code runs among this file's names: `import torch` here, `torch.compile` there.
            inner.aliases = {k: set(v) for k, v in self.aliases.items()}
            inner.consts = dict(self.consts)
            inner.check()
        elif f == "builtins.vars" and node.args and self._library(self.qual(node.args[0])):
            self.refuse(node, self.source(node), "patch", self.qual(node.args[0]))
        if isinstance(node.func, ast.Attribute) and node.func.attr == "numpy":
            self.refuse(node, self.source(node), "numpy")


def _forbidden_name(q: str) -> str | None:
    """The rule a qualified name breaks (itself or what it is under), or None."""
    parts = q.split(".")
    for i in range(len(parts), 0, -1):
        rule = FORBIDDEN_NAMES.get(".".join(parts[:i]))
        if rule:
            return rule
    return None


def static_check(candidate_dir: Path) -> None:
    """Rejects sources that reach into the evaluation (read by the judge; never executed). A
    source the check cannot read through (nesting beyond Python's own limits) is refused: it is
    the candidate's, and must not end as the evaluation's error."""
    try:
        StaticCheck(candidate_dir).run()
    except h.RuleBreak:
        raise
    except (RecursionError, MemoryError, ValueError, TypeError, OverflowError, IndexError, KeyError, AttributeError) as e:
        raise h.RuleBreak("forbidden_source", f"the sources could not be checked ({type(e).__name__}: {str(e)[:200]})") from e


# The most the control may add to the late-work allowance (ms). On an H100 host the control
# (the reference worker's own process) used 1.2-1.8 ms in a timing window and honest
# candidates 0.9-2.2 ms; a candidate that finished its calls from a host thread used 7.9 ms.
# Whatever else the reference's process does in that window (it also runs torch.compile's
# baseline) must not open the bound to such work.
LATE_WORK_CONTROL_CAP_MS = 4.0


def late_work_allowance_ms(in_calls_ms: float, control_ms: float) -> float:
    """CPU a legitimate candidate's processes may use between its timed calls: a fixed 1 ms,
    0.5% of its time inside calls, and twice what the reference worker (the control, idle
    between its own calls in the same window) used, at most LATE_WORK_CONTROL_CAP_MS. The
    control carries the machine: on an H100 host, idle workers with a CUDA context used
    0.9-1.7 ms over a 2 s timing window, beyond a fixed allowance; on CPU, about 1 us per gap."""
    return 1.0 + 0.005 * in_calls_ms + min(2.0 * control_ms, LATE_WORK_CONTROL_CAP_MS)


class ProcessCpu:
    """CPU time used by a worker and everything it started, read from /proc (nanoseconds).
    Finds the worker's descendants by parent links, and every process of `uid` when given;
    with `descendants=False`, the worker's own process alone (the control: the reference
    worker's torch.compile starts a pool of compile processes whose start-up, 1.8 s of CPU on
    an H100 host, lands in the timing window and says nothing about an idle worker)."""

    def __init__(self, pid: int, uid: int | None = None, descendants: bool = True):
        self.pid, self.uid, self.descendants = pid, uid, descendants
        self.available = Path(f"/proc/{pid}/stat").exists()

    def _members(self) -> list[int]:
        if not self.descendants and self.uid is None:
            return [self.pid]
        parents, uids = {}, {}
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            try:
                stat = Path(f"/proc/{entry.name}/stat").read_text()
                parents[int(entry.name)] = int(stat[stat.rfind(")") + 2:].split()[1])
                if self.uid is not None:
                    uids[int(entry.name)] = entry.stat().st_uid
            except (OSError, ValueError, IndexError):
                continue
        members = {self.pid}
        changed = True
        while changed:
            changed = False
            for p, pp in parents.items():
                if pp in members and p not in members:
                    members.add(p)
                    changed = True
        if self.uid is not None:
            members |= {p for p, u in uids.items() if u == self.uid}
        return sorted(members)

    def total(self) -> tuple[int, int]:
        """(nanoseconds from each process's CPU clock: precise, every thread it ever had;
        nanoseconds from utime+stime+cutime+cstime: coarse clock ticks, but counting children
        already reaped)."""
        if not self.available:
            return 0, 0
        precise = ticks = 0
        tick = os.sysconf("SC_CLK_TCK")
        for pid in self._members():
            try:
                # The process-wide CPU-time clock of `pid` (the kernel's MAKE_PROCESS_CPUCLOCK).
                precise += time.clock_gettime_ns(((~pid) << 3) | 2)
                stat = Path(f"/proc/{pid}/stat").read_text()
                fields = stat[stat.rfind(")") + 2:].split()
                ticks += sum(int(fields[k]) for k in (11, 12, 13, 14)) * 1_000_000_000 // tick
            except (OSError, ValueError, IndexError):
                continue
        return precise, ticks


class CpuOutsideCalls:
    """CPU time a worker used outside the calls being timed, kept twice: from the precise
    per-thread counters and from the coarse per-process ones (which also count threads that
    exited); the larger is believed."""

    def __init__(self):
        self.sched_ns = 0
        self.ticks_ns = 0
        self.gaps = 0

    def add(self, start: tuple[int, int], end: tuple[int, int]) -> None:
        self.gaps += 1
        self.sched_ns += max(0, end[0] - start[0])
        self.ticks_ns += max(0, end[1] - start[1])

    def add_excess(self, start: tuple[int, int], end: tuple[int, int], wall_s: float) -> None:
        wall_ns = int(wall_s * 1e9)
        self.sched_ns += max(0, end[0] - start[0] - wall_ns)
        # Ticks are 10 ms apart: only a whole tick over the wall time says anything.
        self.ticks_ns += max(0, end[1] - start[1] - wall_ns - 10_000_000)

    def ns(self) -> int:
        # A tick is 10 ms and lands on whoever runs: two ticks of slack before the coarse
        # count is believed over the precise one.
        return max(self.sched_ns, self.ticks_ns - 20_000_000)


@dataclass
class WorkerLink:
    """The judge's side of one worker: its channel, its process, where its outputs appear."""

    name: str
    channel: h.Channel
    pid: int
    out_dir: Path
    uid: int | None
    popen: subprocess.Popen | None = None
    log: Path | None = None
    pidfd: int | None = None
    seq: int = 0
    cpu: ProcessCpu | None = None
    last_reply_cpu: tuple[int, int] | None = None
    gap: "CpuOutsideCalls" = field(default_factory=lambda: CpuOutsideCalls())
    track_cpu: bool = False
    sent_at: float = 0.0
    replied_at: float = 0.0
    opened: list = field(default_factory=list)
    # What the judge is doing (for messages only): build, check or time.
    stage: str = ""
    # The candidate worker's own account of the weights it took (advisory: shown, never believed).
    weights: dict | None = None
    # Every forward asked of this worker: (model, traced, sent, replied), the times in
    # CLOCK_MONOTONIC ns, the clock of the server's outside observation of the worker's CPU.
    runs: list = field(default_factory=list)
    # The evaluation's device type ("cpu", "cuda"): where announced outputs must be.
    device_type: str = "cpu"

    def __post_init__(self):
        try:
            self.pidfd = os.pidfd_open(self.pid)
        except (OSError, AttributeError):
            self.pidfd = None
        # The reference worker is the control (see Judge.time_all); every candidate worker
        # is counted with all it started.
        self.cpu = ProcessCpu(self.pid, self.uid, descendants=self.name != "reference")

    def died(self) -> str | None:
        if self.popen is not None:
            rc = self.popen.poll()
            if rc is not None:
                return f"exit status {rc}" if rc >= 0 else f"killed by signal {-rc} ({signal_name(-rc)})"
            return None
        if not Path(f"/proc/{self.pid}").exists():
            return "the process is gone"
        return None

    def tail(self) -> str:
        if self.log is None or not self.log.exists():
            return ""
        data = self.log.read_bytes()[-3000:].decode(errors="replace")
        data = "\n".join(ln for ln in data.splitlines() if not ln.startswith("Extension modules:")).strip()
        return f"\n--- worker output (last lines: a crash's Python traceback is here) ---\n{data}" if data else ""

    def where(self, op: str) -> str:
        """The stage a request belongs to, for messages: build, check or time."""
        return f"{self.stage} ({op})" if self.stage else op

    def request(self, msg: dict, timeout: float) -> dict:
        """One request and its reply. Every way the candidate's worker can misbehave becomes a
        RuleBreak; a failure of the reference worker (which runs no candidate code) is the
        evaluation's own, never a verdict on the candidate."""
        try:
            return self._request(msg, timeout)
        except h.RuleBreak as e:
            if self.name == "reference":
                raise ReferenceFailure(f"the reference worker failed during {self.where(msg['op'])} ({e.rule}): {e}") from e
            raise

    def _request(self, msg: dict, timeout: float) -> dict:
        if self.channel.pending():
            raise h.RuleBreak("protocol", f"the {self.name} worker wrote to its channel out of turn")
        if self.track_cpu:
            before = self.cpu.total()
            if self.last_reply_cpu is not None:
                self.gap.add(self.last_reply_cpu, before)
        self.seq += 1
        msg = dict(msg, seq=self.seq)
        run_started = time.monotonic_ns()
        try:
            self.sent_at = time.perf_counter()
            self.channel.send(msg)
        except (BrokenPipeError, OSError) as e:
            raise h.RuleBreak("worker_died", f"the {self.name} worker is gone ({self.died() or e}){self.tail()}") from e
        deadline = time.monotonic() + timeout
        import select

        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise h.RuleBreak("time_limit", f"the {self.name} worker did not answer {msg['op']} within {timeout:.0f} s, during {self.where(msg['op'])}")
            watch = [self.channel.rfd] + ([self.pidfd] if self.pidfd is not None else [])
            ready = select.select(watch, [], [], min(left, 0.5))[0]
            if self.channel.rfd in ready:
                break
            if ready or self.died():
                # A reply may still be in the pipe: read it before calling the worker dead.
                if select.select([self.channel.rfd], [], [], 0)[0]:
                    break
                raise h.RuleBreak("worker_died", f"the {self.name} worker died during {self.where(msg['op'])}: {self.died() or 'exited'}{self.tail()}")
        try:
            reply = self.channel.recv(timeout=max(1.0, deadline - time.monotonic()))
            self.replied_at = time.perf_counter()
            if msg["op"] == "run":
                self.runs.append((msg.get("model"), bool(msg.get("trace")), run_started, time.monotonic_ns()))
        except h.ChannelClosed as e:
            if self.popen is not None:
                try:  # a worker that just crashed: let it be reaped, so its signal is known
                    self.popen.wait(timeout=2)
                except subprocess.TimeoutExpired:
                    pass
            raise h.RuleBreak("worker_died", f"the {self.name} worker closed its channel during {self.where(msg['op'])}: {self.died() or 'exited'}{self.tail()}") from e
        except TimeoutError as e:
            raise h.RuleBreak("protocol", f"the {self.name} worker sent half a message") from e
        except ValueError as e:
            raise h.RuleBreak("protocol", f"the {self.name} worker sent garbage: {e}") from e
        if self.track_cpu:
            self.last_reply_cpu = self.cpu.total()
            if msg["op"] in ("load", "inputs"):
                # Loading and the input check are one thread's copy or compare: CPU beyond the
                # request's own wall time was spent by something else of the worker's.
                self.gap.add_excess(before, self.last_reply_cpu, self.replied_at - self.sent_at)
        return parse_reply(msg["op"], reply, self.seq, self.name, self.device_type)

    def close(self) -> None:
        for r in self.opened:
            r.close()
        self.opened.clear()
        try:
            self.channel.send({"op": "exit"})
        except OSError:
            pass
        if self.popen is not None:
            try:
                self.popen.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()
        for fd in (self.channel.rfd, self.channel.wfd, self.pidfd):
            if fd is not None:
                try:
                    os.close(fd)
                except OSError:
                    pass


class ReferenceFailure(Exception):
    """The reference worker failed: an error of the evaluation (a task that does not run, a
    machine that cannot share memory between processes), reported as `harness_error`."""


def signal_name(n: int) -> str:
    import signal

    try:
        return signal.Signals(n).name
    except ValueError:
        return f"signal {n}"


def weights_hint(link: "WorkerLink | None") -> str:
    """A note for a wrong output when the candidate's worker said some weights were not the
    reference's (its own report: shown as a hint, it decides nothing)."""
    w = getattr(link, "weights", None)
    if not isinstance(w, dict):
        return ""
    def names(key):
        v = w.get(key)
        return [str(x)[:80] for x in v[:8]] if isinstance(v, list) else []
    ref_left, own = names("reference_not_loaded"), names("candidate_own")
    if not ref_left and not own:
        return ""
    parts = []
    if ref_left:
        parts.append(f"the reference's {', '.join(ref_left)} matched no parameter of ModelNew by name and shape")
    if own:
        parts.append(f"ModelNew's {', '.join(own)} kept their own initialisation (not the reference's weights)")
    return "\n[weights: " + "; ".join(parts) + ". Weights are shared by parameter name and shape: declare the reference's modules under the same names, or copy them in __init__.]"


# ---------------------------------------------------------------------------------------------
# The worker's replies. Every field the judge reads is listed here with its type, op by op, and
# read through parse_reply alone: a reply that does not fit (a field missing or of the wrong
# type, a number out of range or not finite, a string the verdict's JSON could not carry) is a
# `protocol` break of the worker that sent it: -1 for the candidate's (whose process can write
# anything on its channel), the evaluation's own error for the reference's. Fields not listed
# are ignored. docs/EVALUATION.md ("The worker's messages") has the same table; a test holds
# the two, and the worker's ops, together.

# Failures a worker may report about itself (anything else it says is a protocol break).
WORKER_RULES = {"compile", "missing_solution", "runtime_error", "wrong_output", "precision", "pytorch_compute", "no_custom_kernel", "input_mutation"}

# The most of anything a reply may hold: dimensions, list items, characters.
MAX_DIMS = 64
MAX_DIM = 1 << 48
MAX_ITEMS = 64
MAX_TEXT = 8000

# op -> {field: (type, required)}. Types: "int" (a JSON integer, not a boolean, 0 <= n < 2**62),
# "seconds" (a finite number >= 0), "text", "texts" (a list of text), "seconds_by_name" (an
# object of finite numbers), "weights", "outputs", "trace". Every reply also has `seq` (int) and
# `ok` (bool); a failure (`ok` false) has `rule` (one of WORKER_RULES), `message` (text) and
# optionally `traceback` (text), and nothing else is read of it.
REPLY_FIELDS: dict[str, dict[str, tuple[str, bool]]] = {
    "ready": {},
    "hello": {"pid": ("int", False), "build_s": ("seconds", False), "extensions": ("texts", False), "steps_s": ("seconds_by_name", False)},
    "model": {"weights": ("weights", False)},
    "slot": {},
    "load": {},
    "run": {"outputs": ("outputs", True), "trace": ("trace", False)},
    "inputs": {},
    "stats": {"peak_rss_bytes": ("int", False), "peak_cuda_reserved_bytes": ("int", False)},
    "drop": {},
}


# The dtypes an output may announce: those the judge can read as bytes and compare.
OUTPUT_DTYPES = {
    name: getattr(torch, name)
    for name in ("float16", "bfloat16", "float32", "float64", "complex64", "complex128", "int8", "int16", "int32", "int64",
                 "uint8", "uint16", "uint32", "uint64", "bool", "float8_e4m3fn", "float8_e5m2")
    if isinstance(getattr(torch, name, None), torch.dtype)
}


class Malformed(Exception):
    """A field of a reply that does not fit its type (turned into a protocol break)."""


def _text(v, what: str) -> str:
    if not isinstance(v, str):
        raise Malformed(f"{what} is not text")
    # Lone surrogates cannot be written as UTF-8 (the verdict's JSON reader refuses them).
    return v[:MAX_TEXT].encode("utf-8", "replace").decode("utf-8")


def _int(v, what: str, lo: int = 0, hi: int = 1 << 62) -> int:
    if type(v) is not int or not lo <= v < hi:
        raise Malformed(f"{what} is not an integer in [{lo}, {hi})")
    return v


def _seconds(v, what: str) -> float:
    if type(v) not in (int, float) or not math.isfinite(v) or v < 0:
        raise Malformed(f"{what} is not a finite number of seconds")
    return float(v)


def _list(v, what: str, limit: int = MAX_ITEMS) -> list:
    if not isinstance(v, list) or len(v) > limit:
        raise Malformed(f"{what} is not a list of at most {limit} items")
    return v


def _object(v, what: str) -> dict:
    if not isinstance(v, dict):
        raise Malformed(f"{what} is not an object")
    return v


@dataclass
class IpcRef:
    handle: str
    alloc_bytes: int
    offset: int


@dataclass
class OutputItem:
    """One output as the worker announced it: a value, or a tensor's place."""

    kind: str
    value: object = None
    device: str = ""
    dtype: torch.dtype | None = None
    shape: tuple = ()
    offset: int = 0
    nbytes: int = 0
    stride: tuple = ()
    ipc: IpcRef | None = None

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


def _output(v, i: int, device_type: str) -> OutputItem:
    what = f"output {i}"
    it = _object(v, what)
    kind = it.get("kind")
    if kind == "value":
        value = it.get("value")
        if isinstance(value, str):
            value = _text(value, f"{what}'s value")
        elif not (value is None or type(value) in (bool, int, float)):
            raise Malformed(f"{what}'s value is not a number, a boolean, text or null")
        if type(value) is int and not -(1 << 63) <= value < (1 << 64):
            raise Malformed(f"{what}'s value is out of range")
        return OutputItem("value", value=value)
    if kind != "tensor":
        raise Malformed(f"{what} is neither a tensor nor a value")
    device = _text(it.get("device"), f"{what}'s device")[:64]
    name = it.get("dtype")
    if not isinstance(name, str) or name not in OUTPUT_DTYPES:
        raise Malformed(f"{what}'s dtype {str(name)[:40]!r} is not one the judge can read")
    shape = tuple(_int(s, f"{what}'s shape", 0, MAX_DIM) for s in _list(it.get("shape"), f"{what}'s shape", MAX_DIMS))
    item = OutputItem("tensor", device=device, dtype=OUTPUT_DTYPES[name], shape=shape)
    if item.numel >= 1 << 62:
        raise Malformed(f"{what}'s shape holds too many elements")
    if device != device_type:
        return item  # on the wrong device: a wrong output, whatever else it says
    if device_type == "cpu":
        item.offset = _int(it.get("offset"), f"{what}'s offset")
        item.nbytes = _int(it.get("nbytes"), f"{what}'s nbytes")
    else:
        stride = _list(it.get("stride"), f"{what}'s stride", MAX_DIMS)
        item.stride = tuple(_int(s, f"{what}'s stride", 0, MAX_DIM) for s in stride)
        if len(item.stride) != len(shape):
            raise Malformed(f"{what}'s stride does not match its shape")
        if item.numel:
            ipc = _object(it.get("ipc"), f"{what}'s ipc")
            handle = _text(ipc.get("handle"), f"{what}'s IPC handle")
            if len(handle) != 128 or any(c not in "0123456789abcdefABCDEF" for c in handle):
                raise Malformed(f"{what}'s IPC handle is not 64 bytes in hex")
            item.ipc = IpcRef(handle, _int(ipc.get("alloc_bytes"), f"{what}'s alloc_bytes", 1), _int(ipc.get("offset"), f"{what}'s IPC offset"))
    return item


def _field(kind: str, v, name: str, device_type: str):
    if kind == "int":
        return _int(v, name)
    if kind == "seconds":
        return _seconds(v, name)
    if kind == "text":
        return _text(v, name)
    if kind == "texts":
        return [_text(x, name)[:200] for x in _list(v, name)]
    if kind == "seconds_by_name":
        return {_text(k, name)[:32]: _seconds(x, name) for k, x in list(_object(v, name).items())[:MAX_ITEMS]}
    if kind == "weights":
        w = _object(v, name)
        out = {"loaded": _int(w.get("loaded", 0), f"{name}.loaded")}
        for key in ("reference_not_loaded", "candidate_own"):
            out[key] = [_text(x, f"{name}.{key}")[:200] for x in _list(w.get(key, []), f"{name}.{key}")]
        return out
    if kind == "outputs":
        return [_output(x, i, device_type) for i, x in enumerate(_list(v, name))]
    if kind == "trace":
        t = _object(v, name)
        out = {"forbidden": [_text(x, f"{name}.forbidden")[:200] for x in _list(t.get("forbidden", []), f"{name}.forbidden")],
               "extension_calls": _int(t.get("extension_calls", 0), f"{name}.extension_calls")}
        if t.get("profiler_unavailable") is not None:
            out["profiler_unavailable"] = _text(t["profiler_unavailable"], f"{name}.profiler_unavailable")[:300]
        return out
    raise ValueError(f"no field type {kind!r}")  # the table's own mistake, never a reply's


def parse_reply(op: str, reply, seq: int, worker: str, device_type: str) -> dict:
    """The reply to request `op` (number `seq`), typed: a dict of the listed fields that are
    present (required ones always). Raises RuleBreak: the worker's own failure report (one of
    WORKER_RULES), or `protocol` for anything that does not fit."""
    if not isinstance(reply, dict):
        raise h.RuleBreak("protocol", f"the {worker} worker's reply is not an object")
    if reply.get("seq") != seq or type(reply.get("seq")) is not int:
        raise h.RuleBreak("protocol", f"the {worker} worker answered a request it was not asked (seq {str(reply.get('seq'))[:40]!r}, expected {seq})")
    ok = reply.get("ok")
    if type(ok) is not bool:
        raise h.RuleBreak("protocol", f"the {worker} worker's reply to {op} says neither success nor failure")
    try:
        if not ok:
            rule = reply.get("rule")
            if not isinstance(rule, str) or rule not in WORKER_RULES:
                raise h.RuleBreak("protocol", f"the {worker} worker reported an unknown failure {str(rule)[:80]!r}")
            text = _text(reply.get("message", ""), "the failure's message")[:4000]
            if reply.get("traceback"):
                text += "\n" + _text(reply["traceback"], "the failure's traceback")[-2000:]
            raise h.RuleBreak(rule, text)
        out = {}
        for name, (kind, required) in REPLY_FIELDS[op].items():
            if name not in reply or (reply[name] is None and not required):
                if required:
                    raise Malformed(f"{name} is missing")
                continue
            out[name] = _field(kind, reply[name], name, device_type)
        return out
    except Malformed as e:
        raise h.RuleBreak("protocol", f"the {worker} worker's reply to {op}: {e}") from None
    except RecursionError:
        raise h.RuleBreak("protocol", f"the {worker} worker's reply to {op} is nested too deep") from None




def worker_env() -> dict:
    env = dict(os.environ)
    # Idle OpenMP threads sleep instead of spinning: CPU used between calls is then work.
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    env.pop("PYTORCH_CUDA_ALLOC_CONF", None)  # expandable segments cannot be shared by IPC
    return env


def spawn_worker(role: str, task: Path, device: str, out_dir: Path, log: Path, candidate: Path | None = None, allow_ops: str | None = None) -> WorkerLink:
    """Starts a worker as a child of the judge (the reference worker always; the candidate
    worker when the judge runs as an agent's local tool)."""
    j_read, w_write = os.pipe()
    w_read, j_write = os.pipe()
    argv = [sys.executable, str(WORKER), "serve", "--role", role, "--task", str(task), "--device", device, "--fds", f"{w_read},{w_write}", "--out-dir", str(out_dir)]
    if candidate is not None:
        argv += ["--candidate", str(candidate)]
    if allow_ops:
        argv += ["--allow-ops", allow_ops]
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(log, "wb") as logf:
        popen = subprocess.Popen(argv, pass_fds=(w_read, w_write), stdin=subprocess.DEVNULL, stdout=logf, stderr=logf, env=worker_env())
    os.close(w_read)
    os.close(w_write)
    os.set_inheritable(j_read, False)
    os.set_inheritable(j_write, False)
    return WorkerLink(role, h.Channel(j_read, j_write), popen.pid, out_dir, None, popen=popen, log=log)


def attach_worker(req: str, rep: str, pid: int, uid: int | None, out_dir: Path, timeout: float) -> WorkerLink:
    """Connects to a candidate worker the server started under its own uid, through two FIFOs
    the server made. The reply FIFO is opened without blocking (Linux reports no hang-up on a
    FIFO whose writer has not come yet), and every read waits in select with a deadline; the
    worker's death shows as end of file or through its pidfd."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            w = os.open(req, os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC)
            break
        except OSError as e:
            import errno

            if e.errno != errno.ENXIO or time.monotonic() > deadline or not Path(f"/proc/{pid}").exists():
                raise h.RuleBreak("worker_died", f"the candidate worker never opened its channel ({e})") from e
            time.sleep(0.01)
    os.set_blocking(w, True)
    r = os.open(rep, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    return WorkerLink("candidate", h.Channel(r, w), pid, out_dir, uid)


def cpu_last_level_cache_bytes() -> int:
    """The largest CPU cache of this machine (the last level; per socket), from sysfs; 0 when
    sysfs does not say."""
    largest = 0
    for size in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        try:
            text = size.read_text().strip().upper()
            largest = max(largest, int(text.rstrip("KMG")) << {"K": 10, "M": 20, "G": 30}.get(text[-1:], 0))
        except (OSError, ValueError):
            continue
    return largest


class L2Flusher:
    """Before every timed call, moves a buffer larger than the device's last cache through it, so
    no call runs warm on data an earlier one left (the judge's own input writes included). On
    GPU the buffer is written (and persisting L2 lines reset first); on CPU it is read, so the
    lines it leaves are clean and no contestant pays their write-back. Without it on CPU, the
    input region the judge wrote last (the candidate's) sat in the 32 MB L3 of a 2-core host
    when its call came first in a round, and the reference's own forward judged as the candidate
    measured faster than itself (1.4-2.6x on ReLU's 31 MB input)."""

    def __init__(self, device):
        self.buf = None
        self.reset = None
        if device.type == "cpu":
            llc = cpu_last_level_cache_bytes()
            self.buf = torch.ones(min(max(2 * llc, 64 << 20), 1 << 30) // 4, dtype=torch.float32)
            # Read by NumPy on this thread alone: no thread pool left running into the call.
            self.host = self.buf.numpy()
        if device.type == "cuda":
            l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 64 << 20)
            self.buf = torch.empty(max(2 * l2, 64 << 20) // 4, dtype=torch.float32, device=device)
            self.reset = None
            import ctypes

            for name in ("libcudart.so", "libcudart.so.13", "libcudart.so.12"):
                try:  # torch has loaded it already: found by its soname
                    self.reset = ctypes.CDLL(name).cudaCtxResetPersistingL2Cache
                    break
                except (OSError, AttributeError):
                    continue

    def __call__(self):
        if self.buf is None:
            return
        if self.buf.device.type == "cpu":
            self.host.sum()
            return
        if self.reset is not None:
            self.reset()  # lines a worker marked persisting go back to normal, then are evicted
        self.buf.zero_()


class Judge:
    def __init__(self, task_path: Path, device: torch.device, workdir: Path, atol=None, rtol=None, call_timeout: float = 120.0):
        self.task_path = task_path
        self.task = h.load_task(task_path)
        self.device = device
        self.workdir = workdir
        self.atol, self.rtol = atol, rtol
        self.call_timeout = call_timeout
        # The torch.compile baseline's first call compiles (tens of seconds cold, minutes on a
        # loaded host): it gets the setup's timeout, not a call's (evaluate() sets it).
        self.compile_timeout = call_timeout
        # Called with a line of progress at each step (verify.py and profile.py print them;
        # the server's judge has none: its stdout is the verdict alone).
        self.progress = None
        self.started = time.perf_counter()
        # The tolerance each output was checked at over the input sets, with the smallest
        # typical magnitude seen (the tightest bound): what a passing max_rel_error is read by.
        self.bounds: dict = {}
        self.rng = random.Random(int.from_bytes(os.urandom(8), "little"))
        self.regions: dict = {}
        self.input_bytes = 0  # of the last input set given to the workers
        self.input_shapes: list[tuple] = []
        # The most bytes the reference's outputs have held (a bound on what a candidate's
        # announcement may make the judge read).
        self.reference_output_bytes = 0
        self.ref: WorkerLink | None = None
        self.cand: WorkerLink | None = None

    # -- set-up -------------------------------------------------------------------------

    def start_reference(self) -> None:
        d = self.workdir / "reference"
        d.mkdir(mode=0o700, exist_ok=True)
        self.ref = spawn_worker("reference", self.task_path, self.device.type, d / "out", d / "worker.log")

    def ready(self, setup_timeout: float, compile_too: bool = False) -> None:
        """Waits until both workers have imported torch and loaded the task (they start side
        by side), with no candidate code run and no device work: all a gated evaluation does
        before its lease. The reference worker's hello is all of its setup (torch.compile's
        imports included when the baseline is wanted)."""
        self.set_stage("start of the workers")
        for link in (self.ref, self.cand):
            link.device_type = self.device.type
        self.ref.request({"op": "hello", "compile": bool(compile_too)}, setup_timeout)
        self.cand.request({"op": "ready"}, setup_timeout)

    def hello(self, setup_timeout: float) -> dict:
        """Imports the candidate's model_new.py (after `ready`); the answer carries its
        build report."""
        self.set_stage("build and import of model_new.py")
        return self.cand.request({"op": "hello"}, setup_timeout)

    def region(self, link: WorkerLink, key: str, nbytes: int, where: Path) -> "h.FileRegion | h.CudaRegion":
        """The input region of `link` for inputs of `nbytes`, made (or remade larger) and
        announced to the worker."""
        name = f"{link.name}:{key}"
        r = self.regions.get(name)
        if r is not None and r.nbytes >= nbytes:
            return r
        if r is not None:
            r.close()
        if self.device.type == "cuda":
            r = h.CudaRegion.create(nbytes, self.device)
        else:
            path = where / f"in-{link.name}-{key}-{os.urandom(6).hex()}.bin"
            r = h.FileRegion.create(path, nbytes, mode=0o644 if link is self.cand else 0o600)
        self.regions[name] = r
        link.request({"op": "slot", "id": key, "region": r.describe()}, self.call_timeout)
        return r

    def give_inputs(self, inputs: list, key: str, cand_dir: Path, ref_dir: Path) -> dict:
        """Has both workers map their region for this input set, then writes the set into
        both regions, starting at a random offset (new input addresses every set, on GPU too).
        The workers map first and the data comes after: until the judge sends `run`, a worker
        holds a mapping of stale contents, so nothing can be computed from the inputs in an
        untimed step (and CPU used between the load's reply and the run is counted as work
        outside the timed window). Empties `inputs` once they are in the regions, and on CUDA
        hands the freed block back to the driver: otherwise the caching allocator splits the
        freed input block for a smaller request (the L2 flush buffer, made after the compile
        baseline's input set) and the next set needs a block of its own. On an H100 the judge
        held one more input set with torch.compile on than with it off (ReLU 3 GiB, Add 4)."""
        layout, _ = h.input_layout(inputs, base=h.ALIGN * self.rng.randrange(h.INPUT_SHIFT_SLOTS))
        # Sized for the largest shift whatever this one is: a region is made once per shape.
        nbytes = h.input_layout(inputs, base=h.ALIGN * (h.INPUT_SHIFT_SLOTS - 1))[1]
        regions = [self.region(link, key, nbytes, where) for link, where in ((self.ref, ref_dir), (self.cand, cand_dir))]
        for link in (self.ref, self.cand):
            link.request({"op": "load", "slot": key, "layout": layout}, self.call_timeout)
        for r in regions:
            h.pack_inputs(inputs, layout, r.tensor)
        # For the physical-floor check and messages: the last input set's bytes and shapes,
        # known here without making the inputs again (on meta tensors that costs 2-3 s of lazy
        # imports on a leased GPU).
        tensors = [x for x in inputs if isinstance(x, torch.Tensor)]
        self.input_bytes = sum(x.numel() * x.element_size() for x in tensors)
        self.input_shapes = [tuple(x.shape) for x in tensors]
        inputs.clear()
        h.synchronize(self.device)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        return {"layout": layout}

    # -- outputs ------------------------------------------------------------------------

    def outputs(self, link: WorkerLink, model: str, reply: dict) -> list:
        """The outputs a reply announces (typed by parse_reply), as tensors over the worker's
        memory (read-only on CPU). Nothing in the reply is trusted beyond where to look: sizes
        are checked against the region, and the file is found by the judge's own path, not the
        reply's. What does not fit is the candidate's `protocol` break; the reference worker's
        is the evaluation's error."""
        try:
            out = self._outputs(link, model, reply["outputs"])
        except h.RuleBreak as e:
            if link is self.ref:
                raise ReferenceFailure(f"the reference worker's outputs ({e.rule}): {e}") from e
            raise
        if link is self.ref:
            self.reference_output_bytes = max(self.reference_output_bytes, sum(t.numel() * t.element_size() for t in out if isinstance(t, torch.Tensor)))
        return out

    def _outputs(self, link: WorkerLink, model: str, items: list) -> list:
        if link is self.cand and self.reference_output_bytes:
            # Copied into the judge's memory on CPU: a candidate announcing far more than the
            # reference's outputs (a sparse file of 60 GiB) must not make the judge allocate it.
            announced = sum(it.numel * it.dtype.itemsize for it in items if it.kind == "tensor")
            if announced > 2 * self.reference_output_bytes + (1 << 20):
                raise h.RuleBreak("wrong_output", f"the outputs hold {announced} bytes; the reference's hold {self.reference_output_bytes}")
        out = []
        file_region = None
        opened: dict = {}
        for i, it in enumerate(items):
            if it.kind == "value":
                out.append(it.value)
                continue
            if it.device != self.device.type:
                raise h.RuleBreak("wrong_output", f"output {i} is on {it.device}, expected {self.device.type}")
            dtype, shape, numel = it.dtype, list(it.shape), it.numel
            esize = dtype.itemsize
            if self.device.type == "cpu":
                if file_region is None:
                    file_region = h.PeerFile(link.out_dir / f"out-{model}.bin", owner=link.uid)
                    link.opened.append(file_region)
                off, nbytes = it.offset, it.nbytes
                if nbytes != numel * esize or off % esize:
                    raise h.RuleBreak("protocol", f"output {i}: announced bytes do not fit its region")
                out.append(file_region.read(off, nbytes).view(dtype).view(shape))
            else:
                stride = list(it.stride)
                if numel == 0:
                    out.append(torch.empty(shape, dtype=dtype, device=self.device))
                    continue
                alloc_bytes, off = it.ipc.alloc_bytes, it.ipc.offset
                extent = (1 + sum((s - 1) * st for s, st in zip(shape, stride))) * esize
                if off % esize or off + extent > alloc_bytes:
                    raise h.RuleBreak("protocol", f"output {i}: announced memory does not fit its allocation")
                # Two outputs in one allocation share one mapping (a handle opens once).
                region = opened.get(it.ipc.handle)
                if region is None:
                    try:
                        region = h.CudaRegion.open_peer(it.ipc.handle, alloc_bytes, self.device)
                    except (RuntimeError, OSError, ValueError) as e:
                        raise h.RuleBreak("protocol", f"output {i}: its memory could not be mapped ({str(e)[:200]})") from e
                    opened[it.ipc.handle] = region
                    link.opened.append(region)
                if region.nbytes < alloc_bytes:
                    raise h.RuleBreak("protocol", f"output {i}: two sizes announced for one allocation")
                out.append(region.tensor[off: off + extent].view(dtype).as_strided(shape, stride))
        return out

    def fingerprint(self, link: WorkerLink, model: str, outs: list) -> list:
        """Fingerprints of the candidate's output memory as it is now (read again from the
        worker's file on CPU; over the mapped memory on GPU)."""
        if self.device.type == "cpu":
            f = h.PeerFile(link.out_dir / f"out-{model}.bin", owner=link.uid)
            try:
                return [h.checksum(f.read(0, f.size()))]
            finally:
                f.close()
        return [h.checksum(t.reshape(-1).view(torch.uint8)) if isinstance(t, torch.Tensor) and t.is_contiguous() and t.numel() else None for t in outs]

    def note(self, line: str) -> None:
        """Reports a step to the progress callback, if any, with the seconds since the start."""
        if self.progress is not None:
            self.progress(f"[{time.perf_counter() - self.started:6.1f} s] {line}")

    def compare(self, want: list, got: list, label: str, rule: str = "wrong_output", scale: float = 1.0, record: bool = False) -> dict:
        if len(want) != len(got):
            raise h.RuleBreak(rule, f"{label}: expected {len(want)} outputs, got {len(got)}")
        err = {"max_abs_error": 0.0, "max_rel_error": 0.0}
        for i, (r, n) in enumerate(zip(want, got)):
            if not isinstance(r, torch.Tensor):
                if r != n:
                    raise h.RuleBreak(rule, f"{label}: output {i}: expected {r!r}, got {n!r}")
                continue
            if not isinstance(n, torch.Tensor):
                raise h.RuleBreak(rule, f"{label}: output {i}: expected a tensor, got {n!r}")
            try:
                e = h.compare_tensor(i, r, n, self.atol, self.rtol, scale)
            except h.RuleBreak as b:
                raise h.RuleBreak(rule if b.rule == "wrong_output" else b.rule, f"{label}: {b}") from b
            err = {k: max(err[k], e[k]) for k in err}
            if record:
                b = e["bound"]
                seen = self.bounds.get(i)
                if seen is None or b["typical_magnitude"] < seen["typical_magnitude"]:
                    self.bounds[i] = b
        return err

    def inputs_intact(self) -> None:
        """Has the candidate's worker compare its inputs with the judge's (CPU, where they are
        its private copy; on GPU they are the judge's own memory). Asked after the run's reply
        and after its outputs are copied out (so nothing done meanwhile reaches them), out of
        the timed call: the reference worker makes no such check, and inside the call it cost
        the candidate alone up to a third of an elementwise task's time."""
        if self.device.type == "cpu":
            self.cand.request({"op": "inputs"}, self.call_timeout)

    # -- the evaluation -----------------------------------------------------------------

    def fresh_pair(self, seed: int, make, key: str, cand_dir: Path, ref_dir: Path, trace: bool = False) -> list:
        """A new model pair under `seed` and a new input set from `make`; returns the
        reference's outputs on it (the candidate's run is the caller's)."""
        for link, kind in ((self.ref, "eager"), (self.cand, "candidate")):
            reply = link.request({"op": "model", "name": "check", "kind": kind, "seed": seed}, self.call_timeout)
            if link is self.cand:
                link.weights = reply.get("weights")
        inputs = h.seeded_inputs(make, self.rng.getrandbits(62), self.device)
        self.give_inputs(inputs, key, cand_dir, ref_dir)
        del inputs
        # Traced as the candidate's check is (the verdict ignores it): the trace starts
        # PyTorch's profiler, which leaves state behind in its process, and both workers must
        # carry the same into the timed rounds.
        reply = self.ref.request({"op": "run", "model": "check", "trace": trace}, self.call_timeout)
        return self.outputs(self.ref, "check", reply)

    def check(self, seeds: list[int], cand_dir: Path, ref_dir: Path, trace: bool = True) -> dict:
        """Correctness on fresh models and input sets, one per seed; the candidate's forward is
        traced for PyTorch compute operators and extension calls."""
        errors = []
        for i, seed in enumerate(seeds):
            label = f"input set {i + 1} of {len(seeds)}"
            self.set_stage("check")
            self.note(f"checking {label}")
            want = self.fresh_pair(seed, self.task.get_inputs, "main", cand_dir, ref_dir, trace)
            try:
                reply = self.cand.request({"op": "run", "model": "check", "trace": trace}, self.call_timeout)
            except h.RuleBreak as e:
                raise h.RuleBreak(e.rule, f"{label}: {e}") from e
            got = self.outputs(self.cand, "check", reply)
            try:
                self.inputs_intact()
            except h.RuleBreak as e:
                raise h.RuleBreak(e.rule, f"{label}: {e}") from e
            if trace:
                t = reply.get("trace") or {}
                if t.get("forbidden"):
                    raise h.RuleBreak("pytorch_compute", f"{label}: the forward dispatched PyTorch compute operators: {', '.join(map(str, t['forbidden']))}")
                if not t.get("extension_calls"):
                    raise h.RuleBreak("no_custom_kernel", f"{label}: no compiled extension function was called in the forward")
            try:
                errors.append(self.compare(want, got, label, record=True))
            except h.RuleBreak as e:
                raise h.RuleBreak(e.rule, f"{e}{weights_hint(self.cand) if e.rule == 'wrong_output' else ''}") from e
            self.release()
        bounds = [{"output": i, **b} for i, b in sorted(self.bounds.items())]
        return {"max_abs_error": max(e["max_abs_error"] for e in errors), "max_rel_error": max(e["max_rel_error"] for e in errors), "checks": len(seeds), "tolerance": bounds}

    def check_off_distribution(self, seed: int, cand_dir: Path, ref_dir: Path) -> str:
        """One more input set, drawn as the task draws them and then moved off its distribution:
        every floating-point input centred, scaled by a random factor of either sign and shifted.
        A closed form that holds only on the task's own inputs (the identity for ReLU of
        non-negative numbers, a sum that assumes a mean) is wrong here; an operator computed
        for every input is not. Skipped where the reference itself gives non-finite outputs on
        the moved inputs (a log or a square root leaves its domain)."""
        self.set_stage("check off the task's input distribution")
        self.note("checking an input set off the task's distribution")
        moves: list = []

        def make():
            inputs = list(self.task.get_inputs())
            for i, x in enumerate(inputs):
                if isinstance(x, torch.Tensor) and x.is_floating_point() and x.numel() > 1:
                    mean, std = float(x.float().mean()), float(x.float().std())
                    if not (math.isfinite(mean) and math.isfinite(std)) or std == 0.0:
                        continue
                    scale = self.rng.uniform(0.5, 2.0) * self.rng.choice((-1.0, 1.0))
                    shift = self.rng.uniform(-0.5, 0.5) * std
                    try:  # in place: no second copy of a full-size input
                        x.sub_(mean).mul_(scale).add_(shift)
                    except RuntimeError:  # an expanded view cannot be written in place
                        inputs[i] = ((x - mean) * scale + shift).to(x.dtype)
                    moves.append(f"x{scale:+.2f}{shift:+.2f}")
            return inputs

        want = self.fresh_pair(seed, make, "main", cand_dir, ref_dir)
        try:
            if not moves:
                return "skipped: no floating-point input to move"
            if not all(h.all_finite(t) for t in want if isinstance(t, torch.Tensor)):
                return "skipped: the reference is not finite there"
            label = f"an input set off the task's distribution (inputs centred, then {', '.join(moves)})"
            try:
                got = self.outputs(self.cand, "check", self.cand.request({"op": "run", "model": "check"}, self.call_timeout))
                self.inputs_intact()
            except h.RuleBreak as e:
                raise h.RuleBreak(e.rule, f"{label}: {e}") from e
            # At ten times the task's tolerance: moved inputs change the rounding of long sums
            # (a float32 matmul of centred, rescaled and shifted inputs drifts past the task's
            # own tolerance at outputs near zero), and this set is here for answers that are
            # not the operator at all, which miss by far more. Precision is the five sets' job.
            self.compare(want, got, label, scale=OFF_DISTRIBUTION_TOLERANCE)
            return "checked"
        finally:
            self.release()

    def check_alt(self, seed: int, cand_dir: Path, ref_dir: Path) -> bool:
        """The task's second input shape, where it defines one."""
        if not hasattr(self.task, "get_inputs_alt"):
            return False
        self.set_stage("check of the second input shape")
        self.note("checking the second input shape (get_inputs_alt)")
        # The same input regions as the first shape (remade only where the second is larger):
        # a second pair of regions would hold two more input sets for the rest of the run.
        want = self.fresh_pair(seed, self.task.get_inputs_alt, "main", cand_dir, ref_dir)
        try:
            got = self.outputs(self.cand, "check", self.cand.request({"op": "run", "model": "check"}, self.call_timeout))
            self.inputs_intact()
            self.compare(want, got, "second input shape")
        except h.RuleBreak as e:
            if e.rule in ("wrong_output", "runtime_error", "precision"):
                shapes = ", ".join(str(s) for s in self.input_shapes)  # the second shape's set
                raise h.RuleBreak("hard_coded_shape", f"wrong on the task's second input shape (inputs {shapes}): {e}") from e
            raise
        self.release()
        return True

    def set_stage(self, stage: str) -> None:
        for link in (self.ref, self.cand):
            if link is not None:
                link.stage = stage

    def release(self) -> None:
        for link in (self.ref, self.cand):
            if link is not None:
                for r in link.opened:
                    r.close()
                link.opened.clear()

    def time_all(self, seed: int, cand_dir: Path, ref_dir: Path, compile_too: bool, budget_s: float, min_rounds: int, max_rounds: int, warmup_rounds: int) -> dict:
        """Eager, torch.compile and the candidate, interleaved in random order in each round,
        each round on fresh input contents; every timed candidate call is checked against the
        eager output of the same round, and its output fingerprint is re-read at the end of
        the round (a change means work after the reply)."""
        names = ["eager"] + (["compile"] if compile_too else []) + ["candidate"]
        compile_first_call_s = None
        self.set_stage("time, making the timed models")
        # The checked models and their last outputs are done with: freed before the timed
        # models exist, so that no worker holds a third output through the rounds.
        for link in (self.ref, self.cand):
            link.request({"op": "drop", "name": "check"}, self.call_timeout)
        self.ref.request({"op": "model", "name": "eager", "kind": "eager", "seed": seed}, self.call_timeout)
        if compile_too:
            self.ref.request({"op": "model", "name": "compile", "kind": "compile", "seed": seed}, self.call_timeout)
        self.cand.request({"op": "model", "name": "timed", "kind": "candidate", "seed": seed}, self.call_timeout)
        who = {"eager": (self.ref, "eager"), "compile": (self.ref, "compile"), "candidate": (self.cand, "timed")}
        if compile_too:
            # torch.compile compiles on its first call (seconds, tens on a cold cache): done
            # before the candidate's CPU is tracked, since its idle threads (the CUDA driver's
            # own) add up over such a wait and a legitimate candidate would fail late_work.
            self.set_stage("time, compiling the torch.compile baseline")
            t = time.perf_counter()
            inputs = h.seeded_inputs(self.task.get_inputs, self.rng.getrandbits(62), self.device)
            self.give_inputs(inputs, "main", cand_dir, ref_dir)
            del inputs
            self.ref.request({"op": "run", "model": "compile"}, max(self.call_timeout, self.compile_timeout))
            self.release()
            compile_first_call_s = time.perf_counter() - t
        flush = L2Flusher(self.device)
        times: dict = {n: [] for n in names}
        checked = 0
        # The reference worker is tracked the same way as the control: the same worker code,
        # the same driver and protocol, idle between its calls in the same window. What it uses
        # there is the machine's floor for an idle worker (driver threads, the protocol's own
        # return path), measured in this run and out of the candidate's reach.
        for link in (self.cand, self.ref):
            link.track_cpu = True
            link.gap = CpuOutsideCalls()
            link.last_reply_cpu = None
        start = time.perf_counter()
        rounds = 0
        while True:
            timed = rounds >= warmup_rounds
            n_timed = rounds - warmup_rounds
            if timed and n_timed >= min_rounds and (n_timed >= max_rounds or time.perf_counter() - start > budget_s):
                break
            self.set_stage(f"time, round {rounds + 1}")
            inputs = h.seeded_inputs(self.task.get_inputs, self.rng.getrandbits(62), self.device)
            self.give_inputs(inputs, "main", cand_dir, ref_dir)
            del inputs
            order = names[:]
            self.rng.shuffle(order)
            outs: dict = {}
            fingerprint = None
            for name in order:
                link, model = who[name]
                flush()
                h.synchronize(self.device)
                reply = link.request({"op": "run", "model": model}, self.call_timeout)
                t0, t1 = link.sent_at, link.replied_at
                outs[name] = self.outputs(link, model, reply)
                if name == "candidate":
                    fingerprint = self.fingerprint(link, model, outs[name])
                if timed:
                    times[name].append((t1 - t0) * 1e3)
            # After the round's calls, not between them: the compare reads every input byte, and
            # whoever was timed next would start on caches it left.
            self.inputs_intact()
            try:
                self.compare(outs["eager"], outs["candidate"], f"timed call {rounds + 1}", rule="timed_output")
            except h.RuleBreak as e:
                if e.rule == "timed_output":
                    raise h.RuleBreak("timed_output", f"a timed call's output was wrong (the checked calls were right): {e}") from e
                raise
            checked += 1
            h.synchronize(self.device)
            again = self.fingerprint(self.cand, "timed", outs["candidate"])
            if again != fingerprint:
                raise h.RuleBreak("late_work", f"timed call {rounds + 1}: the output changed after the worker had replied")
            del outs
            self.release()
            rounds += 1
        # Work left running after the last reply shows in its output or its CPU time.
        time.sleep(0.05)
        for link in (self.cand, self.ref):
            if link.last_reply_cpu is not None:
                link.gap.add(link.last_reply_cpu, link.cpu.total())
                link.last_reply_cpu = None
            link.track_cpu = False
        gap_cpu_ns = self.cand.gap.ns()
        control_ms = self.ref.gap.ns() / 1e6 if self.ref.cpu.available else 0.0
        in_calls_ms = sum(times["candidate"])
        allowed_ms = late_work_allowance_ms(in_calls_ms, control_ms)
        if self.cand.cpu.available and gap_cpu_ns / 1e6 > allowed_ms:
            raise h.RuleBreak(
                "late_work",
                f"the candidate's processes used {gap_cpu_ns / 1e6:.1f} ms of CPU between calls (allowed {allowed_ms:.1f} ms: "
                f"the reference worker used {control_ms:.1f} ms between its own calls): work outside the timed window",
            )
        return {
            "stats": {n: stats(v) for n, v in times.items()},
            "rounds": len(times["candidate"]),
            "timed_calls_checked": checked,
            "cpu_between_calls_ms": gap_cpu_ns / 1e6 if self.cand.cpu.available else None,
            "gaps_between_calls": self.cand.gap.gaps,
            "compile_first_call_s": compile_first_call_s,
            "reference_cpu_between_calls_ms": control_ms if self.ref.cpu.available else None,
            "reference_gaps_between_calls": self.ref.gap.gaps,
            "samples_ms": times,
        }

    def memory(self) -> dict:
        """Peak memory of the three processes (the judge's shared regions are device memory
        outside torch's allocator on CUDA: added to its count)."""
        mem = {"judge": {"peak_rss_bytes": h.peak_rss_bytes(os.getpid())}}
        if self.device.type == "cuda":
            regions = sum(r.nbytes for r in self.regions.values())
            mem["judge"]["peak_cuda_bytes"] = torch.cuda.max_memory_reserved() + regions
        for link in (self.ref, self.cand):
            r = link.request({"op": "stats"}, self.call_timeout)
            mem[f"{link.name}_worker"] = {k: v for k, v in r.items() if k.startswith("peak_")}
        return mem

    def close(self) -> None:
        self.release()
        for link in (self.ref, self.cand):
            if link is not None:
                link.close()
        for r in self.regions.values():
            r.close()
        self.regions.clear()


def stats(xs: list[float]) -> dict:
    xs = sorted(xs)
    med = statistics.median(xs)
    q = statistics.quantiles(xs, n=4) if len(xs) >= 2 else [xs[0]] * 3
    mean = statistics.fmean(xs)
    return {
        "median_ms": med,
        "mean_ms": mean,
        "min_ms": xs[0],
        "max_ms": xs[-1],
        "p25_ms": q[0],
        "p75_ms": q[2],
        "cv": statistics.stdev(xs) / mean if len(xs) > 1 and mean > 0 else 0.0,
        "trials": len(xs),
    }


# The milestone reward's rule, as the server applies it (env-server/src/reward.rs): a baseline
# is beaten when the candidate's median time is more than 5% below the baseline's median, that
# is a speedup (ratio of medians) above 1 / 0.95 = 1.0526. The noise band decides nothing.
MILESTONE_MARGIN = 0.05


def beats(candidate_ms: float | None, baseline_ms: float | None) -> bool:
    """Whether the candidate beats a baseline by the reward's rule (a missing time: no)."""
    return candidate_ms is not None and baseline_ms is not None and baseline_ms > 0 and (baseline_ms - candidate_ms) / baseline_ms > MILESTONE_MARGIN


def milestone(correct: bool, candidate_ms: float | None, eager_ms: float | None, compile_ms: float | None) -> int:
    """The reward: -1 incorrect, 1 correct, 2 beats eager, 3 beats eager and torch.compile."""
    if not correct:
        return -1
    if not beats(candidate_ms, eager_ms):
        return 1
    return 3 if beats(candidate_ms, compile_ms) else 2


def milestone_rule() -> str:
    """The reward's rule in words, from the margin beats uses: SKILL.md states it word for word
    and profile.py prints it (tests/python/test_skill_pages.py holds the page to it)."""
    keep = 1.0 - MILESTONE_MARGIN
    return (f"A baseline is beaten when your median time is more than {MILESTONE_MARGIN:.0%} below its median "
            f"(a speedup above 1/{keep:g} = {1.0 / keep:.3f}); the noise band decides nothing.")


def milestone_note(candidate_ms: float, baseline_ms: float, band: tuple[float, float] | None) -> str:
    """What the candidate's time against one baseline means for the reward (decided by beats,
    the rule itself), and whether the speedup's band says another evaluation could land on
    the other side of the threshold."""
    threshold = 1.0 / (1.0 - MILESTONE_MARGIN)
    reached = beats(candidate_ms, baseline_ms)
    text = (f"more than {MILESTONE_MARGIN:.0%} faster on the medians: milestone reached" if reached
            else f"not more than {MILESTONE_MARGIN:.0%} faster on the medians: no milestone")
    if band is not None and band[0] <= threshold < band[1]:
        text += f" (the band straddles {threshold:.3f}: another evaluation may {'not reach it' if reached else 'reach it'})"
    return text


def speedup_band(base: list[float], cand: list[float], rng: random.Random, resamples: int = 400) -> dict:
    """The speedup (ratio of medians) and a 90% band from resampling the paired rounds."""
    ratio = statistics.median(base) / statistics.median(cand)
    n = len(base)
    draws = []
    for _ in range(resamples):
        idx = [rng.randrange(n) for _ in range(n)]
        draws.append(statistics.median([base[i] for i in idx]) / statistics.median([cand[i] for i in idx]))
    draws.sort()
    return {"speedup": ratio, "low": draws[int(0.05 * resamples)], "high": draws[int(0.95 * resamples) - 1]}


@dataclass
class Options:
    """What one evaluation does."""

    device: str = "auto"
    seeds: list[int] = field(default_factory=lambda: [int.from_bytes(os.urandom(4), "little") for _ in range(5)])
    atol: float | None = None
    rtol: float | None = None
    compile: bool = True
    time: bool = True
    budget_s: float = 2.0
    min_rounds: int = 10
    max_rounds: int = 100
    warmup_rounds: int = 3
    setup_timeout: float = 600.0
    call_timeout: float = 120.0
    allow_ops: str | None = None
    max_cv: float = 0.5
    static: bool = True


def _json_safe(v):
    """`v` as the server's JSON reader takes it: non-finite numbers as null, text without lone
    surrogates."""
    if isinstance(v, float):
        return v if math.isfinite(v) else None
    if isinstance(v, str):
        return v.encode("utf-8", "replace").decode("utf-8")
    if isinstance(v, dict):
        return {_json_safe(str(k)): _json_safe(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_json_safe(x) for x in v]
    return v


def verdict_json(result: dict) -> str:
    """The verdict as one line of strict JSON (whatever text or numbers reached it)."""
    return json.dumps(_json_safe(result), allow_nan=False)


def wait_for_go() -> None:
    """Blocks until the server writes a line on stdin (it holds the device lease then); end of
    file means the server gave the evaluation up. The server takes the lease when it reads the
    line printed here: a judge still starting never holds the device."""
    print('{"gate": "waiting"}', flush=True)
    line = sys.stdin.readline()
    if line.strip() != "go":
        raise SystemExit(f"the server closed the gate ({line.strip()!r}): no evaluation")


def evaluate(task_path: Path, candidate_dir: Path, opts: Options, attach=None, workdir: Path | None = None, gate=None, progress=None) -> dict:
    """The whole evaluation. `attach` connects to a candidate worker started by someone else
    (the server); without it the judge starts one itself. `gate`, when given, is called once
    both workers are started (imports done, no candidate code run, no device work) and returns
    when the device is the judge's. `progress`, when given, is called with a line at each step
    (never by the server's judge, whose stdout is the verdict)."""
    device = h.pick_device(opts.device)
    h.pin_precision()
    own_tmp = None
    if workdir is None:
        own_tmp = tempfile.TemporaryDirectory(prefix="cuda-agent-judge-")
        workdir = Path(own_tmp.name)
    judge = Judge(task_path, device, workdir, opts.atol, opts.rtol, opts.call_timeout)
    judge.progress = progress
    judge.compile_timeout = opts.setup_timeout
    result: dict
    # Where the judge's time goes (seconds per stage; the judge's own clock), for throughput work.
    stage_s: dict = {}
    mark = [time.perf_counter()]

    def lap(stage: str) -> None:
        now = time.perf_counter()
        stage_s[stage] = round(stage_s.get(stage, 0.0) + now - mark[0], 3)
        mark[0] = now

    try:
        try:
            allowed_ops = h.task_allowed_ops(judge.task)
        except ValueError as e:
            raise ReferenceFailure(str(e)) from e
        if opts.static:
            static_check(candidate_dir)
        ref_dir = workdir / "reference"
        judge.note("starting the reference and candidate workers (each imports torch)")
        judge.start_reference()
        if attach is None:
            cdir = workdir / "candidate"
            cdir.mkdir(mode=0o700, exist_ok=True)
            judge.cand = spawn_worker("candidate", task_path, device.type, cdir / "out", cdir / "worker.log", candidate=candidate_dir, allow_ops=opts.allow_ops)
            cand_in = cdir
        else:
            judge.cand, cand_in = attach()
        # Everything that needs neither the device nor the candidate's code comes before the
        # gate: the imports and the task's load in both workers.
        judge.ready(opts.setup_timeout, opts.time and opts.compile)
        if gate is not None:
            lap("prestart")
            gate()
            lap("lease_wait")
        judge.note("workers ready; building (if the sources changed) and importing model_new.py")
        hello = judge.hello(opts.setup_timeout)
        lap("start")
        built = hello.get("build_s")
        judge.note(f"model_new.py imported{f' (build {built:.1f} s)' if isinstance(built, (int, float)) else ''}")
        details: dict = {"build_s": hello.get("build_s"), "extensions": hello.get("extensions"), "stage_s": stage_s}
        if allowed_ops:
            details["allowed_ops"] = allowed_ops
        steps = hello.get("steps_s")
        if isinstance(steps, dict):  # the worker's own account of its start: informational
            details["worker_start_s"] = {str(k)[:32]: v for k, v in list(steps.items())[:8] if isinstance(v, (int, float))}
        details.update(judge.check(opts.seeds, cand_in, ref_dir))
        details["off_distribution"] = judge.check_off_distribution(opts.seeds[-1] ^ 0x5EED, cand_in, ref_dir)
        lap("check")
        details["second_shape"] = judge.check_alt(opts.seeds[0], cand_in, ref_dir)
        lap("second_shape")
        result = {"correct": True, "details": details, "env": h.environment(device)}
        if allowed_ops:
            # For the server: PyTorch compute of these operators is the task's to allow, so
            # its outside observation reports that compute instead of judging it.
            result["allowed_ops"] = allowed_ops
        if opts.time:
            timing = None
            judge.note(f"timing eager{', torch.compile (compiled first)' if opts.compile else ''} and ModelNew, about {opts.budget_s:g} s each")
            for attempt in range(2):
                timing = judge.time_all(opts.seeds[0], cand_in, ref_dir, opts.compile, opts.budget_s, opts.min_rounds, opts.max_rounds, opts.warmup_rounds)
                noisy = [n for n, s in timing["stats"].items() if s["cv"] > opts.max_cv]
                lap("time")
                if not noisy:
                    break
                details["disturbed"] = noisy  # measured again: a disturbed baseline is never kept
            samples = timing.pop("samples_ms")
            st = timing.pop("stats")
            result["timing"] = st
            result["times_ms"] = {n: st[n]["median_ms"] if n in st else None for n in ("eager", "compile", "candidate")}
            result["speedup"] = {}
            result["noise_band"] = {}
            for base in ("eager", "compile"):
                if base in samples:
                    b = speedup_band(samples[base], samples["candidate"], judge.rng)
                    result["speedup"][base] = b["speedup"]
                    result["noise_band"][base] = [b["low"], b["high"]]
            details.update(timing)
            details["still_disturbed"] = [n for n, s in st.items() if s["cv"] > opts.max_cv]
            floor = h.physical_floor_ms(judge.input_bytes, device)
            if floor is not None and st["candidate"]["median_ms"] < 0.9 * floor:
                raise h.RuleBreak("impossible_time", f"median {st['candidate']['median_ms']:.4f} ms is below the {floor:.4f} ms it takes to read the inputs at peak bandwidth")
        details["memory"] = judge.memory()
        # For the server's outside observation: when each worker ran a forward of the
        # candidate (every one), or of the eager reference as it runs untraced (a traced
        # forward spends most of its time in the trace's Python, which is no measure of where
        # the reference's own compute lies).
        result["run_windows"] = {
            "candidate": [[a, b] for _, _, a, b in judge.cand.runs],
            "reference": [[a, b] for m, traced, a, b in judge.ref.runs if m in ("check", "eager") and not traced],
        }
    except h.RuleBreak as e:
        result = {"correct": False, "rule": e.rule, "reason": f"{e.rule}: {e}"}
    except ReferenceFailure as e:
        result = {"correct": False, "rule": "harness_error", "reason": f"harness_error: {e}"}
    finally:
        judge.close()
        if own_tmp is not None:
            own_tmp.cleanup()
        lap("finish")  # the memory readout and the workers' exit
    return result
