#!/usr/bin/env python3
"""Every host kernel compiled whole for its instruction set.

  check_isa_inlined.py OBJECT-OR-ARCHIVE...

A per-instruction-set body (zero/simd/dispatch.hpp) is compiled by inlining
all it calls into simd::detail::run_avx512 / run_avx2, which carry the target
attributes. A function instantiated for an instruction set (zero::simd::Avx512
or Avx2 among its template arguments, or one of their helpers) that the
optimized build still holds as a function of its own was not inlined: a
body's function is then compiled for baseline x86-64, and a helper is called
out of line, the whole step many times slower (Clang 14 before ZERO_FLATTEN,
zero/compiler.hpp: the bf16 AdamW step 10x g++'s). Reads the symbol tables with readelf; fails
naming each such function.
"""
import re
import subprocess
import sys

ISA = re.compile(r"zero::simd::Avx(512|2)\b")
ENTRY = re.compile(r"^void zero::simd::detail::run_avx(512|2)<")


def functions(path):
    """The names of the functions `path` defines."""
    out = subprocess.run(["readelf", "-sW", "--demangle", path], capture_output=True, text=True, check=True).stdout
    names = []
    for line in out.splitlines():
        # Num: Value Size Type Bind Vis Ndx Name
        fields = line.split(None, 7)
        if len(fields) == 8 and fields[3] == "FUNC" and fields[6] != "UND":
            names.append(fields[7])
    return names


def main(paths):
    if not paths:
        print(__doc__)
        return 2
    entries = 0
    left = set()
    for path in paths:
        for name in functions(path):
            if ENTRY.match(name):
                entries += 1
            elif ISA.search(name):
                left.add(name)
    if entries == 0:
        # Nothing to check would pass anything: the objects must hold kernels.
        print(f"no simd::detail::run_avx512/run_avx2 entry in {' '.join(paths)}: not the objects of host kernels "
              "(or a build without host SIMD)")
        return 1
    if left:
        print(f"{len(left)} function(s) instantiated for an instruction set were not inlined into their "
              "run_avx512/run_avx2 entry (a body's function compiled for baseline x86-64, or a helper called out "
              "of line); give each function and lambda between the body's run and the helpers ZERO_FLATTEN "
              "(zero/compiler.hpp):")
        for name in sorted(left):
            print("  " + name)
        return 1
    print(f"{entries} entries, every per-instruction-set function inlined into one")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
