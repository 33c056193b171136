#!/usr/bin/env bash
# Why: Open MPI's rsh launcher starts one daemon (orted) per host through an
# "rsh agent" that it calls like ssh:  AGENT [options] HOST COMMAND...
# bench/netns_link.sh names its two simulated nodes after their network
# namespaces (zero-node0, zero-node1), so this agent's whole job is to run
# COMMAND inside the namespace called HOST:
#
#   mpirun --mca plm_rsh_agent bench/netns_rsh.sh --hostfile H ...
#
# Two details make the namespaces behave like two machines:
#  - COMMAND is one shell command line, as ssh would pass it to the remote
#    shell (Open MPI quotes its arguments for that), so it runs under sh -c.
#  - Every namespace gets its own UTS namespace with the host name set to the
#    namespace's name. All namespaces otherwise share the machine's host name,
#    and Open MPI builds names of per-node files from it: the shared-memory
#    BTL's segment files (/dev/shm/vader_segment.<host>.<job>.<local rank>)
#    of local rank 0 on node 0 and local rank 0 on node 1 would be the same
#    file, and the job crashes in MPI_Init's first collective (seen with Open
#    MPI 4.1.4). With distinct host names the session directories and the
#    segments are per node, and MPI_Get_processor_name tells the nodes apart.
#
# The environment passes through unchanged (ip netns exec and sh -c keep it),
# so the daemons and the ranks see mpirun's PATH, LD_LIBRARY_PATH and OMPI_*.
# Exit status 255 for the agent's own errors, as ssh does.
set -euo pipefail

# Skip options an ssh-style caller may put before the host name (Open MPI
# passes none to an agent whose name is not ssh, but tolerate them).
while [[ $# -gt 0 && $1 == -* ]]; do shift; done
if [[ $# -lt 2 ]]; then
  echo "netns_rsh: usage: netns_rsh.sh HOST COMMAND..." >&2
  exit 255
fi
host=$1
shift
# Only the namespaces netns_link.sh makes: this runs as root.
if [[ ! $host =~ ^zero-node[0-9]+$ ]]; then
  echo "netns_rsh: '$host' is not a netns_link.sh node (zero-nodeN)" >&2
  exit 255
fi
if [[ ! -e /run/netns/$host ]]; then
  echo "netns_rsh: no network namespace '$host' (bench/netns_link.sh up?)" >&2
  exit 255
fi
# shellcheck disable=SC2016  # $1 and $* belong to the inner shell
exec ip netns exec "$host" unshare --uts -- \
  /bin/sh -c 'hostname "$1" && shift && exec /bin/sh -c "$*"' netns_rsh "$host" "$@"
