"""zero beside the peers users run today, on the same CPU jobs, in one run.

    bench/peers/run.sh [--quick] [--rounds R] [--seeds 1,2,3] [--jobs gpt,mlp] [--configs ID,...] ...

(run.sh makes the virtual environment once, then runs this with its Python;
--help lists every option.) Two jobs:

  gpt  the GPT of examples/gpt/ (tests/gpt/torch_gpt.py's model: 4 layers, width 128,
       4 heads, context 128, 0.82M parameters) on The Devil's Dictionary, 32 windows of
       128 characters per step, fp32 AdamW, clipping at 1, gpt_train's schedule, by
       zero's gpt_train (ranks as threads, and as MPI processes), PyTorch eager and
       torch.compile in one process, FSDP2 and DeepSpeed ZeRO-3 in 4 processes
       (gpt_peer.py);
  mlp  the main job, the README's first command (train_fashion_mnist: the MLP
       784-256-128-10 on Fashion-MNIST, 4 ranks, stage 3, bf16, batch 256, 8 epochs),
       beside PyTorch in one process and FSDP2 in 4 (mlp_peer.py, fp32), to the same epochs.

Speed: --rounds rounds, each running every configuration once, in an order that
rotates by one each round (the machine's speed drifts; nothing runs beside them). A GPT
run trains W + N steps and times the last N (N = --gpt-steps; zero's W is N, through
--eval-every, the peers' --gpt-warmup); an MLP run trains --mlp-epochs epochs and
times them (evaluation excluded on both sides). Peak resident memory: each process's
ru_maxrss (wait4), summed over the processes of a run (mpirun itself not counted).
Quality: the GPT's speed runs are too short for it, so then, for each seed of --seeds,
every GPT configuration marked for it trains --gpt-seed-steps steps (the schedule
spanning them) and reports its validation loss over every validation window. An MLP
speed run trains the whole run already: round r trains seed r (--rounds 3: seeds 1-3),
and its test accuracy counts as that seed's.

Threads: every configuration runs on the same cores (all of them: os.cpu_count()), and
each of its ranks computes with max(1, cores / ranks) threads -- the rule zero's
trainers apply to themselves (comm::LocalGroup for rank threads, --comm mpi for
processes), applied to the peers through OMP_NUM_THREADS, MKL_NUM_THREADS and
torch.set_num_threads (one inter-op thread). On 2 cores: one-rank configurations 2
threads; 4-rank ones 4 ranks x 1 thread. Communication threads (gloo's, MPI's) are
not counted. OpenMP's wait policy is each side's default: zero's trainers set
OMP_WAIT_POLICY=passive for themselves, PyTorch runs with the environment's
(unset: libgomp's default, which spins a while before it sleeps), and once more,
eager, under OMP_WAIT_POLICY=passive (eager-passive): the faster of the two is the
best one-process peer.

Prints a line per run, the tables at the end (also written to OUT/table.md) and the
results as JSON (OUT/results.json, and --json PATH) for plots (docs/plots.py).
"""
import argparse
import datetime
import json
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
import harness  # noqa: E402

GPT_BATCH = 32

# Every configuration: id (for --configs), name, kind (harness.KINDS), ranks, and how it
# runs. seeds: whether it trains in the seed runs. default: whether it runs when
# --configs is not given.
GPT_CONFIGS = [
    dict(id="zero-1r-s0", name="zero, 1 rank, stage 0", kind="zero", ranks=1, stage=0, comm="local"),
    dict(id="zero-4r-s3", name="zero, 4 ranks (threads), stage 3", kind="zero", ranks=4, stage=3, comm="local",
         seeds=True),
    dict(id="zero-mpi-1r-s0", name="zero, 1 MPI process, stage 0", kind="zero", ranks=1, stage=0, comm="mpi"),
    dict(id="zero-mpi-4r-s3", name="zero, 4 MPI processes, stage 3", kind="zero", ranks=4, stage=3, comm="mpi"),
    dict(id="eager", name="PyTorch eager", kind="single", ranks=1, system="eager", seeds=True),
    dict(id="compile", name="torch.compile", kind="single", ranks=1, system="compile", seeds=True,
         reports_compile=True),
    dict(id="fsdp2", name="FSDP2, 4 processes", kind="sharded", ranks=4, system="fsdp2", seeds=True),
    dict(id="deepspeed", name="DeepSpeed ZeRO-3, 4 processes", kind="sharded", ranks=4, system="deepspeed",
         seeds=True),
    # PyTorch 1.13 gained from passive waits (bench/gpt_torch.py); 2.x as measured here.
    dict(id="eager-passive", name="PyTorch eager, OMP_WAIT_POLICY=passive", kind="single", ranks=1, system="eager",
         env={"OMP_WAIT_POLICY": "passive"}),
]
MLP_CONFIGS = [
    dict(id="zero", name="zero, 4 ranks (threads), stage 3, bf16 (the README's command)", kind="zero", ranks=4,
         comm="local", seeds=True),
    dict(id="zero-fp32", name="zero, 4 ranks (threads), stage 3, fp32", kind="zero", ranks=4, comm="local",
         precision="fp32"),
    dict(id="zero-mpi", name="zero, 4 MPI processes, stage 3, bf16", kind="zero", ranks=4, comm="mpi"),
    dict(id="torch", name="PyTorch, 1 process", kind="single", ranks=1, system="torch", seeds=True),
    dict(id="fsdp2", name="FSDP2, 4 processes", kind="sharded", ranks=4, system="fsdp2", seeds=True),
]
TITLES = {
    "gpt": "GPT (0.82M parameters, 32 x 128 tokens per step, fp32 AdamW)",
    "mlp": "The main job: Fashion-MNIST MLP 784-256-128-10, batch 256",
}


def threads_for(ranks, cores):
    return max(1, cores // ranks)


def layout(cfg, cores):
    t = threads_for(cfg["ranks"], cores)
    if cfg["kind"] == "zero" and cfg["comm"] == "local" and cfg["ranks"] > 1:
        return f"1 process: {cfg['ranks']} rank threads x {t}"
    n = cfg["ranks"]
    return f"{n} process{'es' if n > 1 else ''} x {t} thread{'s' if t > 1 else ''}"


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def shm_names():
    try:
        return set(os.listdir("/dev/shm"))
    except OSError:
        return set()


def remove_left_shm(before):
    """DeepSpeed's CPU all-reduce leaves its shared buffers in /dev/shm
    (deepspeed_allreduce_buffer_*, 66 MiB per rank and run, never unlinked):
    4 GiB of the machine's memory after two full runs. Those a run made are
    removed once its processes are gone."""
    for name in shm_names() - before:
        if name.startswith("deepspeed_"):
            try:
                os.unlink(os.path.join("/dev/shm", name))
            except OSError:
                pass


class Runner:
    def __init__(self, args, out):
        self.args, self.out = args, out
        self.cores = os.cpu_count() or 1
        self.count = 0
        self.started = time.time()
        self.mpirun = shutil.which("mpirun")

    def elapsed(self):
        s = int(time.time() - self.started)
        return f"{s // 60:3d}:{s % 60:02d}"

    def _wait_all(self, procs, deadline):
        """{pid: (exit code, ru_maxrss KiB)}, killing what is left at the deadline."""
        done = {}
        while len(done) < len(procs):
            for p in procs:
                if p.pid in done:
                    continue
                pid, status, usage = os.wait4(p.pid, os.WNOHANG)
                if pid:
                    p.returncode = os.waitstatus_to_exitcode(status)
                    done[p.pid] = (p.returncode, usage.ru_maxrss)
            if len(done) < len(procs):
                if time.time() > deadline:
                    for p in procs:
                        if p.pid not in done:
                            p.kill()
                    deadline = float("inf")
                time.sleep(0.05)
        return done

    def launch(self, commands, envs, folder):
        """Runs the commands side by side (one per rank); (rank 0's stdout, [exit codes],
        [peak RSS MiB of each process], wall seconds, whether the MPI wrapper wrote the RSS)."""
        os.makedirs(folder, exist_ok=True)
        procs, files = [], []
        shm_before = shm_names()
        start = time.perf_counter()
        for r, (cmd, env) in enumerate(zip(commands, envs)):
            out = open(os.path.join(folder, f"rank{r}.out"), "w")
            err = open(os.path.join(folder, f"rank{r}.err"), "w")
            files += [out, err]
            procs.append(subprocess.Popen(cmd, stdout=out, stderr=err, env=env, cwd=ROOT))
        try:
            done = self._wait_all(procs, time.time() + self.args.timeout)
        except BaseException:  # interrupted (Ctrl-C, SIGTERM): no rank outlives the harness
            for p in procs:
                if p.poll() is None:
                    p.kill()
            raise
        wall = time.perf_counter() - start
        remove_left_shm(shm_before)
        for f in files:
            f.close()
        with open(os.path.join(folder, "rank0.out")) as f:
            text = f.read()
        codes = [done[p.pid][0] for p in procs]
        rss = [done[p.pid][1] / 1024.0 for p in procs]
        return text, codes, rss, wall

    def error_text(self, folder, codes):
        tails = []
        for name in sorted(os.listdir(folder)):
            if name.endswith(".err") or name.endswith(".out"):
                with open(os.path.join(folder, name), errors="replace") as f:
                    lines = [ln for ln in f.read().splitlines() if ln.strip()]
                if lines and (name.endswith(".err") or not tails):
                    tails.append(f"{name}: " + " | ".join(lines[-3:]))
        return f"exit codes {codes}; " + " / ".join(tails[-3:])

    def base_env(self, threads, extra=None):
        env = dict(os.environ)
        env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
        env.update(extra or {})
        return env

    def zero_command(self, job, cfg, steps, timed_from, seed):
        trainer = self.args.gpt_train if job == "gpt" else self.args.train_fashion_mnist
        if job == "gpt":
            cmd = [trainer, "--stage", str(cfg["stage"]), "--micro-batch", str(GPT_BATCH // cfg["ranks"]),
                   "--steps", str(steps), "--eval-every", str(timed_from or steps), "--sample", "0",
                   "--seed", str(seed)]
        else:
            cmd = [trainer, "--epochs", str(steps), "--seed", str(seed)]
            if cfg.get("precision"):
                cmd += ["--precision", cfg["precision"]]
        if cfg["comm"] == "local":
            return cmd + ["--ranks", str(cfg["ranks"])]
        return cmd + ["--comm", "mpi"]

    def run(self, job, cfg, phase, steps, seed, label):
        """One run of one configuration: its parsed figures, peak RSS per process and wall
        time, or {"error": why}."""
        self.count += 1
        folder = os.path.join(self.out, "runs", f"{self.count:03d}-{job}-{cfg['id']}-{phase}-seed{seed}")
        threads = threads_for(cfg["ranks"], self.cores)
        load_before = os.getloadavg()[0]
        timed_from = None
        if job == "gpt" and phase == "speed":
            timed_from = steps if cfg["kind"] == "zero" else self.args.gpt_warmup
        if cfg["kind"] == "zero":
            total = (2 * steps if timed_from else steps)
            cmd = self.zero_command(job, cfg, total, timed_from, seed)
            env = self.base_env(threads)
            if cfg["comm"] == "mpi":
                os.makedirs(folder, exist_ok=True)
                env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
                env.setdefault("OMPI_MCA_btl_vader_single_copy_mechanism", "none")
                cmd = [self.mpirun, "-np", str(cfg["ranks"]), "--oversubscribe", "--bind-to", "none",
                       sys.executable, os.path.join(HERE, "peak_rss.py"), folder, "--"] + cmd
            text, codes, rss, wall = self.launch([cmd], [env], folder)
            if cfg["comm"] == "mpi":
                rss = [int(open(os.path.join(folder, n)).read()) / 1024.0
                       for n in sorted(os.listdir(folder)) if n.startswith("rss.")]
        else:
            worker = os.path.join(HERE, "gpt_peer.py" if job == "gpt" else "mlp_peer.py")
            if job == "gpt":
                if phase == "speed":
                    args = ["--steps", str(self.args.gpt_warmup + steps), "--warmup-steps", str(self.args.gpt_warmup)]
                else:
                    args = ["--steps", str(steps), "--warmup-steps", "1", "--validate"]
                args += ["--attention", self.args.attention]
                if self.args.profile and phase == "speed":
                    os.makedirs(folder, exist_ok=True)
                    args += ["--profile", os.path.join(folder, "profile-rank0.txt")]
            else:
                args = ["--epochs", str(steps)]
            port = str(free_port())
            commands, envs = [], []
            for r in range(cfg["ranks"]):
                extra = dict(cfg.get("env", {}), RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(cfg["ranks"]),
                             LOCAL_SIZE=str(cfg["ranks"]), LOCAL_WORLD_SIZE=str(cfg["ranks"]),
                             MASTER_ADDR="127.0.0.1", MASTER_PORT=port, DS_ACCELERATOR="cpu",
                             TORCHINDUCTOR_CACHE_DIR=os.path.join(self.out, "inductor-cache"))
                commands.append([sys.executable, worker, "--system", cfg["system"], "--threads", str(threads),
                                 "--seed", str(seed)] + args)
                envs.append(self.base_env(threads, extra))
            text, codes, rss, wall = self.launch(commands, envs, folder)
        result = {"phase": phase, "seed": seed, "wall_s": wall, "rss_mib": rss, "load_before": load_before,
                  "load_after": os.getloadavg()[0], "log": os.path.relpath(folder, self.out)}
        try:
            if any(codes):
                raise RuntimeError(self.error_text(folder, codes))
            if cfg["kind"] == "zero":
                parsed = harness.parse_zero_gpt(text, timed_from or 0) if job == "gpt" else harness.parse_zero_mlp(text)
            else:
                parsed = harness.parse_peer(text, job)
            result.update(parsed)
        except (RuntimeError, harness.OutputFormatError) as e:
            result["error"] = str(e)
        self.report(job, cfg, label, result)
        return result

    def report(self, job, cfg, label, r):
        if r.get("error"):
            print(f"[{self.elapsed()}] {job} {label}  {cfg['name']}: FAILED: {r['error'][:600]}", flush=True)
            return
        speed = harness.speed_key(job)
        quality = harness.quality_key(job)
        rss = r["rss_mib"]
        mem = f"{rss[0]:.0f} MiB" if len(rss) == 1 else f"{len(rss)} x {max(rss):.0f} = {sum(rss):.0f} MiB"
        extra = f", warm-up/compile {r['warmup_s']:.1f} s" if cfg.get("reports_compile") and "warmup_s" in r else ""
        q = r.get(quality) if r.get("full_length", r["phase"] == "seed" or job == "mlp") else None
        qtext = f", {quality} {q:.4f}" if q is not None and q == q else ""
        print(f"[{self.elapsed()}] {job} {label}  {cfg['name']}: {r[speed]:.0f} {speed.replace('_per_s', '/s')}{qtext}, "
              f"peak RSS {mem}, {r['wall_s']:.1f} s{extra}, load {r['load_before']:.1f}", flush=True)


def versions():
    out = {"python": platform.python_version()}
    try:
        from importlib import metadata
        for name in ("torch", "deepspeed", "numpy"):
            try:
                out[name] = metadata.version(name)
            except metadata.PackageNotFoundError:
                out[name] = None
    except ImportError:
        pass
    try:
        out["zero_commit"] = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True,
                                            text=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", ROOT, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True).stdout.strip()
        out["zero_tree"] = "modified" if dirty else "clean"
    except OSError:
        pass
    for tool, flag in (("mpirun", "--version"), ("g++", "--version")):
        try:
            out[tool] = subprocess.run([tool, flag], capture_output=True, text=True).stdout.splitlines()[0]
        except (OSError, IndexError):
            out[tool] = None
    return out


def machine():
    cpu = "unknown CPU"
    try:
        for line in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines():
            if line.startswith("Model name:"):
                cpu = line.split(":", 1)[1].strip()
    except OSError:
        pass
    with open("/proc/meminfo") as f:
        mem = int(f.readline().split()[1]) // 1024
    return {"cpu": cpu, "cores": os.cpu_count(), "memory_mib": mem, "kernel": platform.release(),
            "load_at_start": os.getloadavg()}


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true",
                    help="a smoke run of a few minutes, its figures too noisy to quote: --rounds 1 --gpt-steps 6 "
                         "--gpt-seed-steps 30 --mlp-epochs 1 --seeds 1 (options given as well win)")
    ap.add_argument("--rounds", type=int, help="speed rounds (default 3)")
    ap.add_argument("--seeds", help="seeds of the GPT's quality runs (default 1,2,3; '' for none)")
    ap.add_argument("--jobs", default="gpt,mlp")
    ap.add_argument("--configs", default=None,
                    help="ids to run, e.g. zero-4r-s3,fsdp2 (both jobs' ids; default: every default one). GPT: "
                         + ", ".join(c["id"] for c in GPT_CONFIGS) + ". MLP: " + ", ".join(c["id"] for c in MLP_CONFIGS))
    ap.add_argument("--gpt-steps", type=int, help="timed GPT steps per speed run (default 16)")
    ap.add_argument("--gpt-warmup", type=int, default=3,
                    help="the peers' untimed GPT steps before them (default 3; zero's: --gpt-steps)")
    ap.add_argument("--gpt-seed-steps", type=int,
                    help="GPT steps of a seed run, the schedule spanning them (default 150; gpt_train's own: 400)")
    ap.add_argument("--mlp-epochs", type=int, help="MLP epochs, speed and seed runs (default 8)")
    ap.add_argument("--attention", choices=["sdpa", "matmul"], default="sdpa",
                    help="the peers' attention: F.scaled_dot_product_attention (default) or torch_gpt.py's matmuls")
    ap.add_argument("--gpt-train", default=os.path.join(ROOT, "build", "examples", "gpt_train"))
    ap.add_argument("--train-fashion-mnist", default=os.path.join(ROOT, "build", "examples", "train_fashion_mnist"))
    ap.add_argument("--out", default=None, help="folder for logs and results (default bench/peers/out/DATE-TIME)")
    ap.add_argument("--json", default=None, help="also write the results JSON here")
    ap.add_argument("--profile", action="store_true",
                    help="the GPT peers' rank 0 profiles its timed steps (torch.profiler) into its run's folder, "
                         "runs/*/profile-rank0.txt (their tokens/s then include the profiler's cost)")
    ap.add_argument("--timeout", type=float, default=1200, help="seconds before a run is killed (default 1200)")
    args = ap.parse_args()
    defaults = {"rounds": 3, "gpt_steps": 16, "gpt_seed_steps": 150, "mlp_epochs": 8, "seeds": "1,2,3"}
    quick = {"rounds": 1, "gpt_steps": 6, "gpt_seed_steps": 30, "mlp_epochs": 1, "seeds": "1"}
    for key, value in (quick if args.quick else defaults).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


def main():
    signal.signal(signal.SIGTERM, lambda *_: sys.exit("bench/peers: terminated"))
    args = parse_args()
    jobs = [j for j in args.jobs.split(",") if j]
    chosen = set(args.configs.split(",")) if args.configs else None
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    tables = {"gpt": GPT_CONFIGS, "mlp": MLP_CONFIGS}
    for job in jobs:
        if job not in tables:
            sys.exit(f"--jobs: no job '{job}' (gpt, mlp)")
    if chosen:
        unknown = chosen - {c["id"] for j in jobs for c in tables[j]}
        if unknown:
            sys.exit(f"--configs: no configuration {', '.join(sorted(unknown))} in the jobs {', '.join(jobs)}")
    needs_mpi = False
    for job in jobs:
        for c in tables[job]:
            if (chosen is None and c.get("default", True)) or (chosen and c["id"] in chosen):
                needs_mpi |= c.get("comm") == "mpi"
    for path in ([args.gpt_train] if "gpt" in jobs else []) + ([args.train_fashion_mnist] if "mlp" in jobs else []):
        if not os.access(path, os.X_OK):
            sys.exit(f"{path} is not built: ninja -C build examples/gpt_train "
                     "examples/train_fashion_mnist (or meson compile -C build gpt_train train_fashion_mnist)")
    if needs_mpi and not shutil.which("mpirun"):
        sys.exit("mpirun is missing (apt-get install openmpi-bin), or leave out the MPI configurations with --configs")
    stamp = datetime.datetime.now().strftime("%Y-%m-%d-%H%M%S")
    out = os.path.abspath(args.out or os.path.join(HERE, "out", stamp))
    os.makedirs(out, exist_ok=True)
    # The trainers run from copies, so that a rebuild during the run changes nothing.
    os.makedirs(os.path.join(out, "bin"), exist_ok=True)
    for attr in ("gpt_train", "train_fashion_mnist"):
        copy = os.path.join(out, "bin", os.path.basename(getattr(args, attr)))
        if os.access(getattr(args, attr), os.X_OK):
            shutil.copy2(getattr(args, attr), copy)
            setattr(args, attr, copy)
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(HERE, ".venv", "torch_extensions"))
    runner = Runner(args, out)
    cores = runner.cores
    doc = {"date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"), "machine": machine(),
           "versions": versions(), "command": " ".join(["bench/peers/run.sh"] + sys.argv[1:]),
           "settings": {k: getattr(args, k) for k in ("rounds", "gpt_steps", "gpt_warmup", "gpt_seed_steps",
                                                      "mlp_epochs", "attention", "quick")},
           "seeds": seeds,
           "threads_rule": f"each rank computes with max(1, {cores} cores / ranks) threads on the same {cores} cores",
           "jobs": {}}
    for job in jobs:
        configs = []
        for c in tables[job]:
            if (chosen is None and c.get("default", True)) or (chosen and c["id"] in chosen):
                entry = {k: v for k, v in c.items() if k not in ("default",)}
                entry.update(processes=c["ranks"] if c["kind"] != "zero" or c["comm"] == "mpi" else 1,
                             threads_per_process=threads_for(c["ranks"], cores), layout=layout(c, cores),
                             speed_runs=[], seed_runs=[])
                configs.append(entry)
        doc["jobs"][job] = {"title": TITLES[job], "configs": configs}
    # What a peer's process holds before it computes anything: the libraries' pages.
    doc["baseline_rss_mib"] = {}
    for what, code in (("import torch", "import torch"),
                       ("import torch, deepspeed", "import torch, deepspeed, deepspeed.ops.adam")):
        _, codes, rss, _ = runner.launch([[sys.executable, "-c", code]],
                                         [dict(os.environ, DS_ACCELERATOR="cpu")],
                                         os.path.join(out, "runs", "baseline-" + what.replace(", ", "-").replace(" ", "-")))
        if codes == [0]:
            doc["baseline_rss_mib"][what] = rss[0]
    print(f"bench/peers: {doc['machine']['cpu']}, {cores} cores; torch {doc['versions'].get('torch')}, "
          f"deepspeed {doc['versions'].get('deepspeed')}; {doc['threads_rule']}; logs in {out}", flush=True)

    for job in jobs:
        configs = doc["jobs"][job]["configs"]
        steps = args.gpt_steps if job == "gpt" else args.mlp_epochs
        for r in range(args.rounds):
            order = configs[r % len(configs):] + configs[:r % len(configs)]
            # An MLP speed run trains the whole run: round r trains seed r + 1, and its test
            # accuracy counts as that seed's (the MLP has no seed runs of its own).
            seed = 1 if job == "gpt" else r + 1
            for c in order:
                run = runner.run(job, c, "speed", steps, seed, f"speed round {r + 1}/{args.rounds}")
                run["full_length"] = job == "mlp"
                c["speed_runs"].append(run)
        if job == "mlp":
            continue
        for i, seed in enumerate(seeds):
            marked = [c for c in configs if c.get("seeds")]
            order = marked[i % len(marked):] + marked[:i % len(marked)] if marked else []
            for c in order:
                run = runner.run(job, c, "seed", args.gpt_seed_steps, seed, f"seed {seed}")
                run["full_length"] = True
                c["seed_runs"].append(run)
    doc["machine"]["load_at_end"] = os.getloadavg()
    doc["wall_s"] = time.time() - runner.started
    harness.summarize(doc)
    table = harness.make_tables(doc)
    text = json.dumps(doc, indent=1)
    for path in [os.path.join(out, "results.json")] + ([args.json] if args.json else []):
        with open(path, "w") as f:
            f.write(text + "\n")
    with open(os.path.join(out, "table.md"), "w") as f:
        f.write(table + "\n")
    print()
    print(table)
    print(f"{doc['threads_rule']}. Whole run {doc['wall_s'] / 60:.1f} min; load average "
          f"{doc['machine']['load_at_start'][0]:.1f} at the start, {doc['machine']['load_at_end'][0]:.1f} at the end. "
          f"Results: {os.path.join(out, 'results.json')}" + (f" and {args.json}" if args.json else ""))
    failed = sum(len(c["failures"]) for j in doc["jobs"].values() for c in j["configs"])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
