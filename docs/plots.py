#!/usr/bin/python3
"""Draws the figures of docs/ from the JSON (and text) the programs print.

    /usr/bin/python3 docs/plots.py --data DIR [--out docs/images] [--only memory,step,comm,training,peers]

DIR holds what docs/make_plots.sh collects (every part is optional; a figure
whose inputs are missing is skipped with a message):

    DIR/plan/*.json       `zero_plan --json` outputs, one per (stage, ranks)
    DIR/step_host/*.json  `bench_step_host --json` outputs (one JSON object per line)
    DIR/comm/*.json       `bench_comm --json` outputs
    DIR/train/*.json      trainer `--history-json` files, or
    DIR/train/*.txt       the trainer's stdout (its `epoch ...` lines)
    DIR/peers/*.json      bench/peers/run.sh's results (--json FILE; the newest name is drawn)
    DIR/machine.json      where the data came from (cpu, cores, l3_bytes, date)

Without plan files, the memory figure is drawn from the ZeRO paper's
formulas instead, and says so in its title (`--formula-params` sets the model
size; `--formulas` forces it).
"""
import argparse
import glob
import json
import math
import os
import re
import sys

try:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: E402  (after the backend is chosen)
    from matplotlib.ticker import FuncFormatter  # noqa: E402
except ImportError:  # the formulas and readers below work without it (tests/docs checks them); drawing does not
    plt = None

STAGE_COLORS = ["#555555", "#1f77b4", "#2ca02c", "#d62728"]
STAGE_STYLES = [("o", "-"), ("s", "--"), ("^", "-."), ("D", ":")]
STAGE_NAMES = ["stage 0 (data parallel)", "stage 1 (P_os)", "stage 2 (P_os+g)", "stage 3 (P_os+g+p)"]


def binary_size(n, _pos=None):
    """64K, 1M, 256M: counts in powers of 1024, as the benchmarks take them."""
    for unit, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= scale:
            v = n / scale
            return ("%d%s" % (v, unit)) if v == int(v) else ("%.3g%s" % (v, unit))
    return "%d" % n


def load_json_objects(path):
    """A file with one JSON document, or JSON lines (bench_step_host prints one object per configuration)."""
    with open(path) as f:
        text = f.read()
    try:
        doc = json.loads(text)
        return doc if isinstance(doc, list) else [doc]
    except json.JSONDecodeError:
        return [json.loads(line) for line in text.splitlines() if line.strip().startswith("{")]


def files(data, sub, pattern):
    return sorted(glob.glob(os.path.join(data, sub, pattern)))


def machine_note(data):
    path = os.path.join(data, "machine.json")
    if not os.path.exists(path):
        return "", {}
    with open(path) as f:
        m = json.load(f)
    parts = [m.get("cpu", ""), "%s cores" % m["cores"] if "cores" in m else "", m.get("date", "")]
    return ", ".join(p for p in parts if p), m


SYNTHETIC = False  # set by --synthetic: every figure says so across its face


def save(fig, out, name):
    if SYNTHETIC:
        fig.text(0.5, 0.5, "SYNTHETIC DATA - drawing test only", ha="center", va="center", fontsize=28,
                 color="red", alpha=0.35, rotation=20)
    path = os.path.join(out, name)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    print("wrote", path)


# ---- (1) memory per rank against N ------------------------------------------------------------------


def paper_model_state_bytes(stage, phi, n, k=12):
    """The ZeRO paper's model states per rank: 2-byte parameters and gradients, K bytes of optimizer state."""
    return [(2 + 2 + k) * phi, (2 + 2) * phi + k * phi / n, 2 * phi + (2 + k) * phi / n, (2 + 2 + k) * phi / n][stage]


def human_count(n):
    """7500000000 -> 7.5B (a string such as "7.5B" passes through)."""
    if isinstance(n, str):
        return n
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return "%.4g%s" % (n / scale, unit)
    return "%d" % n


def plan_ranks(config):
    for key in ("ranks", "world_size", "n"):
        if key in config:
            return int(config[key])
    if "ranks_per_node" in config and "nodes" in config:
        return int(config["ranks_per_node"]) * int(config["nodes"])
    raise KeyError("zero_plan config has no ranks (looked for ranks, world_size, ranks_per_node x nodes): %s" % config)


def memory_from_plans(paths):
    """{stage: [(N, bytes per rank on device + host + disk)]}, the same for the paper's model
    states alone, and a description of the model."""
    series, paper, described = {}, {}, ""
    for path in paths:
        for doc in load_json_objects(path):
            config, total = doc["config"], doc["total"]
            stage, ranks = int(config["stage"]), plan_ranks(config)
            per_rank = total.get("device", 0) + total.get("host", 0) + total.get("disk", 0)
            series.setdefault(stage, []).append((ranks, per_rank))
            if "model_state_bytes" in doc.get("paper", {}):
                paper.setdefault(stage, []).append((ranks, doc["paper"]["model_state_bytes"]))
            if not described:
                described = ", ".join(
                    "%s %s" % (k, human_count(config[k]) if k == "params" else config[k])
                    for k in ("params", "units", "precision", "optimizer", "offload") if k in config)
    return {s: sorted(v) for s, v in series.items()}, {s: sorted(v) for s, v in paper.items()}, described


def memory_from_formulas(phi):
    ns = [2 ** i for i in range(11)]
    return {s: [(n, paper_model_state_bytes(s, phi, n)) for n in ns] for s in range(4)}


def plot_memory(args, out):
    paths = [] if args.formulas else files(args.data, "plan", "*.json")
    paper = {}
    if paths:
        series, paper, described = memory_from_plans(paths)
        title = ("Memory per rank from zero_plan --json (device + host + disk)\n"
                 "model states + communication buffers; thin lines: the ZeRO paper's model states\n(%s)" % described)
    else:
        series = memory_from_formulas(args.formula_params)
        title = ("Model states per rank from the ZeRO paper's formulas (not zero_plan output)\n"
                 "%s parameters, mixed-precision Adam (K = 12): (2 + 2 + K)·Φ ... (2 + 2 + K)·Φ/N"
                 % ("%.3g B" % (args.formula_params / 1e9)))
        print("memory: no plan/*.json in %s; drawing the paper's formulas" % args.data)
    fig, ax = plt.subplots(figsize=(7.5, 5))
    for stage in sorted(series):
        ns = [n for n, _ in series[stage]]
        gb = [b / 1e9 for _, b in series[stage]]
        marker, style = STAGE_STYLES[stage]
        ax.plot(ns, gb, marker=marker, linestyle=style, color=STAGE_COLORS[stage], label=STAGE_NAMES[stage])
        if stage in paper:
            ax.plot([n for n, _ in paper[stage]], [b / 1e9 for _, b in paper[stage]], linestyle=style, linewidth=0.9,
                    color=STAGE_COLORS[stage], alpha=0.6)
        if 64 in ns:  # the paper's example point, labelled with its value
            ax.annotate("%.3g GB" % gb[ns.index(64)], xy=(64, gb[ns.index(64)]), xytext=(4, 6),
                        textcoords="offset points", fontsize=8, color=STAGE_COLORS[stage])
    ax.axhline(80, color="#999999", linewidth=1)
    ax.text(300, 80 / 1.35, "80 GB: one A100/H100", color="#666666", fontsize=8, ha="center")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    all_ns = sorted({n for points in series.values() for n, _ in points})
    ax.set_xticks(all_ns)
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _p: "%d" % v))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _p: "%g" % v))
    ax.set_xlabel("data-parallel ranks N")
    ax.set_ylabel("bytes per rank [GB = 1e9 B] (log)")
    ax.set_title(title, fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    save(fig, out, "memory_per_rank.png")


# ---- (2) host step throughput against its probe ------------------------------------------------------


def fastest_per_size(rows):
    """One row per (config, n): the fastest step and the fastest probe over every run given.

    Noise on a shared machine only adds time, so, as bench_step_host does over its own
    repetitions, the fastest of all repeated runs is the best estimate of each speed."""
    best = {}
    for r in rows:
        key = (r["config"], r["n"])
        b = best.setdefault(key, dict(r))
        b["seconds"] = min(b["seconds"], r["seconds"])
        b["probe_seconds"] = min(b["probe_seconds"], r["probe_seconds"])
    for b in best.values():
        moved = b["n"] * b["bytes_per_param"] / 1e9
        b["gb_per_s"], b["probe_gb_per_s"] = moved / b["seconds"], moved / b["probe_seconds"]
        b["ratio_to_probe"] = b["probe_seconds"] / b["seconds"]
    return best


def plot_step(args, out):
    rows = [r for p in files(args.data, "step_host", "*.json") for r in load_json_objects(p)
            if r.get("bench") == "step_host"]
    if not rows:
        print("step: no step_host/*.json in %s; skipped" % args.data)
        return
    note, _ = machine_note(args.data)
    configs = []
    for r in rows:
        if r["config"] not in configs:
            configs.append(r["config"])
    best = fastest_per_size(rows)
    runs = max(sum(1 for r in rows if (r["config"], r["n"]) == key) for key in best)
    fig, (ax_bw, ax_ratio) = plt.subplots(1, 2, figsize=(12, 4.8))
    colors = ["#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd"]
    for i, config in enumerate(configs):
        pts = sorted((n, b["gb_per_s"], b["probe_gb_per_s"], b["ratio_to_probe"])
                     for (c, n), b in best.items() if c == config)
        ns = [p[0] for p in pts]
        color = colors[i % len(colors)]
        ax_bw.plot(ns, [p[1] for p in pts], marker="o", color=color, label="%s: fused step" % config)
        ax_bw.plot(ns, [p[2] for p in pts], linestyle="--", color=color, alpha=0.7, label="%s: probe" % config)
        ax_ratio.plot(ns, [p[3] for p in pts], marker="o", color=color, label=config)
    ax_ratio.axhline(1.0, color="#999999", linewidth=1)
    for ax in (ax_bw, ax_ratio):
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_formatter(FuncFormatter(binary_size))
        ax.set_xlabel("parameters per step (n)")
        ax.grid(True, which="both", alpha=0.3)
    ax_bw.set_yscale("log")
    ax_bw.yaxis.set_major_formatter(FuncFormatter(lambda v, _p: "%g" % v))
    ax_bw.set_ylabel("memory traffic [GB/s] (log)")
    ax_bw.set_title("Fused step (solid) and its bandwidth probe (dashed)", fontsize=10)
    ax_bw.legend(fontsize=8, loc="center right")
    ax_ratio.set_ylabel("probe time / step time (1 = at the bandwidth limit)")
    ax_ratio.set_title("Ratio to the probe", fontsize=10)
    ax_ratio.legend(fontsize=8, loc="upper right")
    threads = sorted({r["threads"] for r in rows})
    isas = sorted({r["isa"] for r in rows})
    fig.suptitle("Host fused optimizer step: bench_step_host --json --n SIZE (isa %s, %s threads, fastest of %d run%s)%s"
                 % ("/".join(isas), "/".join(map(str, threads)), runs, "s" if runs > 1 else "",
                    ("\n" + note) if note else ""), fontsize=11, y=1.02)
    save(fig, out, "step_host.png")


# ---- (3) communicator bandwidth over message sizes ---------------------------------------------------


def plot_comm(args, out):
    docs = [d for p in files(args.data, "comm", "*.json") for d in load_json_objects(p)]
    rows = [r for d in docs for r in d.get("rows", [])]
    if not rows:
        print("comm: no comm/*.json in %s; skipped" % args.data)
        return
    note, _ = machine_note(args.data)
    probes = sorted({d["probe_GBps"] for d in docs if "probe_GBps" in d})
    ops = [op for op in ("all_reduce", "reduce_scatter", "all_gather", "broadcast") if any(r["op"] == op for r in rows)]
    ops += sorted({r["op"] for r in rows} - set(ops))
    series = sorted({(r["comm"], r["ranks"], r["dtype"]) for r in rows})
    palette = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    color_of = {key: palette[i % len(palette)] for i, key in enumerate(sorted({(c, n) for c, n, _ in series}))}
    for metric, ylabel, name in (("busbw_GBps", "bus bandwidth [GB/s] (log)", "comm_bandwidth.png"),
                                 ("limit_ratio", "ratio to the memory-traffic limit at probe bandwidth",
                                  "comm_limit_ratio.png")):
        cols = 2 if len(ops) > 1 else 1
        nrows = (len(ops) + cols - 1) // cols
        fig, axes = plt.subplots(nrows, cols, figsize=(6.2 * cols, 4.2 * nrows), squeeze=False)
        for ax, op in zip(axes.flat, ops):
            for comm, ranks, dtype in series:
                pts = sorted((r["bytes"], r[metric]) for r in rows
                             if (r["comm"], r["ranks"], r["dtype"], r["op"]) == (comm, ranks, dtype, op))
                if not pts:
                    continue
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o" if dtype == "fp32" else "x",
                        linestyle="-" if dtype == "fp32" else "--", color=color_of[(comm, ranks)],
                        label="%s, %d ranks, %s" % (comm, ranks, dtype))
            ax.set_xscale("log", base=2)
            ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _p: binary_size(v).replace("K", " Ki").replace("M", " Mi").replace("G", " Gi") + "B"))
            if metric == "busbw_GBps":
                ax.set_yscale("log")
                ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _p: "%g" % v))
            else:
                ax.axhline(1.0, color="#999999", linewidth=1)
            ax.set_title(op, fontsize=10)
            ax.set_xlabel("message size (full buffer)")
            ax.set_ylabel(ylabel, fontsize=9)
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=7)
        for ax in list(axes.flat)[len(ops):]:
            ax.set_visible(False)
        title = "Communicators: bench_comm --json (bus bandwidth as nccl-tests defines it)"
        if probes:
            title += "\nmemory probe %s GB/s" % "/".join("%.1f" % p for p in probes)
        fig.suptitle(title + (("\n" + note) if note else ""), fontsize=11)
        fig.tight_layout()
        save(fig, out, name)


# ---- (4) the trainer's loss and test accuracy per epoch ----------------------------------------------

EPOCH_LINE = re.compile(r"^epoch (\d+)/(\d+)\s+loss ([0-9.eE+-]+|nan|inf)\s+test_accuracy ([0-9.]+)")
HEADER_LINE = re.compile(r"(\d+) ranks \(([a-z]+)\), stage (\d), (\w+), (\w+), batch (\d+)")


def training_run(path):
    """(config, [(epoch, loss, accuracy)]) from a --history-json file or from the trainer's stdout."""
    if path.endswith(".json"):
        doc = load_json_objects(path)[0]
        return doc["config"], [(e["epoch"], e["loss"], e["test_accuracy"]) for e in doc["epochs"]]
    config, epochs = {}, []
    with open(path) as f:
        for line in f:
            header = HEADER_LINE.search(line)
            if header and not config:
                config = {"ranks": int(header.group(1)), "comm": header.group(2), "stage": int(header.group(3)),
                          "precision": header.group(4), "optimizer": header.group(5), "batch": int(header.group(6))}
            m = EPOCH_LINE.match(line)
            if m:
                epochs.append((int(m.group(1)), float(m.group(3)), float(m.group(4))))
    if not epochs:
        raise ValueError("%s has no 'epoch E/N  loss L  test_accuracy A' lines" % path)
    return config, epochs


def plot_training(args, out):
    paths = files(args.data, "train", "*.json") + files(args.data, "train", "*.txt")
    # A run given both ways (history JSON and stdout) is drawn once, from the JSON.
    by_stem = {}
    for p in paths:
        by_stem.setdefault(os.path.splitext(p)[0], p)
    runs = [training_run(p) for p in sorted(by_stem.values())]
    if not runs:
        print("training: no train/*.json or train/*.txt in %s; skipped" % args.data)
        return
    note, _ = machine_note(args.data)
    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(12, 4.6))
    for config, epochs in sorted(runs, key=lambda r: r[0].get("stage", 0)):
        stage = int(config.get("stage", 0))
        marker, style = STAGE_STYLES[stage % 4]
        color = STAGE_COLORS[stage % 4]
        e = [x[0] for x in epochs]
        # Markers shrink with the stage so that identical curves stay visible on top of each other.
        size = 9 - 1.5 * stage
        ax_loss.plot(e, [x[1] for x in epochs], marker=marker, markersize=size, linestyle=style, color=color,
                     label=STAGE_NAMES[stage])
        ax_acc.plot(e, [x[2] for x in epochs], marker=marker, markersize=size, linestyle=style, color=color,
                    label=STAGE_NAMES[stage])
    curves = [[(e[1], e[2]) for e in epochs] for _, epochs in runs]
    if len(runs) > 1 and all(c == curves[0] for c in curves):
        ax_acc.text(0.97, 0.04, "the %d runs print the same loss and accuracy\nat every epoch: the curves coincide"
                    % len(runs), transform=ax_acc.transAxes, ha="right", va="bottom", fontsize=9, color="#444444")
    c = runs[0][0]
    described = ", ".join(str(c[k]) + suffix for k, suffix in
                          (("ranks", " ranks"), ("comm", ""), ("precision", ""), ("optimizer", ""), ("batch", " batch"))
                          if k in c)
    ax_loss.set_ylabel("mean training loss over the epoch")
    ax_acc.set_ylabel("test accuracy (10,000 images)")
    for ax in (ax_loss, ax_acc):
        ax.set_xlabel("epoch")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
        ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    fig.suptitle("Fashion-MNIST MLP 784-256-128-10 (train_fashion_mnist, %s)%s"
                 % (described, ("\n" + note) if note else ""), fontsize=11)
    save(fig, out, "training_curves.png")


# ---- (5) zero beside its peers (bench/peers/run.sh's results JSON) ---------------------------------

PEER_COLORS = {"zero": "#d62728", "single": "#1f77b4", "sharded": "#7f7f7f"}


def peers_results(path):
    """[(job, title, [(name, kind, speed summary, RSS summary)])] from bench/peers' results JSON (its
    summaries: harness.summarize() writes them into the file)."""
    with open(path) as f:
        doc = json.load(f)
    jobs = []
    for job, j in doc["jobs"].items():
        rows = [(c["name"], c["kind"], c["speed"], c["rss_sum_mib"]) for c in j["configs"] if c.get("speed")]
        if rows:
            jobs.append((job, j["title"], rows))
    if not jobs:
        raise ValueError("%s has no configuration with a speed summary" % path)
    return doc, jobs


def plot_peers(args, out):
    paths = files(args.data, "peers", "*.json")
    if not paths:
        print("peers: no peers/*.json (bench/peers/run.sh --json FILE) in %s; skipped" % args.data)
        return
    doc, jobs = peers_results(sorted(paths)[-1])
    fig, axes = plt.subplots(len(jobs), 2, figsize=(13, 1.2 + 0.42 * sum(len(r) for _, _, r in jobs) + 0.8 * len(jobs)),
                             squeeze=False, gridspec_kw={"height_ratios": [len(r) for _, _, r in jobs], "hspace": 0.4})
    for (job, title, rows), (ax_speed, ax_mem) in zip(jobs, axes):
        names = [r[0] for r in rows][::-1]
        colors = [PEER_COLORS.get(r[1], "#999999") for r in rows][::-1]
        speed = [r[2] for r in rows][::-1]
        mem = [r[3]["median"] if r[3] else 0 for r in rows][::-1]
        y = range(len(rows))
        med = [s["median"] for s in speed]
        err = [[s["median"] - s["min"] for s in speed], [s["max"] - s["median"] for s in speed]]
        ax_speed.barh(y, med, xerr=err, color=colors, capsize=3)
        ax_speed.set_yticks(list(y))
        ax_speed.set_yticklabels(names, fontsize=8)
        ax_speed.set_xlabel(("tokens/s" if job == "gpt" else "samples/s") + ": median, bars from min to max")
        ax_speed.set_title(title, fontsize=9, loc="left")
        ax_mem.barh(y, mem, color=colors)
        ax_mem.set_yticks(list(y))
        ax_mem.set_yticklabels([])
        ax_mem.set_xlabel("peak resident memory, all processes (MiB, median)")
        for ax in (ax_speed, ax_mem):
            ax.grid(True, axis="x", alpha=0.3)
    m, v = doc.get("machine", {}), doc.get("versions", {})
    fig.suptitle("zero (red) beside one-process PyTorch (blue) and sharded peers (grey): %s, %s cores; torch %s, "
                 "DeepSpeed %s; %s" % (m.get("cpu", "?"), m.get("cores", "?"), v.get("torch"), v.get("deepspeed"),
                                       doc.get("date", "")[:10]),
                 fontsize=10)
    save(fig, out, "peers.png")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", required=True, help="directory of JSON/text inputs (see above)")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "images"),
                        help="where the PNG files go (default: docs/images)")
    parser.add_argument("--only", default="memory,step,comm,training,peers",
                        help="comma-separated subset of memory,step,comm,training,peers")
    parser.add_argument("--formulas", action="store_true", help="memory figure from the paper's formulas")
    parser.add_argument("--formula-params", type=float, default=7.5e9,
                        help="model size for the formula fallback (default 7.5e9, the ZeRO paper's example)")
    parser.add_argument("--synthetic", action="store_true",
                        help="mark the figures as drawn from synthetic data (for testing the drawing)")
    args = parser.parse_args()
    if plt is None:
        print("plots.py: matplotlib is not installed (apt-get install python3-matplotlib)", file=sys.stderr)
        return 1
    global SYNTHETIC
    SYNTHETIC = args.synthetic
    if not os.path.isdir(args.data):
        parser.error("--data %s is not a directory" % args.data)
    os.makedirs(args.out, exist_ok=True)
    plots = {"memory": plot_memory, "step": plot_step, "comm": plot_comm, "training": plot_training,
             "peers": plot_peers}
    for name in args.only.split(","):
        if name not in plots:
            parser.error("--only: unknown figure '%s' (choose from %s)" % (name, ",".join(plots)))
        plots[name](args, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
