#!/usr/bin/env python3
"""The program output the docs show is what the programs print today.

    check_samples.py DOCS_DIR EXAMPLES_DIR

Each sample below is a command written in a doc page, followed in that page
by a ```text block with its output. The command is run from EXAMPLES_DIR
(the build's examples folder, for the page's `build/examples/`) and the
block is compared with what it prints: the whole output, or its JSON report
lines only where the rest holds timings. The docs wrap long JSON lines at
commas (a wrapped line starts with a space); they are joined before the
comparison. Why: samples went stale unnoticed as reports gained fields and
buffers shrank (a reader checks the docs' arithmetic against them). The
samples print the same under g++ and Clang.
"""
import difflib
import os
import shlex
import subprocess
import sys

# (page, command as the page writes it, what is compared)
SAMPLES = [
    ("tutorial.md",
     "build/examples/train_fashion_mnist --stage 3 --ranks 4 --precision bf16 --epochs 1 --report", "json"),
    ("zero-math.md",
     "build/examples/zero_plan --params 7.5B --ranks-per-node 8 --nodes 8 --stage 3 --precision fp16 --optimizer adam",
     "all"),
    ("custom-optimizer.md", "build/examples/lion_optimizer", "all"),
]


def shown_output(page_text, command):
    """The ```text block that opens with `$ command`, or else the first one after the command's first place in
    the page (written in a ```sh block above it); its lines, without the `$ command` line."""
    at = page_text.find("```text\n$ " + command + "\n")
    if at < 0:
        at = page_text.find(command)
        at = page_text.find("```text\n", at) if at >= 0 else -1
    if at < 0:
        return None
    start = at + len("```text\n")
    end = page_text.find("```", start)
    lines = page_text[start:end].splitlines()
    if lines and lines[0].startswith("$ "):
        lines = lines[1:]
    return lines


def unwrap_json(lines):
    """The JSON lines, each wrapped line (a space, then the rest) joined to the one it continues."""
    out = []
    for line in lines:
        if line.startswith("{"):
            out.append(line)
        elif line.startswith(" ") and out and not out[-1].endswith("}"):
            out[-1] += line[1:]
    return out


def main():
    docs, examples = sys.argv[1], sys.argv[2]
    failures = 0
    for page, command, mode in SAMPLES:
        text = open(os.path.join(docs, page), encoding="utf-8").read()
        shown = shown_output(text, command)
        if shown is None:
            print(f"FAIL {page}: the sample of `{command}` (the command, then a ```text block) is not there")
            failures += 1
            continue
        argv = shlex.split(command)
        argv[0] = os.path.join(examples, os.path.basename(argv[0]))
        run = subprocess.run(argv, capture_output=True, text=True, timeout=300)
        if run.returncode != 0:
            print(f"FAIL {page}: `{command}` exited {run.returncode}:\n{run.stderr[-2000:]}")
            failures += 1
            continue
        printed = run.stdout.splitlines()
        if mode == "json":
            shown, printed = unwrap_json(shown), [line for line in printed if line.startswith("{")]
            if not printed:
                print(f"FAIL {page}: `{command}` printed no JSON line")
                failures += 1
                continue
        if shown == printed:
            print(f"ok   {page}: `{command}` ({len(printed)} {'JSON ' if mode == 'json' else ''}lines as shown)")
            continue
        failures += 1
        print(f"FAIL {page}: `{command}` prints other lines than the page shows; paste its output there"
              + (" (JSON lines wrapped at commas, each continuation starting with a space)" if mode == "json" else ""))
        for line in difflib.unified_diff(shown, printed, f"docs/{page}", "the program", lineterm="", n=1):
            print("  " + line)
    print(f"{len(SAMPLES) - failures} passed, {failures} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
