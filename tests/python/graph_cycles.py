"""Cycles of a directed graph, for the tests that look for them: imports (test_code_limits.py) and
recursive functions (test_checkpoint_skeleton_walk.py)."""

from __future__ import annotations


def cycles(graph: dict[str, set[str]], self_loops: bool = False) -> list[list[str]]:
    """The strongly connected components with more than one node, each sorted, in the order found (Tarjan's
    algorithm, iterative: no recursion limit); ``self_loops``: a node with an edge to itself too."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1 or (self_loops and node in graph.get(node, ())):
                    components.append(sorted(component))
    return components
