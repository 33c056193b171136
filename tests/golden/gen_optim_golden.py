#!/usr/bin/python3
"""Generate tests/golden/optim_golden.txt: PyTorch reference trajectories for
Adam / AdamW / SGD, used by the C++ optimizer tests.

Regenerate with:
    /usr/bin/python3 tests/golden/gen_optim_golden.py

Output is deterministic: single thread, fixed seed per case, CPU float32,
single-tensor (foreach=False) optimizer paths, ATEN_CPU_CAPABILITY=default
(no SIMD kernels, hence no fused multiply-add; see the note above
`import torch`).  The header carries only the calendar date (UTC, or
SOURCE_DATE_EPOCH when set), so re-running on the same day gives a
byte-identical file.

File format (one record per line, fields separated by single spaces; every
float is a C99 hex-float literal that std::strtof / std::strtod parse exactly):

    # comment
    case <name> optimizer=<adam|adamw|sgd> n=<n> steps=<steps> lr=<hex>
         beta1=<hex> beta2=<hex> eps=<hex> weight_decay=<hex> momentum=<hex>
         dampening=<hex> nesterov=<0|1>                      (one line)
    init <n values>                   initial params
    grad <step> <n values>            gradient fed at that step (step >= 1)
    param <step> <n values>           params after optimizer.step()
    state0 <step> <n values>          adam/adamw: exp_avg; sgd: momentum_buffer
    state1 <step> <n values>          adam/adamw: exp_avg_sq
    end

For every step the lines come in the order grad, param, state0, state1.
state0/state1 are omitted when the optimizer keeps no such state (SGD with
momentum == 0 has no state0 and never a state1).  Unused hyper-parameters are
0x0p+0.  Scalars are the hex of the Python doubles handed to torch.
"""

import datetime
import math
import os
import sys

# Pin ATen's CPU kernels to the plain (non-SIMD) build before torch loads.
# With the AVX2/AVX512 kernels, torch fuses `x.add_(y, alpha=a)` and the
# addcmul_ update into FMAs, so results would depend on the generating
# machine.  "default" gives plain IEEE float32 ops: each op rounded
# separately, exactly what a scalar C++ loop without FP contraction computes.
os.environ["ATEN_CPU_CAPABILITY"] = "default"

import torch  # noqa: E402

N = 33          # odd on purpose: exercises the non-vector tail
STEPS = 24
SCALE_MIN, SCALE_MAX = 0.05, 4.0
G_MIN = 2.0 ** -10   # normal in fp16 (min normal 2^-14) and bf16
G_MAX = 59904.0      # largest bf16 value <= 60000 (60000 itself is not bf16)

# name, optimizer, hyper-parameters (python floats exactly as given to torch)
CASES = [
    ("adam", "adam", dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)),
    ("adam_l2", "adam", dict(lr=2e-3, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.01)),
    ("adamw", "adamw", dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)),
    ("adamw_strong", "adamw", dict(lr=5e-3, betas=(0.85, 0.995), eps=1e-7, weight_decay=0.1)),
    ("sgd_plain", "sgd", dict(lr=0.05, momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False)),
    ("sgd_momentum", "sgd", dict(lr=0.05, momentum=0.9, dampening=0.0, weight_decay=0.0, nesterov=False)),
    ("sgd_dampening", "sgd", dict(lr=0.03, momentum=0.9, dampening=0.25, weight_decay=1e-3, nesterov=False)),
    ("sgd_nesterov", "sgd", dict(lr=0.02, momentum=0.8, dampening=0.0, weight_decay=5e-4, nesterov=True)),
    ("sgd_wd", "sgd", dict(lr=0.1, momentum=0.0, dampening=0.0, weight_decay=0.01, nesterov=False)),
]
SEED_BASE = 20240


def hexf(x: float) -> str:
    """Shortest exact C99 hex literal of a double (trailing mantissa zeros cut)."""
    s = float(x).hex()                  # e.g. '-0x1.8000000000000p-3'
    mant, exp = s.split("p")
    if "." in mant:
        mant = mant.rstrip("0").rstrip(".")
    return mant + "p" + exp


def hexvec(t: torch.Tensor) -> str:
    assert t.dtype == torch.float32 and t.dim() == 1
    return " ".join(hexf(v) for v in t.tolist())   # float32 -> double is exact


def make_grad(scale: float) -> torch.Tensor:
    # drawn in float64: torch's float32 randn kernel is vectorised per CPU
    # capability (AVX2 vs default give different bits), the float64 one is not
    g = (torch.randn(N, dtype=torch.float64) * scale).to(torch.float32)
    g = g.to(torch.bfloat16).to(torch.float32)
    mag = g.abs().clamp(G_MIN, G_MAX)
    sign = torch.where(g < 0, -1.0, 1.0)          # exact zeros -> +2^-10
    g = (sign * mag).to(torch.float32)
    assert torch.equal(g.to(torch.bfloat16).to(torch.float32), g), "grad not bf16-exact"
    assert torch.equal(g.to(torch.float16).to(torch.float32), g), "grad not fp16-exact"
    assert bool((g.abs() >= G_MIN).all()) and bool((g.abs() <= G_MAX).all())
    return g


def make_optimizer(kind, p, hp):
    if kind == "adam":
        return torch.optim.Adam([p], lr=hp["lr"], betas=hp["betas"], eps=hp["eps"],
                                weight_decay=hp["weight_decay"], amsgrad=False,
                                foreach=False, maximize=False)
    if kind == "adamw":
        return torch.optim.AdamW([p], lr=hp["lr"], betas=hp["betas"], eps=hp["eps"],
                                 weight_decay=hp["weight_decay"], amsgrad=False,
                                 foreach=False, maximize=False)
    if kind == "sgd":
        return torch.optim.SGD([p], lr=hp["lr"], momentum=hp["momentum"],
                               dampening=hp["dampening"], weight_decay=hp["weight_decay"],
                               nesterov=hp["nesterov"], foreach=False, maximize=False)
    raise ValueError(kind)


def case_header(name, kind, hp):
    betas = hp.get("betas", (0.0, 0.0))
    fields = [
        "case", name, "optimizer=" + kind, "n=%d" % N, "steps=%d" % STEPS,
        "lr=" + hexf(hp["lr"]),
        "beta1=" + hexf(betas[0]),
        "beta2=" + hexf(betas[1]),
        "eps=" + hexf(hp.get("eps", 0.0)),
        "weight_decay=" + hexf(hp["weight_decay"]),
        "momentum=" + hexf(hp.get("momentum", 0.0)),
        "dampening=" + hexf(hp.get("dampening", 0.0)),
        "nesterov=%d" % (1 if hp.get("nesterov", False) else 0),
    ]
    return " ".join(fields)


def run_case(idx, name, kind, hp, out):
    seed = SEED_BASE + idx
    torch.manual_seed(seed)
    init = torch.randn(N, dtype=torch.float64).to(torch.float32)  # see make_grad
    # per-step gradient scales, log-uniform in [SCALE_MIN, SCALE_MAX]
    u = torch.rand(STEPS, dtype=torch.float64).tolist()
    scales = [math.exp(math.log(SCALE_MIN) + ui * (math.log(SCALE_MAX) - math.log(SCALE_MIN)))
              for ui in u]

    p = torch.nn.Parameter(init.clone())
    opt = make_optimizer(kind, p, hp)

    out.append("# case %s seed=%d" % (name, seed))
    out.append(case_header(name, kind, hp))
    out.append("init " + hexvec(init))
    for step in range(1, STEPS + 1):
        g = make_grad(scales[step - 1])
        p.grad = g.clone()
        opt.step()
        out.append("grad %d %s" % (step, hexvec(g)))
        out.append("param %d %s" % (step, hexvec(p.detach())))
        st = opt.state[p]
        if kind in ("adam", "adamw"):
            assert float(st["step"]) == float(step)
            out.append("state0 %d %s" % (step, hexvec(st["exp_avg"])))
            out.append("state1 %d %s" % (step, hexvec(st["exp_avg_sq"])))
        else:
            buf = st.get("momentum_buffer")
            if hp["momentum"] != 0.0:
                assert buf is not None
                out.append("state0 %d %s" % (step, hexvec(buf)))
            else:
                assert buf is None
    out.append("end")


def capability() -> str:
    for line in torch.__config__.show().splitlines():
        if "CPU capability usage:" in line:
            return line.split(":", 1)[1].strip()
    return "unknown"


def main():
    cap = capability()
    assert cap == "NO AVX", "ATEN_CPU_CAPABILITY=default not in effect: " + cap
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    here = os.path.dirname(os.path.abspath(__file__))
    path = os.path.join(here, "optim_golden.txt")
    if len(sys.argv) > 1:
        path = sys.argv[1]

    epoch = os.environ.get("SOURCE_DATE_EPOCH")
    when = (datetime.datetime.fromtimestamp(int(epoch), datetime.timezone.utc) if epoch
            else datetime.datetime.now(datetime.timezone.utc))

    out = [
        "# optim_golden.txt -- generated by tests/golden/gen_optim_golden.py",
        "# torch %s (CPU, float32, foreach=False, 1 thread, %s), python %s"
        % (torch.__version__, capability(), sys.version.split()[0]),
        "# every op rounded to float32 separately (no FMA); scalars cast double->float",
        "# date %s" % when.strftime("%Y-%m-%d"),
        "# regenerate with /usr/bin/python3 tests/golden/gen_optim_golden.py",
        "# format: see tests/golden/README.md; floats are C99 hex literals (std::strtof)",
        "# grads are exactly representable in bf16 and fp16 (|g| in [2^-10, 59904])",
    ]
    for idx, (name, kind, hp) in enumerate(CASES):
        run_case(idx, name, kind, hp, out)

    data = "\n".join(out) + "\n"
    with open(path, "w", encoding="ascii", newline="\n") as f:
        f.write(data)
    print("wrote %s (%d bytes)" % (path, len(data)))


if __name__ == "__main__":
    main()
