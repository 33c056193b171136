#!/usr/bin/python3
"""Runs a command as its child and writes the child's peak resident memory
(getrusage's ru_maxrss of that one process, through wait4) to DIR/rss.<pid>,
in KiB; exits with the child's status. peers.py puts it between mpirun and
each MPI rank, whose peaks it cannot otherwise tell apart (mpirun's own
rusage keeps only the largest of its children).

    peak_rss.py DIR -- COMMAND [ARGS...]
"""
import os
import sys


def main():
    if len(sys.argv) < 4 or sys.argv[2] != "--":
        sys.exit(__doc__)
    folder, command = sys.argv[1], sys.argv[3:]
    pid = os.fork()
    if pid == 0:
        try:
            os.execvp(command[0], command)
        finally:
            os._exit(127)
    _, status, usage = os.wait4(pid, 0)
    with open(os.path.join(folder, f"rss.{pid}"), "w") as f:
        f.write(f"{usage.ru_maxrss}\n")
    sys.exit(os.waitstatus_to_exitcode(status) if hasattr(os, "waitstatus_to_exitcode") else status >> 8)


if __name__ == "__main__":
    main()
