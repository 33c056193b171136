#!/usr/bin/env python3
"""Runs the built zero_plan as a user would: its --json output must follow the
documented schema (the docs' plotting script reads it), add up, and agree
with the ZeRO paper's formulas computed here; --help, bad input (exit 2,
naming the option) and the --device-memory verdict are checked too.
The byte-exact agreement with real optimizers is tests/engine/test_engine_plan.cpp.

usage: check_plan.py ZERO_PLAN
"""
import json
import subprocess
import sys

PLAN = sys.argv[1]
failures = []


def check(ok, what):
    if not ok:
        failures.append(what)
        print("FAIL:", what)


def run(*args):
    return subprocess.run([PLAN, *args], capture_output=True, text=True, timeout=60)


def plan_json(*args):
    r = run("--json", *args)
    if r.returncode != 0:
        raise SystemExit(f"zero_plan --json {' '.join(args)} exited {r.returncode}: {r.stderr}")
    return json.loads(r.stdout)


def check_schema(doc, what):
    check(set(doc) == {"config", "lines", "total", "paper", "comm"}, f"{what}: top-level keys {sorted(doc)}")
    for key in ("params", "ranks", "stage", "offload", "precision", "optimizer"):
        check(key in doc["config"], f"{what}: config lacks {key}")
    for line in doc["lines"]:
        check(set(line) == {"name", "device", "host", "disk"}, f"{what}: line keys {sorted(line)}")
        check(all(isinstance(line[k], int) and line[k] >= 0 for k in ("device", "host", "disk")),
              f"{what}: line {line['name']} has a non-integer or negative byte count")
    check(set(doc["total"]) == {"device", "host", "disk"}, f"{what}: total keys")
    check(set(doc["paper"]) == {"model_state_bytes"}, f"{what}: paper keys")
    check(set(doc["comm"]) == {"elements_per_step", "bytes_sent_per_step", "bytes_received_per_step",
                               "all_to_all_bytes_per_step", "across_nodes_bytes_per_step_all_ranks",
                               "across_nodes_bytes_per_step_busiest_rank"},
          f"{what}: comm keys")
    # Across nodes (comm/topology.hpp): a ring over every rank crosses at each
    # node's last rank, which sends all it sends; nothing on one node.
    check(isinstance(doc["config"]["hpz"], bool), f"{what}: config hpz")
    nodes = doc["config"]["nodes"]
    comm = doc["comm"]
    if not doc["config"]["hpz"]:  # (hpZ's gathers inside the node cross nothing)
        check(comm["across_nodes_bytes_per_step_busiest_rank"] == (comm["bytes_sent_per_step"] if nodes > 1 else 0),
              f"{what}: the busiest rank's bytes across nodes")
    check(comm["across_nodes_bytes_per_step_all_ranks"] == nodes * comm["across_nodes_bytes_per_step_busiest_rank"],
          f"{what}: all ranks' bytes across nodes")
    # Every line but padding (a share of the model-state lines) adds to the total.
    for tier in ("device", "host", "disk"):
        summed = sum(l[tier] for l in doc["lines"] if l["name"] != "padding")
        check(summed == doc["total"][tier], f"{what}: {tier} lines add to {summed}, total says {doc['total'][tier]}")


def paper_bytes(stage, phi, n, p, g, k):
    return [(p + g + k) * phi, (p + g) * phi + k * phi // n, p * phi + (g + k) * phi // n,
            (p + g + k) * phi // n][stage]


# Units that split into aligned shards without padding: the plan's model
# states are the paper's formula exactly; traffic 2Φ or 3Φ (N-1)/N elements.
phi = 8 * 8 * 64 * 1000
for stage in range(4):
    for precision, p, k in (("bf16", 2, 12), ("fp32", 4, 8)):
        for n in (1, 2, 8):
            what = f"stage {stage}, {precision}, N {n}"
            doc = plan_json("--params", str(phi), "--units", "8", "--stage", str(stage), "--precision", precision,
                            "--ranks-per-node", str(n))
            check_schema(doc, what)
            c = doc["config"]
            check((c["params"], c["ranks"], c["stage"], c["precision"], c["optimizer"], c["offload"]) ==
                  (phi, n, stage, precision, "adamw", "none"), f"{what}: config {c}")
            expected = paper_bytes(stage, phi, n, p, p, k)
            check(doc["paper"]["model_state_bytes"] == expected, f"{what}: paper {doc['paper']} != {expected}")
            states = sum(l["device"] for l in doc["lines"]
                         if l["name"] in ("params", "grads", "master", "optimizer_states"))
            check(states == expected, f"{what}: model states {states} != paper {expected}")
            elements = (3 if stage == 3 else 2) * phi * (n - 1) // n
            check(doc["comm"]["elements_per_step"] == elements, f"{what}: elements {doc['comm']}")
            check(doc["comm"]["bytes_sent_per_step"] == p * elements, f"{what}: bytes sent {doc['comm']}")
            check(doc["comm"]["bytes_received_per_step"] == p * elements, f"{what}: bytes received")

# SGD keeps K = 4 bytes (the momentum buffer) at fp32, none made with
# momentum 0 (optim::PlainSgd), as torch.optim.SGD keeps no buffer then.
for momentum, k in (("0.9", 4), ("0", 0)):
    doc = plan_json("--params", str(phi), "--units", "8", "--stage", "1", "--precision", "fp32",
                    "--ranks-per-node", "2", "--optimizer", "sgd", "--momentum", momentum)
    expected = paper_bytes(1, phi, 2, 4, 4, k)
    states = sum(l["device"] for l in doc["lines"] if l["name"] in ("params", "grads", "master", "optimizer_states"))
    check(states == expected, f"sgd, momentum {momentum}: model states {states} != paper {expected}")
    check(sum(l["device"] for l in doc["lines"] if l["name"] == "optimizer_states") == k * phi // 2,
          f"sgd, momentum {momentum}: optimizer states")

# Nodes and hpZ (docs/zeropp.md): 2 nodes of 4, stage 3, bf16. Plain: every
# gather and the reduce-scatter over all 8 ranks; hpZ: the first gather of a
# step over all ranks, the others over the node's 4, and a secondary copy of
# Φ/4 parameters. Across nodes each node's last rank sends its ring traffic.
for micro in (1, 3):
    base = ("--params", str(phi), "--units", "8", "--stage", "3", "--precision", "bf16", "--ranks-per-node", "4",
            "--nodes", "2", "--grad-accumulation", str(micro))
    plain, hpz = plan_json(*base), plan_json(*base, "--hpz")
    what = f"hpz, accumulation {micro}"
    check_schema(hpz, what)
    check(hpz["config"]["hpz"] is True and plain["config"]["hpz"] is False, f"{what}: config hpz")
    ring8, ring4 = phi * 7 // 8, phi * 3 // 4
    check(plain["comm"]["elements_per_step"] == 3 * micro * ring8, f"{what}: plain elements {plain['comm']}")
    check(hpz["comm"]["elements_per_step"] == (1 + micro) * ring8 + (2 * micro - 1) * ring4,
          f"{what}: hpz elements {hpz['comm']}")
    check(hpz["comm"]["across_nodes_bytes_per_step_busiest_rank"] == 2 * (1 + micro) * ring8,
          f"{what}: hpz across {hpz['comm']}")
    check(plain["comm"]["across_nodes_bytes_per_step_busiest_rank"] == 2 * 3 * micro * ring8,
          f"{what}: plain across {plain['comm']}")
    params = {d: sum(l["device"] for l in doc["lines"] if l["name"] == "params") for d, doc in (("plain", plain),
                                                                                            ("hpz", hpz))}
    check(params["hpz"] - params["plain"] == 2 * phi // 4, f"{what}: the secondary copy {params}")
# qwZ: every gather over all ranks sends (N-1) int8 payloads of a shard
# (codes, then one fp32 scale per 256 elements): units of Φ/8, shards of Φ/64.
shard = phi // 8 // 8
payload = (shard + 3) // 4 * 4 + 4 * ((shard + 255) // 256)
base = ("--params", str(phi), "--units", "8", "--stage", "3", "--precision", "bf16", "--ranks-per-node", "4",
        "--nodes", "2")
qwz = plan_json(*base, "--qwz")
check(qwz["comm"]["bytes_sent_per_step"] == 2 * 8 * 7 * payload + 2 * 8 * 7 * shard,
      f"qwz: bytes sent {qwz['comm']} (gathers of payloads, the bf16 reduce-scatter)")
both = plan_json(*base, "--qwz", "--hpz")
check(both["comm"]["across_nodes_bytes_per_step_busiest_rank"] == 8 * 7 * payload + 8 * 7 * 2 * shard,
      f"qwz and hpz: across {both['comm']}")
check(sum(l["device"] for l in qwz["lines"] if l["name"] == "qwz_staging") == 8 * payload, "qwz: the payload staging")
# qgZ: per unit, an all-to-all inside the node of (k-1) blocks of M payloads
# and one across nodes of (M-1) payloads (k = 4 ranks per node, M = 2
# nodes), int4 codes two to a byte and one fp32 scale per 256 elements.
q4 = ((shard + 1) // 2 + 3) // 4 * 4 + 4 * ((shard + 255) // 256)
qgz = plan_json(*base, "--qgz")
check(qgz["comm"]["all_to_all_bytes_per_step"] == 8 * (3 * 2 + 1) * q4, f"qgz: all-to-all bytes {qgz['comm']}")
check(qgz["comm"]["bytes_sent_per_step"] == 2 * 8 * 7 * 2 * shard + 8 * 7 * q4,
      f"qgz: bytes sent {qgz['comm']} (the bf16 gathers, the all-to-alls)")
every = plan_json(*base, "--qwz", "--hpz", "--qgz")
check(every["comm"]["across_nodes_bytes_per_step_busiest_rank"] == 8 * 7 * payload + 8 * q4,
      f"hpz, qwz and qgz: across, busiest rank {every['comm']}")
check(every["comm"]["across_nodes_bytes_per_step_all_ranks"] == 2 * 8 * 7 * payload + 8 * 8 * q4,
      f"hpz, qwz and qgz: across, all ranks {every['comm']}")
plain3 = plan_json(*base)
check(4 * every["comm"]["across_nodes_bytes_per_step_all_ranks"] <= plain3["comm"]["across_nodes_bytes_per_step_all_ranks"],
      f"hpz, qwz and qgz: at most a quarter of plain stage 3 across nodes ({every['comm']}, {plain3['comm']})")
check(sum(l["device"] for l in qgz["lines"] if l["name"] == "qgz_payloads") == 2 * 8 * q4, "qgz: the payloads")
r = run("--params", "1M", "--stage", "2", "--hpz")
check(r.returncode != 0 and "hpz" in r.stderr and "use stage 3" in r.stderr, f"--hpz at stage 2: {r.stderr}")
r = run("--params", "1M", "--stage", "0", "--qgz")
check(r.returncode != 0 and "qgz" in r.stderr and "stage 0 all-reduces" in r.stderr, f"--qgz at stage 0: {r.stderr}")

# Parameter counts: suffixes, and GPT-2 small's published 124,439,808.
check(plan_json("--params", "7B", "--units", "32")["config"]["params"] == 7_000_000_000, "--params 7B")
check(plan_json("--params", "1.5M")["config"]["params"] == 1_500_000, "--params 1.5M")
gpt2 = plan_json("--layers", "12", "--width", "768", "--vocab", "50257", "--context", "1024", "--heads", "12")
check(gpt2["config"]["params"] == 124_439_808, f"GPT-2 small: {gpt2['config']['params']}")
check(plan_json("--unit-sizes", "37+1,129+6,5+3,1")["config"]["params"] == 182, "--unit-sizes")

# Offload: host and disk tiers used, device relieved.
none = plan_json("--params", "7B", "--units", "32", "--stage", "2", "--ranks-per-node", "8")
cpu = plan_json("--params", "7B", "--units", "32", "--stage", "2", "--ranks-per-node", "8", "--offload", "cpu")
nvme = plan_json("--params", "7B", "--units", "32", "--stage", "2", "--ranks-per-node", "8", "--offload", "nvme")
check_schema(cpu, "offload cpu")
check_schema(nvme, "offload nvme")
check(cpu["total"]["device"] < none["total"]["device"] and cpu["total"]["host"] > 0, "offload cpu tiers")


def line(doc, name):
    return next(l for l in doc["lines"] if l["name"] == name)


disk = 12 * 7_000_000_000 // 8  # fp32 master, m and v of Φ/N, plus a little padding
states_on_disk = line(nvme, "master")["disk"] + line(nvme, "optimizer_states")["disk"]
check(disk <= states_on_disk < disk * 1.001, f"offload nvme: master + states on disk {states_on_disk}, about {disk}")
# The swap file holds whole records (a chunk of each array); a chunk fills a
# third of the window at most, so the rounding is below a third of it.
window = 64 << 20
check(nvme["config"]["nvme_window_bytes"] == window, f"offload nvme: window {nvme['config']}")
check(0 <= line(nvme, "swap_padding")["disk"] < window // 3, f"offload nvme: swap padding {line(nvme, 'swap_padding')}")
check(nvme["total"]["disk"] == states_on_disk + line(nvme, "swap_padding")["disk"], "offload nvme: disk total")
check(window - 3 * 12 * 1024 < line(nvme, "nvme_window")["host"] <= window, f"offload nvme: {line(nvme, 'nvme_window')}")
check(nvme["total"]["host"] < cpu["total"]["host"], "offload nvme needs less host memory than cpu")
# --nvme-window-mib, the trainers' option, sizes the window.
small = plan_json("--params", "7B", "--units", "32", "--stage", "2", "--ranks-per-node", "8", "--offload", "nvme",
                  "--nvme-window-mib", "1")
check(small["config"]["nvme_window_bytes"] == 1 << 20 and line(small, "nvme_window")["host"] <= 1 << 20,
      f"--nvme-window-mib 1: {small['config']}, {line(small, 'nvme_window')}")
# The host backend: every buffer in host memory, and no offload cpu.
host = plan_json("--params", "7B", "--units", "32", "--stage", "2", "--ranks-per-node", "8", "--backend", "host")
check(host["total"]["device"] == 0 and host["total"]["host"] > 0 and host["config"]["backend"] == "host",
      f"--backend host: {host['total']}")

# --help lists the options with their defaults.
h = run("--help")
check(h.returncode == 0, "--help exits 0")
for text in ("--params", "--unit-sizes", "--offload", "--bucket-bytes", "32M", "bf16", "adamw", "--device-memory",
             "--nvme-window-mib", "--backend"):
    check(text in h.stdout, f"--help mentions {text}")

# Bad input: exit 2 and a message that names the option.
for args, option in ((["--params", "7X"], "--params"), (["--params", "7B", "--stage", "5"], "--stage"),
                     (["--params", "7B", "--stage", "0", "--offload", "cpu"], "--offload"),
                     (["--params", "7B", "--stage", "1", "--offload", "cpu", "--backend", "host"], "--offload cpu"),
                     (["--params", "7B", "--stage", "1", "--offload", "nvme", "--nvme-window-mib", "0.01"],
                      "--nvme-window-mib"),
                     (["--params", "7B", "--stage", "1", "--delayed-update"], "--delayed-update"),
                     (["--params", "7B", "--precision", "fp8"], "--precision"),
                     (["--params", "7B", "--device-memory", "lots"], "--device-memory"),
                     (["--layers", "2", "--width", "30", "--vocab", "5", "--context", "4", "--heads", "4"], "--heads"),
                     (["--stage", "2"], "--params")):
    r = run(*args)
    check(r.returncode == 2, f"{args}: exit {r.returncode}, wanted 2")
    check(option in r.stderr, f"{args}: stderr does not name {option}: {r.stderr!r}")

# Verdicts: 7B with AdamW in bf16 is 16 bytes a parameter, 104 GiB at stage 0.
r = run("--params", "7B", "--units", "32", "--stage", "0", "--ranks-per-node", "8", "--device-memory", "80G")
verdict = [l for l in r.stdout.splitlines() if l.startswith("verdict:")]
check(len(verdict) == 1 and "does not fit" in verdict[0] and "--stage 1" in verdict[0], f"verdict: {verdict}")
r = run("--params", "7B", "--units", "32", "--stage", "3", "--ranks-per-node", "8", "--device-memory", "80G")
check("verdict: fits" in r.stdout, f"stage 3 verdict: {r.stdout[-300:]}")
r = run("--json", "--params", "7B", "--units", "32", "--stage", "0", "--device-memory", "80G")
json.loads(r.stdout)  # the verdict goes to stderr with --json
check("verdict: does not fit" in r.stderr and "--offload cpu" in r.stderr, f"json verdict: {r.stderr}")

if failures:
    print(f"{len(failures)} check(s) failed")
    sys.exit(1)
print("zero_plan: schema, formulas, parsing, errors and verdicts as documented")
