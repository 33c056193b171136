#!/usr/bin/python3
"""Generate tests/quant/blockwise_fixture.txt: a reference for 8-bit block-wise
quantization of optimizer states (Dettmers et al. 2022, "8-bit Optimizers via
Block-wise Quantization"), used by tests/quant/test_blockwise_quant.cpp.

Regenerate with:
    /usr/bin/python3 tests/quant/reference_blockwise.py [output path]

Plain Python 3 (standard library only), written from the paper and from
bitsandbytes' definitions, not from the C++: every float32 operation is
emulated with Python doubles rounded to float32 (struct) after each operation,
which is exact for +, -, *, / and sqrt of float32 operands (a double has more
than 2*24+2 bits, so rounding twice gives the correctly rounded result); a
fused multiply-add is computed with fractions.Fraction and rounded once. The
inputs come from random.Random(seed) with the seeds below, so re-running on
the same machine gives a byte-identical file (gauss() uses the C library's
log/cos/sqrt, so another libm may change inputs, and then the C++ must still
agree with the new file).

What it computes:
  * The two 256-entry "dynamic" code tables of bitsandbytes'
    create_dynamic_map(signed, max_exponent_bits=7, total_bits=8): for level
    i = 0..6, the means of neighbouring points of
    torch.linspace(0.1, 1, cells + 1) (cells = 2^i signed, 2^(i+1) unsigned)
    times 10^(i-6), mirrored for the signed table, plus 0 and 1, sorted.
    torch.linspace in float32 is emulated as PyTorch 2 computes it on x86-64
    CPUs with FMA: point k is fma(step, k, start) below steps // 2 and
    fma(-step, steps-1-k, end) from there. A few entries of the signed table
    are checked against the values bitsandbytes' map holds.
  * Block-wise quantization: per block N = max |x|; each element becomes the
    index of the code nearest to fp32(x / N). "Nearest" compares with the fp32
    midpoint (code[j] + code[j+1]) * 0.5 of neighbouring codes, and a value
    exactly on it takes the even index of the two, as bitsandbytes' CUDA
    quantizer does. An all-zero block: N = 0 and every index the code 0.0. A
    block holding a NaN or an infinity: N = NaN and every index the code 0.0.
    Dequantization: fp32(code[q] * N).
  * One 8-bit AdamW step: dequantize m (signed code) and v (unsigned code),
    update as torch.optim.AdamW does in float32 (include/zero/optim/adam.hpp:
    bias corrections in double, weight decay on the weight first, every
    product rounded on its own), re-quantize m and v block-wise.

File format (one record per line, fields separated by single spaces; floats
are C99 hex-float literals, or nan/inf/-inf, that std::strtof parses exactly;
codes are decimal 0..255):

    # comment
    code <signed|unsigned> <256 floats>       ascending
    case <name> code=<signed|unsigned> n=<n> block=<block>
    x <n floats>                              input
    absmax <blocks floats>                    one per block, last may be short
    q <n codes>
    end
    adamw <name> n=<n> block=<block> step=<t> lr=<hex> beta1=<hex> beta2=<hex>
          eps=<hex> weight_decay=<hex>        (one line; doubles)
    scalars <9 floats>    beta1 1-beta1 beta2 1-beta2 lr/(1-beta1^t)
                          sqrt(1-beta2^t) eps weight_decay 1-lr*weight_decay
    param <n floats>      fp32 master weights before the step
    grad <n floats>
    m_q <n codes>  m_absmax <blocks floats>   8-bit first moment before
    v_q <n codes>  v_absmax <blocks floats>   8-bit second moment before
    param_out <n floats>                      weights after the step
    m_out <n floats>  v_out <n floats>        fp32 moments after the update
    m_q_out <n codes>  m_absmax_out <blocks floats>   re-quantized
    v_q_out <n codes>  v_absmax_out <blocks floats>
    end
"""

import bisect
import math
import os
import random
import struct
import sys
from fractions import Fraction

# --- float32 arithmetic ------------------------------------------------------


def f32(x):
    """The float32 nearest to the double x (round to nearest even)."""
    return struct.unpack("<f", struct.pack("<f", x))[0]


def f32_exact(q):
    """The float32 nearest to the rational q, ties to even (normal range)."""
    if q == 0:
        return 0.0
    sign = -1.0 if q < 0 else 1.0
    q = abs(q)
    e = q.numerator.bit_length() - q.denominator.bit_length()
    while q >= Fraction(2) ** (e + 1):
        e += 1
    while q < Fraction(2) ** e:
        e -= 1
    scaled = q / Fraction(2) ** (e - 23)  # in [2^23, 2^24)
    m, rest = divmod(scaled.numerator, scaled.denominator)
    if 2 * rest > scaled.denominator or (2 * rest == scaled.denominator and m % 2 == 1):
        m += 1
    return sign * math.ldexp(m, e - 23)


def fma32(a, b, c):
    """a * b + c rounded once to float32."""
    return f32_exact(Fraction(a) * Fraction(b) + Fraction(c))


# --- the dynamic code tables -------------------------------------------------


def torch_linspace_f32(start, end, steps):
    """torch.linspace(start, end, steps, dtype=torch.float32) as PyTorch 2
    computes it on an x86-64 CPU with FMA (GCC contracts the kernel's
    start + step * k into one FMA)."""
    start, end = f32(start), f32(end)
    step = f32(f32(end - start) / (steps - 1))
    halfway = steps // 2
    return [fma32(step, k, start) if k < halfway else fma32(-step, steps - 1 - k, end) for k in range(steps)]


def dynamic_map(signed):
    data = []
    for i in range(7):
        cells = 2 ** i if signed else 2 ** (i + 1)
        b = torch_linspace_f32(0.1, 1.0, cells + 1)
        means = [f32(f32(b[j] + b[j + 1]) / 2.0) for j in range(cells)]
        scale = f32(10.0 ** (i - 6))  # Python's 10 ** (i - 6), cast to float32 by torch
        values = [f32(scale * mean) for mean in means]
        data += values
        if signed:
            data += [-v for v in values]
    data += [0.0, 1.0]
    data.sort()
    assert len(data) == 256 and all(data[k] < data[k + 1] for k in range(255))
    return data


SIGNED = dynamic_map(True)
UNSIGNED = dynamic_map(False)

# Entries of bitsandbytes' signed map as torch prints them (PyTorch 2, x86-64).
# Entries 20 and 25 are where fused linspace differs from a correctly rounded
# one (which would give -0.711718738079071 and -0.641406238079071).
for index, value in [(0, -0.992968738079071), (20, -0.7117187976837158), (25, -0.6414062976837158),
                     (63, -0.10703125596046448), (126, -5.500000384017767e-07), (127, 0.0),
                     (128, 5.500000384017767e-07), (203, 0.2757812738418579), (254, 0.992968738079071),
                     (255, 1.0)]:
    assert SIGNED[index] == f32(value), (index, SIGNED[index], value)
assert UNSIGNED[0] == 0.0 and UNSIGNED[255] == 1.0


# --- block-wise quantization (the paper's Section 2, bitsandbytes' ties) -------


def midpoints(code):
    return [f32(f32(code[j] + code[j + 1]) * 0.5) for j in range(255)]


MIDPOINTS = {id(SIGNED): midpoints(SIGNED), id(UNSIGNED): midpoints(UNSIGNED)}


def quantize(x, code):
    """Index of the code nearest to x; exactly on a midpoint: the even index."""
    if x != x:
        return 0
    mids = MIDPOINTS[id(code)]
    j = bisect.bisect_left(mids, x)  # midpoints strictly below x
    if j < 255 and mids[j] == x:  # tie between code[j] and code[j + 1]
        return j if j % 2 == 0 else j + 1
    return j


def quantize_block(xs, code):
    zero = code.index(0.0)
    if any(not math.isfinite(x) for x in xs):
        return float("nan"), [zero] * len(xs)
    absmax = max((abs(x) for x in xs), default=0.0)
    if absmax == 0.0:
        return 0.0, [zero] * len(xs)
    return absmax, [quantize(f32(x / absmax), code) for x in xs]


def quantize_blockwise(xs, block, code):
    absmax, q = [], []
    for begin in range(0, len(xs), block):
        a, codes = quantize_block(xs[begin:begin + block], code)
        absmax.append(a)
        q += codes
    return absmax, q


def dequantize_blockwise(q, absmax, block, code):
    return [f32(code[c] * absmax[i // block]) for i, c in enumerate(q)]


# --- AdamW (torch.optim.AdamW, float32, no FMA) -------------------------------


def adamw_scalars(lr, beta1, beta2, eps, weight_decay, step):
    bias_correction1 = 1.0 - beta1 ** step  # Python doubles, as torch.optim
    bias_correction2 = 1.0 - beta2 ** step
    return [f32(beta1), f32(1.0 - beta1), f32(beta2), f32(1.0 - beta2), f32(lr / bias_correction1),
            f32(math.sqrt(bias_correction2)), f32(eps), f32(weight_decay), f32(1.0 - lr * weight_decay)]


def adamw_element(s, w, g, m, v):
    beta1, one_minus_beta1, beta2, one_minus_beta2, step_size, bc2_sqrt, eps, weight_decay, decay = s
    if weight_decay != 0.0:
        w = f32(w * decay)  # param.mul_(1 - lr * weight_decay)
    m = f32(f32(m * beta1) + f32(one_minus_beta1 * g))  # exp_avg.mul_(b1).add_(g, alpha=1-b1)
    v = f32(f32(v * beta2) + f32(f32(one_minus_beta2 * g) * g))  # exp_avg_sq.mul_(b2).addcmul_(g, g, 1-b2)
    denom = f32(f32(f32(math.sqrt(v)) / bc2_sqrt) + eps)  # (sqrt(v) / sqrt(bc2)).add_(eps)
    w = f32(w + f32(f32(-step_size * m) / denom))  # param.addcdiv_(m, denom, value=-step_size)
    return w, m, v


# --- inputs ------------------------------------------------------------------


def gauss32(rng, n, scale=1.0):
    return [f32(rng.gauss(0.0, 1.0) * scale) for _ in range(n)]


def log_magnitudes(rng, n, low, high, signed=True):
    """sign * 10^uniform(low, high): exercises every decade of the code."""
    out = []
    for _ in range(n):
        x = 10.0 ** rng.uniform(low, high)
        out.append(f32(-x if signed and rng.random() < 0.5 else x))
    return out


def nextafter32(x, direction):
    bits = struct.unpack("<I", struct.pack("<f", x))[0]
    if x == 0.0:
        bits = 1 if direction > 0 else 0x80000001
    elif (x > 0) == (direction > 0):
        bits += 1
    else:
        bits -= 1
    return struct.unpack("<f", struct.pack("<I", bits))[0]


def tie_inputs(code, scale=1.0):
    """Every midpoint times scale, and its two float32 neighbours, plus scale
    itself so that absmax is scale. With scale 1, x / absmax is x: the
    midpoints themselves must take the even index. With a scale that is not a
    power of two, x / absmax lands on or next to the midpoints only if it is
    rounded as a division (multiplying by a rounded 1 / absmax differs)."""
    xs = []
    for mid in midpoints(code):
        x = f32(mid * scale)
        xs += [x, nextafter32(x, -1), nextafter32(x, +1)]
    return xs + [f32(scale)]


def quant_cases():
    """(name, code name, block, inputs). Seeds: 21001.. in order."""
    cases = []
    rng = random.Random(21001)  # prime n = 2053 with block 2048: a normal block, a short one of 5
    cases.append(("signed_2048_prime", "signed", 2048, gauss32(rng, 2048) + log_magnitudes(rng, 5, -8, 0)))
    rng = random.Random(21002)  # prime n = 1031 in blocks of 64: 16 full blocks and one of 7
    xs = []
    for b in range(17):
        length = 64 if b < 16 else 7
        kind = b % 4
        if kind == 0:
            xs += gauss32(rng, length)
        elif kind == 1:
            xs += log_magnitudes(rng, length, -9, 1)
        elif kind == 2:
            xs += gauss32(rng, length, 10.0 ** rng.uniform(-30, 30))
        else:  # one outlier, the rest small: most of the block lands near 0
            block = gauss32(rng, length, 1e-3)
            block[rng.randrange(length)] = f32(rng.choice((-1.0, 1.0)) * 1e3)
            xs += block
    cases.append(("signed_64_prime", "signed", 64, xs))
    rng = random.Random(21003)
    cases.append(("signed_n1", "signed", 2048, [f32(-rng.uniform(0.5, 2.0))]))
    rng = random.Random(21004)  # a second moment: squares and log magnitudes, prime n = 1031
    xs = [f32(g * g) for g in gauss32(rng, 512)] + log_magnitudes(rng, 519, -12, -2, signed=False)
    cases.append(("unsigned_64_prime", "unsigned", 64, xs))
    rng = random.Random(21005)
    cases.append(("unsigned_n1", "unsigned", 2048, [f32(rng.uniform(0.0, 1e-3))]))
    cases.append(("signed_ties", "signed", 1024, tie_inputs(SIGNED)))
    cases.append(("unsigned_ties", "unsigned", 1024, tie_inputs(UNSIGNED)))
    cases.append(("signed_ties_scaled", "signed", 1024, tie_inputs(SIGNED, 2.7)))
    cases.append(("unsigned_ties_scaled", "unsigned", 1024, tie_inputs(UNSIGNED, 2.7)))
    rng = random.Random(21006)  # blocks of 64: zeros, -0.0, NaN, +inf, -inf, a normal tail
    nan, inf = float("nan"), float("inf")
    zeros = [0.0] * 64
    signed_zeros = [-0.0 if k % 2 else 0.0 for k in range(64)]
    with_nan = gauss32(rng, 64)
    with_nan[17] = nan
    with_inf = gauss32(rng, 64)
    with_inf[3] = inf
    with_minus_inf = gauss32(rng, 64)
    with_minus_inf[63] = -inf
    xs = zeros + signed_zeros + with_nan + with_inf + with_minus_inf + gauss32(rng, 5)
    cases.append(("signed_zero_and_nonfinite", "signed", 64, xs))
    cases.append(("unsigned_zero_and_nonfinite", "unsigned", 64, [abs(x) for x in xs]))
    return cases


def adamw_cases():
    """(name, n, block, step, lr, beta1, beta2, eps, weight_decay, param, grad,
    m before, v before). Seeds: 21101.. in order."""
    cases = []
    # Step 7 of a run: m and v hold 8-bit states; blocks of 2048, n = 2125
    # (a short last block of 77); one gradient outlier in block 0.
    rng = random.Random(21101)
    n = 2125
    param = gauss32(rng, n)
    grad = gauss32(rng, n, 0.1)
    grad[1000] = f32(50.0)
    m0 = gauss32(rng, n, 1e-2)
    v0 = [f32(f32(g * g) * 1e-3) for g in gauss32(rng, n)]
    cases.append(("adamw_step7", n, 2048, 7, 1e-3, 0.9, 0.999, 1e-8, 1e-2, param, grad, m0, v0))
    # The first step of a run: zero states (all-zero blocks), blocks of 64,
    # n = 269, strong hyper-parameters, one block of zero gradient (its m
    # and v stay zero and re-quantize as all-zero blocks).
    rng = random.Random(21102)
    n = 269
    param = gauss32(rng, n)
    grad = gauss32(rng, n, 2.0)
    grad[128:192] = [0.0] * 64
    cases.append(("adamw_step1", n, 64, 1, 5e-3, 0.85, 0.995, 1e-7, 0.1, param, grad, [0.0] * n, [0.0] * n))
    return cases


# --- output ------------------------------------------------------------------


def hexf(x):
    """C99 hex-float of a float32 value, trailing zeros dropped."""
    if x != x:
        return "nan"
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    text = float.hex(x)  # e.g. 0x1.99999a0000000p-4
    mantissa, exponent = text.split("p")
    if "." in mantissa:
        mantissa = mantissa.rstrip("0").rstrip(".")
    return mantissa + "p" + exponent


def floats(values):
    return " ".join(hexf(v) for v in values)


def ints(values):
    return " ".join(str(v) for v in values)


def generate():
    codes = {"signed": SIGNED, "unsigned": UNSIGNED}
    lines = [
        "# blockwise_fixture.txt -- generated by tests/quant/reference_blockwise.py (stdlib Python, no date:",
        "# re-running gives the same file). 8-bit block-wise dynamic quantization (Dettmers et al. 2022)",
        "# and one 8-bit AdamW step; format in the script's docstring.",
        "# regenerate with /usr/bin/python3 tests/quant/reference_blockwise.py",
        "code signed " + floats(SIGNED),
        "code unsigned " + floats(UNSIGNED),
    ]
    for name, code_name, block, xs in quant_cases():
        absmax, q = quantize_blockwise(xs, block, codes[code_name])
        lines += [f"case {name} code={code_name} n={len(xs)} block={block}", "x " + floats(xs),
                  "absmax " + floats(absmax), "q " + ints(q), "end"]
    for (name, n, block, step, lr, beta1, beta2, eps, wd, param, grad, m0, v0) in adamw_cases():
        m_absmax, m_q = quantize_blockwise(m0, block, SIGNED)
        v_absmax, v_q = quantize_blockwise(v0, block, UNSIGNED)
        m = dequantize_blockwise(m_q, m_absmax, block, SIGNED)
        v = dequantize_blockwise(v_q, v_absmax, block, UNSIGNED)
        s = adamw_scalars(lr, beta1, beta2, eps, wd, step)
        out = [adamw_element(s, param[i], grad[i], m[i], v[i]) for i in range(n)]
        param_out, m_out, v_out = [o[0] for o in out], [o[1] for o in out], [o[2] for o in out]
        m_absmax_out, m_q_out = quantize_blockwise(m_out, block, SIGNED)
        v_absmax_out, v_q_out = quantize_blockwise(v_out, block, UNSIGNED)
        lines += [
            f"adamw {name} n={n} block={block} step={step} lr={lr.hex()} beta1={beta1.hex()} "
            f"beta2={beta2.hex()} eps={eps.hex()} weight_decay={wd.hex()}",
            "scalars " + floats(s), "param " + floats(param), "grad " + floats(grad),
            "m_q " + ints(m_q), "m_absmax " + floats(m_absmax), "v_q " + ints(v_q), "v_absmax " + floats(v_absmax),
            "param_out " + floats(param_out), "m_out " + floats(m_out), "v_out " + floats(v_out),
            "m_q_out " + ints(m_q_out), "m_absmax_out " + floats(m_absmax_out),
            "v_q_out " + ints(v_q_out), "v_absmax_out " + floats(v_absmax_out), "end",
        ]
    return "\n".join(lines) + "\n"


def main():
    path = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                               "blockwise_fixture.txt")
    text = generate()
    with open(path, "w", encoding="ascii", newline="\n") as f:
        f.write(text)
    print(f"wrote {path} ({len(text)} bytes)")


if __name__ == "__main__":
    main()
