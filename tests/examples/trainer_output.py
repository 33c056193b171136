"""What the trainer tests share: run a trainer, echo its output, read the
value of its `name=<value>` last line, kill it after a checkpoint."""
import os
import re
import signal
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


def run_checked(command, timeout=600):
    """stdout of a run that must succeed (its tail echoed); exits the test
    with FAIL and the exit code otherwise."""
    print("$", " ".join(command))
    run = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    print(run.stdout[-1200:])
    if run.returncode != 0:
        print(run.stderr[-2000:], file=sys.stderr)
        raise SystemExit(f"FAIL: exit code {run.returncode}")
    return run.stdout


def last_value_text(stdout, name):
    """The value of the last line `name=<value>`, as printed (to compare
    digit for digit); exits the test with FAIL when there is none."""
    lines = stdout.strip().splitlines()
    match = re.fullmatch(name + r"=([0-9.]+)", lines[-1]) if lines else None
    if not match:
        raise SystemExit(f"FAIL: the last line is not {name}=<value>:\n" + stdout[-2000:])
    return match.group(1)


def kill_after_checkpoint(command, step):
    """Runs a trainer with --save, echoing its output, and kills it with
    SIGKILL as soon as it reports the checkpoint of `step`
    (`saved checkpoint .../step-<step, 9 digits>`). Returns whether it did."""
    print("$", " ".join(command), f"(killed after step {step}'s checkpoint)")
    process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    killed = False
    for line in process.stdout:
        print(line, end="")
        if line.startswith("saved checkpoint") and line.rstrip().endswith(f"step-{step:09d}"):
            process.send_signal(signal.SIGKILL)
            killed = True
            break
    process.wait()
    return killed


def kill_then_resume(command, ckpt, save_every, step):
    """Runs a trainer `command` with --save ckpt --save-every save_every,
    kills it with SIGKILL after step `step`'s checkpoint, and runs it again
    with --resume ckpt. Returns (the resumed run's stdout, what went wrong:
    no such checkpoint reported, a checkpoint past the kill, a resumed run
    that does not say where it resumed)."""
    failures = []
    if not kill_after_checkpoint(command + ["--save", ckpt, "--save-every", str(save_every)], step):
        failures.append(f"the run never reported step {step}'s checkpoint")
    saved = sorted(os.listdir(ckpt))
    print("checkpoints:", saved)
    if any(name.startswith("step-") and int(name[5:]) > step for name in saved):
        failures.append("the run went on past the kill")
    resumed = run_checked(command + ["--resume", ckpt])
    if "resumed from" not in resumed or f"at step {step}" not in resumed:
        failures.append("the resumed run does not say where it resumed")
    return resumed, failures
