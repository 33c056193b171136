#!/usr/bin/env python3
"""An independent reader of the files zero writes: safetensors read from the
format's definition (not through the C++ code), the checkpoint's manifest
ranges and the Hugging Face index checked against it, and every value against
the formula the C++ test stored.

  check_files.py TEST_CHECKPOINT_EXECUTABLE
runs the executable's hidden [.python] case to write the files into a
temporary directory, then checks them. Exits non-zero naming what is wrong.
"""
import json
import os
import struct
import subprocess
import sys
import tempfile

SIZES = {"F32": 4, "F16": 2, "BF16": 2, "I64": 8}


def read_safetensors(path):
    """(header dict, data bytes): the format as its specification defines it."""
    with open(path, "rb") as f:
        raw = f.read()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    data = raw[8 + n:]
    assert (8 + n) % 8 == 0, f"{path}: data does not start 8-byte aligned"
    spans = sorted((t["data_offsets"][0], t["data_offsets"][1], k) for k, t in header.items() if k != "__metadata__")
    at = 0
    for begin, end, name in spans:
        t = header[name]
        count = 1
        for d in t["shape"]:
            count *= d
        assert begin == at, f"{path}: tensor {name} starts at {begin}, expected {at}"
        assert end - begin == count * SIZES[t["dtype"]], f"{path}: tensor {name} size"
        assert begin % SIZES[t["dtype"]] == 0, f"{path}: tensor {name} misaligned"
        at = end
    assert at == len(data), f"{path}: {len(data) - at} bytes not covered"
    return header, data


def values(header, data, name):
    t = header[name]
    b, e = t["data_offsets"]
    raw = data[b:e]
    if t["dtype"] == "F32":
        return list(struct.unpack(f"<{len(raw) // 4}f", raw))
    if t["dtype"] == "BF16":
        return [struct.unpack("<f", struct.pack("<I", h << 16))[0] for h in struct.unpack(f"<{len(raw) // 2}H", raw)]
    raise AssertionError(f"unexpected dtype {t['dtype']}")


def f32(x):
    return struct.unpack("<f", struct.pack("<f", x))[0]


def bf16(x):
    """Round to nearest even, as the C++ conversion does (values here are finite)."""
    (u,) = struct.unpack("<I", struct.pack("<f", x))
    u = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16
    return struct.unpack("<f", struct.pack("<I", u))[0]


def check_checkpoint(d):
    m = json.load(open(os.path.join(d, "manifest.json")))
    assert m["format"] == "zero-checkpoint" and m["format_version"] == 1
    assert m["world_size"] == 3 and len(m["files"]) == 3
    checked = 0
    covered = {}
    for f in m["files"]:
        header, data = read_safetensors(os.path.join(d, f["name"]))
        assert os.path.getsize(os.path.join(d, f["name"])) == f["bytes"]
        for t in f["tensors"]:
            slot = m["slots"][t["slot"]]
            assert header[t["name"]]["dtype"] == slot["dtype"] and header[t["name"]]["shape"] == [t["count"]]
            got = values(header, data, t["name"])
            for k, v in enumerate(got):
                i = t["begin"] + k
                want = f32((t["slot"] + 1) * 1000.0 + t["unit"] * 10.0 + (i % 4093) * 0.0625)
                if slot["dtype"] == "BF16":
                    want = bf16(want)
                assert v == want, f"{f['name']} {t['name']}[{k}] = {v}, expected {want}"
            checked += len(got)
            covered.setdefault((t["slot"], t["unit"]), []).append((t["begin"], t["begin"] + t["count"]))
    for (slot, unit), spans in covered.items():
        at = 0
        for b, e in sorted(spans):
            assert b == at, f"slot {slot} unit {unit}: gap or overlap at {b}"
            at = e
        assert at == m["units"][unit]["numel"]
    assert len(covered) == len(m["slots"]) * len(m["units"])
    return checked


def check_hf(d):
    index = json.load(open(os.path.join(d, "model.safetensors.index.json")))
    total = 0
    names = []
    for name, file in index["weight_map"].items():
        header, data = read_safetensors(os.path.join(d, file))
        assert header["__metadata__"]["format"] == "pt"
        tensor = ["embed.weight", "h.0.bias", "h.0.weight", "head.weight"].index(name)
        got = values(header, data, name)
        for i, v in enumerate(got):
            want = f32(tensor * 100.0 + (i % 1000) * 0.125)
            if header[name]["dtype"] == "BF16":
                want = bf16(want)
            assert v == want, f"{file} {name}[{i}] = {v}, expected {want}"
        b, e = header[name]["data_offsets"]
        total += e - b
        names.append(name)
    assert total == index["metadata"]["total_size"], "total_size"
    assert sorted(names) == ["embed.weight", "h.0.bias", "h.0.weight", "head.weight"]
    return len(set(index["weight_map"].values()))


def main():
    with tempfile.TemporaryDirectory() as out:
        r = subprocess.run([sys.argv[1], "[.python]"], env=dict(os.environ, ZERO_CHECKPOINT_OUT=out),
                           capture_output=True, text=True)
        if r.returncode != 0:
            print(r.stdout, r.stderr)
            return 1
        n = check_checkpoint(os.path.join(out, "checkpoint"))
        shards = check_hf(os.path.join(out, "hf"))
        print(f"ok: {n} checkpoint values over 3 rank files and {shards} export shards match the formulas")
    return 0


if __name__ == "__main__":
    sys.exit(main())
