// The checkpoint tests' per-rank error capture: fn(comm) on `ranks` in-process
// ranks, and each rank's zero::Error message ("" where fn returned); any other
// exception is marked "not a zero::Error: ...", which the tests refuse.
#pragma once

#include <exception>
#include <string>
#include <vector>

#include "zero/comm/local.hpp"
#include "zero/error.hpp"

namespace zero::test {

template <class Fn>
std::vector<std::string> rank_errors(int ranks, Fn&& fn) {
  std::vector<std::string> errors(static_cast<std::size_t>(ranks));
  zero::comm::LocalGroup group(ranks);
  group.run([&](zero::comm::Local& comm) {
    auto& error = errors[static_cast<std::size_t>(comm.rank())];
    try {
      fn(comm);
    } catch (const zero::Error& e) {
      error = e.what();
    } catch (const std::exception& e) {
      error = std::string("not a zero::Error: ") + e.what();
    }
  });
  return errors;
}

}  // namespace zero::test
