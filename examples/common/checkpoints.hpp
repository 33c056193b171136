// Why: the trainers save checkpoints the same way (--save-async, --keep-last)
// and report them in the same words, which their tests read: "saved
// checkpoint DIR" once a checkpoint is complete, "saving checkpoint in the
// background: DIR" while --save-async still writes it.
#pragma once

#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <string>
#include <utility>

#include "common/choices.hpp"
#include "zero/checkpoint/optimizer_io.hpp"

namespace zero::examples {

// Where a run is, in its checkpoints: the batches (or steps) it trained,
// which a resume continues from, beside the optimizer's step count when it
// saved. They differ in fp16, which takes no optimizer step for a batch whose
// gradients overflowed. record_position() writes both into a save's `extra`;
// resume_position() reads the position back, or the step count for a
// checkpoint whose step count is not the one saved with it (zero_checkpoint
// import: step 0, a fresh optimizer state) or that has none (saved before).
inline void record_position(nlohmann::json& extra, const char* key, std::int64_t position,
                            std::int64_t optimizer_steps) {
  extra[key] = position;
  extra["optimizer_steps"] = optimizer_steps;
}
inline std::int64_t resume_position(const nlohmann::json& extra, const char* key, std::int64_t optimizer_steps) {
  const bool same_state = extra.contains(key) && extra.value("optimizer_steps", std::int64_t{-1}) == optimizer_steps;
  return same_state ? extra[key].get<std::int64_t>() : optimizer_steps;
}

class CheckpointSaves {
 public:
  // `lead`: this rank prints (rank 0).
  CheckpointSaves(const CheckpointChoices& choices, bool lead) : choices_(choices), lead_(lead) {}

  // The options of the next save: the run's own state `extra`, --save-async, --keep-last.
  checkpoint::OptimizerSaveOptions options(nlohmann::json extra) const {
    checkpoint::OptimizerSaveOptions o;
    o.extra = std::move(extra);
    o.async = choices_.save_async;
    o.io.keep_last = static_cast<std::uint64_t>(choices_.keep_last);
    return o;
  }
  // After a save_step() (collective) returned `dir`: a background save
  // before it is complete now (the save completed it first).
  void saved(const std::filesystem::path& dir) {
    if (!writing_.empty()) say("saved checkpoint", writing_);
    writing_ = choices_.save_async ? dir.string() : std::string();
    say(choices_.save_async ? "saving checkpoint in the background:" : "saved checkpoint", dir.string());
  }
  // After the optimizer's wait_save(): the background save it completed.
  void finished() {
    if (!writing_.empty()) say("saved checkpoint", writing_);
    writing_.clear();
  }

 private:
  void say(const char* what, const std::string& dir) const {
    if (!lead_) return;
    std::printf("%s %s\n", what, dir.c_str());
    std::fflush(stdout);
  }

  const CheckpointChoices& choices_;
  bool lead_;
  std::string writing_;  // the checkpoint --save-async is writing in the background
};

}  // namespace zero::examples
