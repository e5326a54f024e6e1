"""Cutting a network's forward into segments at named modules: traced once with ``torch.fx`` (the exit modules
kept whole), each segment run on the live network (its current weights and device); or the network as a list of
whole blocks. What :func:`~learn2stop.core.exits.attach_exits` builds its steps from."""
from __future__ import annotations

from typing import Any, Sequence

from torch import fx, nn


class ExitTracer(fx.Tracer):
    """torch.fx's tracer, with the exit modules kept whole (their output is the cut)."""

    def __init__(self, keep_whole: set[str]):
        super().__init__()
        self.keep_whole = keep_whole

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return qualname in self.keep_whole or super().is_leaf_module(m, qualname)


class Segment:
    """The nodes of a traced forward between two cuts, run on a live network (its current weights and device).

    The nodes are copied into a graph of their own and turned into Python once (``fx.Graph.python_code``, what
    ``fx.GraphModule`` runs), with the network as its ``self``: modules and attributes are looked up on the network
    it is called with, so copies of an :class:`ExitNetwork` share it, and each intermediate is freed at its last use.
    (Read node by node, the segments had kept every intermediate to the end: measured on ResNet-20 at batch 256,
    one thread, 1.40 ms per image against 1.14 for this and for the network's own forward.)
    """

    def __init__(self, nodes: list[fx.Node], source: fx.Node, result: fx.Node, extra_inputs: dict):
        graph, env = fx.Graph(), {}
        env[source] = graph.placeholder("x")
        for p in extra_inputs:  # a forward's further inputs, at their defaults: passed as arguments
            env[p] = graph.placeholder(p.name)
        for node in nodes:
            env[node] = graph.node_copy(node, lambda n: env[n])
        graph.output(env[result])
        code = graph.python_code(root_module="self")
        scope = dict(code.globals)
        exec(compile(code.src, f"<learn2stop segment up to {result.name}>", "exec"), scope)
        self._run, self._extra = scope["forward"], tuple(extra_inputs.values())

    def __call__(self, root: nn.Module, x: Any) -> Any:
        return self._run(root, x, *self._extra)


def module_names(backbone: nn.Module, limit: int = 12) -> str:
    names = [n for n, _ in backbone.named_children()]
    return ", ".join(names[:limit]) + (", ..." if len(names) > limit else "") or "none"


def cut_forward(backbone: nn.Module, after: Sequence[str]) -> tuple[list[str], list[Segment]]:
    """Trace ``backbone`` and cut its forward after each named module: (names in forward order, segments)."""
    net = type(backbone).__name__
    if isinstance(after, str) or not isinstance(after, Sequence) or not all(isinstance(a, str) for a in after):
        raise TypeError(f"after: a list of module names of the network, e.g. ['layer1', 'layer2.0']; got {after!r}")
    if not after:
        raise ValueError("after: name at least one module to put an exit after")
    seen = set()
    for name in after:
        if name in seen:
            raise ValueError(f"after: {name!r} is named twice; two exits at the same point")
        seen.add(name)
        try:
            backbone.get_submodule(name)
        except AttributeError:
            raise ValueError(f"after: {net} has no module {name!r}; its top-level modules are {module_names(backbone)}") from None
    for a in after:
        for b in after:
            if b.startswith(a + "."):
                raise ValueError(f"after: {b!r} lies inside {a!r}, which also has an exit after it; "
                                 f"name one point per exit")
    try:
        graph = ExitTracer(set(after)).trace(backbone)
    except Exception as e:  # data-dependent control flow and the like
        raise ValueError(f"attach_exits cannot trace {net}.forward with torch.fx ({type(e).__name__}: {e}); "
                         f"pass the network as blocks=[...] instead (exits after every block but the last)") from None
    nodes = list(graph.nodes)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    extra = {}
    for p in placeholders[1:]:
        if not p.args:
            raise ValueError(f"{net}.forward takes more than one input ({', '.join(str(q.target) for q in placeholders)}); "
                             f"attach_exits needs a network of one input")
        extra[p] = p.args[0]
    calls = {name: [n for n in nodes if n.op == "call_module" and n.target == name] for name in after}
    for name, found in calls.items():
        if len(found) != 1:
            why = "never called on its own" if not found else f"called {len(found)} times"
            raise ValueError(f"after: module {name!r} is {why} in {net}.forward; an exit goes after a module "
                             f"that runs once")
    index = {n: i for i, n in enumerate(nodes)}
    order = sorted(after, key=lambda a: index[calls[a][0]])
    cuts = [calls[a][0] for a in order]
    output = next(n for n in nodes if n.op == "output")
    if not isinstance(output.args[0], fx.Node):
        raise ValueError(f"{net}'s output must be one (batch, classes) tensor; its forward returns {output.args[0]!r}")
    bounds = [index[c] for c in cuts] + [index[output]]
    segment_of = {}
    for n in nodes:
        segment_of[n] = sum(index[n] > b for b in bounds[:-1])
    work = lambda n: n.op in ("call_module", "call_function", "call_method")
    last = [n for n in nodes if segment_of[n] == len(cuts) and work(n)]
    if not last:
        raise ValueError(f"after: {order[-1]!r} is the network's last layer (nothing runs after it); "
                         f"the network's own output is the last exit")
    for n in nodes:
        for m in n.all_input_nodes:
            if m.op in ("get_attr",) or m in extra or segment_of[m] == segment_of[n]:
                continue
            k = segment_of[n]
            if m is (cuts[k - 1] if k >= 1 else None):
                continue
            cut = order[segment_of[m]] if segment_of[m] < len(order) else "the end"
            raise ValueError(f"after: the exit after {cut!r} cuts a connection: {n.name!r} after it reads "
                             f"{m.name!r} from before it (a skip connection crosses this point); put exits between "
                             f"whole blocks")
    segments = []
    for k in range(len(cuts) + 1):
        source = placeholders[0] if k == 0 else cuts[k - 1]
        result = cuts[k] if k < len(cuts) else output.args[0]
        body = [n for n in nodes if segment_of[n] == k and n.op not in ("placeholder", "output")]
        body += [n for n in nodes if n.op == "get_attr" and n not in body]  # constants: wherever they are read
        body.sort(key=index.get)
        segments.append(Segment(body, source, result, extra))
    return order, segments


class Block:
    """Block ``i`` of a network given as a list of whole blocks: one step of it."""

    def __init__(self, i: int):
        self.i = i

    def __call__(self, root: nn.Module, x: Any) -> Any:
        return root[self.i](x)
