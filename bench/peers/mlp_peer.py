"""One rank of a peer training the main job's model the way train_fashion_mnist
does: the MLP 784-256-128-10 (ReLU), torch.nn.Linear's initialisation (the
one the trainer draws), Fashion-MNIST from Debian's dataset-fashion-mnist
standardised as the trainer does ((x/255 - 0.2860) / 0.3530), a global
batch of 256 (the last partial batch of an epoch dropped: 234 steps),
every epoch one permutation of the training set shared by the ranks, each
rank taking its slice of each batch, AdamW (lr 2e-3, torch's defaults
otherwise: weight decay 0.01) with the learning rate decaying from 2e-3 to
0 on a cosine over the run, in fp32; after every epoch the test accuracy
over the 10,000 test images (dealt to the ranks). Systems:

  torch   PyTorch in one process
  fsdp2   torch.distributed.fsdp.fully_shard on every Linear and on the root,
          one process per rank over gloo

peers.py starts it; rank 0 prints the `peer:` and `timed:` lines harness.py
reads, a line per epoch, and last `test_accuracy=<value>`.
"""
import argparse
import gzip
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from worker_common import Clock, all_sum, barrier, harness, init_gloo, rank_and_world, say, set_threads  # noqa: E402

DATA = "/usr/share/datasets/fashion-mnist"


def read_idx(torch, path, header):
    raw = gzip.open(path).read()
    return torch.frombuffer(bytearray(raw[header:]), dtype=torch.uint8)


def load(torch, folder, split):
    images = read_idx(torch, os.path.join(folder, f"{split}-images-idx3-ubyte.gz"), 16).float().view(-1, 784)
    labels = read_idx(torch, os.path.join(folder, f"{split}-labels-idx1-ubyte.gz"), 8).long()
    return (images / 255.0 - 0.2860) / 0.3530, labels


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--system", required=True, choices=["torch", "fsdp2"])
    ap.add_argument("--epochs", type=int, default=8)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--threads", type=int, required=True, help="compute threads of this process")
    ap.add_argument("--data", default=DATA)
    args = ap.parse_args()

    rank, world = rank_and_world()
    import torch
    threads = set_threads(args.threads)
    if args.batch % world:
        ap.error(f"--batch {args.batch} is not a multiple of the {world} ranks")
    local = args.batch // world
    x_train, y_train = load(torch, args.data, "train")
    x_test, y_test = load(torch, args.data, "t10k")

    torch.manual_seed(args.seed)
    model = torch.nn.Sequential(torch.nn.Linear(784, 256), torch.nn.ReLU(), torch.nn.Linear(256, 128),
                                torch.nn.ReLU(), torch.nn.Linear(128, 10))
    parameters = sum(p.numel() for p in model.parameters())
    dist = None
    if args.system == "fsdp2":
        from torch.distributed.fsdp import fully_shard
        dist = init_gloo(world)
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer)
        fully_shard(model)
    elif world != 1:
        ap.error("--system torch runs in one process")
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    say(rank, harness.info_line(system=args.system, job="mlp", ranks=world, threads_per_rank=threads,
                                parameters=parameters, batch=args.batch, seed=args.seed,
                                torch=torch.__version__.split("+")[0]))

    steps_per_epoch = len(y_train) // args.batch
    total = steps_per_epoch * args.epochs
    gen = torch.Generator().manual_seed(args.seed)
    per_rank = (len(y_test) + world - 1) // world
    mine = slice(min(len(y_test), rank * per_rank), min(len(y_test), (rank + 1) * per_rank))
    train_seconds, accuracy = 0.0, float("nan")
    for epoch in range(1, args.epochs + 1):
        order = torch.randperm(len(y_train), generator=gen)
        model.train()
        barrier(dist, world)
        clock = Clock()
        loss_sum = 0.0
        for s in range(steps_per_epoch):
            idx = order[s * args.batch + rank * local:s * args.batch + (rank + 1) * local]
            t = ((epoch - 1) * steps_per_epoch + s) / total
            for g in opt.param_groups:
                g["lr"] = args.lr * 0.5 * (1.0 + math.cos(math.pi * t))
            opt.zero_grad(set_to_none=True)
            loss = torch.nn.functional.cross_entropy(model(x_train[idx]), y_train[idx])
            loss.backward()
            opt.step()
            loss_sum += loss.item()
        barrier(dist, world)
        seconds = clock.seconds()
        train_seconds += seconds
        model.eval()
        with torch.no_grad():
            correct = float((model(x_test[mine]).argmax(1) == y_test[mine]).sum())
        correct, loss_total = all_sum(dist, world, [correct, loss_sum])
        accuracy = correct / len(y_test)
        say(rank, f"epoch {epoch}/{args.epochs}  loss {loss_total / world / steps_per_epoch:.4f}  test_accuracy "
                  f"{accuracy:.4f}  {steps_per_epoch * args.batch / seconds:.0f} samples/s  {seconds:.1f} s")
    say(rank, harness.timed_line(epochs=args.epochs, seconds=train_seconds,
                                 samples_per_s=args.epochs * steps_per_epoch * args.batch / train_seconds))
    if dist is not None and world > 1:
        dist.destroy_process_group()
    say(rank, f"test_accuracy={accuracy:.4f}")


if __name__ == "__main__":
    main()
