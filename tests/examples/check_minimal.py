#!/usr/bin/env python3
"""examples/minimal.cpp learns: its loss starts where its initial values put
it and falls to the least-squares minimum of its data, both computed here on
their own (in double precision, from the data and initial values the program
writes down), and no lower: the model is linear, so no fit beats least
squares, and a loss below it is a loss computed wrongly. And the README's
quote of it (its first code) is what the program says, line for line.

    check_minimal.py MINIMAL MINIMAL_CPP README
"""
import math
import subprocess
import sys

EXAMPLES, INPUTS, HIDDEN, STEPS = 256, 8, 4, 20  # minimal.cpp's constants


def data():
    """minimal.cpp's examples: x_ij = cos(0.37 i (j+1)), y_i = sum_j a_j x_ij + 0.5 + 0.1 sin(1.7 i^2)."""
    xs, ys = [], []
    for i in range(EXAMPLES):
        x = [math.cos(0.37 * (i * (j + 1))) for j in range(INPUTS)]
        xs.append(x)
        ys.append(0.5 + 0.1 * math.sin(1.7 * i * i) + sum((1 if j % 2 == 0 else -1) * (j + 1) / 8.0 * x[j]
                                                          for j in range(INPUTS)))
    return xs, ys


def least_squares_loss(xs, ys):
    """The smallest mean squared error of y ~ a.x + b: the normal equations, solved by Gauss-Jordan elimination."""
    rows = [x + [1.0] for x in xs]
    n = len(rows[0])
    m = [[sum(r[p] * r[q] for r in rows) for q in range(n)] + [sum(r[p] * y for r, y in zip(rows, ys))]
         for p in range(n)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        m[col], m[pivot] = m[pivot], m[col]
        for r in range(n):
            if r != col:
                f = m[r][col] / m[col][col]
                m[r] = [a - f * b for a, b in zip(m[r], m[col])]
    coef = [m[k][n] / m[k][k] for k in range(n)]
    return sum((sum(c * v for c, v in zip(coef, r)) - y) ** 2 for r, y in zip(rows, ys)) / len(rows)


def initial_loss(xs, ys):
    """The mean squared error at minimal.cpp's initial values: W_kj = 0.5 sin(k INPUTS + j + 1), v_k = 0.5 cos(k + 1),
    d = 0."""
    w = [[0.5 * math.sin(k * INPUTS + j + 1) for j in range(INPUTS)] for k in range(HIDDEN)]
    v = [0.5 * math.cos(k + 1) for k in range(HIDDEN)]
    return sum((sum(v[k] * sum(w[k][j] * x[j] for j in range(INPUTS)) for k in range(HIDDEN)) - y) ** 2
               for x, y in zip(xs, ys)) / len(xs)


def quoted_in_source(readme, source):
    """Whether the README's ```cpp block after its link to examples/minimal.cpp is a run of the source's lines
    (the same text, each line at the same depth, the run's indentation taken away)."""
    text = open(readme, encoding="utf-8").read()
    start = text.find("```cpp\n", text.find("](examples/minimal.cpp)")) + len("```cpp\n")
    quote = text[start:text.find("```", start)].splitlines()
    lines = open(source, encoding="utf-8").read().splitlines()
    for first, line in enumerate(lines):
        indent = len(line) - len(line.lstrip(" "))
        run = lines[first:first + len(quote)]
        if quote and [l[indent:] if l.startswith(" " * indent) else l for l in run] == quote:
            return True
    return False


def main():
    binary, source, readme = sys.argv[1:4]
    if not quoted_in_source(readme, source):
        print(f"FAIL: the README's code after its link to examples/minimal.cpp is not a run of {source}'s lines: "
              "quote the program as it is")
        return 1
    run = subprocess.run([binary], capture_output=True, text=True, timeout=50)
    print(run.stdout, end="")
    if run.returncode != 0:
        print(f"FAIL: exited {run.returncode}:\n{run.stderr}")
        return 1
    lines = run.stdout.splitlines()
    losses = [float(l.split()[3]) for l in lines if l.startswith("step ")]
    if len(losses) != STEPS or not lines or not lines[-1].startswith("loss="):
        print(f"FAIL: expected {STEPS} lines 'step N  loss L', then 'loss=<value>'")
        return 1
    final = float(lines[-1].partition("=")[2])
    xs, ys = data()
    start, floor = initial_loss(xs, ys), least_squares_loss(xs, ys)
    print(f"computed here: initial loss {start:.6f}, least-squares minimum {floor:.6f}")
    failures = []
    if abs(losses[0] - start) > 1e-4 * start:  # fp32 against double
        failures.append(f"the first step's loss {losses[0]} is not the initial values' {start:.6f}")
    if final != losses[-1]:
        failures.append(f"loss={final} is not the last step's loss {losses[-1]}")
    if not floor * (1 - 1e-3) <= final <= floor * 1.01:
        failures.append(f"the final loss {final} is not within 1% above the least-squares minimum {floor:.6f}")
    for f in failures:
        print("FAIL:", f)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
