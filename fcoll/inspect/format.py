"""Stable text of an FX graph, for expecttest snapshots (``assertExpectedInline``).

The text depends only on the graph's structure, its ops and arguments, and the shapes and dtypes
in ``node.meta["val"]``. It does not depend on node-name counters (``mm_3``), source file paths,
stack traces, memory addresses, devices or cost-model estimates, so the same program traced twice,
in any process, gives identical text.

Example (``x`` all-reduced while ``mm`` runs)::

    graph(%arg0: f32[4, 4], %arg1: f32[4, 4]):
      %ar0: f32[4, 4] = fcoll.all_reduce(%arg0, 'sum', '0')  # all_reduce group=0 ranks=2 op=sum
      %mm0: f32[4, 4] = aten.mm(%arg0, %arg1)
      %wait0: f32[4, 4] = fcoll.wait_tensor(%ar0)  # waits %ar0
      %add0: f32[4, 4] = aten.add.Tensor(%wait0, %mm0)
      return (%add0,)

Naming: nodes are renamed ``<base><k>`` where ``k`` counts nodes of the same base in graph order.
The base is ``arg`` for placeholders, ``attr`` for ``get_attr``, a short code for collectives
from :data:`fcoll.ops.facts.OPS` (``ar``, ``ar_co``, ``ag``, ``ag_co``, ``rs``, ``rs_co``, ``a2a``,
``bc``, with a trailing ``_`` for the in-place forms and ``_out`` for out-forms), ``wait`` for
``wait_tensor``, and the op name for everything else (``mm``, ``add``, ``getitem``). Symbolic
sizes are printed as sympy expressions whose free symbols are renamed by first appearance
(``s0``, ``s1``, ...; unbacked ``u0``, ...), so they do not depend on the symbol numbering of one
trace either.
"""

from __future__ import annotations

import operator
import re
from typing import Any

import torch
import torch.fx as fx

from fcoll.ops.facts import OPS
from fcoll.passes.graph import collective_info, is_collective, is_wait, start_of

__all__ = ["format_graph", "stable_names", "format_value", "dtype_abbr"]

_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def dtype_abbr(dtype: torch.dtype) -> str:
    """Short dtype name as FX prints it: ``f32``, ``bf16``, ``i64``, ``b8``."""
    try:
        from torch.utils._dtype_abbrs import dtype_abbrs

        return dtype_abbrs[dtype]
    except (ImportError, KeyError):
        return str(dtype).replace("torch.", "")


def _op_base(target: Any) -> str:
    if isinstance(target, torch._ops.OpOverload):
        return target._schema.name.split("::", 1)[-1]
    if isinstance(target, torch._ops.HigherOrderOperator):
        return target.name()
    name = getattr(target, "__name__", None) or type(target).__name__
    return name.strip("_") or "fn"


def _base(node: fx.Node) -> str:
    if node.op == "placeholder":
        return "arg"
    if node.op == "get_attr":
        return "attr"
    if node.op == "call_module":
        return "mod"
    if node.op == "call_method":
        return str(node.target)
    if is_wait(node):
        return "wait"
    op = _op_base(node.target)
    if is_collective(node):
        return OPS[op].code
    return op


def stable_names(graph: fx.Graph | fx.GraphModule) -> dict[fx.Node, str]:
    """Map every node (output excluded) to its stable name, e.g. ``ar0``, ``wait1``, ``mm0``.

    Names depend only on each node's kind and its position among nodes of the same kind, so they
    survive retracing and the name counters of FX.
    """
    g = graph.graph if isinstance(graph, fx.GraphModule) else graph
    counts: dict[str, int] = {}
    names: dict[fx.Node, str] = {}
    for node in g.nodes:
        if node.op == "output":
            continue
        base = _base(node)
        k = counts.get(base, 0)
        counts[base] = k + 1
        sep = "_" if base[-1:].isdigit() else ""
        names[node] = f"{base}{sep}{k}"
    return names


class _Symbols:
    """Renames sympy free symbols by first appearance, per prefix letter (s0, s1, u0, ...)."""

    def __init__(self) -> None:
        self.mapping: dict[Any, Any] = {}
        self.counts: dict[str, int] = {}

    def expr(self, e: Any) -> str:
        import sympy

        if not isinstance(e, sympy.Basic):
            return str(e)
        subs = {}
        for sym in sorted(e.free_symbols, key=lambda s: s.name):
            if sym not in self.mapping:
                prefix = sym.name[:1] if sym.name[:1].isalpha() else "s"
                k = self.counts.get(prefix, 0)
                self.counts[prefix] = k + 1
                self.mapping[sym] = sympy.Symbol(f"{prefix}{k}", **sym.assumptions0)
            subs[sym] = self.mapping[sym]
        return str(e.xreplace(subs))

    def size(self, s: Any) -> str:
        if isinstance(s, torch.SymInt):
            return self.expr(s.node.expr)
        return str(s)


def format_value(val: Any, symbols: _Symbols | None = None) -> str:
    """Type text of a ``node.meta["val"]``: ``f32[4, 2*s0]``, ``[f32[4], i64[]]``, ``Sym(s0)``."""
    symbols = symbols if symbols is not None else _Symbols()
    if isinstance(val, torch.Tensor):
        return f"{dtype_abbr(val.dtype)}[{', '.join(symbols.size(s) for s in val.shape)}]"
    if isinstance(val, (list, tuple)):
        inner = ", ".join(format_value(v, symbols) for v in val)
        return f"[{inner}]" if isinstance(val, list) else f"({inner})"
    if isinstance(val, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return f"Sym({symbols.expr(val.node.expr)})"
    if val is None:
        return ""
    return type(val).__name__


def _arg(a: Any, names: dict[fx.Node, str], symbols: _Symbols) -> str:
    if isinstance(a, fx.Node):
        return f"%{names.get(a, a.name)}"
    if isinstance(a, (list, tuple)):
        inner = ", ".join(_arg(x, names, symbols) for x in a)
        if isinstance(a, tuple):
            return f"({inner},)" if len(a) == 1 else f"({inner})"
        return f"[{inner}]"
    if isinstance(a, dict):
        return "{" + ", ".join(f"{k!r}: {_arg(v, names, symbols)}" for k, v in a.items()) + "}"
    if isinstance(a, torch.dtype):
        return dtype_abbr(a)
    if isinstance(a, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return symbols.expr(a.node.expr)
    if isinstance(a, str):
        return repr(a)
    return _ADDRESS.sub("", repr(a))


def _target(node: fx.Node) -> str:
    t = node.target
    if isinstance(t, torch._ops.OpOverload):
        ns = t.namespace
        op = _op_base(t)
        overload = t._overloadname
        return f"{ns}.{op}" if overload == "default" else f"{ns}.{op}.{overload}"
    if node.op == "call_method":
        return f".{t}"
    if node.op in ("call_module", "get_attr"):
        return str(t)
    if t is operator.getitem:
        return "getitem"
    return _op_base(t)


def _annotation(node: fx.Node, names: dict[fx.Node, str]) -> str:
    if is_collective(node):
        info = collective_info(node)
        ranks = "?" if info.group_size is None else str(info.group_size)
        text = f"{info.kind} group={info.group_name} ranks={ranks}"
        if info.reduce_op is not None:
            text += f" op={info.reduce_op}"
        if info.src is not None:
            text += f" src={info.src}"
        return f"  # {text}"
    if is_wait(node):
        start = start_of(node)
        if start is None:
            return "  # waits (unknown)"
        src = node.args[0]
        if isinstance(src, fx.Node) and src is not start:  # through getitem: name the index
            return f"  # waits %{names[start]}[{src.args[1]}]"
        return f"  # waits %{names[start]}"
    return ""


def format_graph(gm: fx.GraphModule | fx.Graph) -> str:
    """Stable, readable text of a graph for snapshot tests.

    One line per node: ``%name: type = target(args)  # note``. Types come from
    ``node.meta["val"]`` (dtype abbreviation and shape; symbolic sizes as sympy expressions);
    collectives are noted with their kind, group name, group size, reduce op and root; waits with
    the collective (and output index, for coalesced ops) they wait on. See the module docstring
    for the naming rules.

    Args:
        gm: a ``GraphModule`` or ``Graph``; nodes without ``meta["val"]`` are printed untyped.

    Returns:
        The text, ending without a newline. Identical for identical graph structure.
    """
    g = gm.graph if isinstance(gm, fx.GraphModule) else gm
    names = stable_names(g)
    symbols = _Symbols()
    params: list[str] = []
    body: list[str] = []
    for node in g.nodes:
        if node.op == "output":
            body.append(f"  return {_arg(node.args[0], names, symbols)}")
            continue
        typ = format_value(node.meta.get("val"), symbols)
        decl = f"%{names[node]}" + (f": {typ}" if typ else "")
        if node.op == "placeholder":
            params.append(decl)
            continue
        args = [_arg(a, names, symbols) for a in node.args]
        args += [f"{k}={_arg(v, names, symbols)}" for k, v in node.kwargs.items()]
        body.append(f"  {decl} = {_target(node)}({', '.join(args)}){_annotation(node, names)}")
    return "\n".join([f"graph({', '.join(params)}):", *body])
