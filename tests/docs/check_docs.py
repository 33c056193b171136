#!/usr/bin/python3
"""Checks docs/: every relative link and image resolves, the ZeRO paper's worked
example in docs/zero-math.md agrees with the formulas docs/plots.py draws, and
plots.py draws every figure from inputs in each format the programs write
(zero_plan --json, bench_step_host --json lines, bench_comm --json, trainer
--history-json and trainer stdout, bench/peers/run.sh's results JSON). Without matplotlib the drawing is not
checked (it says so); the rest is.

    check_docs.py DOCS_DIR
"""
import json
import os
import re
import sys
import tempfile

failures = []


def check(ok, what):
    if not ok:
        failures.append(what)
        print("FAIL:", what)


def heading_anchors(path):
    anchors = set()
    in_code = False
    for line in open(path, encoding="utf-8"):
        if line.startswith("```"):
            in_code = not in_code
        m = re.match(r"^(#+) (.*)", line)
        if m and not in_code:
            anchors.add(re.sub(r"[^\w\- ]", "", m.group(2).strip().lower()).replace(" ", "-"))
    return anchors


def check_links(docs):
    """Markdown links outside code blocks: [text](target) and ![alt](image)."""
    count = 0
    for name in sorted(os.listdir(docs)):
        if not name.endswith(".md"):
            continue
        path = os.path.join(docs, name)
        text = re.sub(r"```.*?```", "", open(path, encoding="utf-8").read(), flags=re.S)
        text = re.sub(r"`[^`\n]*`", "", text)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"^[a-z]+://", target):
                continue
            file_part, _, anchor = target.partition("#")
            resolved = os.path.normpath(os.path.join(docs, file_part)) if file_part else path
            count += 1
            check(os.path.exists(resolved), "%s links to %s, which does not exist" % (name, target))
            if anchor and resolved.endswith(".md") and os.path.exists(resolved):
                check(anchor in heading_anchors(resolved), "%s links to #%s, no such heading in %s"
                      % (name, anchor, os.path.basename(resolved)))
    check(count > 20, "only %d links found in docs/*.md: the link scan is broken" % count)


def check_worked_example(docs, plots):
    """docs/zero-math.md's bold per-rank figures for 7.5B parameters on 64 ranks against the formulas."""
    text = open(os.path.join(docs, "zero-math.md"), encoding="utf-8").read()
    phi, n = 7.5e9, 64
    def same_as_shown(value, shown):  # equal to the precision the page prints
        number = shown.split()[0]
        decimals = len(number.partition(".")[2])
        return "%.*f" % (decimals, value) == number

    for stage, shown in zip(range(4), ("120 GB", "31.4 GB", "16.6 GB", "1.9 GB")):
        value = plots.paper_model_state_bytes(stage, phi, n) / 1e9
        check(("**%s**" % shown) in text, "zero-math.md does not show **%s** for stage %d" % (shown, stage))
        check(same_as_shown(value, shown), "stage %d: the formula gives %.3f GB, zero-math.md shows %s"
              % (stage, value, shown))
    for stages, factor, shown in (("0, 1, 2", 2, "29.5 GB"), ("3", 3, "44.3 GB")):
        value = factor * phi * (n - 1) / n * 2 / 1e9
        check(same_as_shown(value, shown), "stages %s traffic: %.2f GB, shown %s" % (stages, value, shown))
        check(("**%s**" % shown) in text, "zero-math.md does not show **%s**" % shown)


def check_formulas_against_planner(docs, plots):
    """The fallback formulas of plots.py against the planner's own paper figures (C++, include/zero/engine/plan.hpp),
    as saved with the committed figure: an independent implementation, at full precision, for every N and stage."""
    paths = [os.path.join(docs, "plot-data", "plan", p) for p in os.listdir(os.path.join(docs, "plot-data", "plan"))
             if p.endswith(".json")] if os.path.isdir(os.path.join(docs, "plot-data", "plan")) else []
    for path in paths:
        doc = json.load(open(path))
        c = doc["config"]
        if c.get("precision") in ("fp16", "bf16") and c.get("optimizer") in ("adam", "adamw"):
            mine = plots.paper_model_state_bytes(int(c["stage"]), float(c["params"]), int(c["ranks"]))
            theirs = doc["paper"]["model_state_bytes"]
            check(abs(mine - theirs) <= 1e-9 * theirs, "%s: plots.py's formula gives %.0f, zero_plan %.0f"
                  % (os.path.basename(path), mine, theirs))
    return len(paths)


def write_inputs(data):
    """One small input of every kind, in the formats the programs print."""
    for sub in ("plan", "step_host", "comm", "train"):
        os.makedirs(os.path.join(data, sub))
    for stage in range(4):
        for ranks in (1, 8, 64):
            b = 16e9 / ranks
            doc = {"config": {"params": 1000000000, "ranks": ranks, "stage": stage, "units": 4},
                   "lines": [{"name": "params", "device": b, "host": 0, "disk": 0}],
                   "total": {"device": b, "host": 1.0, "disk": 0}, "paper": {"model_state_bytes": b}, "comm": {}}
            json.dump(doc, open(os.path.join(data, "plan", "s%d_n%d.json" % (stage, ranks)), "w"))
    for p, seconds in ((1, 0.004), (2, 0.002)):  # two passes: the faster one must win
        with open(os.path.join(data, "step_host", "pass%d.json" % p), "w") as f:
            for n in (65536, 1048576):
                f.write(json.dumps({"bench": "step_host", "config": "fp32_adamw", "n": n, "isa": "avx2", "threads": 2,
                                    "seconds": seconds, "probe_seconds": 0.001 * p, "params_per_s": n / seconds,
                                    "bytes_per_param": 28, "gb_per_s": n * 28 / seconds / 1e9,
                                    "ratio_to_probe": 0.001 * p / seconds}) + "\n")
    rows = [{"comm": "local", "ranks": 2, "op": op, "dtype": "fp32", "bytes": b, "time_s": 1e-4, "algbw_GBps": 1.0,
             "busbw_GBps": 1.0, "limit_ratio": 0.5} for op in ("all_reduce", "all_gather") for b in (4096, 65536)]
    json.dump({"probe_GBps": 10.0, "rows": rows}, open(os.path.join(data, "comm", "local.json"), "w"))
    json.dump({"config": {"stage": 2, "ranks": 4},
               "epochs": [{"epoch": 1, "loss": 0.5, "test_accuracy": 0.85, "samples_per_s": 1.0, "seconds": 1.0}]},
              open(os.path.join(data, "train", "stage2.json"), "w"))
    os.makedirs(os.path.join(data, "peers"))
    summary = lambda m: {"n": 3, "median": m, "min": 0.9 * m, "max": 1.1 * m, "mean": m, "stdev": 0.1 * m}  # noqa: E731
    json.dump({"date": "2026-12-07T00:00:00+00:00", "machine": {"cpu": "a CPU", "cores": 2},
               "versions": {"torch": "2.15.0", "deepspeed": "0.19.8"},
               "jobs": {"gpt": {"title": "GPT", "configs": [
                   {"name": "zero, 4 ranks", "kind": "zero", "speed": summary(25000.0), "rss_sum_mib": summary(390.0)},
                   {"name": "PyTorch eager", "kind": "single", "speed": summary(19000.0), "rss_sum_mib": summary(1050.0)},
                   {"name": "FSDP2", "kind": "sharded", "speed": summary(10000.0), "rss_sum_mib": summary(3800.0)},
                   {"name": "failed peer", "kind": "sharded", "speed": None, "rss_sum_mib": None}]}}},
              open(os.path.join(data, "peers", "results.json"), "w"))
    with open(os.path.join(data, "train", "stage3.txt"), "w") as f:
        f.write("zero: Fashion-MNIST MLP 784-256-128-10, 4 ranks (local), stage 3, bf16, adamw, batch 256, 2 epochs, "
                "235146 parameters\n"
                "epoch 1/2  loss 0.5008  test_accuracy 0.8521  4034 samples/s  14.9 s  model states 0.90 MiB/rank  "
                "traffic 1.01 MiB/rank/step  lr 1.92e-03\n"
                "epoch 2/2  loss 0.3406  test_accuracy 0.8629  3641 samples/s  16.5 s  model states 0.90 MiB/rank  "
                "traffic 1.01 MiB/rank/step  lr 1.71e-03\ntest_accuracy=0.8629\n")


def check_plots(plots, data, out):
    write_inputs(data)
    config, epochs = plots.training_run(os.path.join(data, "train", "stage3.txt"))
    check(config.get("stage") == 3 and config.get("ranks") == 4, "trainer stdout header parsed as %s" % config)
    check(epochs == [(1, 0.5008, 0.8521), (2, 0.3406, 0.8629)], "trainer stdout epochs parsed as %s" % epochs)
    config, epochs = plots.training_run(os.path.join(data, "train", "stage2.json"))
    check(config["stage"] == 2 and epochs == [(1, 0.5, 0.85)], "history JSON parsed as %s %s" % (config, epochs))
    rows = [json.loads(l) for p in sorted(os.listdir(os.path.join(data, "step_host")))
            for l in open(os.path.join(data, "step_host", p))]
    best = plots.fastest_per_size(rows)[("fp32_adamw", 65536)]
    check(best["seconds"] == 0.002 and best["probe_seconds"] == 0.001 and abs(best["ratio_to_probe"] - 0.5) < 1e-12,
          "fastest of two passes: %s" % best)
    series, paper, _ = plots.memory_from_plans([os.path.join(data, "plan", p) for p in os.listdir(os.path.join(data, "plan"))])
    check(series[3] == [(1, 16e9 + 1), (8, 2e9 + 1), (64, 16e9 / 64 + 1)], "plan totals by N: %s" % series.get(3))
    check(paper[0][0] == (1, 16e9), "paper model states from the plan: %s" % paper.get(0))
    _, jobs = plots.peers_results(os.path.join(data, "peers", "results.json"))
    check([(j, [r[0] for r in rows]) for j, _, rows in jobs] == [("gpt", ["zero, 4 ranks", "PyTorch eager", "FSDP2"])],
          "bench/peers results read as %s (a configuration without a speed left out)" % jobs)
    if plots.plt is None:
        print("not checked: drawing the figures (matplotlib is not installed: apt-get install python3-matplotlib)")
        return
    sys.argv = ["plots.py", "--data", data, "--out", out, "--synthetic"]
    check(plots.main() == 0, "plots.py failed")
    for name in ("memory_per_rank.png", "step_host.png", "comm_bandwidth.png", "comm_limit_ratio.png",
                 "training_curves.png", "peers.png"):
        path = os.path.join(out, name)
        check(os.path.exists(path) and os.path.getsize(path) > 10000, "%s was not drawn" % name)


def main():
    docs = os.path.abspath(sys.argv[1])
    sys.path.insert(0, docs)
    import plots
    check_links(docs)
    check_worked_example(docs, plots)
    print("formulas checked against %d zero_plan outputs" % check_formulas_against_planner(docs, plots))
    with tempfile.TemporaryDirectory() as tmp:
        check_plots(plots, os.path.join(tmp, "data"), os.path.join(tmp, "images"))
    print("%d failure(s)" % len(failures))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
