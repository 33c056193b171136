"""What the trainer smoke tests share: run a trainer, echo its output, and
read the value of its `name=<value>` last line."""
import re
import subprocess
import sys


def run_for_last_line(command, name, timeout=600):
    """(stdout, value of the last line `name=<value>`), or (None, None) after
    printing why the run failed (exit code, or another last line)."""
    run = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    print(run.stdout[-4000:])
    print(run.stderr[-4000:], file=sys.stderr)
    if run.returncode != 0:
        print(f"FAIL: exit code {run.returncode}")
        return None, None
    lines = run.stdout.strip().splitlines()
    match = re.fullmatch(name + r"=([-+0-9.eEnaif]+)", lines[-1]) if lines else None
    if not match:
        print(f"FAIL: the last line is not {name}=<value>")
        return None, None
    return run.stdout, float(match.group(1))
