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


def final_value_text(stdout, name):
    """The value of the last line `name=<value>`, as printed (to compare
    digit for digit), or None when the last line is not that."""
    lines = stdout.strip().splitlines()
    match = re.fullmatch(name + r"=([0-9.]+)", lines[-1]) if lines else None
    return match.group(1) if match else None


def last_value_text(stdout, name):
    """final_value_text; exits the test with FAIL when there is none."""
    value = final_value_text(stdout, name)
    if value is None:
        raise SystemExit(f"FAIL: the last line is not {name}=<value>:\n" + stdout[-2000:])
    return value


def saved_checkpoint(line):
    """The directory a trainer's `saved checkpoint DIR` line names (the
    checkpoint is complete), or None for any other line."""
    prefix = "saved checkpoint "
    return line.rstrip()[len(prefix):] if line.startswith(prefix) else None


def resumed_from(stdout):
    """(directory, step) of a resumed run's `resumed from DIR at step N`
    line, or None when it has none."""
    match = re.search(r"^resumed from (\S+) at step (\d+)", stdout, re.MULTILINE)
    return (match.group(1), int(match.group(2))) if match else None


def kill_after_checkpoint(command, step):
    """Runs a trainer with --save, echoing its output, and kills it with
    SIGKILL as soon as it reports the checkpoint of `step`
    (`saved checkpoint .../step-<step, 9 digits>`). Returns whether it did."""
    print("$", " ".join(command), f"(killed after step {step}'s checkpoint)")
    process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    killed = False
    for line in process.stdout:
        print(line, end="")
        if (saved_checkpoint(line) or "").endswith(f"step-{step:09d}"):
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
    if (resumed_from(resumed) or (None, None))[1] != step:
        failures.append("the resumed run does not say where it resumed")
    return resumed, failures
