#!/usr/bin/env python3
"""Runs mpi_failure_program (rank 1 misbehaves) under mpirun with a hard timeout
and checks that the whole job ends (mpirun itself exits), how soon, with which
exit code and which message on stderr. A job still running at the hard timeout
is a hang: its whole process group is killed and the check fails.

    check_mpi_failure.py SCENARIO MPIRUN [MPIRUN ARGS...] -np N [...] -- PROGRAM

Scenarios that must not wait for comm::Mpi's timeout run with a long one
(LONG_TIMEOUT_MS), so a job that ends only by it is past the hard limit.
"""
import os
import re
import signal
import subprocess
import sys
import time

TIMEOUT_MS = 3000          # comm::Mpi::Options::timeout given to the program where the timeout ends the job
LONG_TIMEOUT_MS = 120000   # and where it must not be what ends it
SLACK_S = 12               # "within a few seconds": mpirun start-up and tear-down on a busy machine
HANG_S = 30                # past the expected end by this much, the job is taken as hung

# scenario: (exit code 0?, patterns stderr (or stdout, for `none`) must match, ended by comm::Mpi's timeout?);
# {n} is the number of ranks. A rank that left is told to every waiting rank: any of them may print first.
LEFT = (r"comm::Mpi rank [02-9]\d* of {n}: rank 1 left \(returned from main: its zero::comm::MpiRuntime was "
        r"destroyed\) while this rank waits in ")
EXPECT = {
    "none": (True, [r"trained 3 steps"], False),
    "throw": (False, [r"comm::Mpi: rank 1 of {n} ends the job \(MPI_Abort\).*"
                      r"rank 1 failed before finalize\(\) \(scenario throw\)"], False),
    "throw_no_abort": (False, [r"comm::Mpi: rank 1 of {n} ends the job \(MPI_Abort\): this rank exits after an "
                               r"exception unwound past zero::comm::MpiRuntime"], False),
    "throw_caught": (False, [LEFT + r"all_gather #1 \(\d+ elements? of u64 per rank\) in finalize\(\)",
                             r"MPI_Abort"], False),
    "skip_grad_ready": (False, [r"comm::Mpi: rank 1 of {n} ends the job \(MPI_Abort\).*"
                                r"unit 'layer0' has no gradient in this micro-batch"], False),
    "skip_step": (False, [LEFT + r"reduce_scatter #\d+ \(\d+ elements of fp32 per rank\) in grad_ready\(\)",
                          r"MPI_Abort"], False),
    "hang": (False, [r"comm::Mpi rank [02-9]\d* of {n}: all_gather #1 \(\d+ elements? of u64 per rank\) in "
                     r"finalize\(\) did not complete within 3000 ms", r"MPI_Abort"], True),
}


def main():
    scenario = sys.argv[1]
    sep = sys.argv.index("--")
    ok_exit, patterns, by_timeout = EXPECT[scenario]
    timeout_ms = TIMEOUT_MS if by_timeout else LONG_TIMEOUT_MS
    command = sys.argv[2:sep] + sys.argv[sep + 1:] + [scenario, str(timeout_ms)]
    ranks = sys.argv[sys.argv.index("-np") + 1]
    patterns = [p.replace("{n}", ranks) for p in patterns]
    limit = (TIMEOUT_MS / 1000 if by_timeout else 0) + SLACK_S
    print("$", " ".join(command), flush=True)
    start = time.monotonic()
    job = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           start_new_session=True)
    try:
        out, err = job.communicate(timeout=limit + HANG_S)
    except subprocess.TimeoutExpired:
        os.killpg(job.pid, signal.SIGKILL)
        out, err = job.communicate()
        print(out[-3000:], err[-3000:], sep="\n")
        print(f"FAIL: the job hung: still running after {limit + HANG_S:.0f} s (killed)")
        return 1
    seconds = time.monotonic() - start
    print(out[-3000:], err[-6000:], sep="\n")
    print(f"scenario {scenario}: exit code {job.returncode} after {seconds:.1f} s "
          f"(comm::Mpi timeout {timeout_ms / 1000:.1f} s)")
    failures = []
    if (job.returncode == 0) != ok_exit:
        failures.append(f"exit code {job.returncode}, expected {'0' if ok_exit else 'non-zero'}")
    text = out if ok_exit else err
    flat = " ".join(text.split())  # Open MPI's help text may wrap lines
    for pattern in patterns:
        if not re.search(pattern, flat):
            failures.append(f"no match for /{pattern}/ in {'stdout' if ok_exit else 'stderr'}")
    if seconds > limit:
        failures.append(f"took {seconds:.1f} s, more than {limit:.0f} s")
    if by_timeout and seconds < TIMEOUT_MS / 1000:
        failures.append(f"ended after {seconds:.1f} s, before the {TIMEOUT_MS / 1000:.0f} s timeout could fire")
    for f in failures:
        print("FAIL:", f)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
