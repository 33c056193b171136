#!/usr/bin/env python3
"""Runs mpi_failure_program (2 ranks, rank 1 misbehaves) under mpirun with a hard
timeout and checks that the job ends, how soon, with which exit code and which
message on stderr. A job still running at the hard timeout is a hang: its whole
process group is killed and the check fails.

    check_mpi_failure.py SCENARIO MPIRUN [MPIRUN ARGS...] -- PROGRAM
"""
import os
import re
import signal
import subprocess
import sys
import time

TIMEOUT_MS = 3000                      # comm::Mpi::Options::timeout given to the program
HARD_LIMIT_S = TIMEOUT_MS / 1000 + 40  # then the job is taken as hung
SLACK_S = 12                           # "within a few seconds": mpirun start-up and tear-down on a busy machine

# scenario: (exit code 0?, patterns stderr (or stdout, for `none`) must match, ended by comm::Mpi's timeout?)
EXPECT = {
    "none": (True, [r"trained 3 steps"], False),
    "throw": (False, [r"comm::Mpi: rank 1 of 2 ends the job \(MPI_Abort\).*"
                      r"rank 1 failed before finalize\(\) \(scenario throw\)"], False),
    "throw_caught": (False, [r"comm::Mpi rank 0 of 2: all_gather #1 \(\d+ elements? of u64 per rank\) did not "
                             r"complete within 3000 ms", r"MPI_Abort"], True),
    "skip_grad_ready": (False, [r"comm::Mpi: rank 1 of 2 ends the job \(MPI_Abort\).*"
                                r"unit 'layer0' has no gradient in this micro-batch"], False),
    "skip_step": (False, [r"comm::Mpi rank 0 of 2: reduce_scatter #\d+ \(\d+ elements of fp32 per rank\) did not "
                          r"complete within 3000 ms", r"MPI_Abort"], True),
}


def main():
    scenario = sys.argv[1]
    sep = sys.argv.index("--")
    command = sys.argv[2:sep] + sys.argv[sep + 1:] + [scenario, str(TIMEOUT_MS)]
    ok_exit, patterns, by_timeout = EXPECT[scenario]
    print("$", " ".join(command), flush=True)
    start = time.monotonic()
    job = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           start_new_session=True)
    try:
        out, err = job.communicate(timeout=HARD_LIMIT_S)
    except subprocess.TimeoutExpired:
        os.killpg(job.pid, signal.SIGKILL)
        out, err = job.communicate()
        print(out[-3000:], err[-3000:], sep="\n")
        print(f"FAIL: the job hung: still running after {HARD_LIMIT_S:.0f} s (killed)")
        return 1
    seconds = time.monotonic() - start
    print(out[-3000:], err[-6000:], sep="\n")
    print(f"scenario {scenario}: exit code {job.returncode} after {seconds:.1f} s "
          f"(comm::Mpi timeout {TIMEOUT_MS / 1000:.1f} s)")
    failures = []
    if (job.returncode == 0) != ok_exit:
        failures.append(f"exit code {job.returncode}, expected {'0' if ok_exit else 'non-zero'}")
    text = out if ok_exit else err
    flat = " ".join(text.split())  # Open MPI's help text may wrap lines
    for pattern in patterns:
        if not re.search(pattern, flat):
            failures.append(f"no match for /{pattern}/ in {'stdout' if ok_exit else 'stderr'}")
    limit = (TIMEOUT_MS / 1000 if by_timeout else 0) + SLACK_S
    if seconds > limit:
        failures.append(f"took {seconds:.1f} s, more than {limit:.0f} s")
    if by_timeout and seconds < TIMEOUT_MS / 1000:
        failures.append(f"ended after {seconds:.1f} s, before the {TIMEOUT_MS / 1000:.0f} s timeout could fire")
    for f in failures:
        print("FAIL:", f)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
