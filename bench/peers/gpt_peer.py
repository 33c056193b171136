"""One rank of a peer training the GPT of examples/gpt/ (bench/peers/gpt_model.py)
the way gpt_train does: the same model and initialisation rule, global batch
(32 windows of 128 characters), AdamW (torch's defaults: betas 0.9/0.999,
eps 1e-8, weight decay 0.01), clipping at 1, learning-rate schedule (linear
warm-up over 30 steps to 6e-3, cosine decay to 6e-4 at the last step), each
rank drawing its own windows from the first 90% of The Devil's Dictionary,
and at the end the validation loss over every window of the last 10% (the
windows dealt round-robin to the ranks, as gpt_train does). Systems:

  eager      PyTorch in one process
  compile    the same model under torch.compile (inductor); the warm-up steps,
             where it compiles, are reported apart (warmup_s) and the
             validation runs the uncompiled module (no recompilation)
  fsdp2      torch.distributed.fsdp.fully_shard on every block and on the root,
             one process per rank over gloo
  deepspeed  DeepSpeed ZeRO-3 on its CPU accelerator (DS_ACCELERATOR=cpu), gloo,
             DeepSpeedCPUAdam (adamw_mode), gradient_clipping 1

peers.py starts it (RANK, WORLD_SIZE, ... in the environment); rank 0 prints
the `peer:` and `timed:` lines harness.py reads, progress lines, and last
`val_loss=<value>`.
"""
import argparse
import gzip
import logging
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from worker_common import (Clock, all_sum, barrier, harness, inductor_links_its_own_torch, init_gloo,  # noqa: E402
                           rank_and_world, say, set_threads)

CORPUS = "/usr/share/dictd/devil.dict.dz"


def learning_rate(step, steps, lr=6e-3, warmup=30, min_lr=6e-4):
    """gpt_trainer.hpp's learning_rate()."""
    if step < warmup:
        return lr * (step + 1) / warmup
    span = max(1, steps - 1 - warmup)
    t = min(1.0, (step - warmup) / span)
    return min_lr + 0.5 * (lr - min_lr) * (1.0 + math.cos(math.pi * t))


def load_corpus(torch, path):
    text = gzip.open(path).read()
    alphabet = sorted(set(text))
    table = bytes(range(256)).maketrans(bytes(alphabet), bytes(range(len(alphabet))))
    ids = torch.frombuffer(bytearray(text.translate(table)), dtype=torch.uint8).long()
    train_size = int(len(text) * 0.9)
    return ids, train_size, len(alphabet)



def torch_step(torch, model, runner, opt):
    """One optimizer step of a torch.optim optimizer (PyTorch eager, compiled
    or FSDP2): the learning rate, backward through `runner` (the model or its
    compiled form), clipping at 1.0 as zero's trainer does, the update.
    `torch` is the module, which main() imports."""
    def train_step(x, y, lr):
        for g in opt.param_groups:
            g["lr"] = lr
        opt.zero_grad(set_to_none=True)
        loss = runner(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        return loss.detach()
    return train_step


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--system", required=True, choices=["eager", "compile", "fsdp2", "deepspeed"])
    ap.add_argument("--steps", type=int, required=True, help="optimizer steps (the schedule spans them)")
    ap.add_argument("--warmup-steps", type=int, default=3, help="untimed steps before the timed ones")
    ap.add_argument("--validate", action="store_true", help="the validation loss at the end (else val_loss=nan)")
    ap.add_argument("--threads", type=int, required=True, help="compute threads of this process")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--batch", type=int, default=32, help="global batch, windows")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--width", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--attention", choices=["matmul", "sdpa"], default="matmul")
    ap.add_argument("--progress-every", type=int, default=25)
    ap.add_argument("--data", default=CORPUS)
    ap.add_argument("--profile", metavar="FILE",
                    help="rank 0 profiles the timed steps (torch.profiler, CPU) and writes its operators by self "
                         "time to FILE (the tokens/s then include the profiler's cost)")
    args = ap.parse_args()
    if args.warmup_steps >= args.steps:
        ap.error("--warmup-steps must be below --steps")

    rank, world = rank_and_world()
    import torch
    threads = set_threads(args.threads)
    if args.batch % world:
        ap.error(f"--batch {args.batch} is not a multiple of the {world} ranks")
    local = args.batch // world
    T = args.context
    ids, train_size, vocab = load_corpus(torch, args.data)

    import gpt_model
    model = gpt_model.Gpt(vocab, T, args.width, args.heads, args.layers, args.attention)
    model.init_gpt2(args.seed)
    parameters = sum(p.numel() for p in model.parameters())
    versions = {"torch": torch.__version__.split("+")[0]}
    dist = None
    if args.system in ("eager", "compile"):
        if world != 1:
            ap.error(f"--system {args.system} runs in one process")
        opt = torch.optim.AdamW(model.parameters(), lr=learning_rate(0, args.steps), weight_decay=0.01)
        eval_module = model
        runner = model
        if args.system == "compile":
            versions["inductor_isa"] = inductor_links_its_own_torch()
            runner = torch.compile(model)
        train_step = torch_step(torch, model, runner, opt)
    elif args.system == "fsdp2":
        from torch.distributed.fsdp import fully_shard
        dist = init_gloo(world)
        for block in model.h:
            fully_shard(block)
        fully_shard(model)
        opt = torch.optim.AdamW(model.parameters(), lr=learning_rate(0, args.steps), weight_decay=0.01)
        eval_module = model
        train_step = torch_step(torch, model, model, opt)
    else:
        import deepspeed
        from deepspeed.ops.adam import DeepSpeedCPUAdam
        deepspeed.utils.logger.setLevel(logging.WARNING)
        versions["deepspeed"] = deepspeed.__version__
        deepspeed.init_distributed(dist_backend="gloo")
        import torch.distributed as dist
        ds_opt = DeepSpeedCPUAdam(model.parameters(), lr=learning_rate(0, args.steps), betas=(0.9, 0.999), eps=1e-8,
                                  weight_decay=0.01, adamw_mode=True)
        config = {"train_batch_size": args.batch, "train_micro_batch_size_per_gpu": local,
                  "gradient_accumulation_steps": 1, "gradient_clipping": 1.0, "zero_optimization": {"stage": 3},
                  "steps_per_print": 1 << 30}
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=ds_opt, config=config)
        eval_module = engine

        def train_step(x, y, lr):
            for g in engine.optimizer.param_groups:
                g["lr"] = lr
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            return loss.detach()

    say(rank, harness.info_line(system=args.system, job="gpt", ranks=world, threads_per_rank=threads,
                                attention=args.attention, parameters=parameters, tokens_per_step=args.batch * T,
                                seed=args.seed, **versions))
    profiler = None
    if args.profile and rank == 0:
        profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
    gen = torch.Generator().manual_seed(args.seed * 1000003 + rank + 1)
    span = torch.arange(T)
    timed_clock = warm_clock = Clock()
    warmup_s = 0.0
    loss_sum, loss_n, interval_clock = 0.0, 0, Clock()
    for step in range(args.steps):
        if step == args.warmup_steps:
            barrier(dist, world)
            warmup_s = warm_clock.seconds()
            if profiler is not None:
                profiler.__enter__()
            timed_clock = Clock()
        starts = torch.randint(0, train_size - T, (local,), generator=gen)
        x = ids[starts[:, None] + span]
        y = ids[starts[:, None] + span + 1]
        loss_sum += train_step(x, y, learning_rate(step, args.steps)).item()
        loss_n += 1
        if (step + 1) % args.progress_every == 0 or step + 1 == args.steps:
            mean = all_sum(dist, world, [loss_sum / loss_n])[0] / world
            rate = loss_n * args.batch * T / interval_clock.seconds()
            say(rank, f"step {step + 1}/{args.steps}  train_loss {mean:.4f}  {rate:.0f} tokens/s (wall, with "
                      f"warm-up)")
            loss_sum, loss_n, interval_clock = 0.0, 0, Clock()
    barrier(dist, world)
    seconds = timed_clock.seconds()
    if profiler is not None:
        profiler.__exit__(None, None, None)
        with open(args.profile, "w") as f:
            f.write(f"{args.system}, rank 0 of {world}, {threads} threads, {args.steps - args.warmup_steps} steps, "
                    f"{seconds:.2f} s wall\n")
            f.write(profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=30) + "\n")
    timed = args.steps - args.warmup_steps
    say(rank, harness.timed_line(steps=timed, seconds=seconds, tokens_per_s=timed * args.batch * T / seconds,
                                 warmup_steps=args.warmup_steps, warmup_s=warmup_s))

    val = float("nan")
    if args.validate:
        start = time.perf_counter()
        val_ids = ids[train_size:]
        windows = (len(val_ids) - 1) // T
        mine = list(range(rank, windows, world))
        most = (windows + world - 1) // world
        rounds = (most + local - 1) // local
        total = count = 0.0
        if args.system == "deepspeed":
            eval_module.eval()
        else:
            eval_module.train(False)
        with torch.no_grad():
            for r in range(rounds):
                batch = mine[r * local:(r + 1) * local]
                use = batch or [0]  # every rank runs every forward (the collectives); an empty one counts nothing
                x = torch.stack([val_ids[w * T:w * T + T] for w in use])
                y = torch.stack([val_ids[w * T + 1:w * T + T + 1] for w in use])
                s = eval_module(x, y, reduction="sum")
                if batch:
                    total += float(s)
                    count += len(batch) * T
        total, count = all_sum(dist, world, [total, count])
        val = total / count
        say(rank, f"validation: {windows} windows, {time.perf_counter() - start:.1f} s")
    if dist is not None and world > 1:
        dist.destroy_process_group()
    say(rank, f"val_loss={val:.4f}")


if __name__ == "__main__":
    main()
