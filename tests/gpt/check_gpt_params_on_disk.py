#!/usr/bin/env python3
"""Parameters on demand, at a size that shows it: the GPT trainer at stage 3
with its parameter and gradient shards on disk (--param-place disk) and the
optimizer state too (--offload nvme) trains a model whose 16 bytes per
parameter are at least 4x the run's own peak resident memory, and equals the
run that keeps the shards in memory bit for bit: the same printed losses,
and the same fp32 master after the last step (the checkpoint tool's export
of one run verified, byte for byte, against the other's checkpoint).

    check_gpt_params_on_disk.py GPT_TRAIN ZERO_CHECKPOINT [TRAINER OPTIONS...]

The text is 5000 characters of The Devil's Dictionary (a short validation
split keeps each step's validation loss cheap). So large a model on 128
characters a step fits each batch at once and its validation loss rises
from the second step; the training loss, of the batch before its update,
falls over the three steps at this learning rate. Skips (77) when
the dictionary is not installed.
"""
import gzip
import os
import re
import resource
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
from trainer_output import run_checked  # noqa: E402

CORPUS = "/usr/share/dictd/devil.dict.dz"
# 20 blocks of width 1024: 252M parameters, 16 bytes each = 3.8 GiB. What a
# rank keeps resident grows with a unit (a block: 12.6M parameters), not with
# the blocks, so more of them raise the ratio at the same peak.
MODEL = ["--layers", "20", "--width", "1024", "--heads", "8", "--context", "64", "--micro-batch", "2"]
RUN = MODEL + ["--ranks", "1", "--stage", "3", "--precision", "bf16", "--offload", "nvme", "--steps", "3",
               "--eval-every", "1", "--warmup", "0", "--lr", "1e-4", "--min-lr", "1e-4", "--sample", "0",
               "--seed", "3", "--checkpoint-activations"]
BYTES_PER_PARAM = 16  # bf16 parameter and gradient, fp32 master, Adam's two fp32 moments


def losses(out):
    """The progress lines' losses, as printed: [(train, val)] per step."""
    return re.findall(r"^step \d+/\d+\s+train_loss (\S+)\s+val_loss (\S+)", out, re.M)


def peak_rss_bytes_of_children():
    return resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024


def main():
    trainer, tool, extra = sys.argv[1], sys.argv[2], sys.argv[3:]
    if not os.path.exists(CORPUS):
        print(f"SKIP: {CORPUS} missing (apt-get install dict-devil)")
        return 77
    with tempfile.TemporaryDirectory(prefix="zero-params-disk-") as tmp:
        text = os.path.join(tmp, "devil.txt")
        with gzip.open(CORPUS, "rb") as f, open(text, "wb") as out:
            out.write(f.read(25000)[20000:])  # definitions, past the header; 500 characters of validation
        runs = {}
        for place in ["disk", "device"]:  # the disk run first: the children's peak is its own
            nvme = os.path.join(tmp, "nvme-" + place)
            save = os.path.join(tmp, "ckpt-" + place)
            os.mkdir(nvme)
            out = run_checked([trainer] + RUN + extra + ["--data", text, "--param-place", place, "--nvme-dir", nvme,
                                                         "--save", save], timeout=900)
            runs[place] = (out, save)
            if place == "disk":
                peak = peak_rss_bytes_of_children()
                left = os.listdir(nvme)
                if left:
                    raise SystemExit(f"FAIL: the run left files in --nvme-dir: {left}")
        out, _ = runs["disk"]
        params = int(re.search(r"vocab \d+: (\d+) parameters", out).group(1))
        ratio = BYTES_PER_PARAM * params / peak
        print(f"{params} parameters x {BYTES_PER_PARAM} B = {BYTES_PER_PARAM * params / 2**30:.2f} GiB; "
              f"peak resident memory with the shards on disk {peak / 2**20:.0f} MiB: {ratio:.2f}x")
        failures = []
        if ratio < 4:
            failures.append(f"16 bytes per parameter are {ratio:.2f}x the peak resident memory, below 4x")
        disk, device = losses(runs["disk"][0]), losses(runs["device"][0])
        if len(disk) != 3:
            failures.append(f"expected 3 progress lines, found {disk}")
        elif float(disk[-1][0]) >= float(disk[0][0]):
            failures.append(f"the training loss did not fall: {[t for t, _ in disk]}")
        if disk != device:
            failures.append(f"the losses differ: disk {disk}, device {device}")
        hf = os.path.join(tmp, "hf-disk")
        run_checked([tool, "export", runs["disk"][1], hf])
        verified = run_checked([tool, "verify", hf, runs["device"][1]])
        if "all match" not in verified:
            failures.append("the fp32 master after the last step differs between the placements")
        for f in failures:
            print("FAIL:", f)
        if failures:
            return 1
        print("ok: trained with the shards on disk, bit for bit the run with them in memory")
        return 0


if __name__ == "__main__":
    sys.exit(main())
