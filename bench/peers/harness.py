"""What bench/peers/peers.py reads and writes, with nothing but the standard
library, so that CI can hold it to recorded output with Debian's Python
(tests/scripts/check_peers_harness.py) while the benchmark itself needs a
virtual environment of gigabytes:

- the lines the peers' workers print (gpt_peer.py, mlp_peer.py): made by
  info_line() and timed_line() here, read back by parse_peer();
- the lines zero's trainers print (examples/gpt/gpt_trainer.hpp,
  examples/fashion_mnist/train_fashion_mnist.cpp): parse_zero_gpt() and
  parse_zero_mlp(), which raise OutputFormatError, naming the line, when one
  is missing or its format changed;
- the statistics, the results document (the JSON file for plots) and the
  tables printed at the end (make_tables()).
"""
import math
import re
import statistics

# ---- what every configuration is -------------------------------------------------------------------
# kind: "zero" (this library's trainers), "single" (PyTorch in one process),
# "sharded" (a sharded trainer in several processes). Ratios are taken to the
# best peer (the fastest median of the non-zero kinds) and to the best of each kind.
KINDS = ("zero", "single", "sharded")
KIND_NAMES = {"single": "one-process PyTorch", "sharded": "sharded peer"}


class OutputFormatError(ValueError):
    """A program's output lacks a line the harness reads, or the line's format changed."""


def _need(match, what, text):
    if match is None:
        tail = "\n".join(text.strip().splitlines()[-8:])
        raise OutputFormatError(f"no {what} in the output (its format changed?); the output ended with:\n{tail}")
    return match


# ---- zero's trainers -------------------------------------------------------------------------------
# examples/gpt/gpt_trainer.hpp
ZERO_GPT_HEADER = re.compile(
    r"^zero: GPT (\d+) layers, width (\d+), (\d+) heads, context (\d+), vocab (\d+): (\d+) parameters; "
    r"(\d+) ranks \((\w+)\), stage (\d), (\w+), (\w+), backend (\w+)$", re.M)
ZERO_GPT_BATCH = re.compile(r"^batch: (\d+) windows x (\d+) characters x (\d+) ranks x (\d+) micro-batches = "
                            r"(\d+) tokens/step, (\d+) steps$", re.M)
ZERO_GPT_STEP = re.compile(
    r"^step (\d+)/(\d+)  train_loss ([0-9.]+|nan|inf)  val_loss ([0-9.]+|nan|inf) nats/char  ([0-9.]+) tokens/s"
    r".*  model states ([0-9.]+) MiB/rank  lr \S+  ([0-9.]+) s$", re.M)
ZERO_GPT_TRAINING = re.compile(r"^training: ([0-9.]+) s, ([0-9.]+) tokens/s.*, ([0-9.]+) ms/step$", re.M)
LAST_VALUE = r"^{}=([0-9.]+|nan|inf)\s*\Z"
# examples/fashion_mnist/train_fashion_mnist.cpp
ZERO_MLP_HEADER = re.compile(r"^zero: Fashion-MNIST MLP 784-256-128-10, (\d+) ranks \((\w+)\), stage (\d), (\w+), "
                             r"(\w+), batch (\d+), (\d+) epochs, (\d+) parameters$", re.M)
ZERO_MLP_EPOCH = re.compile(
    r"^epoch (\d+)/(\d+)  loss ([0-9.]+|nan|inf)  test_accuracy ([0-9.]+)  ([0-9.]+) samples/s  ([0-9.]+) s  "
    r"model states ([0-9.]+) MiB/rank  traffic ([0-9.]+) MiB/rank/step  lr \S+$", re.M)


def last_value(text, name):
    """The value of the last line `name=<value>` (the trainers' and the workers' last line)."""
    return float(_need(re.search(LAST_VALUE.format(name), text.strip() + "\n", re.M), f"last line '{name}=<value>'",
                       text).group(1))


def parse_zero_gpt(text, timed_from_step):
    """gpt_train's output, run with --eval-every W --steps W+N (W = timed_from_step): the
    first W steps are warm-up; the tokens/s are those of the progress lines after step W
    (evaluation is not training time: the trainer restarts its clock after it)."""
    h = _need(ZERO_GPT_HEADER.search(text), "'zero: GPT ... parameters; N ranks (comm), stage S' header", text)
    b = _need(ZERO_GPT_BATCH.search(text), "'batch: ... tokens/step, N steps' line", text)
    steps = [m for m in ZERO_GPT_STEP.finditer(text)]
    _need(steps or None, "'step K/N  train_loss ...  tokens/s ...' progress line", text)
    training = _need(ZERO_GPT_TRAINING.search(text), "'training: S s, R tokens/s, M ms/step' line", text)
    tokens_per_step = int(b.group(5))
    timed_steps, seconds, previous = 0, 0.0, 0
    for m in steps:
        step, rate = int(m.group(1)), float(m.group(5))
        if step > timed_from_step:
            n = step - previous
            timed_steps += n
            seconds += n * tokens_per_step / rate if rate > 0 else math.inf
        previous = step
    if timed_steps == 0:
        raise OutputFormatError(f"no progress line after the warm-up's step {timed_from_step} (run it with "
                                f"--eval-every {timed_from_step} and more steps)")
    return {
        "parameters": int(h.group(6)), "ranks": int(h.group(7)), "comm": h.group(8), "stage": int(h.group(9)),
        "precision": h.group(10), "tokens_per_step": tokens_per_step, "steps": int(b.group(6)),
        "timed_steps": timed_steps, "seconds": seconds,
        "tokens_per_s": timed_steps * tokens_per_step / seconds,
        "all_steps_tokens_per_s": float(training.group(2)),
        "model_states_mib_per_rank": float(steps[-1].group(6)),
        "val_loss": last_value(text, "val_loss"),
    }


def parse_zero_mlp(text):
    """train_fashion_mnist's output: samples/s over the epochs' training time (the trainer's
    per-epoch figures, evaluation not included) and the last line's test accuracy."""
    h = _need(ZERO_MLP_HEADER.search(text), "'zero: Fashion-MNIST MLP 784-256-128-10, N ranks (comm), ...' header",
              text)
    epochs = [m for m in ZERO_MLP_EPOCH.finditer(text)]
    _need(epochs or None, "'epoch E/N  loss L  test_accuracy A  R samples/s  S s  model states ...' line", text)
    # Every epoch trains the same samples: over all of them, the harmonic mean of the epochs'
    # rates (their seconds are printed to 0.1 s only).
    rates = [float(m.group(5)) for m in epochs]
    seconds = sum(float(m.group(6)) for m in epochs)
    return {
        "ranks": int(h.group(1)), "comm": h.group(2), "stage": int(h.group(3)), "precision": h.group(4),
        "batch": int(h.group(6)), "epochs": len(epochs), "parameters": int(h.group(8)),
        "seconds": seconds, "samples_per_s": len(rates) / sum(1.0 / r for r in rates) if all(rates) else math.inf,
        "model_states_mib_per_rank": float(epochs[-1].group(7)),
        "test_accuracy": last_value(text, "test_accuracy"),
    }


# ---- the peers' workers ----------------------------------------------------------------------------
PEER_INFO = re.compile(r"^peer: (.*)$", re.M)
PEER_TIMED = re.compile(r"^timed: (.*)$", re.M)


def _fields(line):
    return dict(kv.split("=", 1) for kv in line.split())


def info_line(**fields):
    """`peer: key=value ...`: what a worker ran (system, ranks, threads, versions)."""
    return "peer: " + " ".join(f"{k}={v}" for k, v in fields.items())


def timed_line(**fields):
    """`timed: key=value ...`: a worker's timed window (GPT: steps, seconds, tokens_per_s,
    warmup_s; MLP: epochs, seconds, samples_per_s)."""
    return "timed: " + " ".join(f"{k}={v:.6g}" if isinstance(v, float) else f"{k}={v}" for k, v in fields.items())


def parse_peer(text, job):
    """A worker's rank-0 output: its info and timed lines and its last line."""
    info = _fields(_need(PEER_INFO.search(text), "'peer: system=...' line", text).group(1))
    timed = {k: float(v) for k, v in _fields(_need(PEER_TIMED.search(text), "'timed: ...' line", text).group(1)).items()}
    out = dict(info)
    out.update(timed)
    if job == "gpt":
        for key in ("steps", "seconds", "tokens_per_s"):
            if key not in timed:
                raise OutputFormatError(f"the 'timed:' line has no {key}=")
        out["timed_steps"] = int(timed["steps"])
        out["val_loss"] = last_value(text, "val_loss")
    else:
        for key in ("epochs", "seconds", "samples_per_s"):
            if key not in timed:
                raise OutputFormatError(f"the 'timed:' line has no {key}=")
        out["test_accuracy"] = last_value(text, "test_accuracy")
    return out


# ---- statistics ------------------------------------------------------------------------------------
def summary(values):
    """median, min, max, mean and sample standard deviation (0 for one value) of finite values."""
    v = [x for x in values if x is not None and math.isfinite(x)]
    if not v:
        return None
    return {"n": len(v), "median": statistics.median(v), "min": min(v), "max": max(v), "mean": statistics.fmean(v),
            "stdev": statistics.stdev(v) if len(v) > 1 else 0.0}


def speed_key(job):
    return "tokens_per_s" if job == "gpt" else "samples_per_s"


def quality_key(job):
    return "val_loss" if job == "gpt" else "test_accuracy"


def summarize(doc):
    """Adds to every configuration of doc["jobs"] the summaries of its speed runs and seed runs
    (speed, peak RSS summed over processes and its largest process, quality), and to every job
    the best peer overall and of each kind, and each configuration's ratio to them."""
    for job, j in doc["jobs"].items():
        sk, qk = speed_key(job), quality_key(job)
        for c in j["configs"]:
            ok = [r for r in c.get("speed_runs", []) if not r.get("error")]
            c["speed"] = summary([r[sk] for r in ok])
            c["rss_sum_mib"] = summary([sum(r["rss_mib"]) for r in ok])
            c["rss_max_process_mib"] = summary([max(r["rss_mib"]) for r in ok])
            c["wall_s"] = summary([r["wall_s"] for r in ok])
            c["compile_s"] = summary([r["warmup_s"] for r in ok if "warmup_s" in r]) \
                if c.get("reports_compile") else None
            seeds = [r for r in c.get("seed_runs", []) + c.get("speed_runs", [])
                     if r.get("full_length") and not r.get("error")]
            c["quality"] = summary([r[qk] for r in seeds])
            c["failures"] = [r["error"] for r in c.get("speed_runs", []) + c.get("seed_runs", []) if r.get("error")]
        measured = [c for c in j["configs"] if c["speed"]]
        peers = [c for c in measured if c["kind"] != "zero"]
        best = max(peers, key=lambda c: c["speed"]["median"]) if peers else None
        j["best_peer"] = best["name"] if best else None
        j["best_of_kind"] = {}
        for kind in ("single", "sharded"):
            of_kind = [c for c in peers if c["kind"] == kind]
            if of_kind:
                j["best_of_kind"][kind] = max(of_kind, key=lambda c: c["speed"]["median"])["name"]
        by_name = {c["name"]: c for c in j["configs"]}
        # The fastest run of each: on a machine shared with other work, the least disturbed one.
        fastest_peer = max(c["speed"]["max"] for c in peers) if peers else None
        j["best_of_kind_fastest"] = {}
        for kind in ("single", "sharded"):
            of_kind = [c for c in peers if c["kind"] == kind]
            if of_kind:
                j["best_of_kind_fastest"][kind] = max(of_kind, key=lambda c: c["speed"]["max"])["name"]
        for c in measured:
            c["ratio_to_best_peer"] = c["speed"]["median"] / best["speed"]["median"] if best else None
            c["ratio_to_best_peer_fastest"] = c["speed"]["max"] / fastest_peer if peers else None
            c["ratios_to_best_of_kind"] = {
                kind: c["speed"]["median"] / by_name[name]["speed"]["median"]
                for kind, name in j["best_of_kind"].items()}
            c["ratios_to_best_of_kind_fastest"] = {
                kind: c["speed"]["max"] / by_name[name]["speed"]["max"]
                for kind, name in j["best_of_kind_fastest"].items()}
            c["rss_ratio_to_best_of_kind"] = {
                kind: c["rss_sum_mib"]["median"] / by_name[name]["rss_sum_mib"]["median"]
                for kind, name in j["best_of_kind"].items()}
    return doc


# ---- tables ----------------------------------------------------------------------------------------
def _range(s, fmt):
    return "-" if not s else f"{fmt.format(s['median'])} ({fmt.format(s['min'])}-{fmt.format(s['max'])})"


def _spread(s, fmt):
    if not s:
        return "-"
    return f"{fmt.format(s['mean'])} ± {fmt.format(s['stdev'])} ({fmt.format(s['min'])}-{fmt.format(s['max'])}, n={s['n']})"


def make_tables(doc):
    """The results as Markdown tables, one per job, and zero's ratios in words under each."""
    lines = []
    if doc.get("baseline_rss_mib"):
        lines.append("Peak RSS of a process that only imports: " + ", ".join(
            f"{what} {mib:.0f} MiB" for what, mib in doc["baseline_rss_mib"].items()) + ".")
        lines.append("")
    for job, j in doc["jobs"].items():
        unit = "tokens/s" if job == "gpt" else "samples/s"
        quality = "validation loss (nats/char)" if job == "gpt" else "test accuracy"
        qfmt = "{:.4f}"
        lines.append(f"### {j['title']}")
        lines.append("")
        lines.append(f"| system | processes x threads | {unit}: median (min-max) | / best peer | fastest / fastest peer | "
                     f"peak RSS, all processes, MiB | largest process, MiB | {quality}: mean ± sd (min-max, n) |")
        lines.append("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
        for c in j["configs"]:
            name = c["name"] + (" (best peer)" if c["name"] == j.get("best_peer") else "")
            ratio = f"{c['ratio_to_best_peer']:.2f}x" if c.get("ratio_to_best_peer") is not None else "-"
            if c["speed"] is None and c.get("failures"):
                ratio = "failed"
            fastest = f"{c['ratio_to_best_peer_fastest']:.2f}x" if c.get("ratio_to_best_peer_fastest") else "-"
            lines.append(f"| {name} | {c['layout']} | {_range(c['speed'], '{:.0f}')} | "
                         f"{ratio} | {fastest} | {_range(c['rss_sum_mib'], '{:.0f}')} | {_range(c['rss_max_process_mib'], '{:.0f}')} | "
                         f"{_spread(c['quality'], qfmt)} |")
        lines.append("")
        by_name = {c["name"]: c for c in j["configs"]}
        for c in j["configs"]:
            if c["kind"] != "zero" or not c["speed"]:
                continue
            parts = []
            for kind, best in j["best_of_kind"].items():
                fastest = j["best_of_kind_fastest"][kind]
                parts.append(f"{c['ratios_to_best_of_kind'][kind]:.2f}x the {unit} of the best {KIND_NAMES[kind]} "
                             f"({best}) in {c['rss_ratio_to_best_of_kind'][kind]:.2f} of its memory (fastest runs: "
                             f"{c['ratios_to_best_of_kind_fastest'][kind]:.2f}x {fastest})")
            lines.append(f"- {c['name']}: " + "; ".join(parts))
        for c in j["configs"]:
            if c.get("compile_s"):
                s = c["compile_s"]
                lines.append(f"- {c['name']}: warm-up steps (compilation) {s['median']:.1f} s median "
                             f"({s['min']:.1f}-{s['max']:.1f}), not in its {unit}")
            for f in c.get("failures", [])[:2]:
                lines.append(f"- {c['name']} failed: {f.splitlines()[0] if f else '?'}")
        loads = [r["load_before"] for c in j["configs"] for r in c.get("speed_runs", []) if "load_before" in r]
        if loads:
            lines.append(f"- load average (1 min) as the speed runs started: {min(loads):.1f}-{max(loads):.1f} "
                         f"(on {doc.get('machine', {}).get('cores', '?')} cores)")
        peers_q = [by_name[n]["quality"] for n in by_name if by_name[n]["kind"] != "zero" and by_name[n]["quality"]]
        if peers_q:
            lo = min(q["min"] for q in peers_q)
            hi = max(q["max"] for q in peers_q)
            lines.append(f"- the peers' {quality} over all their seeds: {lo:.4f}-{hi:.4f}")
        lines.append("")
    return "\n".join(lines)
