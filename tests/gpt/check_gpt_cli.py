#!/usr/bin/env python3
"""The GPT trainer's --backend cuda on the command line, where CI runs (no
GPU): combinations the CUDA part is not built for are refused with exit 2
and a message naming the fix, and a run with --backend cuda ends with a clear
error: "no CUDA device" (built with CUDA), or how to build with CUDA (built
without). On a machine with a GPU the run must train instead and print its
MFU.

    check_gpt_cli.py TRAINER cuda|nocuda
"""
import os
import re
import subprocess
import sys
import tempfile

CORPUS = "/usr/share/dictd/devil.dict.dz"
TINY = ["--layers", "1", "--width", "32", "--heads", "2", "--context", "16", "--micro-batch", "2", "--steps", "3",
        "--eval-every", "3", "--sample", "4"]


def run(trainer, args):
    r = subprocess.run([trainer] + args, capture_output=True, text=True, timeout=300)
    return r.returncode, r.stdout + r.stderr


def main():
    trainer, built = sys.argv[1], sys.argv[2]
    failures = []

    def expect(args, code, pattern):
        rc, out = run(trainer, args)
        ok = rc == code and re.search(pattern, out) is not None
        print(f"{'ok  ' if ok else 'FAIL'} {' '.join(args)}: exit {rc}, {out.strip().splitlines()[0] if out.strip() else ''}")
        if not ok:
            failures.append(f"{args}: exit {rc} (want {code}), output must match {pattern!r}:\n{out[-800:]}")

    # Built without CUDA, every --backend cuda is refused first, with the fix.
    no_cuda = r"--backend cuda: this gpt_train was built without CUDA; reconfigure with -Dcuda=enabled"

    def refused(pattern):
        return no_cuda if built == "nocuda" else pattern

    expect(["--comm", "nccl"], 2, r"--comm nccl: needs --backend cuda")
    expect(["--backend", "cuda", "--comm", "mpi"], 2, refused(r"--comm mpi: --backend cuda communicates with --comm nccl"))
    # Every precision, optimizer, stage and tier is built into the CUDA part
    # (zero::make_optimizer); what is refused is what makes no sense.
    expect(["--offload", "cpu"], 2, r"--offload cpu: moves the optimizer state from GPU memory to the host: it needs --backend cuda")
    expect(["--backend", "cuda", "--offload", "cpu", "--stage", "0"], 2, refused(r"offload cpu: ZeRO-Offload moves this rank.s partition .*stage 0 has no partition: use stage 1 or higher"))
    expect(["--nccl-id-file", "/tmp/x", "--backend", "cuda"], 2, refused(r"--nccl-id-file: needs --comm nccl"))
    expect(["--backend", "cuda", "--comm", "nccl", "--nccl-id-file", "/tmp/x", "--rank", "2", "--world", "2"], 2,
           refused(r"--rank: 2 is not below --world 2"))
    expect(["--backend", "cuda", "--comm", "nccl", "--rank", "1", "--world", "2"], 2,
           refused(r"--rank/--world: go with --nccl-id-file"))
    expect(["--backend", "gpu"], 2, r"--backend")

    if not os.path.exists(CORPUS):
        print(f"SKIP: the --backend cuda run ({CORPUS} missing: apt-get install dict-devil)")
    elif built == "nocuda":
        expect(["--backend", "cuda"] + TINY, 2, no_cuda)
    else:
        # With --save (the CUDA part saves checkpoints as the host part does;
        # tests/gpt/check_gpt_resume.py checks them on a GPU).
        with tempfile.TemporaryDirectory(dir="/tmp") as tmp:
            ckpt = os.path.join(tmp, "ckpt")
            args = ["--backend", "cuda", "--ranks", "2", "--stage", "3"] + TINY
            # (and the choices the CUDA part once refused: sgd, fp16, offload cpu)
            expect(["--backend", "cuda", "--optimizer", "sgd", "--precision", "fp16", "--offload", "cpu"] + TINY,
                   1 if "no CUDA device" in run(trainer, ["--backend", "cuda"] + TINY)[1] else 0,
                   r"no CUDA device|^val_loss=")
            saves = True
            rc, out = run(trainer, args + ["--save", ckpt])
            if rc == 2 and "this build has no checkpoints" in out:  # no nlohmann-json or xxHash here
                saves = False
                rc, out = run(trainer, args)
        if rc == 1 and "error: --backend cuda: no CUDA device" in out:
            print("ok   --backend cuda: no CUDA device here, said so: " + out.strip().splitlines()[-1])
        elif (rc == 0 and re.search(r"MFU [0-9.]+%", out) and re.search(r"^val_loss=[0-9.]+$", out, re.M)
              and (not saves or re.search(r"^saved checkpoint .*step-000000003$", out, re.M))):
            print("ok   --backend cuda trained on this GPU and saved:\n" + out[-1500:])
        else:
            failures.append(f"--backend cuda: exit {rc}, neither 'no CUDA device' nor a run with MFU, val_loss and "
                            f"its checkpoint:\n{out[-1500:]}")
    for f in failures:
        print("FAIL:", f)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
