#!/usr/bin/env python3
"""The include tree reads downward: no header includes itself through others
(a circle), and the engine's floor includes nothing from the floors built on
it (the disk tier's store, checkpoints, the run-time handle, integrations).
And the engine's parts stay out of the user's sight: the programs a user
reads (USER_DIRS, the examples) include no `detail/` header.

    check_include_layers.py INCLUDE_ROOT [USER_DIR...]

Reads every `#include "zero/..."` line under INCLUDE_ROOT/zero (and the C++
files under each USER_DIR); prints each circle, each arrow that runs back up
and each user file that reaches into `detail/`, with the file and line, and
exits 1 if there is any. What the floors are: docs/design.md ("The engine's
parts")."""
import os
import re
import sys

# Folders of include/zero/ that the engine's floor (engine/) must not include:
# they are built on it.
ABOVE_ENGINE = ("offload", "checkpoint", "runtime", "integrations")
INCLUDE = re.compile(r'\s*#\s*include\s+"zero/([^"]+)"')


def read_graph(root):
    graph, where = {}, {}
    for folder, _, names in os.walk(os.path.join(root, "zero")):
        for name in sorted(names):
            if not name.endswith((".hpp", ".cuh", ".h")):
                continue
            path = os.path.join(folder, name)
            rel = os.path.relpath(path, os.path.join(root, "zero"))
            graph[rel] = []
            with open(path, encoding="utf-8") as f:
                for number, line in enumerate(f, 1):
                    m = INCLUDE.match(line)
                    if m:
                        graph[rel].append(m.group(1))
                        where[(rel, m.group(1))] = number
    return graph, where


def circles(graph):
    found, state, path = [], {}, []

    def visit(node):
        state[node] = "open"
        path.append(node)
        for nxt in graph.get(node, []):
            if state.get(nxt) == "open":
                found.append(path[path.index(nxt):] + [nxt])
            elif nxt in graph and nxt not in state:
                visit(nxt)
        path.pop()
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node)
    return found


def user_reaches_into_detail(user_dirs):
    problems = []
    for top in user_dirs:
        for folder, _, names in os.walk(top):
            for name in sorted(names):
                if not name.endswith((".cpp", ".hpp", ".cu", ".cuh", ".h")):
                    continue
                path = os.path.join(folder, name)
                with open(path, encoding="utf-8") as f:
                    for number, line in enumerate(f, 1):
                        m = INCLUDE.match(line)
                        if m and "/detail/" in m.group(1):
                            problems.append(f"{path}:{number}: a user's program includes zero/{m.group(1)}, one "
                                            "of the engine's parts: include the user's header that offers it "
                                            "(zero/zero.hpp lists them)")
    return problems


def main():
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    graph, where = read_graph(sys.argv[1])
    problems = user_reaches_into_detail(sys.argv[2:])
    for circle in circles(graph):
        problems.append("a circle: " + " -> ".join(circle))
    for src, targets in sorted(graph.items()):
        if not src.startswith("engine/"):
            continue
        for tgt in targets:
            if tgt.split("/")[0] in ABOVE_ENGINE:
                problems.append(f"zero/{src}:{where[(src, tgt)]}: engine/ includes zero/{tgt}, a floor built on "
                                "the engine: move what it needs down (as engine/detail/disk_window.hpp and "
                                "engine/detail/builtin_engines.hpp did)")
    for p in problems:
        print(p)
    print(f"{len(graph)} headers, {sum(len(t) for t in graph.values())} includes: "
          f"{len(problems)} problem(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
