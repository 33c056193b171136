// Why: LocalGroup::run rethrows the exception of the rank that failed first
// in time, and a check made on every rank (a checkpoint load verifying its
// files) fails on every rank at once: the rank that read the damaged file
// names it, the others say that it failed elsewhere, and which of them is
// first is a race. The soak test (tests/examples/soak_trainer.py) saw the
// trainer print only "reading the rank files failed on rank(s) 0 (their
// errors name the file and the problem)", without rank 0's error. So the
// example programs report every failed rank's own error, one per line.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdio>
#include <exception>
#include <string>
#include <vector>

#include "zero/comm/local.hpp"
#include "zero/error.hpp"

namespace zero::examples {

// group.run(fn); when ranks fail, throws a zero::Error whose message holds
// each failed rank's error on its own line ("rank 0: ...", lowest rank
// first), leaving out the CommErrors of ranks released from a collective
// because another failed, when some rank has another error.
template <class Fn>
void run_local_ranks(comm::LocalGroup& group, Fn&& fn) {
  struct Failure {
    std::string what;
    bool released = false;  // a CommError: a collective failed, maybe because another rank did
  };
  std::vector<Failure> failures(static_cast<std::size_t>(group.size()));
  try {
    group.run([&](comm::Local& comm) {
      Failure& mine = failures[static_cast<std::size_t>(comm.rank())];
      try {
        fn(comm);
      } catch (const CommError& e) {
        mine = {e.what(), true};
        throw;
      } catch (const std::exception& e) {
        mine = {e.what(), false};
        throw;
      }
    });
  } catch (const std::exception&) {
    bool any_own = false;
    std::size_t failed = 0;
    for (const Failure& f : failures) {
      any_own = any_own || (!f.what.empty() && !f.released);
      failed += !f.what.empty();
    }
    if (failed <= 1) throw;  // one error: as it is
    std::string message;
    for (std::size_t r = 0; r < failures.size(); ++r)
      if (!failures[r].what.empty() && !(any_own && failures[r].released))
        message += (message.empty() ? "" : "\n") + ("rank " + std::to_string(r) + ": ") + failures[r].what;
    throw Error(message);
  }
}

// Prints `what` to stderr, every line of it as "error: <line>" (the form
// the example programs' tests read).
inline void print_error(const std::string& what) {
  std::size_t begin = 0;
  do {
    const std::size_t end = std::min(what.find('\n', begin), what.size());
    std::fprintf(stderr, "error: %.*s\n", static_cast<int>(end - begin), what.data() + begin);
    begin = end + 1;
  } while (begin < what.size());
}

}  // namespace zero::examples
