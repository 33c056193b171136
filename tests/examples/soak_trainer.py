#!/usr/bin/env python3
"""A soak test of the Fashion-MNIST trainer's checkpoints. Round after round
it trains a short configuration (--ranks 1-4, --stage 0-3, --precision,
--optimizer, --offload none|nvme, --save-every, --keep-last, --save-async),
interrupts or damages it at a random moment in one of these ways, and runs it
again with --resume:

  kill-training     SIGKILL between checkpoints (or before the first)
  kill-sync-save    SIGKILL while a synchronous save writes its step directory
  kill-async-save   SIGKILL while --save-async writes in the background
  truncate          the run killed after a checkpoint; then a file of the newest
  flip-byte         checkpoint (a rank file, its manifest.json, or the root's
  delete            `latest`) cut short, one byte changed, or removed
  fill-checkpoints  from a random moment on, writes of checkpoint files fail
  fill-disk-tier    the same with --offload nvme: the swap files' writes fail too

A round passes when the resumed run either started from the newest complete
checkpoint and printed the uninterrupted run's test_accuracy to the last
digit (resumed-equal), or stopped with exit code 1 and an `error:` naming the
damage: the damaged file, or the directory when no checkpoint is complete
(refused). A run that fills its disk must stop the same way, naming the file.
Everything else fails: a signal, an abort, a sanitizer report, "terminate
called", a run past --timeout (then killed with its process group), another
test_accuracy, or a resume from another checkpoint than the newest complete.

What the library promises (docs/checkpoint-format.md): a checkpoint exists
once its manifest.json does, a loader takes the newest one, `latest` is
informative, and load verifies sizes and checksums and refuses what fails
them without falling back (resuming an older checkpoint would silently redo
steps). So deleting the newest manifest must resume from the checkpoint
before it (or refuse when there is none); damage to `latest` must change
nothing; any other damage must be refused naming the file, unless it is to a
file the loader does not read (the rank-*.json records rank 0 collects).

A full disk without privileges: RLIMIT_FSIZE lowered on the running trainer
(prlimit(2), allowed on one's own processes) with SIGXFSZ ignored (an ignored
signal stays ignored across exec), so that every write past the limit fails
with EFBIG as writes fail with ENOSPC on a full disk, and the process lives
on to report it. A small tmpfs would need root to mount, and a cleanup that a
killed test would skip.

The seed, and each round's action and configuration, are printed; --round K
replays round K of --seed S (the kill moments depend on timing: a replay
kills at about the same moment). Known bugs (KNOWN_BUGS) are counted apart
and fail the run only with --strict. Skips (77) without the data set.

    soak_trainer.py TRAINER [--rounds 8] [--seed 1] [--round K] [--timeout 120] [--strict]
    soak_trainer.py build/examples/train_fashion_mnist --rounds 300   # by hand: about 35 min on 2 cores
"""
import argparse
import collections
import dataclasses
import json
import os
import random
import re
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

from trainer_output import final_value_text, resumed_from, saved_checkpoint

DATA = "/usr/share/datasets/fashion-mnist"
TRAIN_IMAGES = 60000
ACTIONS = ["kill-training", "kill-sync-save", "kill-async-save", "truncate", "flip-byte", "delete",
           "fill-checkpoints", "fill-disk-tier"]
DAMAGES = ("truncate", "flip-byte", "delete")
# What no run may print, whatever happened to it.
CRASH = re.compile(r"terminate called|Sanitizer|runtime error:|Assertion .* failed|Segmentation fault|"
                   r"core dumped|Aborted|stack smashing|double free|corrupted size")


@dataclasses.dataclass
class Config:
    ranks: int
    stage: int
    precision: str
    optimizer: str
    offload: str
    epochs: int
    batch: int
    save_every: int
    keep_last: int
    save_async: bool

    def training(self):
        """What the result depends on: the key of the reference cache."""
        return (self.ranks, self.stage, self.precision, self.optimizer, self.offload, self.epochs, self.batch)

    def train_args(self, swap):
        args = ["--ranks", str(self.ranks), "--stage", str(self.stage), "--precision", self.precision,
                "--optimizer", self.optimizer, "--epochs", str(self.epochs), "--batch", str(self.batch),
                "--seed", "1"]
        if self.offload == "nvme":
            args += ["--offload", "nvme", "--nvme-dir", swap, "--nvme-window-mib", "1"]
        return args

    def save_args(self, ckpt):
        args = ["--save", ckpt, "--save-every", str(self.save_every)]
        if self.keep_last:
            args += ["--keep-last", str(self.keep_last)]
        return args + (["--save-async"] if self.save_async else [])

    def save_steps(self):
        """The steps the trainer saves at: every --save-every steps inside an
        epoch, and at the end of every epoch."""
        per_epoch = TRAIN_IMAGES // self.batch
        ends = {per_epoch * e for e in range(1, self.epochs + 1)}
        return sorted(ends | set(range(self.save_every, per_epoch * self.epochs, self.save_every)))

    def __str__(self):
        return (f"ranks {self.ranks} stage {self.stage} {self.precision} {self.optimizer} offload {self.offload} "
                f"epochs {self.epochs} batch {self.batch} save-every {self.save_every} keep-last {self.keep_last}"
                + (" save-async" if self.save_async else ""))


def pick_config(rng, action):
    stage = rng.randint(1, 3) if action == "fill-disk-tier" else rng.randint(0, 3)
    if action == "fill-disk-tier":
        offload = "nvme"
    elif action == "fill-checkpoints" or stage == 0:  # (the disk tier holds stages 1-3's state)
        offload = "none"
    else:
        offload = rng.choice(["none", "nvme"])
    epochs = rng.choice([1, 1, 2])
    batch = rng.choice([240, 480, 600])  # multiples of every --ranks 1-4
    total = TRAIN_IMAGES // batch * epochs
    return Config(ranks=rng.randint(1, 4), stage=stage, precision=rng.choice(["fp32", "bf16", "fp16"]),
                  optimizer=rng.choice(["adamw", "adam", "sgd"]), offload=offload, epochs=epochs, batch=batch,
                  save_every=rng.randint(total // 6, total // 2), keep_last=rng.choice([0, 0, 1, 2, 3]),
                  save_async={"kill-async-save": True, "kill-sync-save": False}.get(action, rng.random() < 0.4))


class TrainerRun:
    """One trainer process in its own process group, SIGXFSZ ignored, killed
    (group and all) past `timeout`. lines() yields its stdout as it comes;
    kill(), after() and watch() act on it from other threads."""

    def __init__(self, command, timeout):
        self.command = command
        # stderr through a pipe, not a file: a file size limit would stop the error message too.
        self.process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                        errors="replace", start_new_session=True,
                                        preexec_fn=lambda: signal.signal(signal.SIGXFSZ, signal.SIG_IGN))
        self.stderr_reader = threading.Thread(target=self._read_stderr)
        self.stderr_reader.start()
        self.lock = threading.Lock()
        self.exited = False  # set before the process is reaped: no kill can reach a reused pid
        self.killed = None   # why we killed it
        self.stdout = []
        self.timers = [self.after(timeout, lambda: self.kill("timeout"))]

    def _read_stderr(self):
        self.stderr = self.process.stderr.read()

    def kill(self, why):
        with self.lock:
            if not self.exited and self.killed is None:
                self.killed = why
                os.killpg(self.process.pid, signal.SIGKILL)

    def limit_file_size(self, limit):
        """Lowers the running process's RLIMIT_FSIZE; False once it has exited."""
        with self.lock:
            if not self.exited:
                hard = resource.prlimit(self.process.pid, resource.RLIMIT_FSIZE)[1]  # (raising it needs privileges)
                resource.prlimit(self.process.pid, resource.RLIMIT_FSIZE, (limit, hard))
            return not self.exited

    def after(self, seconds, action):
        timer = threading.Timer(seconds, action)
        timer.daemon = True
        timer.start()
        return timer

    def watch(self, check, interval=0.0005):
        """Calls check() every `interval` seconds until it returns True or the
        process exits (a thread: it may kill())."""
        def loop():
            while not self.exited and not check():
                time.sleep(interval)
        threading.Thread(target=loop, daemon=True).start()

    def lines(self):
        for line in self.process.stdout:
            self.stdout.append(line)
            yield line

    def finish(self):
        for _ in self.lines():
            pass
        os.waitid(os.P_PID, self.process.pid, os.WEXITED | os.WNOWAIT)
        with self.lock:
            self.exited = True
        self.process.wait()
        for timer in self.timers:
            timer.cancel()
        self.stderr_reader.join()
        self.output = "".join(self.stdout)
        return self

    def errors(self):
        """Its `error:` lines (one per failed rank), joined by " | "."""
        return " | ".join(line for line in self.stderr.splitlines() if line.startswith("error:"))

    def tail(self):
        return f"$ {' '.join(self.command)}\n{self.output[-1500:]}{self.stderr[-1500:]}"


def run_to_end(command, timeout):
    return TrainerRun(command, timeout).finish()


def checkpoint_dirs(ckpt):
    """The step-* directories under ckpt, oldest first."""
    names = os.listdir(ckpt) if os.path.isdir(ckpt) else []
    return sorted(n for n in names if re.fullmatch(r"step-\d+", n))


def newest_complete(ckpt):
    """The newest step-* directory holding a manifest.json (what a loader
    must take), or None."""
    complete = [n for n in checkpoint_dirs(ckpt) if os.path.isfile(os.path.join(ckpt, n, "manifest.json"))]
    return complete[-1] if complete else None


def interrupt(rng, action, config, command, ckpt, timeout):
    """Runs `command` (it saves to ckpt) and interrupts it as `action` says at
    a random moment. Returns (the run, what was done)."""
    run = TrainerRun(command, timeout)
    # The moment: around one of the run's saves, counted (fp16's skipped
    # overflow steps make the directory names, the optimizer's step counts,
    # hard to foresee).
    steps = config.save_steps()
    target = rng.randrange(len(steps))
    which = f"save {target + 1} of {len(steps)} (batch {steps[target]})"
    did = []
    if action == "kill-sync-save":
        # A save's step directory appears before its files are written and
        # its manifest last: kill as soon as the target's is there.
        seen = set()

        def in_save():
            new = [n for n in checkpoint_dirs(ckpt) if n not in seen]
            seen.update(new)
            if len(seen) <= target:
                return False
            done = os.path.exists(os.path.join(ckpt, max(new), "manifest.json"))
            run.kill(f"killed {'after' if done else 'during'} {which}: {max(new)}")
            did.append(run.killed or "the run ended before the kill")
            return True
        run.watch(in_save)
        return run.finish(), did
    # (a background save of this model takes milliseconds: kill-async-save waits less)
    delay = rng.choice([0.0, rng.uniform(0, 0.02), rng.uniform(0, 0.005 if action == "kill-async-save" else 0.5)])
    if action == "kill-training" and rng.random() < 0.15:
        target = None  # before the first checkpoint: a refusal naming the directory
    limit = rng.choice([0, 4096, rng.randrange(4096, 256 << 10)])
    if action in DAMAGES:
        moment = f"once {which} was complete"
    else:
        moment = f"{delay:.3f} s after " + (f"{which} began" if target is not None else "the start")

    def act():
        if action.startswith("fill-"):
            did.append(f"file size limit {limit} bytes {moment}" if run.limit_file_size(limit)
                       else "the run ended before the disk filled")
        else:
            run.kill(f"killed {moment}")
            did.append(run.killed or "the run ended before the kill")

    if target is None:
        run.timers.append(run.after(delay, act))
    # Damage: once the target checkpoint is complete; otherwise from the
    # moment its save begins (a background one says so at once).
    begins = "saving checkpoint in the background: " if config.save_async and action not in DAMAGES else None
    count = 0
    for line in run.lines():
        count += bool(line.startswith(begins) if begins else saved_checkpoint(line))
        if target is not None and count == target + 1:
            target = None
            if action in DAMAGES or delay == 0:
                act()
            else:
                run.timers.append(run.after(delay, act))
    run.finish()
    return run, did or [f"the run ended before the {action.split('-')[0]} {moment}"]


@dataclasses.dataclass
class Damage:
    path: str
    what: str
    kind: str  # "manifest", "latest", "rank file"
    parses: bool = False  # a changed manifest.json that is still valid JSON


def json_changes(a, b, where=""):
    """The key paths whose values differ between two parsed JSON values."""
    if isinstance(a, dict) and isinstance(b, dict):
        return [c for k in sorted(set(a) | set(b)) for c in json_changes(a.get(k), b.get(k), f"{where}.{k}")]
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [c for i, (x, y) in enumerate(zip(a, b)) for c in json_changes(x, y, f"{where}[{i}]")]
    return [] if a == b and type(a) is type(b) else [where or "."]


def damage_newest(rng, action, ckpt):
    """Truncates, flips a byte in or deletes a file of the newest complete
    checkpoint (a rank file, its manifest, or the root's `latest`)."""
    newest = newest_complete(ckpt)
    if newest is None:
        return None
    directory = os.path.join(ckpt, newest)
    kind = rng.choice(["rank file", "manifest", "latest"])
    if kind == "latest" and not os.path.exists(os.path.join(ckpt, "latest")):
        kind = "manifest"
    if kind == "rank file":
        path = os.path.join(directory, rng.choice(sorted(n for n in os.listdir(directory) if n.startswith("rank-"))))
    else:
        path = os.path.join(ckpt, "latest") if kind == "latest" else os.path.join(directory, "manifest.json")
    with open(path, "rb") as f:
        data = f.read()
    damage = Damage(path, "", kind)
    if action == "delete" or not data:
        os.remove(path)
        damage.what = f"deleted {path}"
    elif action == "truncate":
        size = rng.randrange(len(data))
        damage.what = f"truncated {path} to {size} of {len(data)} bytes"
        data = data[:size]
    else:
        at = rng.randrange(len(data))
        if kind == "rank file" and path.endswith(".safetensors") and rng.random() < 0.3:
            at = rng.randrange(min(len(data), 8 + int.from_bytes(data[:8], "little")))  # in the header
        xor = rng.randrange(1, 256)
        before = data
        data = data[:at] + bytes([data[at] ^ xor]) + data[at + 1:]
        damage.what = f"byte {at} of {path} xor 0x{xor:02x}"
        if kind == "manifest":
            try:
                changes = json_changes(json.loads(before), json.loads(data))
                damage.parses = True
                damage.what += f" (still JSON; changed {', '.join(changes) or 'nothing'})"
            except ValueError:
                pass
    if action != "delete":
        with open(path, "wb") as f:
            f.write(data)
    return damage


# Known bugs: (name, whether a round with another test_accuracy is it, what it is).
KNOWN_BUGS = [
    ("manifest-unchecked", lambda config, damage: damage is not None and damage.parses,
     "manifest.json has no checksum: a changed value that still parses (step, loss scale) loads unnoticed"),
]


def first_run_outcome(run, action, reference, ckpt, swap):
    """How the interrupted run ended: killed, finished (with the reference
    test_accuracy) or stopped with an error naming the file it could not
    write (fill-*); or a failure."""
    if run.killed == "timeout":
        return "FAIL: the run hung (killed after --timeout)"
    if CRASH.search(run.output + run.stderr):
        return f"FAIL: the run crashed: {CRASH.search(run.output + run.stderr).group(0)}"
    if run.killed and run.process.returncode == -signal.SIGKILL:
        return "killed"
    if run.process.returncode == 0:
        accuracy = final_value_text(run.output, "test_accuracy")
        return "finished" if accuracy == reference else f"FAIL: the saving run printed {accuracy}, uninterrupted {reference}"
    errors = run.errors()
    if action.startswith("fill-") and run.process.returncode == 1 and errors:
        named = [d for d in (ckpt, swap) if d in errors]
        if named and "too large" in errors:
            return "stopped"
        return f"FAIL: the run stopped on a full disk without naming the file: {errors}"
    return f"FAIL: the run ended with exit code {run.process.returncode}: {errors or 'no error line'}"


def resume_outcome(run, reference, expected, ckpt, damage):
    """resumed-equal, refused, or a failure (see the module's comment)."""
    if run.killed == "timeout":
        return "FAIL: the resumed run hung (killed after --timeout)"
    crash = CRASH.search(run.output + run.stderr)
    if crash or run.process.returncode < 0:
        return f"FAIL: the resumed run crashed: {crash.group(0) if crash else f'signal {-run.process.returncode}'}"
    errors = run.errors()
    if run.process.returncode == 1 and errors:
        if expected is None:
            return "refused" if ckpt in errors else f"FAIL: no checkpoint, and the error does not say where: {errors}"
        if damage is None or damage.kind == "latest":
            return f"FAIL: refused the intact checkpoint {expected}: {errors}"
        if os.path.basename(damage.path) in errors:
            return "refused"
        return f"FAIL: refused without naming the damaged {os.path.basename(damage.path)}: {errors}"
    if run.process.returncode != 0:
        return f"FAIL: the resumed run ended with exit code {run.process.returncode}"
    where = resumed_from(run.output)
    if expected is None or where is None or os.path.basename(where[0]) != expected:
        return f"FAIL: resumed from {where and where[0]}, the newest complete checkpoint is {expected}"
    accuracy = final_value_text(run.output, "test_accuracy")
    if accuracy != reference:
        return f"different: resumed from {expected}: test_accuracy {accuracy}, uninterrupted {reference}"
    return "resumed-equal"


def soak_round(trainer, seed, number, references, timeout, work):
    """One round; returns (action, outcome, details, its directory)."""
    rng = random.Random(f"{seed}/{number}")
    action = random.Random(seed).sample(ACTIONS, len(ACTIONS))[number % len(ACTIONS)]  # each action every 8 rounds
    config = pick_config(rng, action)
    print(f"round {number}: {action}: {config}", flush=True)
    directory = tempfile.mkdtemp(prefix=f"soak-{seed}-{number}-", dir=work)
    ckpt, swap = os.path.join(directory, "ckpt"), os.path.join(directory, "swap")
    os.mkdir(swap)
    train = [trainer] + config.train_args(swap)
    details = []
    if config.training() not in references:
        reference_run = run_to_end(train, timeout)
        accuracy = final_value_text(reference_run.output, "test_accuracy")
        if reference_run.process.returncode != 0 or accuracy is None:
            return action, "FAIL: the uninterrupted run failed", [reference_run.tail()], directory
        references[config.training()] = accuracy
    reference = references[config.training()]
    first, did = interrupt(rng, action, config, train + config.save_args(ckpt), ckpt, timeout)
    details += did
    before = first_run_outcome(first, action, reference, ckpt, swap)
    if before.startswith("FAIL"):
        return action, before, details + [first.tail()], directory
    if before == "stopped":
        details.append(first.errors())
    damage = damage_newest(rng, action, ckpt) if action in DAMAGES else None
    if damage:
        details.append(damage.what)
    expected = newest_complete(ckpt)
    details.append(f"checkpoints {checkpoint_dirs(ckpt)}, newest complete {expected}")
    resumed = run_to_end(train + config.save_args(ckpt) + ["--resume", ckpt], timeout)
    after = resume_outcome(resumed, reference, expected, ckpt, damage)
    if after.startswith("different"):
        known = [name for name, applies, _ in KNOWN_BUGS if applies(config, damage)]
        after = f"known-bug {known[0]}: {after}" if known else f"FAIL: {after}"
    if after == "refused":
        details.append(resumed.errors())
    if after.startswith(("FAIL", "known")):
        details.append(resumed.tail())
    return action, f"{before}/{after}", details, directory


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trainer")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--round", type=int, help="replay this round of --seed only")
    parser.add_argument("--timeout", type=float, default=120, help="seconds a run may take before it is a hang")
    parser.add_argument("--strict", action="store_true", help="known bugs fail the run too")
    parser.add_argument("--work", default=tempfile.gettempdir(), help="where the rounds' directories go")
    args = parser.parse_args()
    if not os.path.isdir(DATA):
        print(f"SKIP: {DATA} missing (apt-get install dataset-fashion-mnist)")
        return 77
    rounds = [args.round] if args.round is not None else range(1, args.rounds + 1)
    print(f"soak: seed {args.seed}, {len(rounds)} rounds (replay one: {sys.argv[0]} {args.trainer} "
          f"--seed {args.seed} --round K)", flush=True)
    references = {}  # uninterrupted test_accuracy per Config.training()
    counts = collections.defaultdict(collections.Counter)
    bad = []
    start = time.monotonic()
    for number in rounds:
        action, outcome, details, directory = soak_round(args.trainer, args.seed, number, references, args.timeout,
                                                         args.work)
        failed = "FAIL" in outcome or (args.strict and "known-bug" in outcome)
        kind = outcome.split(": ", 1)[0]  # without the particulars
        counts[action][kind] += 1
        print(f"round {number}: {action}: {outcome}", flush=True)
        for d in details:
            print("   ", d.replace("\n", "\n    "))
        if failed or "known-bug" in outcome:
            bad.append((number, action, outcome, failed))
        if failed:
            print(f"    replay: {sys.argv[0]} {args.trainer} --seed {args.seed} --round {number}; kept {directory}")
        else:
            shutil.rmtree(directory, ignore_errors=True)
    print(f"\nsoak: seed {args.seed}, {len(rounds)} rounds in {time.monotonic() - start:.0f} s")
    for action in ACTIONS:
        if counts[action]:
            print(f"  {action:17} " + ", ".join(f"{n} {kind}" for kind, n in sorted(counts[action].items())))
    for number, action, outcome, failed in bad:
        print(f"  {'FAIL' if failed else 'known'} round {number} ({action}): {outcome}")
    return 1 if any(failed for *_, failed in bad) else 0


if __name__ == "__main__":
    sys.exit(main())
