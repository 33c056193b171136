#!/usr/bin/env python3
"""Compile-time contract of the library, checked with the real compiler.

  check_compile.py headers  CXX... -- INCLUDE_DIR   every public header compiles on its own,
                                                    without a warning under -Wall -Wextra
  check_compile.py headers-together CXX... -- INCLUDE_DIR
                                                    every public header in one file, without a
                                                    warning (the second compiler: whether a header
                                                    includes what it uses is the same question for
                                                    both, which share libstdc++)
  check_compile.py engines  CXX... -- INCLUDE_DIR ENGINES_CPP
                                                    the nine built-in engines, their handles and
                                                    disk stores (src/zero_engines.cpp, once per
                                                    precision) instantiated without a warning: all
                                                    the engine code the test programs run, through
                                                    the second compiler
  check_compile.py fail     CXX... -- INCLUDE_DIR   each nonsensical configuration fails with
                                                    its plain-English static_assert or #error
  check_compile.py warnings CXX... -- INCLUDE_DIR PROGRAM
                                                    a user's program (user_program.cpp) compiles
                                                    to code at -O2 without a single diagnostic
  check_compile.py precompiled CXX... -- INCLUDE_DIR PROGRAM
                                                    a file compiled with ZERO_PRECOMPILED_ENGINES
                                                    (precompiled_program.cpp) calls the engines,
                                                    handles and disk stores without compiling them

CXX is the compiler command (as Meson gives it). Exits non-zero naming the
header or case that broke the contract (77, a skip, where a mode's headers
are not installed).
"""
import concurrent.futures
import contextlib
import os
import re
import subprocess
import sys
import tempfile

# What a user's build passes: the warnings must stay off in theirs, so they stay off here.
WARNINGS = ["-Wall", "-Wextra", "-Werror"]

# (name, code, text the compiler must print, or a tuple of g++'s and Clang's
# spellings of it); code follows #include "zero/zero.hpp"
FAIL_CASES = [
    ("mixed_fp32", "zero::precision::Mixed<float> p;", "Mixed<T> needs a 16-bit type"),
    ("full_bf16", "zero::precision::Full<zero::bf16> p;", "training entirely in 16-bit floats"),
    ("stage4", "zero::stage<4> s;", "ZeRO has stages 0, 1, 2 and 3"),
    ("offload_host",
     "using O = zero::ZeroOptimizer<zero::precision::Mixed<zero::bf16>, zero::optim::AdamW, zero::stage<2>,"
     " zero::offload::Cpu, zero::backend::Host>; static_assert(sizeof(O) > 0);",
     "already in host memory"),
    ("offload_stage0",
     "using O = zero::ZeroOptimizer<zero::precision::Mixed<zero::bf16>, zero::optim::AdamW, zero::stage<0>,"
     " zero::offload::Cpu, zero::backend::Cuda>; static_assert(sizeof(O) > 0);",
     "stage 0 has no partition"),
    ("nvme_without_its_store",
     "using O = zero::ZeroOptimizer<zero::precision::Mixed<zero::bf16>, zero::optim::AdamW, zero::stage<2>,"
     " zero::offload::Nvme, zero::backend::Host>; static_assert(sizeof(O) > 0);",
     "offload::Nvme needs its store"),
    ("not_an_optimizer",
     "struct NoUpdate { static constexpr const char* name = \"x\"; static constexpr int state_slots = 0;"
     " struct Hyper { void validate() const {} }; struct Scalars {};"
     " static Scalars prepare(const Hyper&, long) { return {}; } };"
     " using O = zero::ZeroOptimizer<zero::precision::Full<float>, NoUpdate, zero::stage<1>,"
     " zero::offload::None, zero::backend::Host>; O* o = nullptr;",
     ("Policy<Optimizer>", "does not satisfy 'Policy'")),
    ("not_a_communicator",
     "struct NotComm { int rank() const { return 0; } };"
     " using O = zero::ZeroOptimizer<zero::precision::Full<float>, zero::optim::Sgd, zero::stage<1>,"
     " zero::offload::None, zero::backend::Host>;"
     " void f(NotComm& c) { O o(c, {}); }",
     ("Communicator<Comm>", "does not satisfy 'Communicator'")),
    # Checkpoints without their header: which header, and what it needs (was
    # "invalid use of incomplete type OptimizerIo").
    ("save_without_optimizer_io",
     "using O = zero::ZeroOptimizer<zero::precision::Full<float>, zero::optim::Sgd, zero::stage<1>,"
     " zero::offload::None, zero::backend::Host>;"
     " void f(O& o) { o.save(\"ckpt\", {.async = true}); }",
     ("need #include \"zero/checkpoint/optimizer_io.hpp\" (which needs nlohmann-json and xxHash",
      "need #include \\\"zero/checkpoint/optimizer_io.hpp\\\" (which needs nlohmann-json and xxHash")),
    ("load_without_optimizer_io",
     "using O = zero::ZeroOptimizer<zero::precision::Full<float>, zero::optim::Sgd, zero::stage<1>,"
     " zero::offload::None, zero::backend::Host>;"
     " void f(O& o) { o.load(\"ckpt\"); }",
     ("need #include \"zero/checkpoint/optimizer_io.hpp\"", "need #include \\\"zero/checkpoint/optimizer_io.hpp\\\"")),
]

# FAIL_CASES whose text must be the first error, before those it causes.
FIRST_ERROR_CASES = {"save_without_optimizer_io", "load_without_optimizer_io"}

# (name, header, text): the header alone in a C++17 translation unit must stop
# with this as its first error, not at the first concept deep inside.
OLD_STANDARD = "-std=c++17"
OLD_STANDARD_CASES = [
    ("cxx17_umbrella", "zero/zero.hpp", "zero needs C++20"),
    ("cxx17_policy", "zero/optim/policy.hpp", "zero needs C++20"),
    ("cxx17_layout", "zero/engine/layout.hpp", "zero needs C++20"),
]

# Headers that need something g++ alone does not have.
SKIP = {"zero/comm/mpi.hpp", "zero/comm/mpi_c_api.hpp",  # need mpi.h: compiled by the MPI tests
        # needs LibTorch, whose headers need g++ in C++20: compiled alone by
        # tests/integrations (test_torch.cpp includes it first), with -Werror
        "zero/integrations/torch.hpp"}
# The disk tier needs liburing.h and xxhash.h (as zero/xxhash.hpp does): checked where they are installed.
DISK_TIER = {"zero/offload/uring.hpp", "zero/offload/disk_swap.hpp", "zero/offload/disk_state_store.hpp",
             "zero/xxhash.hpp"}
DISK_TIER_PROBE = "#include <liburing.h>\n#include <xxhash.h>\nint main() {}\n"
# The CUDA host headers (zero/cuda/runtime.hpp says which) need the toolkit's
# headers, whose folder the build passes as ZERO_CUDA_INCLUDE where it found
# nvcc; comm/nccl.hpp needs nccl.h too. Checked where they are found.
CUDA_INCLUDE = os.environ.get("ZERO_CUDA_INCLUDE", "")
CUDA_FLAGS = ["-isystem", CUDA_INCLUDE] if CUDA_INCLUDE else []


def needs_cuda(rel):
    name = os.path.basename(rel)
    return rel.startswith("zero/cuda/") or "cuda" in name or rel in ("zero/comm/local_device.hpp", "zero/comm/nccl.hpp")


def compile_source(cxx, include, source, label, flags=("-std=c++20", "-fsyntax-only")):
    with tempfile.NamedTemporaryFile("w", suffix=".cpp", delete=False) as f:
        f.write(source)
        path = f.name
    try:
        r = subprocess.run(cxx + list(flags) + ["-fopenmp", "-I", include, *CUDA_FLAGS, path], capture_output=True,
                           text=True)
        return label, r.returncode, r.stdout + r.stderr
    finally:
        os.unlink(path)


def first_error(output):
    """The first line the compiler marks as an error (g++ and Clang both write 'error: ')."""
    return next((line for line in output.splitlines() if "error: " in line), "")


def check_warnings(cxx, include, program):
    """The user's program compiled to an object file, as their build would: any diagnostic fails."""
    with open(program) as f:
        source = f.read()
    flags = ["-std=c++20", *WARNINGS, "-O2", "-c", "-o", os.devnull]
    label, rc, out = compile_source(cxx, include, source, os.path.basename(program), flags)
    ok = rc == 0 and out.strip() == ""
    command = " ".join(cxx + flags + ["-fopenmp"])
    print(f"{'ok  ' if ok else 'FAIL'} {label}: {command}" + ("" if ok else "\n" + out[:3000]))
    return 0 if ok else 1


# What a file compiled with ZERO_PRECOMPILED_ENGINES (with the disk tier) must
# not compile (it would be compiled in every file again), and what it must
# call instead: the engine's and the handle's heavy members and the disk
# tier's store maker, compiled once in src/zero_engines.cpp.
PRECOMPILED_FLAGS = ["-DZERO_PRECOMPILED_ENGINES"]
COMPILED_ELSEWHERE = re.compile(
    r"zero::detail::Engine(Handle)?<.*>::(finalize|step|set_param|grad_ready|gather_masters|save|load)\(|"
    r"zero::offload::DiskTier::make<|^vtable for zero::detail::EngineHandle<")
MUST_CALL = [
    "zero::detail::Engine<zero::precision::Mixed<zero::bf16>, zero::optim::AdamW, zero::backend::Host>::step()",
    "vtable for zero::detail::EngineHandle<",
    "zero::offload::DiskTier::make<zero::optim::SgdPolicy<false>,",  # "sgd" at momentum 0: optim::PlainSgd
]


def check_precompiled(cxx, include, program):
    """The program's object defines none of COMPILED_ELSEWHERE and refers to each of MUST_CALL."""
    probe = "#include <nlohmann/json.hpp>\n#include <xxhash.h>\n#include <liburing.h>\nint main() {}\n"
    if compile_source(cxx, include, probe, "probe")[1] != 0:
        print("skip: nlohmann-json, xxHash or liburing headers are not installed")
        return 77
    with open(program) as f:
        source = f.read()
    with tempfile.TemporaryDirectory() as work:
        obj = os.path.join(work, "program.o")
        label, rc, out = compile_source(cxx, include, source, os.path.basename(program),
                                        ["-std=c++20", "-O1", *PRECOMPILED_FLAGS, "-c", "-o", obj])
        if rc != 0:
            print(f"FAIL {label} does not compile:\n{out[:3000]}")
            return 1
        symbols = {}
        for which in ("--defined-only", "--undefined-only"):
            r = subprocess.run(["nm", "-C", which, obj], capture_output=True, text=True, check=True)
            # "ADDRESS TYPE NAME" or "         U NAME"
            symbols[which] = [line.split(maxsplit=2)[-1] if which == "--defined-only" else line.split(maxsplit=1)[-1]
                              for line in r.stdout.splitlines() if line.strip()]
    compiled = [name for name in symbols["--defined-only"] if COMPILED_ELSEWHERE.search(name)]
    missing = [want for want in MUST_CALL if not any(want in name for name in symbols["--undefined-only"])]
    for name in compiled:
        print(f"FAIL compiled here, though declared extern: {name[:300]}")
    for want in missing:
        print(f"FAIL not called (compiled here, or the program changed): {want}")
    ok = not compiled and not missing
    if ok:
        print(f"ok   {label}: {len(symbols['--defined-only'])} symbols defined, none of the engines'; "
              f"{len(MUST_CALL)} calls to the engines compiled once")
    else:
        print(f"FAIL {label}: {len(compiled)} engine symbols compiled here, {len(missing)} calls missing")
    return 0 if ok else 1


def public_headers(cxx, include):
    """The public headers (paths under INCLUDE_DIR) whose dependencies are installed."""
    skip = set(SKIP)
    if compile_source(cxx, include, DISK_TIER_PROBE, "disk tier probe")[1] != 0:
        print("skip zero/offload/{uring,disk_swap}.hpp: liburing.h or xxhash.h is not installed")
        skip |= DISK_TIER
    # The checkpoint headers need nlohmann-json and xxHash; where those
    # are not installed, neither are the checkpoint tests.
    probe = "#include <nlohmann/json.hpp>\n#include <xxhash.h>\nint main() {}\n"
    if compile_source(cxx, include, probe, "probe")[1] != 0:
        print("skip zero/checkpoint/: nlohmann-json or xxHash headers are not installed")
        skip.update(f"zero/checkpoint/{n}" for n in os.listdir(os.path.join(include, "zero", "checkpoint")))
    cuda_probe = "#include <cuda_runtime.h>\nint main() {}\n"
    if not CUDA_INCLUDE or compile_source(cxx, include, cuda_probe, "CUDA probe")[1] != 0:
        print("skip the CUDA host headers: no CUDA toolkit (ZERO_CUDA_INCLUDE names its include folder)")
        skip_cuda = True
    else:
        skip_cuda = False
        if compile_source(cxx, include, "#include <nccl.h>\nint main() {}\n", "NCCL probe")[1] != 0:
            print("skip zero/comm/nccl.hpp: nccl.h is not installed")
            skip.add("zero/comm/nccl.hpp")
    headers = []
    for root, _, files in os.walk(os.path.join(include, "zero")):
        for name in sorted(files):
            rel = os.path.relpath(os.path.join(root, name), include)
            if name.endswith(".hpp") and rel not in skip and not (skip_cuda and needs_cuda(rel)):
                headers.append(rel)
    return sorted(headers)


def check_engines(cxx, include, engines_cpp):
    """src/zero_engines.cpp for each precision, with the disk tier's stores: no diagnostic."""
    if compile_source(cxx, include, DISK_TIER_PROBE + "#include <nlohmann/json.hpp>\n", "probe")[1] != 0:
        print("skip: nlohmann-json, xxHash or liburing headers are not installed")
        return 77
    with open(engines_cpp) as f:
        source = f.read()
    flags = ["-std=c++20", "-fsyntax-only", *WARNINGS, "-DZERO_ENGINES_WITH_DISK_TIER"]
    with concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        jobs = [pool.submit(compile_source, cxx, include, source, f"engines {precision}",
                            flags + [f"-DZERO_ENGINES_PRECISION={precision}"])
                for precision in ("fp32", "bf16", "fp16")]
        results = [j.result() for j in jobs]
    failed = 0
    for label, rc, out in results:
        ok = rc == 0 and out.strip() == ""
        print(f"{'ok  ' if ok else 'FAIL'} {label}: {' '.join(cxx + flags)}" + ("" if ok else "\n" + out[:3000]))
        failed += not ok
    return 1 if failed else 0


def precompile_umbrella(cxx, include, work):
    """zero/zero.hpp precompiled once into WORK for the FAIL_CASES, which all
    start by including it (parsing it was most of each case's time); the
    flags that make a case use it. Where precompiling fails, none: the cases
    then parse the header themselves, only slower."""
    version = subprocess.run(cxx + ["--version"], capture_output=True, text=True).stdout
    header = os.path.join(include, "zero", "zero.hpp")
    if "clang" in version:
        pch = os.path.join(work, "zero.pch")
        use = ["-include-pch", pch]
    else:  # g++ finds DIR/zero/zero.hpp.gch first when DIR comes first on the include path
        os.makedirs(os.path.join(work, "zero"))
        pch = os.path.join(work, "zero", "zero.hpp.gch")
        use = ["-I", work]
    r = subprocess.run(cxx + ["-std=c++20", "-fopenmp", "-I", include, "-x", "c++-header", header, "-o", pch],
                       capture_output=True, text=True)
    if r.returncode != 0:
        print(f"note: zero/zero.hpp not precompiled, each case parses it:\n{r.stderr[:1000]}")
        return []
    return use


def main():
    mode = sys.argv[1]
    sep = sys.argv.index("--")
    cxx, include = sys.argv[2:sep], sys.argv[sep + 1]
    if mode == "warnings":
        return check_warnings(cxx, include, sys.argv[sep + 2])
    if mode == "precompiled":
        return check_precompiled(cxx, include, sys.argv[sep + 2])
    if mode == "engines":
        return check_engines(cxx, include, sys.argv[sep + 2])
    jobs = []
    flags = ("-std=c++20", "-fsyntax-only", *WARNINGS)
    with contextlib.ExitStack() as stack, \
            concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        if mode == "headers":
            for rel in public_headers(cxx, include):
                src = f'#include "{rel}"\n#include "{rel}"  // twice: #pragma once\nint main() {{}}\n'
                jobs.append(pool.submit(compile_source, cxx, include, src, rel, flags))
        elif mode == "headers-together":
            headers = public_headers(cxx, include)
            src = "".join(f'#include "{rel}"\n' for rel in headers) + "int main() {}\n"
            jobs.append(pool.submit(compile_source, cxx, include, src, f"all {len(headers)} public headers", flags))
        else:
            work = tempfile.TemporaryDirectory()
            stack.callback(work.cleanup)
            pch_flags = precompile_umbrella(cxx, include, work.name)
            for name, code, _ in FAIL_CASES:
                src = f'#include "zero/zero.hpp"\n{code}\nint main() {{}}\n'
                jobs.append(pool.submit(compile_source, cxx, include, src, name,
                                        ("-std=c++20", "-fsyntax-only", *pch_flags)))
            for name, header, _ in OLD_STANDARD_CASES:
                src = f'#include "{header}"\nint main() {{}}\n'
                jobs.append(pool.submit(compile_source, cxx, include, src, name, (OLD_STANDARD, "-fsyntax-only")))
        results = [j.result() for j in jobs]
    failed = 0
    expected = {name: text for name, _, text in FAIL_CASES + OLD_STANDARD_CASES}
    first_only = {name for name, _, _ in OLD_STANDARD_CASES} | FIRST_ERROR_CASES
    for label, rc, out in sorted(results):
        if mode.startswith("headers"):
            ok = rc == 0 and out.strip() == ""
            why = "" if ok else "\n" + out[:3000]
        else:
            # The old-standard cases (and FIRST_ERROR_CASES) must say it first, before any error it would cause.
            texts = expected[label] if isinstance(expected[label], tuple) else (expected[label],)
            said = any(text in (first_error(out) if label in first_only else out) for text in texts)
            ok = rc != 0 and said
            why = "" if ok else (" (compiled successfully)" if rc == 0 else f" (message {' or '.join(texts)} missing)\n{out[:3000]}")
        print(f"{'ok  ' if ok else 'FAIL'} {label}{why}")
        failed += not ok
    print(f"{len(results) - failed} passed, {failed} failed")
    return 1 if failed or not results else 0


if __name__ == "__main__":
    sys.exit(main())
