#!/usr/bin/python3
"""bench/peers/ (zero beside PyTorch 2.x, FSDP2 and DeepSpeed) needs a virtual
environment of gigabytes and half an hour, so CI does not run it; this holds
what it reads and writes to recorded output, with Debian's Python alone:

1. bench/peers/harness.py reads the recorded output of zero's trainers and of
   the peers' workers (peers_fixtures/*.txt, from a run of bench/peers/run.sh)
   into the figures the run printed, and refuses each of them with one line
   changed (a line renamed, a field reformatted, the last line gone);
2. the workers' `peer:` and `timed:` lines, made by harness.py's own
   functions, read back;
3. the tables and ratios made from a recorded results file
   (peers_fixtures/results.json: every run's figures, as peers.py saved them),
   recomputed here from the runs;
4. with the trainers' paths (meson passes them): short runs of gpt_train and
   train_fashion_mnist, through peers.py's own command lines, read by the
   harness, so that a changed output line fails here and not in the benchmark
   (skipped, and said so, without the data sets);
5. with Debian's PyTorch (python3-torch, 1.13): bench/peers/gpt_model.py, the
   module the peers train, computes tests/gpt/torch_gpt.py's loss and names its
   parameters as torch_gpt.param_specs does.

    check_peers_harness.py [GPT_TRAIN TRAIN_FASHION_MNIST]
"""
import copy
import json
import math
import os
import statistics
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
FIXTURES = os.path.join(HERE, "peers_fixtures")
sys.path.insert(0, os.path.join(ROOT, "bench", "peers"))
import harness  # noqa: E402

failures = []


def check(ok, what):
    print(("ok:   " if ok else "FAIL: ") + what)
    if not ok:
        failures.append(what)


def fixture(name):
    with open(os.path.join(FIXTURES, name)) as f:
        return f.read()


def refused(parse, text, what):
    try:
        parse(text)
    except harness.OutputFormatError as e:
        check(True, f"refused: {what} ({str(e).splitlines()[0][:90]})")
        return
    check(False, f"accepted output with {what}")


def close(a, b, rel=1e-6):
    return a is not None and b is not None and abs(a - b) <= rel * max(abs(a), abs(b), 1e-12)


def check_recorded():
    # gpt_train, 4 ranks, stage 3, --steps 2W --eval-every W: steps W+1..2W timed. The
    # expected figures are read here by splitting the lines, not by the harness' patterns.
    text = fixture("zero_gpt_4r_s3.txt")
    progress = [line.split() for line in text.splitlines() if line.startswith("step ")]
    warm = int(progress[0][1].split("/")[0])
    timed = [p for p in progress if int(p[1].split("/")[0]) > warm]
    steps = sum(int(b[1].split("/")[0]) - int(a[1].split("/")[0]) for a, b in zip(progress, progress[1:])
                if int(b[1].split("/")[0]) > warm)
    expected = steps / sum((int(b[1].split("/")[0]) - int(a[1].split("/")[0])) / float(b[7])
                           for a, b in zip(progress, progress[1:]) if int(b[1].split("/")[0]) > warm)
    z = harness.parse_zero_gpt(text, warm)
    check(z["ranks"] == 4 and z["stage"] == 3 and z["comm"] == "local" and z["parameters"] == 820608,
          f"zero GPT header: {z['ranks']} ranks ({z['comm']}), stage {z['stage']}, {z['parameters']} parameters")
    check(timed and z["timed_steps"] == steps and close(z["tokens_per_s"], expected, 1e-9),
          f"zero GPT tokens/s after the warm-up: {z['tokens_per_s']:.1f} over {z['timed_steps']} steps "
          f"({expected:.1f} over {steps})")
    check(z["val_loss"] == float(text.strip().splitlines()[-1].split("=")[1])
          and z["model_states_mib_per_rank"] == float(progress[-1][progress[-1].index("states") + 1]),
          "zero GPT val_loss and model states")
    mpi = harness.parse_zero_gpt(fixture("zero_gpt_mpi_4r_s3.txt"), warm)
    check(mpi["comm"] == "mpi" and mpi["ranks"] == 4, "zero GPT as MPI processes")
    p = lambda t: harness.parse_zero_gpt(t, warm)  # noqa: E731
    refused(p, text.replace(" tokens/s  model states", " tok/s  model states"), "the progress line's 'tokens/s' renamed")
    refused(p, text.replace("nats/char  ", "nats per char  "), "the progress line's val_loss unit changed")
    refused(p, text.replace("batch: 8 windows", "batch: 8 sequences"), "the batch line changed")
    refused(p, text.replace("; 4 ranks (local), stage 3", "; 4 ranks, stage 3"), "the header's comm gone")
    refused(p, text.replace("\nval_loss=", "\nvalidation_loss="), "the last line renamed")
    refused(p, text.replace("training: ", "trained: "), "the 'training:' line renamed")
    try:
        harness.parse_zero_gpt(text, int(progress[-1][1].split("/")[0]))
        check(False, "a warm-up covering every step accepted")
    except harness.OutputFormatError:
        check(True, "refused: no progress line after the warm-up")

    text = fixture("zero_mlp.txt")
    m = harness.parse_zero_mlp(text)
    epochs = [line.split() for line in text.splitlines() if line.startswith("epoch ")]
    rate = len(epochs) / sum(1 / float(e[6]) for e in epochs)  # the same samples every epoch
    check(m["epochs"] == len(epochs) and close(m["samples_per_s"], rate) and m["precision"] == "bf16",
          f"zero MLP: {m['epochs']} epochs, {m['samples_per_s']:.0f} samples/s over their seconds, {m['precision']}")
    check(m["test_accuracy"] == float(text.strip().splitlines()[-1].split("=")[1]), "zero MLP test_accuracy")
    refused(harness.parse_zero_mlp, text.replace(" samples/s ", " images/s "), "the epoch line's samples/s renamed")
    refused(harness.parse_zero_mlp, text.replace("test_accuracy 0.", "accuracy 0."), "the epoch line's accuracy renamed")
    refused(harness.parse_zero_mlp, text.replace("784-256-128-10, 4 ranks", "784-256-128-10 on 4 ranks"),
            "the header changed")
    refused(harness.parse_zero_mlp, text.strip().rsplit("\n", 1)[0], "the last line gone")

    for name, job, key, value in (("peer_gpt_deepspeed.txt", "gpt", "tokens_per_s", None),
                                  ("peer_gpt_compile.txt", "gpt", "warmup_s", None),
                                  ("peer_mlp_fsdp2.txt", "mlp", "samples_per_s", None)):
        text = fixture(name)
        r = harness.parse_peer(text, job)
        check(key in r and r["ranks"] in ("1", "4") and "torch" in r, f"{name}: {key} {r.get(key)}, torch {r.get('torch')}")
        refused(lambda t: harness.parse_peer(t, job), text.replace("timed: ", "timing: "), f"{name}'s timed line renamed")
        refused(lambda t: harness.parse_peer(t, job), text.replace("peer: ", "worker: "), f"{name}'s peer line renamed")
        field = "tokens_per_s=" if job == "gpt" else "samples_per_s="
        refused(lambda t: harness.parse_peer(t, job), text.replace(field, "rate="), f"{name}'s {field} renamed")


def check_round_trip():
    text = "\n".join([harness.info_line(system="fsdp2", job="gpt", ranks=4, threads_per_rank=1, torch="2.15.0"),
                      "step 9/9  train_loss 3.7  6000 tokens/s",
                      harness.timed_line(steps=6, seconds=3.5, tokens_per_s=7021.7142857, warmup_steps=3, warmup_s=2.5),
                      "val_loss=2.1234"])
    r = harness.parse_peer(text, "gpt")
    check(r["system"] == "fsdp2" and r["timed_steps"] == 6 and close(r["tokens_per_s"], 7021.71, 1e-5)
          and r["val_loss"] == 2.1234, "the workers' lines read back")


def check_tables():
    with open(os.path.join(FIXTURES, "results.json")) as f:
        recorded = json.load(f)
    doc = harness.summarize(copy.deepcopy(recorded))
    table = harness.make_tables(doc)
    print(table)
    for job, j in doc["jobs"].items():
        sk, qk = harness.speed_key(job), harness.quality_key(job)
        med = {c["name"]: statistics.median(r[sk] for r in c["speed_runs"] if not r.get("error"))
               for c in j["configs"] if any(not r.get("error") for r in c["speed_runs"])}
        peers = {c["name"]: c["kind"] for c in j["configs"] if c["kind"] != "zero" and c["name"] in med}
        best = max(peers, key=lambda n: med[n])
        check(j["best_peer"] == best and f"| {best} (best peer) |" in table, f"{job}: best peer {best}")
        for c in j["configs"]:
            if c["name"] not in med:
                continue
            rss = statistics.median(sum(r["rss_mib"]) for r in c["speed_runs"] if not r.get("error"))
            ratio = med[c["name"]] / med[best]
            section = table.split(f"### {j['title']}")[1].split("### ")[0]
            row = next((ln for ln in section.splitlines() if ln.startswith(f"| {c['name']} ")), "")
            fastest = max(r[sk] for r in c["speed_runs"] if not r.get("error")) / max(
                max(r[sk] for r in p["speed_runs"] if not r.get("error")) for p in j["configs"]
                if p["name"] in peers)
            check(f"| {ratio:.2f}x | {fastest:.2f}x |" in row and f"| {rss:.0f} (" in row,
                  f"{job}: {c['name']}: {ratio:.2f}x the best peer ({fastest:.2f}x fastest against fastest), "
                  f"{rss:.0f} MiB in its row")
            full = [r[qk] for r in c["speed_runs"] + c["seed_runs"] if r.get("full_length") and not r.get("error")]
            if len(full) > 1:
                text = f"{statistics.fmean(full):.4f} ± {statistics.stdev(full):.4f}"
                check(text in row, f"{job}: {c['name']}: {qk} {text} over {len(full)} seeds in its row")
            if c["kind"] == "zero":
                for kind in ("single", "sharded"):
                    of_kind = [n for n, k in peers.items() if k == kind]
                    if of_kind:
                        b = max(of_kind, key=lambda n: med[n])
                        words = f"{med[c['name']] / med[b]:.2f}x the {'tokens/s' if job == 'gpt' else 'samples/s'} " \
                                f"of the best {harness.KIND_NAMES[kind]} ({b})"
                        check(words in section, f"{job}: {c['name']}: '{words}'")
    broken = copy.deepcopy(recorded)
    first = next(iter(broken["jobs"].values()))["configs"][0]
    first["speed_runs"][0]["error"] = "exit codes [1]; rank0.err: boom"
    first["speed_runs"] = first["speed_runs"][:1]
    table = harness.make_tables(harness.summarize(broken))
    check("failed: exit codes [1]" in table, "a failed run is named under its table")


def check_trainers(gpt_train, train_fashion_mnist):
    import peers
    if not os.path.exists("/usr/share/dictd/devil.dict.dz") or not os.path.isdir("/usr/share/datasets/fashion-mnist"):
        print("skipped: short trainer runs (dict-devil or dataset-fashion-mnist not installed)")
        return
    with tempfile.TemporaryDirectory() as out:
        sys.argv = ["peers.py", "--gpt-train", gpt_train, "--train-fashion-mnist", train_fashion_mnist, "--out", out]
        args = peers.parse_args()
        runner = peers.Runner(args, out)
        gpt = next(c for c in peers.GPT_CONFIGS if c["id"] == "zero-4r-s3")
        r = runner.run("gpt", gpt, "speed", 2, 1, "check")
        check(not r.get("error") and r["timed_steps"] == 2 and r["tokens_per_s"] > 0 and len(r["rss_mib"]) == 1,
              "gpt_train read by the harness: " + (r.get("error") or f"{r['tokens_per_s']:.0f} tokens/s"))
        mlp = next(c for c in peers.MLP_CONFIGS if c["id"] == "zero")
        r = runner.run("mlp", mlp, "speed", 1, 1, "check")
        check(not r.get("error") and r["epochs"] == 1 and 0.5 < r["test_accuracy"] <= 1,
              "train_fashion_mnist read by the harness: " + (r.get("error") or f"test_accuracy {r['test_accuracy']}"))


def check_module():
    try:
        import torch
    except ImportError:
        print("skipped: gpt_model.py against torch_gpt.py (no python3-torch)")
        return
    import gpt_model
    import torch_gpt
    vocab, context, width, heads, layers = 11, 16, 32, 4, 2
    model = gpt_model.Gpt(vocab, context, width, heads, layers, "matmul")
    model.init_gpt2(3)
    ok, ours, theirs = gpt_model.check_names(model, vocab, context, width, layers)
    check(ok, "gpt_model.py's parameters are torch_gpt.param_specs' (names, order, shapes)")
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in model.parameters():  # away from the initialisation's zeros and ones
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    params = {gpt_model.torch_gpt_name(n): p for n, p in model.named_parameters()}
    x = torch.randint(0, vocab, (3, context), generator=gen)
    y = torch.randint(0, vocab, (3, context), generator=gen)
    ours = model(x, y)
    _, theirs = torch_gpt.forward(params, x, heads, y)
    check(float((ours - theirs).abs()) < 1e-6, f"gpt_model.py's loss {float(ours):.6f} is torch_gpt.forward's "
                                               f"{float(theirs):.6f}")
    total = model(x, y, reduction="sum")
    check(math.isclose(float(total), float(ours) * x.numel(), rel_tol=1e-5), "reduction='sum' is the mean x positions")
    std = {n: float(p.std()) for n, p in gpt_model.Gpt(vocab, 128, 128, 4, 4).named_parameters()}
    fresh = gpt_model.Gpt(vocab, 128, 128, 4, 4)
    fresh.init_gpt2(1)
    got = {n: p for n, p in fresh.named_parameters()}
    check(abs(float(got["h.0.mlp.c_fc.weight"].std()) - 0.02) < 0.002
          and abs(float(got["h.0.attn.c_proj.weight"].std()) - 0.02 / math.sqrt(8)) < 0.001
          and float(got["h.0.ln_1.weight"].min()) == 1.0 and float(got["h.0.mlp.c_fc.bias"].abs().max()) == 0.0
          and len(std) == len(got), "init_gpt2: GPT-2's rule, as gpt_model.hpp's init_param")


def main():
    check_recorded()
    check_round_trip()
    check_tables()
    if len(sys.argv) == 3:
        check_trainers(sys.argv[1], sys.argv[2])
    else:
        print("skipped: short trainer runs (no trainer paths given)")
    sys.path.insert(0, os.path.join(ROOT, "tests", "gpt"))
    check_module()
    print(f"{len(failures)} failed" if failures else "all passed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
