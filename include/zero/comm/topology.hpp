// Why: across nodes the link is ten to a hundred times slower than inside
// one, so what matters at scale is not how many bytes a rank sends but how
// many of them leave its node. A communicator knows how its ranks sit on
// nodes (a Topology), counts the bytes that cross (ByteCounters::across),
// and splits into the ranks of its own node and the ranks at its place on
// every other node (node() and across() of comm::Local, comm::Mpi and
// comm::Nccl), the two communicators that hierarchical collectives (ZeRO++'s
// hpZ and qgZ) are built from.
//
// Placement: ranks fill nodes in order, `ranks_per_node` to a node (rank r
// is on node r / ranks_per_node), as Open MPI places them by slot (its
// default) and SLURM's block distribution does.
//
// Counting rule: a flat collective runs as a ring in rank order (what
// ByteCounters counts; comm/communicator.hpp), in which rank r sends to
// r + 1. Its bytes cross nodes exactly when r is the last rank of its node
// and there is more than one node: of a ring's N links, one per node
// crosses. Summed over the ranks this is the traffic through the nodes'
// network links; per rank it is all of the sends of the last rank of each
// node and none of the others'. all_to_all is not a ring but a direct
// exchange (each block goes straight to its rank), and not this rule: of a
// rank's N - 1 blocks, the N - ranks_per_node addressed to ranks on other
// nodes cross (ByteCounters::count_all_to_all).
#pragma once

#include "zero/compiler.hpp"

#include "zero/error.hpp"

namespace zero::comm {

struct Topology {
  int ranks = 1;
  int ranks_per_node = 1;

  // One node holding every rank (a communicator that says nothing else).
  static Topology one_node(int ranks) { return Topology{ranks, ranks}; }
  // `ranks_per_node` ranks to a node; 0 means one node of every rank. `who`
  // names the setting in the error.
  static Topology checked(int ranks, int ranks_per_node, const char* who) {
    require(ranks >= 1, who, ": a communicator of ", ranks, " ranks");
    if (ranks_per_node == 0) return one_node(ranks);
    require(ranks_per_node >= 1 && ranks % ranks_per_node == 0, who, " is ", ranks_per_node, ", which does not divide ",
            ranks, " ranks into whole nodes; use a divisor of ", ranks,
            " (0 or the rank count: one node; nodes with different rank counts are not supported)");
    return Topology{ranks, ranks_per_node};
  }

  int nodes() const { return ranks / ranks_per_node; }
  int node_of(int rank) const { return rank / ranks_per_node; }
  // The rank's place in its node (its rank in node()), which is also its
  // node's rank in across().
  int local_rank(int rank) const { return rank % ranks_per_node; }
  // Whether rank's sends in a flat ring collective leave its node.
  bool ring_send_crosses(int rank) const { return nodes() > 1 && node_of(rank) != node_of((rank + 1) % ranks); }

  bool operator==(const Topology&) const = default;
};

}  // namespace zero::comm
