#!/usr/bin/env python3
"""zero_checkpoint on a checkpoint of the Fashion-MNIST trainer, checked
without the C++ code: the trainer trains one epoch on 2 ranks at stage 3 in
fp32, saving every 100 steps and keeping the last 2; `zero_checkpoint export`
writes Hugging Face safetensors, which this script parses by hand (8-byte
length, JSON header, data; no safetensors module in torch 1.13) and compares
with the fp32 master it reassembles itself from the manifest and the rank
files, bit for bit; shapes are the registered [out, in] / [out]; PyTorch
then evaluates the exported model on the test set and must print the
trainer's test_accuracy. A bf16 export is the master rounded to nearest even
(PyTorch's rounding). `verify` accepts the export and finds a changed value;
`import` writes weights of its own (the export halved) into a one-rank
checkpoint of the run: that master, zero optimizer state, step 0 (or the
run's state with --keep-state), which the trainer resumes on 4 ranks; a
run with --save-async writes the same bytes as the synchronous one; bad
input exits 2 with a message naming the problem; `inspect` of a checkpoint
whose rank file is missing, truncated or corrupt names it and exits 1.
Skips (77) without the data.

    check_checkpoint_tool.py TRAINER ZERO_CHECKPOINT
"""
import gzip
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "checkpoint"))
from check_files import read_safetensors  # noqa: E402  (the format read from its definition)

DATA = "/usr/share/datasets/fashion-mnist"
TRAIN = ["--epochs", "1", "--ranks", "2", "--stage", "3", "--precision", "fp32", "--seed", "5"]
LAYERS = [(256, 784), (128, 256), (10, 128)]  # (out, in) of fc0, fc1, fc2
TORCH_TYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
failures = []


def expect(ok, what):
    if not ok:
        failures.append(what)
        print("FAIL:", what)


def run(cmd, code=0):
    print("$", " ".join(cmd))
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    print(r.stdout[-1500:], end="")
    if r.returncode != code:
        print(r.stderr[-2000:], file=sys.stderr)
        raise SystemExit(f"FAIL: exit code {r.returncode}, expected {code}")
    return r


def tensor(header, data, name):
    t = header[name]
    b, e = t["data_offsets"]
    return torch.frombuffer(bytearray(data[b:e]), dtype=TORCH_TYPES[t["dtype"]]).reshape(t["shape"])


def read_export(d):
    """{name: tensor} of a Hugging Face file set, through its index."""
    index = json.load(open(os.path.join(d, "model.safetensors.index.json")))
    out, total, files = {}, 0, set(index["weight_map"].values())
    for f in sorted(files):
        header, data = read_safetensors(os.path.join(d, f))
        expect(header.get("__metadata__") == {"format": "pt"}, f"{f}: metadata {header.get('__metadata__')}")
        for name in header:
            if name == "__metadata__":
                continue
            expect(index["weight_map"].get(name) == f, f"index puts {name} in {index['weight_map'].get(name)}, not {f}")
            out[name] = tensor(header, data, name)
            total += out[name].numel() * out[name].element_size()
    expect(index["metadata"]["total_size"] == total, f"total_size {index['metadata']['total_size']}, tensors {total}")
    return out, sorted(files)


def read_master(ckpt, slot_name="master"):
    """{name: (shape, fp32 tensor)}: each parameter's master (or another fp32 slot) from the rank files, by the
    manifest."""
    m = json.load(open(os.path.join(ckpt, "manifest.json")))
    master = [s["name"] for s in m["slots"]].index(slot_name)
    units = [torch.full((u["numel"],), float("nan")) for u in m["units"]]
    for f in m["files"]:
        header, data = read_safetensors(os.path.join(ckpt, f["name"]))
        for t in f["tensors"]:
            if t["slot"] == master:
                units[t["unit"]][t["begin"]:t["begin"] + t["count"]] = tensor(header, data, t["name"])
    out = {}
    for u, unit in zip(m["units"], units):
        for p in u["params"]:
            out[p["name"]] = (p.get("shape"), unit[p["offset"]:p["offset"] + p["numel"]].clone())
    return out


def write_safetensors(path, tensors):
    """One safetensors file of fp32 tensors, written from the format's definition."""
    header, blobs, at = {}, [], 0
    for name, t in tensors.items():
        raw = t.contiguous().numpy().tobytes()
        header[name] = {"dtype": "F32", "shape": list(t.shape), "data_offsets": [at, at + len(raw)]}
        blobs.append(raw)
        at += len(raw)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little") + text + b"".join(blobs))


def idx(path):
    raw = gzip.open(path).read()
    dims = raw[3]
    shape = [int.from_bytes(raw[4 + 4 * i:8 + 4 * i], "big") for i in range(dims)]
    return torch.frombuffer(bytearray(raw[4 + 4 * dims:]), dtype=torch.uint8).reshape(shape)


def accuracy(weights):
    """The trainer's model (ReLU MLP, inputs standardised as it does) evaluated by PyTorch."""
    x = idx(os.path.join(DATA, "t10k-images-idx3-ubyte.gz")).reshape(-1, 784).float()
    x = (x / 255.0 - 0.2860) / 0.3530
    y = idx(os.path.join(DATA, "t10k-labels-idx1-ubyte.gz")).long()
    for layer in range(3):
        x = torch.nn.functional.linear(x, weights[f"fc{layer}.weight"], weights[f"fc{layer}.bias"])
        if layer < 2:
            x = torch.relu(x)
    return (x.argmax(1) == y).float().mean().item()


def listing(d):
    return sorted(os.listdir(d))


def main():
    if not os.path.isdir(DATA):
        print(f"SKIP: {DATA} missing (apt-get install dataset-fashion-mnist)")
        return 77
    trainer, tool = sys.argv[1], sys.argv[2]
    with tempfile.TemporaryDirectory(dir="/tmp") as tmp:
        root = os.path.join(tmp, "ckpt")
        out = run([trainer] + TRAIN + ["--save", root, "--save-every", "100", "--keep-last", "2"]).stdout
        m = re.search(r"^test_accuracy=([0-9.]+)$", out, re.M)
        expect(m is not None, "the trainer printed no test_accuracy")
        trained = float(m.group(1)) if m else -1
        # 234 steps: saves at 100, 200 and 234 (the epoch's end); --keep-last 2 leaves the last two.
        expect(listing(root) == ["latest", "step-000000200", "step-000000234"], f"--keep-last 2 left {listing(root)}")
        ckpt = os.path.join(root, "step-000000234")

        info = run([tool, "inspect", root]).stdout
        for want in ["step-000000234", "saved by 2 rank(s) at ZeRO stage 3, precision fp32, optimizer adamw",
                     "step 234,", "fc0.weight", "[256, 784]", "fc2.bias", "[10]",
                     "file rank-1-of-2.safetensors: rank 1, ", "tensors, checksums verified"]:
            expect(want in info, f"inspect does not print {want!r}")

        hf = os.path.join(tmp, "hf")
        run([tool, "export", root, hf, "--max-shard-size", "500KB"])
        exported, files = read_export(hf)
        # fc0.weight (802,816 bytes) fills a shard alone; the rest fit in the next.
        expect(files == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"], f"shards {files}")
        master = read_master(ckpt)
        expect(sorted(exported) == sorted(master), f"exported {sorted(exported)}, parameters {sorted(master)}")
        for layer, (o, i) in enumerate(LAYERS):
            for name, shape in [(f"fc{layer}.weight", [o, i]), (f"fc{layer}.bias", [o])]:
                expect(master[name][0] == shape, f"the manifest records {name} as {master[name][0]}, not {shape}")
                t = exported.get(name)
                if t is None:
                    continue
                expect(list(t.shape) == shape and t.dtype == torch.float32, f"{name}: {t.dtype} {list(t.shape)}")
                expect(torch.equal(t.reshape(-1), master[name][1]), f"{name}: exported values differ from the master")
        acc = accuracy(exported)
        print(f"PyTorch on the exported model: test_accuracy {acc:.4f}, the trainer printed {trained:.4f}")
        # fp32 parameters are the master; only summation order differs from the trainer's BLAS.
        expect(abs(acc - trained) <= 0.0005, f"exported model's accuracy {acc:.4f}, trainer's {trained:.4f}")

        hf16 = os.path.join(tmp, "hf16")
        run([tool, "export", ckpt, hf16, "--dtype", "bf16"])
        half, files16 = read_export(hf16)
        expect(files16 == ["model-00001-of-00001.safetensors"], f"bf16 shards {files16}")
        for name, (_, values) in master.items():
            t = half.get(name)
            expect(t is not None and t.dtype == torch.bfloat16 and
                   torch.equal(t.reshape(-1).view(torch.int16), values.to(torch.bfloat16).view(torch.int16)),
                   f"bf16 export of {name} is not the master rounded to nearest even")

        run([tool, "verify", hf, root])
        run([tool, "verify", os.path.join(hf16, "model-00001-of-00001.safetensors"), ckpt])
        changed = os.path.join(tmp, "changed")
        shutil.copytree(hf, changed)
        shard = os.path.join(changed, "model-00002-of-00002.safetensors")
        with open(shard, "r+b") as f:
            f.seek(-1, os.SEEK_END)  # the last byte: the top of fc2.bias's last value (or the last tensor's)
            b = f.read(1)
            f.seek(-1, os.SEEK_END)
            f.write(bytes([b[0] ^ 0x40]))
        bad = run([tool, "verify", changed, root], code=1).stdout
        expect("1 of" in bad and "values differ" in bad, "verify did not report the changed value")

        # import: weights of its own (the export halved) into a new one-rank checkpoint of the run; the
        # master is exactly those weights, the optimizer state zero, the step 0, and the trainer resumes it.
        halved = {name: t.float() * 0.5 for name, t in exported.items()}
        weights = os.path.join(tmp, "halved.safetensors")
        write_safetensors(weights, halved)
        fresh = os.path.join(tmp, "imported")
        said = run([tool, "import", weights, root, fresh]).stdout
        expect("the optimizer state zero, step 0, as 1 rank at stage 3" in said, f"import says {said!r}")
        imported = read_master(fresh)
        for name, t in halved.items():
            expect(torch.equal(imported[name][1], t.reshape(-1)), f"import: {name}'s master is not the file's values")
            expect(imported[name][0] == list(t.shape), f"import: {name} recorded as {imported[name][0]}")
        manifest = json.load(open(os.path.join(fresh, "manifest.json")))
        expect(manifest["step"] == 0 and manifest["world_size"] == 1,
               f"import: step {manifest['step']}, world size {manifest['world_size']}")
        for slot in ("exp_avg", "exp_avg_sq"):  # AdamW's state, by its names
            expect(all(not v[1].any() for v in read_master(fresh, slot).values()), f"import: {slot} is not zero")
        run([tool, "verify", weights, fresh])
        kept = os.path.join(tmp, "kept")
        run([tool, "import", weights, root, kept, "--keep-state"])
        expect(json.load(open(os.path.join(kept, "manifest.json")))["step"] == 234, "--keep-state: not step 234")
        saved_m = read_master(ckpt, "exp_avg")
        expect(all(torch.equal(t, saved_m[n][1]) for n, (_, t) in read_master(kept, "exp_avg").items()),
               "--keep-state: exp_avg is not the checkpoint's")
        resumed = run([trainer, "--epochs", "1", "--ranks", "4", "--stage", "1", "--precision", "fp32", "--seed", "5",
                       "--resume", fresh]).stdout
        expect("at step 0" in resumed and re.search(r"^test_accuracy=", resumed, re.M) is not None,
               "the trainer did not resume the imported checkpoint at step 0")
        short = os.path.join(tmp, "short.safetensors")
        write_safetensors(short, {n: t for n, t in halved.items() if n != "fc2.bias"})
        wrong = os.path.join(tmp, "wrong.safetensors")
        write_safetensors(wrong, {n: (t.reshape(-1) if n == "fc1.weight" else t) for n, t in halved.items()})

        # --save-async writes what the synchronous save writes, byte for byte.
        later = os.path.join(tmp, "async")
        out = run([trainer] + TRAIN + ["--save", later, "--save-async"]).stdout
        expect("saving checkpoint in the background:" in out and f"saved checkpoint {later}/step-000000234" in out,
               "--save-async does not report its background save and its completion")
        a, s = os.path.join(later, "step-000000234"), ckpt
        for name in listing(s):
            same = os.path.exists(os.path.join(a, name)) and \
                open(os.path.join(a, name), "rb").read() == open(os.path.join(s, name), "rb").read()
            expect(same, f"--save-async's {name} differs from the synchronous save's")

        # Bad input: exit 2 and a message naming the problem.
        empty = os.path.join(tmp, "empty")
        os.mkdir(empty)
        half_written = os.path.join(tmp, "half")
        shutil.copytree(ckpt, half_written)
        os.remove(os.path.join(half_written, "manifest.json"))
        cases = [
            ([tool], "A subcommand is required"),
            ([tool, "inspect", os.path.join(tmp, "nothing")], "does not exist"),
            ([tool, "inspect", empty], "is empty"),
            ([tool, "inspect", half_written], "holds no complete checkpoint"),
            ([tool, "export", ckpt, os.path.join(tmp, "x"), "--max-shard-size", "lots"], "is not a size"),
            ([tool, "export", ckpt, os.path.join(tmp, "x"), "--dtype", "fp8"], "fp8 not in"),
            ([tool, "verify", empty, ckpt], "holds neither model.safetensors.index.json nor model.safetensors"),
            ([tool, "import", short, ckpt, os.path.join(tmp, "y")], "has no tensor 'fc2.bias'"),
            ([tool, "import", wrong, ckpt, os.path.join(tmp, "y")], "'fc1.weight' has shape [32768], the checkpoint's is [128, 256]"),
        ]
        for cmd, message in cases:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
            text = r.stdout + r.stderr
            print("$", " ".join(cmd), "->", r.returncode, text.strip().splitlines()[-1] if text.strip() else "")
            expect(r.returncode == 2 and message in text, f"{' '.join(cmd[1:])}: exit {r.returncode}, {text[-300:]!r}")

        # inspect checks what is on disk: a missing, truncated or corrupt rank file is named with what is wrong,
        # and the exit code is 1 (it printed the manifest's record and exited 0 before).
        def damaged(name, change):
            d = os.path.join(tmp, name)
            shutil.copytree(ckpt, d)
            change(os.path.join(d, "rank-1-of-2.safetensors"))
            return d

        def truncate(path):
            with open(path, "r+b") as f:
                f.truncate(os.path.getsize(path) - 100)

        def flip(path):
            with open(path, "r+b") as f:
                f.seek(-8, os.SEEK_END)  # inside the last tensor's data
                b = f.read(1)
                f.seek(-8, os.SEEK_END)
                f.write(bytes([b[0] ^ 0x01]))

        for d, flags, problem in [(damaged("missing", os.remove), [], "the file does not exist"),
                                  (damaged("truncated", truncate), [], "(truncated)"),
                                  (damaged("flipped", flip), [], "checksum mismatch in tensor"),
                                  (os.path.join(tmp, "truncated"), ["--no-checksums"], "(truncated)")]:
            r = subprocess.run([tool, "inspect", d] + flags, capture_output=True, text=True, timeout=60)
            print("$ inspect", d, *flags, "->", r.returncode)
            line = next((x for x in r.stdout.splitlines() if x.startswith("file rank-1-of-2.safetensors")), "")
            expect(r.returncode == 1 and "rank 1: DAMAGED: " in line and problem in line and
                   "1 of 2 rank file(s)" in r.stderr and "file rank-0-of-2.safetensors: rank 0, " in r.stdout,
                   f"inspect {d} {flags}: exit {r.returncode}, {line!r}, {r.stderr[-300:]!r}")
        # --no-checksums reads no data: a flipped byte passes, as the header and size still match.
        r = subprocess.run([tool, "inspect", os.path.join(tmp, "flipped"), "--no-checksums"], capture_output=True,
                           text=True, timeout=60)
        expect(r.returncode == 0 and "size and header checked (--no-checksums)" in r.stdout,
               f"inspect --no-checksums of a flipped byte: exit {r.returncode}")
    print("checked: export bit for bit, shapes, accuracy, bf16 rounding, verify, import, --save-async, --keep-last, "
          "errors, inspect of damaged rank files")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
