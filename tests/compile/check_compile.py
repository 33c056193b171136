#!/usr/bin/env python3
"""Compile-time contract of the library, checked with the real compiler.

  check_compile.py headers  CXX... -- INCLUDE_DIR   every public header compiles on its own
  check_compile.py fail     CXX... -- INCLUDE_DIR   each nonsensical configuration fails with
                                                    its plain-English static_assert

CXX is the compiler command (as Meson gives it). Exits non-zero naming the
header or case that broke the contract.
"""
import concurrent.futures
import os
import subprocess
import sys
import tempfile

# (name, code, text the compiler must print)
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
    ("offload_unavailable",
     "using O = zero::ZeroOptimizer<zero::precision::Mixed<zero::bf16>, zero::optim::AdamW, zero::stage<2>,"
     " zero::offload::Nvme, zero::backend::Cuda>; static_assert(sizeof(O) > 0);",
     "not available in this version"),
    ("not_an_optimizer",
     "struct NoUpdate { static constexpr const char* name = \"x\"; static constexpr int state_slots = 0;"
     " struct Hyper { void validate() const {} }; struct Scalars {};"
     " static Scalars prepare(const Hyper&, long) { return {}; } };"
     " using O = zero::ZeroOptimizer<zero::precision::Full<float>, NoUpdate, zero::stage<1>,"
     " zero::offload::None, zero::backend::Host>; O* o = nullptr;",
     "Policy<Optimizer>"),
    ("not_a_communicator",
     "struct NotComm { int rank() const { return 0; } };"
     " using O = zero::ZeroOptimizer<zero::precision::Full<float>, zero::optim::Sgd, zero::stage<1>,"
     " zero::offload::None, zero::backend::Host>;"
     " void f(NotComm& c) { O o(c, {}); }",
     "Communicator<Comm>"),
]

# Headers that need something g++ alone does not have.
SKIP = {"zero/comm/mpi.hpp", "zero/comm/mpi_c_api.hpp"}  # need mpi.h: compiled by the MPI tests


def compile_source(cxx, include, source, label):
    with tempfile.NamedTemporaryFile("w", suffix=".cpp", delete=False) as f:
        f.write(source)
        path = f.name
    try:
        r = subprocess.run(cxx + ["-std=c++20", "-fsyntax-only", "-fopenmp", "-I", include, path],
                           capture_output=True, text=True)
        return label, r.returncode, r.stdout + r.stderr
    finally:
        os.unlink(path)


def main():
    mode = sys.argv[1]
    sep = sys.argv.index("--")
    cxx, include = sys.argv[2:sep], sys.argv[sep + 1]
    jobs = []
    with concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        if mode == "headers":
            for root, _, files in os.walk(os.path.join(include, "zero")):
                for name in sorted(files):
                    if not name.endswith(".hpp"):
                        continue
                    rel = os.path.relpath(os.path.join(root, name), include)
                    if rel in SKIP:
                        continue
                    src = f'#include "{rel}"\n#include "{rel}"  // twice: #pragma once\nint main() {{}}\n'
                    jobs.append(pool.submit(compile_source, cxx, include, src, rel))
        else:
            for name, code, _ in FAIL_CASES:
                src = f'#include "zero/zero.hpp"\n{code}\nint main() {{}}\n'
                jobs.append(pool.submit(compile_source, cxx, include, src, name))
        results = [j.result() for j in jobs]
    failed = 0
    expected = {name: text for name, _, text in FAIL_CASES}
    for label, rc, out in sorted(results):
        if mode == "headers":
            ok = rc == 0
            why = "" if ok else "\n" + out[:3000]
        else:
            ok = rc != 0 and expected[label] in out
            why = "" if ok else (" (compiled successfully)" if rc == 0 else f" (message '{expected[label]}' missing)\n{out[:3000]}")
        print(f"{'ok  ' if ok else 'FAIL'} {label}{why}")
        failed += not ok
    print(f"{len(results) - failed} passed, {failed} failed")
    return 1 if failed or not results else 0


if __name__ == "__main__":
    sys.exit(main())
