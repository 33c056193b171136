// Why: a run must resume on any number of ranks, at any stage, after any
// crash. Saving: each rank writes its ranges of every state slot to
// rank-<r>-of-<N>.safetensors (temporary name, fsync, rename), every rank
// confirms through a collective, and only then rank 0 writes manifest.json,
// the file that makes the checkpoint exist. Loading: each rank reads the
// manifest, computes which byte ranges of which files overlap the ranges it
// owns now (whatever N and stage wrote them) and preads only those, checking
// a checksum for every chunk it reads; nothing is written into the model
// until every rank has read and verified its part, so a bad checkpoint is an
// error on every rank, never a partial load.
//
// CheckpointReader reads any range of a checkpoint without the program that
// saved it (the Hugging Face export and the zero_checkpoint tool use it).
//
// The engine plugs in through StateSource: the units and parameters, the
// state slots, the element ranges this rank holds, and reads and writes of
// them. Ranks talk through Collective: one all-gather of a 64-bit value.
#pragma once

#include "zero/compiler.hpp"

#include <algorithm>
#include <charconv>
#include <cstdint>
#include <cstring>
#include <exception>
#include <filesystem>
#include <functional>
#include <map>
#include <new>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "zero/checkpoint/files.hpp"
#include "zero/checkpoint/manifest.hpp"
#include "zero/checkpoint/safetensors.hpp"
#include "zero/comm/communicator.hpp"
#include "zero/error.hpp"
#include "zero/names.hpp"
#include "zero/precision/convert.hpp"
#include "zero/precision/types.hpp"

namespace zero::checkpoint {

// Elements [begin, begin + count) of unit `unit`'s unpadded data.
struct OwnedRange {
  std::size_t unit = 0;
  std::uint64_t begin = 0, count = 0;
  friend bool operator==(const OwnedRange&, const OwnedRange&) = default;
};

// What the engine implements. Element ranges are in the unit's unpadded
// coordinates (parameter offsets as registered, alignment gaps included,
// sharding padding excluded), so they mean the same for every rank count.
class StateSource {
 public:
  virtual ~StateSource() = default;
  virtual std::vector<UnitDesc> units() const = 0;
  virtual std::vector<SlotDesc> slots() const = 0;
  // The ranges this rank holds; load fills exactly these, for every slot.
  virtual std::vector<OwnedRange> owned() const = 0;
  // The ranges this rank writes on save. Across ranks they must tile every
  // unit exactly once (the saver checks): the owned ranges when ranks own
  // disjoint shards; a split of the replica at stage 0, where all own all.
  virtual std::vector<OwnedRange> save_ranges() const { return owned(); }
  // Copy a sub-range of an owned range of `slot` (an index into slots()) to
  // or from host memory, in the slot's dtype.
  virtual void read(std::size_t slot, const OwnedRange& range, void* dst) const = 0;
  virtual void write(std::size_t slot, const OwnedRange& range, const void* src) = 0;
  // Scalars saved beside the tensors (step, loss scaler, optimizer, ...).
  virtual RunState run_state() const = 0;
};

// The collective the ranks agree through: every rank passes one value and
// gets every rank's, in rank order. make_collective(comm) builds it from a
// communicator; a single process needs none.
struct Collective {
  std::uint64_t rank = 0, size = 1;
  std::function<std::vector<std::uint64_t>(std::uint64_t)> all_gather_u64 = [](std::uint64_t v) {
    return std::vector<std::uint64_t>{v};
  };
};

template <comm::Communicator C>
Collective make_collective(C& comm) {
  Collective c;
  c.rank = static_cast<std::uint64_t>(comm.rank());
  c.size = static_cast<std::uint64_t>(comm.size());
  c.all_gather_u64 = [&comm](std::uint64_t v) {
    std::vector<std::uint64_t> all(static_cast<std::size_t>(comm.size()));
    all[static_cast<std::size_t>(comm.rank())] = v;
    comm.all_gather(&all[static_cast<std::size_t>(comm.rank())], all.data(), 1, DType::u64, true);
    return all;
  };
  return c;
}

struct SaveOptions {
  std::uint64_t checksum_chunk_bytes = default_checksum_chunk_bytes;
  // Host memory each rank streams its state through on a synchronous save
  // (rounded to whole checksum chunks); an asynchronous save copies all of it.
  std::size_t io_buffer_bytes = std::size_t{16} << 20;
  // save_step: once the new checkpoint is complete, keep only the K newest
  // complete step-* checkpoints under the root (0: keep all). See
  // remove_old_checkpoints.
  std::uint64_t keep_last = 0;
};

struct LoadOptions {
  std::size_t io_buffer_bytes = std::size_t{16} << 20;  // each pread reads at most this much
};

struct LoadResult {
  std::filesystem::path directory;  // the checkpoint loaded (the newest complete one under a root)
  Manifest manifest;                // its run state: step, loss scaler, seed, hyper-parameters
  std::vector<std::string> slots_not_loaded;  // optional slots the checkpoint lacks (derive them)
  std::uint64_t bytes_read = 0;              // by this rank, from rank files
};

inline std::string rank_file_name(std::uint64_t rank, std::uint64_t size) {
  return "rank-" + std::to_string(rank) + "-of-" + std::to_string(size) + ".safetensors";
}
// What each rank leaves beside its file for rank 0: its FileRecord.
inline std::string rank_record_name(std::uint64_t rank, std::uint64_t size) {
  return "rank-" + std::to_string(rank) + "-of-" + std::to_string(size) + ".json";
}
inline constexpr const char* latest_file_name = "latest";

// root/step-000000123: where Checkpointer::save_step puts step 123.
inline std::filesystem::path step_directory(const std::filesystem::path& root, std::uint64_t step) {
  std::string digits = std::to_string(step);
  if (digits.size() < 9) digits.insert(0, 9 - digits.size(), '0');
  return root / ("step-" + digits);
}

namespace detail {

inline std::optional<std::uint64_t> step_of(const std::string& name) {
  if (name.rfind("step-", 0) != 0 || name.size() == 5) return std::nullopt;
  std::uint64_t v = 0;
  const char* b = name.data() + 5;
  const char* e = name.data() + name.size();
  auto [p, ec] = std::from_chars(b, e, v);
  if (ec != std::errc() || p != e) return std::nullopt;
  return v;
}

// Runs fn on this rank, then tells every rank whether every rank succeeded:
// a rank that failed rethrows its own error (naming file and problem), the
// others throw one naming the ranks that failed, so no rank hangs in a later
// collective and none goes on alone.
// An error that is not the library's own (a std::filesystem or JSON
// library error that slipped through) becomes a CheckpointError naming the
// directory and the phase, so that every rank gets a zero::Error.
template <class Fn>
void on_every_rank(const Collective& c, const std::filesystem::path& dir, std::string_view phase, Fn&& fn) {
  std::exception_ptr error;
  try {
    fn();
  } catch (const zero::Error&) {
    error = std::current_exception();
  } catch (const std::bad_alloc&) {
    error = std::current_exception();
  } catch (const std::exception& e) {
    error = std::make_exception_ptr(
        CheckpointError(zero::detail::concat(dir.string(), ": ", phase, " failed on rank ", c.rank, ": ", e.what())));
  } catch (...) {
    error = std::current_exception();
  }
  const std::vector<std::uint64_t> flags = c.all_gather_u64(error ? 1 : 0);
  if (error) std::rethrow_exception(error);
  std::string failed;
  for (std::size_t r = 0; r < flags.size(); ++r)
    if (flags[r] != 0) failed += (failed.empty() ? "" : ", ") + std::to_string(r);
  if (!failed.empty())
    fail(dir, phase, " failed on rank(s) ", failed, " (their errors name the file and the problem); rank ", c.rank,
         " stops with them");
}

inline std::size_t element_bytes(DType t) { return dtype_bytes(t); }

// n elements from a file's type to a slot's type (exact, or rounded to
// nearest even when narrowing fp32 to 16 bits).
inline void convert_elements(const void* src, DType f, void* dst, DType to, std::uint64_t n) {
  if (f == to) {
    std::memcpy(dst, src, n * dtype_bytes(to));
    return;
  }
  auto load = [&](std::uint64_t i) {
    switch (f) {
      case DType::f16: { fp16 v; std::memcpy(&v, static_cast<const char*>(src) + 2 * i, 2); return to_float(v); }
      case DType::bf16: { bf16 v; std::memcpy(&v, static_cast<const char*>(src) + 2 * i, 2); return to_float(v); }
      default: { float v; std::memcpy(&v, static_cast<const char*>(src) + 4 * i, 4); return v; }
    }
  };
  for (std::uint64_t i = 0; i < n; ++i) {
    const float x = load(i);
    switch (to) {
      case DType::f16: { const fp16 v = from_float<fp16>(x); std::memcpy(static_cast<char*>(dst) + 2 * i, &v, 2); break; }
      case DType::bf16: { const bf16 v = from_float<bf16>(x); std::memcpy(static_cast<char*>(dst) + 2 * i, &v, 2); break; }
      default: std::memcpy(static_cast<char*>(dst) + 4 * i, &x, 4); break;
    }
  }
}

// The tensors of one rank file, in file order: slots of larger elements
// first (every tensor aligned to its type), then each save range.
inline std::vector<TensorRecord> plan_rank_file(const std::vector<SlotDesc>& slots, const std::vector<UnitDesc>& units,
                                                const std::vector<OwnedRange>& ranges) {
  std::vector<std::size_t> order(slots.size());
  for (std::size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(),
                   [&](std::size_t a, std::size_t b) { return dtype_bytes(slots[a].dtype) > dtype_bytes(slots[b].dtype); });
  std::vector<TensorRecord> out;
  for (std::size_t s : order)
    for (const OwnedRange& r : ranges) {
      if (r.count == 0) continue;
      require(r.unit < units.size() && r.begin <= units[r.unit].numel && r.count <= units[r.unit].numel - r.begin,
              "checkpoint save: range [", r.begin, ", +", r.count, ") of unit ", r.unit, " lies outside the unit");
      TensorRecord t;
      t.name = slots[s].name + "/" + units[r.unit].name + "/" + std::to_string(r.begin) + "+" + std::to_string(r.count);
      t.slot = s;
      t.unit = r.unit;
      t.begin = r.begin;
      t.count = r.count;
      out.push_back(std::move(t));
    }
  return out;
}

// Names the files can hold, checked before anything is written (a source
// other than the engine's Layout, which checks them at add_param, may
// bring any): slots non-empty, without '/' (they start tensor names), UTF-8;
// units UTF-8; parameters as require_saveable_name says.
inline void check_names(const std::vector<SlotDesc>& slots, const std::vector<UnitDesc>& units) {
  for (std::size_t i = 0; i < slots.size(); ++i) {
    const auto& s = slots[i];
    require(!s.name.empty() && s.name.find('/') == std::string::npos, "checkpoint: slot name '", s.name,
            "' must be non-empty and without '/'");
    require_utf8_name("checkpoint", "state slot", s.name);
    for (std::size_t k = 0; k < i; ++k)
      require(slots[k].name != s.name, "checkpoint: two state slots are named '", s.name,
              "' (an optimizer's state_names must differ from each other and from \"master\" and \"param\")");
  }
  for (const auto& u : units) {
    require_utf8_name("checkpoint", "unit", u.name);
    for (const auto& p : u.params) require_saveable_name("checkpoint", "parameter", p.name);
  }
}

}  // namespace detail

// Saves checkpoints; at most one write is in flight. save() with async=false
// returns with the checkpoint complete. With async=true it returns once this
// rank's state is copied to host memory; a background thread writes the rank
// file, and the checkpoint becomes complete at the next finish() (which the
// next save() calls first): the confirmation and the manifest need a
// collective, which must not run on a thread beside training's collectives.
// A crash before that leaves no manifest, so the checkpoint does not exist
// and the previous one is intact. save() and finish() are collective.
class Checkpointer {
 public:
  explicit Checkpointer(Collective collective, SaveOptions options = {})
      : c_(std::move(collective)), options_(options) {
    require(options_.checksum_chunk_bytes > 0 && options_.checksum_chunk_bytes % 8 == 0,
            "SaveOptions::checksum_chunk_bytes must be a positive multiple of 8, got ", options_.checksum_chunk_bytes);
  }
  Checkpointer(const Checkpointer&) = delete;
  Checkpointer& operator=(const Checkpointer&) = delete;
  // Joins a background write but commits nothing (no collective here): call
  // finish() to complete the last asynchronous save.
  ~Checkpointer() {
    if (pending_ && pending_->writer.joinable()) pending_->writer.join();
  }

  // Writes a checkpoint into `dir` (created if needed; a checkpoint already
  // there stops existing first: its manifest goes before any file changes).
  void save(const std::filesystem::path& dir, const StateSource& source, bool async = false) {
    write(dir, std::nullopt, source, async);
  }
  // Writes root/step-<step>/ and, once complete, points root/latest at it
  // (and applies SaveOptions::keep_last).
  void save_step(const std::filesystem::path& root, const StateSource& source, bool async = false) {
    write(step_directory(root, source.run_state().step), root, source, async);
  }
  // Writes `dir`; with `root`, as save_step does once complete.
  void write(const std::filesystem::path& dir, std::optional<std::filesystem::path> root, const StateSource& source,
             bool async);

  bool pending() const { return pending_.has_value(); }

  // Removes all but the `keep` newest complete step-* checkpoints under
  // `root` (keep >= 1: the newest complete one always stays), and the step-*
  // directories without a manifest older than the newest complete one (what
  // interrupted saves left). Each loses its manifest first (and the
  // directory is fsynced), so a removal cut short leaves an incomplete
  // directory, never a checkpoint with files missing.
  static void remove_old_checkpoints(const std::filesystem::path& root, std::uint64_t keep);

  // Completes the write in flight, if any (collective): waits for this
  // rank's file, confirms every rank's, rank 0 writes the manifest.
  void finish() {
    if (!pending_) return;
    if (pending_->writer.joinable()) pending_->writer.join();  // it works on *pending_: join before moving
    Pending p = std::move(*pending_);
    pending_.reset();
    detail::on_every_rank(c_, p.dir, "writing the rank files", [&] {
      if (p.error) std::rethrow_exception(p.error);
    });
    detail::on_every_rank(c_, p.dir, "writing the manifest", [&] {
      if (c_.rank != 0) return;
      Manifest m = std::move(p.manifest);
      for (std::uint64_t r = 0; r < c_.size; ++r) {
        const auto record_path = p.dir / rank_record_name(r, c_.size);
        const nlohmann::json j =
            checkpoint::detail::parse_json_strict(read_whole_file(record_path), record_path, "the rank record");
        m.files.push_back(parse_file_record(j, "", checkpoint::detail::ManifestFields(record_path)));
      }
      validate_manifest(m, p.dir / manifest_file_name);
      write_file_atomically(p.dir / manifest_file_name, manifest_to_json(m).dump(1));
      if (p.root) write_file_atomically(*p.root / latest_file_name, p.dir.filename().string() + "\n");
    });
    if (p.root && options_.keep_last > 0)
      detail::on_every_rank(c_, *p.root, "removing old checkpoints", [&] {
        if (c_.rank == 0) remove_old_checkpoints(*p.root, options_.keep_last);
      });
  }

 private:
  struct Pending {
    std::filesystem::path dir;
    std::optional<std::filesystem::path> root;
    Manifest manifest;  // without files: rank 0 adds them from the rank records
    std::vector<std::vector<char>> snapshot;  // async: each tensor's bytes
    std::thread writer;
    std::exception_ptr error;
  };

  // Streams this rank's file through one buffer of whole checksum chunks,
  // hashing each chunk, then leaves its record beside it for rank 0.
  template <class Fetch>
  static void write_rank_file(const std::filesystem::path& dir, std::uint64_t rank, std::uint64_t size,
                              const SaveOptions& options, const std::vector<SlotDesc>& slots,
                              std::vector<TensorRecord> plan, Fetch&& fetch) {
    std::vector<TensorSpec> specs;
    for (const auto& t : plan) specs.push_back({t.name, tensor_type_of(slots[t.slot].dtype), {t.count}});
    const auto path = dir / rank_file_name(rank, size);
    const std::uint64_t chunk = options.checksum_chunk_bytes;
    const std::uint64_t piece = std::max<std::uint64_t>(chunk, options.io_buffer_bytes / chunk * chunk);
    SafetensorsWriter out(path, specs, {{"format", "zero-checkpoint"}}, 0);
    std::vector<char> buffer;
    for (std::size_t i = 0; i < plan.size(); ++i) {
      TensorRecord& t = plan[i];
      const std::uint64_t es = dtype_bytes(slots[t.slot].dtype);
      const std::uint64_t bytes = t.count * es;
      for (std::uint64_t at = 0; at < bytes; at += piece) {
        const std::uint64_t n = std::min(piece, bytes - at);
        buffer.resize(static_cast<std::size_t>(n));
        fetch(i, at / es, n / es, buffer.data());
        const auto sums = chunk_checksums(buffer.data(), n, chunk);
        t.chunk_xxh3.insert(t.chunk_xxh3.end(), sums.begin(), sums.end());
        out.write(buffer.data(), static_cast<std::size_t>(n));
      }
    }
    out.commit();
    FileRecord record;
    record.name = path.filename().string();
    record.rank = rank;
    std::error_code ec;
    record.bytes = std::filesystem::file_size(path, ec);
    if (ec) fail(path, "cannot read the size of the file just written: ", ec.message());
    record.tensors = std::move(plan);
    write_file_atomically(dir / rank_record_name(rank, size), file_record_to_json(record).dump());
  }

  Collective c_;
  SaveOptions options_;
  std::optional<Pending> pending_;
};

inline void Checkpointer::write(const std::filesystem::path& dir, std::optional<std::filesystem::path> root,
                                const StateSource& source, bool async) {
  finish();
  Pending p;
  p.dir = dir;
  p.root = std::move(root);
  std::vector<OwnedRange> ranges;
  std::vector<SlotDesc> slots;
  std::vector<TensorRecord> plan;
  const auto hashes = c_.all_gather_u64(XXH3_64bits(dir.string().data(), dir.string().size()));
  detail::on_every_rank(c_, dir, "preparing the checkpoint", [&] {
    for (std::size_t r = 0; r < hashes.size(); ++r)
      if (hashes[r] != hashes[0])
        fail(dir, "rank ", r, " saves to another directory than rank 0: every rank must pass the same path");
    p.manifest.run = source.run_state();
    p.manifest.run.world_size = c_.size;
    p.manifest.checksum_chunk_bytes = options_.checksum_chunk_bytes;
    p.manifest.units = source.units();
    slots = source.slots();
    detail::check_names(slots, p.manifest.units);
    for (const auto& s : slots) p.manifest.slots.push_back({s.name, s.dtype});
    ranges = source.save_ranges();
    plan = detail::plan_rank_file(slots, p.manifest.units, ranges);
    // Every rank creates it (each sees why it cannot, a read-only file system
    // or a parent that is a file); rank 0 retires the checkpoint there.
    make_directories(dir, "the checkpoint directory");
    if (c_.rank == 0) {
      std::error_code ec;
      if (std::filesystem::remove(dir / manifest_file_name, ec)) fsync_directory(dir);
      if (ec) fail(dir / manifest_file_name, "cannot remove the old manifest: ", ec.message());
    }
  });
  detail::on_every_rank(c_, dir, "copying the state", [&] {
    if (async) {
      for (const auto& t : plan) {
        std::vector<char> bytes(t.count * dtype_bytes(slots[t.slot].dtype));
        source.read(t.slot, OwnedRange{t.unit, t.begin, t.count}, bytes.data());
        p.snapshot.push_back(std::move(bytes));
      }
    }
  });
  const std::uint64_t rank = c_.rank, size = c_.size;
  const SaveOptions options = options_;
  auto write_file = [dir, rank, size, options, slots, plan, &source, async](const std::vector<std::vector<char>>& snapshot) {
    auto fetch = [&](std::size_t index, std::uint64_t first, std::uint64_t n, void* dst) {
      const TensorRecord& t = plan[index];
      const std::size_t es = dtype_bytes(slots[t.slot].dtype);
      if (async) {
        std::memcpy(dst, snapshot[index].data() + first * es, n * es);
      } else {
        source.read(t.slot, OwnedRange{t.unit, t.begin + first, n}, dst);
      }
    };
    write_rank_file(dir, rank, size, options, slots, plan, fetch);
  };
  if (async) {
    pending_.emplace(std::move(p));
    Pending* q = &*pending_;
    q->writer = std::thread([q, write_file] {
      try {
        write_file(q->snapshot);
      } catch (...) {
        q->error = std::current_exception();
      }
    });
  } else {
    try {
      write_file({});
    } catch (...) {
      p.error = std::current_exception();
    }
    pending_.emplace(std::move(p));
    finish();
  }
}

inline void Checkpointer::remove_old_checkpoints(const std::filesystem::path& root, std::uint64_t keep) {
  require(keep >= 1, "remove_old_checkpoints: keep must be at least 1 (the newest complete checkpoint stays)");
  std::vector<std::pair<std::uint64_t, std::filesystem::path>> complete, incomplete;
  std::error_code ec;
  for (std::filesystem::directory_iterator it(root, ec), end; !ec && it != end; it.increment(ec)) {
    const auto step = detail::step_of(it->path().filename().string());
    const bool directory = step && it->is_directory(ec);
    if (ec) break;  // (before the increment, which would clear it)
    std::error_code absent;  // set when there is no manifest: not an error
    const bool has_manifest = directory && std::filesystem::is_regular_file(it->path() / manifest_file_name, absent);
    if (directory) (has_manifest ? complete : incomplete).emplace_back(*step, it->path());
  }
  if (ec) fail(root, "cannot list the checkpoints to remove old ones: ", ec.message());
  if (complete.empty()) return;
  std::sort(complete.begin(), complete.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
  std::vector<std::filesystem::path> doomed;
  for (std::size_t i = static_cast<std::size_t>(std::min<std::uint64_t>(keep, complete.size())); i < complete.size(); ++i)
    doomed.push_back(complete[i].second);
  for (const auto& [step, dir] : incomplete)
    if (step < complete.front().first) doomed.push_back(dir);
  for (const auto& dir : doomed) {
    if (std::filesystem::remove(dir / manifest_file_name, ec)) fsync_directory(dir);  // no longer a checkpoint
    if (ec) fail(dir / manifest_file_name, "cannot remove it to retire the checkpoint: ", ec.message());
    std::filesystem::remove_all(dir, ec);
    if (ec) fail(dir, "cannot remove the retired checkpoint: ", ec.message());
  }
  fsync_directory(root);
}

// A synchronous save into `dir` (collective).
inline void save_checkpoint(const std::filesystem::path& dir, const StateSource& source, const Collective& c,
                            const SaveOptions& options = {}) {
  Checkpointer(c, options).save(dir, source, false);
}

// `root` itself when it holds a manifest, else its newest step-* directory
// that holds one; nullopt when there is none.
inline std::optional<std::filesystem::path> find_latest_checkpoint(const std::filesystem::path& root) {
  std::error_code ec;
  if (std::filesystem::is_regular_file(root / manifest_file_name, ec)) return root;
  std::optional<std::pair<std::uint64_t, std::filesystem::path>> best;
  for (const auto& e : std::filesystem::directory_iterator(root, ec)) {
    const auto step = detail::step_of(e.path().filename().string());
    if (!step || !std::filesystem::is_regular_file(e.path() / manifest_file_name, ec)) continue;
    if (!best || *step > best->first) best.emplace(*step, e.path());
  }
  if (!best) return std::nullopt;
  return best->second;
}

// find_latest_checkpoint, or an error saying why `path` holds none.
inline std::filesystem::path resolve_checkpoint(const std::filesystem::path& path) {
  std::error_code ec;
  if (!std::filesystem::exists(path, ec)) fail(path, "does not exist: no checkpoint to load");
  if (!std::filesystem::is_directory(path, ec)) fail(path, "is not a directory: a checkpoint is a directory");
  if (auto dir = find_latest_checkpoint(path)) return *dir;
  if (std::filesystem::is_empty(path, ec)) fail(path, "is empty: no checkpoint was saved here");
  fail(path, "holds no complete checkpoint: no ", manifest_file_name,
       " here or in a step-* directory (a save that did not finish; the manifest is written last)");
}

namespace detail {

// Every check between a manifest and the model it loads into that needs no
// data: same units and parameters, same optimizer, owned ranges inside units.
inline void check_compatible(const Manifest& m, const StateSource& source, const std::filesystem::path& file) {
  const auto units = source.units();
  if (units.size() != m.units.size())
    fail(file, "is a checkpoint of another model: it has ", m.units.size(), " units, this model ", units.size());
  for (std::size_t u = 0; u < units.size(); ++u) {
    const UnitDesc& a = m.units[u];
    const UnitDesc& b = units[u];
    if (a.name != b.name || a.numel != b.numel || a.params.size() != b.params.size())
      fail(file, "is a checkpoint of another model: unit ", u, " is '", a.name, "' (", a.numel, " elements, ",
           a.params.size(), " parameters) there, '", b.name, "' (", b.numel, " elements, ", b.params.size(),
           " parameters) here");
    for (std::size_t p = 0; p < a.params.size(); ++p) {
      const ParamDesc& x = a.params[p];
      const ParamDesc& y = b.params[p];
      const bool shapes_ok = x.shape.empty() || y.shape.empty() || x.shape == y.shape;
      if (x.name != y.name || x.offset != y.offset || x.numel != y.numel || !shapes_ok)
        fail(file, "is a checkpoint of another model: parameter ", p, " of unit '", a.name, "' is '", x.name, "' (",
             x.numel, " elements at ", x.offset, shapes_ok ? "" : ", shape " + shape_text(x.shape), ") there, '",
             y.name, "' (", y.numel, " elements at ", y.offset, shapes_ok ? "" : ", shape " + shape_text(y.shape),
             ") here");
    }
  }
  const RunState here = source.run_state();
  if (here.optimizer != m.run.optimizer)
    fail(file, "was saved with optimizer '", m.run.optimizer, "', this run uses '", here.optimizer,
         "': its optimizer state does not carry over; resume with the same optimizer");
  for (const OwnedRange& r : source.owned())
    require(r.unit < units.size() && r.begin <= units[r.unit].numel && r.count <= units[r.unit].numel - r.begin,
            "checkpoint load: owned range [", r.begin, ", +", r.count, ") of unit ", r.unit, " lies outside the unit");
}

}  // namespace detail

// A checkpoint read without the program that saved it: its manifest, and
// any element range of any slot of any unit, assembled from the rank files
// whatever their number, reading only the checksum chunks that cover the
// range and verifying each. Memory: one I/O buffer (io_buffer_bytes, at
// least one checksum chunk) and a file descriptor per rank file read.
class CheckpointReader {
 public:
  // `path`: a checkpoint directory, or a root whose newest complete step-*
  // directory is taken.
  explicit CheckpointReader(const std::filesystem::path& path, std::size_t io_buffer_bytes = std::size_t{16} << 20)
      : dir_(resolve_checkpoint(path)), io_buffer_bytes_(io_buffer_bytes) {
    const auto file = dir_ / manifest_file_name;
    manifest_ = parse_manifest(read_whole_file(file), file);
    // The tensors of each (slot, unit), so that finding the ones a range
    // overlaps does not scan every file for every range.
    by_slot_unit_.resize(manifest_.slots.size() * manifest_.units.size());
    for (std::size_t f = 0; f < manifest_.files.size(); ++f)
      for (std::size_t t = 0; t < manifest_.files[f].tensors.size(); ++t) {
        const TensorRecord& r = manifest_.files[f].tensors[t];
        by_slot_unit_[r.slot * manifest_.units.size() + r.unit].emplace_back(f, t);
      }
  }

  const std::filesystem::path& directory() const { return dir_; }
  const Manifest& manifest() const { return manifest_; }
  // Bytes read from rank files so far.
  std::uint64_t bytes_read() const { return bytes_read_; }

  // Checks rank file `index` (into the manifest's files) as a load reads it,
  // all of it: present, of the size the manifest recorded, its header holding
  // every tensor with the recorded type and element count, and (with
  // `checksums`) every chunk matching its checksum, reading through the I/O
  // buffer. Throws CheckpointError naming the file and what is wrong.
  void verify_file(std::size_t index, bool checksums = true) {
    require(index < manifest_.files.size(), dir_.string(), ": verify_file(", index, "): the manifest lists ",
            manifest_.files.size(), " files");
    const FileRecord& f = manifest_.files[index];
    const SafetensorsReader& r = file(f);
    std::vector<char> piece;
    for (const TensorRecord& t : f.tensors) {
      entry(r, t);
      if (!checksums) continue;
      const DType type = manifest_.slots[t.slot].dtype;
      // Whole checksum chunks at a time (chunk_bytes is a multiple of 8, so
      // of every element size): no chunk is read twice.
      const std::uint64_t chunk = manifest_.checksum_chunk_bytes;
      const std::uint64_t per_piece = std::max<std::uint64_t>(chunk, io_buffer_bytes_ / chunk * chunk) / dtype_bytes(type);
      for (std::uint64_t first = 0; first < t.count; first += per_piece) {
        const std::uint64_t n = std::min(per_piece, t.count - first);
        piece.resize(static_cast<std::size_t>(n * dtype_bytes(type)));
        read_tensor(f, t, first, n, piece.data(), type);
      }
    }
  }

  // Elements [begin, begin + count) of unit `unit` in slot `slot` (indices
  // into the manifest's units and slots) into dst, converted to `to`.
  void read(std::size_t slot, std::size_t unit, std::uint64_t begin, std::uint64_t count, void* dst, DType to) {
    require(slot < manifest_.slots.size() && unit < manifest_.units.size() && begin <= manifest_.units[unit].numel &&
                count <= manifest_.units[unit].numel - begin,
            dir_.string(), ": read of slot ", slot, ", unit ", unit, ", elements [", begin, ", +", count,
            ") outside the checkpoint");
    const std::size_t es = dtype_bytes(to);
    for (const auto& [f, i] : by_slot_unit_[slot * manifest_.units.size() + unit]) {
      const TensorRecord& t = manifest_.files[f].tensors[i];
      const std::uint64_t lo = std::max(begin, t.begin), hi = std::min(begin + count, t.begin + t.count);
      if (lo < hi)
        read_tensor(manifest_.files[f], t, lo - t.begin, hi - lo, static_cast<char*>(dst) + (lo - begin) * es, to);
    }
  }

 private:
  const SafetensorsReader& file(const FileRecord& f) {
    auto it = open_.find(f.name);
    if (it != open_.end()) return it->second;
    const auto path = dir_ / f.name;
    {
      ReadFile probe(path);
      if (probe.size() != f.bytes)
        fail(path, "is ", probe.size(), " bytes, the manifest recorded ", f.bytes,
             probe.size() < f.bytes ? " (truncated)" : " (changed since it was saved)");
    }
    return open_.emplace(f.name, SafetensorsReader(path)).first->second;
  }

  // Tensor t's entry in its file's header, with the type and element count
  // the manifest recorded.
  const TensorEntry& entry(const SafetensorsReader& r, const TensorRecord& t) const {
    const DType type = manifest_.slots[t.slot].dtype;
    const TensorEntry& e = r.at(t.name);
    if (e.dtype != type || e.shape != std::vector<std::uint64_t>{t.count})
      fail(r.path(), "tensor '", t.name, "' is ", tensor_type_name(e.dtype), " of ", e.end - e.begin,
           " bytes, the manifest says ", tensor_type_name(tensor_type_of(type)), " of ", t.count, " elements");
    return e;
  }

  // Elements [first, first + n) of tensor t into dst (type `to`), reading
  // whole checksum chunks and verifying each.
  void read_tensor(const FileRecord& f, const TensorRecord& t, std::uint64_t first, std::uint64_t n, void* dst,
                   DType to) {
    const SafetensorsReader& r = file(f);
    const DType type = manifest_.slots[t.slot].dtype;
    const TensorEntry& e = entry(r, t);
    const std::uint64_t es = dtype_bytes(type), total = t.count * es, chunk = manifest_.checksum_chunk_bytes;
    const std::uint64_t a = first * es, b = (first + n) * es;
    const std::uint64_t piece = std::max<std::uint64_t>(chunk, io_buffer_bytes_ / chunk * chunk);
    for (std::uint64_t at = a / chunk * chunk; at < b; at += piece) {
      const std::uint64_t len = std::min({piece, total - at, (b + chunk - 1) / chunk * chunk - at});
      buffer_.resize(static_cast<std::size_t>(len));
      r.read(e, at, len, buffer_.data());
      bytes_read_ += len;
      for (std::uint64_t c = 0; c < len; c += chunk) {
        const std::uint64_t index = (at + c) / chunk, clen = std::min(chunk, len - c);
        if (XXH3_64bits(buffer_.data() + c, clen) != t.chunk_xxh3[index])
          fail(r.path(), "checksum mismatch in tensor '", t.name, "', bytes [", at + c, ", ", at + c + clen,
               ") (chunk ", index, "): the file is corrupt");
      }
      const std::uint64_t lo = std::max(a, at), hi = std::min(b, at + len);
      detail::convert_elements(buffer_.data() + (lo - at), type,
                               static_cast<char*>(dst) + (lo - a) / es * dtype_bytes(to), to, (hi - lo) / es);
    }
  }

  std::filesystem::path dir_;
  Manifest manifest_;
  std::size_t io_buffer_bytes_;
  std::vector<std::vector<std::pair<std::size_t, std::size_t>>> by_slot_unit_;  // (file, tensor) per (slot, unit)
  std::map<std::string, SafetensorsReader> open_;
  std::vector<char> buffer_;
  std::uint64_t bytes_read_ = 0;
};

// Loads the checkpoint at `path` (a checkpoint directory, or a root whose
// newest complete step-* directory is taken) into `source` (collective).
// Each rank reads only the chunks of the rank files that overlap its owned
// ranges; after every rank has verified its reads, each writes them into
// `source`. Slots the checkpoint has but `source` lacks are skipped (the
// 16-bit "param" when continuing in fp32); a required slot it lacks is an
// error; an optional one is listed in slots_not_loaded.
inline LoadResult load_checkpoint(const std::filesystem::path& path, StateSource& source, const Collective& c,
                                  const LoadOptions& options = {}) {
  LoadResult result;
  std::optional<CheckpointReader> reader;
  std::vector<SlotDesc> slots;
  std::vector<std::size_t> saved_slot;  // per source slot: index in the manifest, or slots.size() when absent
  detail::on_every_rank(c, path, "reading the manifest", [&] {
    reader.emplace(path, options.io_buffer_bytes);
    result.directory = reader->directory();
    result.manifest = reader->manifest();
    const auto file = result.directory / manifest_file_name;
    detail::check_compatible(result.manifest, source, file);
    slots = source.slots();
    for (const SlotDesc& s : slots) {
      std::size_t i = result.manifest.slot_index(s.name);
      if (i == result.manifest.slots.size() && !s.saved_as.empty()) i = result.manifest.slot_index(s.saved_as);
      if (i == result.manifest.slots.size()) {
        if (s.required)
          fail(file, "has no state slot '", s.name, "' (it has ", [&] {
            std::string names;
            for (const auto& x : result.manifest.slots) names += (names.empty() ? "" : ", ") + x.name;
            return names;
          }(), "): saved with another optimizer or precision, or with settings that keep fewer states (SGD made "
               "with momentum 0 keeps no 'momentum'); resume with what it was saved with (the manifest's "
               "optimizer.hyper)");
        result.slots_not_loaded.push_back(s.name);
      }
      saved_slot.push_back(i);
    }
  });
  const Manifest& m = result.manifest;
  const std::vector<OwnedRange> owned = source.owned();
  std::vector<std::vector<char>> loaded;  // per (slot, owned range)
  detail::on_every_rank(c, result.directory, "reading the rank files", [&] {
    for (std::size_t s = 0; s < slots.size(); ++s) {
      for (const OwnedRange& o : owned) {
        loaded.emplace_back();
        if (saved_slot[s] == m.slots.size()) continue;
        loaded.back().resize(static_cast<std::size_t>(o.count * dtype_bytes(slots[s].dtype)));
        reader->read(saved_slot[s], o.unit, o.begin, o.count, loaded.back().data(), slots[s].dtype);
      }
    }
    result.bytes_read = reader->bytes_read();
  });
  detail::on_every_rank(c, result.directory, "writing the loaded state", [&] {
    std::size_t k = 0;
    for (std::size_t s = 0; s < slots.size(); ++s)
      for (const OwnedRange& o : owned) {
        const auto& data = loaded[k++];
        if (saved_slot[s] != m.slots.size() && o.count > 0) source.write(s, o, data.data());
      }
  });
  return result;
}

}  // namespace zero::checkpoint
