// The load side of AsyncCheckpointer (loader.h): the memory-step agreement, the disk candidates' votes, the
// prefetch of both, and the restore's ledger record.
#include "checkpoint/loader.h"

#include <algorithm>
#include <cstdio>
#include <iterator>
#include <nlohmann/json.hpp>
#include <set>
#include <thread>

#include "common/logging.h"
#include "ettkit/common/clock.h"
#include "ettkit/ett/recorder.h"

using nlohmann::json;

namespace ettkit::checkpoint {

std::optional<int64_t> latest_step(const std::string& directory) {
  detail::StepListing listing = detail::list_steps(directory);
  if (listing.committed.empty()) return std::nullopt;
  return listing.committed.front().step;
}

namespace detail {

namespace {

/// Threads that verify and read a step: the stager's copy threads (a restore runs before training, when
/// those cores are idle).
int load_threads(const CheckpointerOptions& opt) {
  return opt.stager.copy_threads > 0 ? opt.stager.copy_threads
                                     : std::clamp(static_cast<int>(std::thread::hardware_concurrency()), 1, 4);
}

/// What a rank's report of its memory-tier steps for load_latest's vote is.
constexpr const char* kMemoryReportShape =
    "{\"held\": [[step, run id], ...], \"replica\": [...] (optional), \"disk\": step or -1}";

/// A rank's report of its memory-tier steps (StoreExchange decoded it from the Store key `source`), checked
/// before any of it is used: kMemoryReportShape. CorruptData naming the key for anything else: no run id
/// that is not one gets into the vote.
void check_memory_report(const json& r, const std::string& source) {
  ETTKIT_CHECK(r.is_object(), CorruptData, source, " is not a JSON object");
  auto step_ok = [](const json& v, int64_t lo) {
    return v.is_number_integer() && v.get<int64_t>() >= lo && v.get<int64_t>() <= kMaxStep;
  };
  for (const char* key : {"held", "replica"}) {
    if (!r.contains(key)) continue;
    ETTKIT_CHECK(r[key].is_array(), CorruptData, source, ": '", key, "' is not an array");
    for (const json& e : r[key]) {
      const bool ok = e.is_array() && e.size() == 2 && step_ok(e[0], 0) && e[1].is_string() &&
                      is_run_id(e[1].get<std::string>());
      ETTKIT_CHECK(ok, CorruptData, source, ": an entry of '", key, "' is not [step, run id] (a step in [0, ",
                   kMaxStep, "], a run id of 16 lowercase hex digits)");
    }
  }
  ETTKIT_CHECK(r.contains("disk") && step_ok(r["disk"], -1), CorruptData, source,
               ": 'disk' is not a step number or -1");
}

/// The newest committed step of `dir`, or -1.
int64_t newest_disk_step(const std::string& dir) { return latest_step(dir).value_or(-1); }

/// Steps as [step, run id] pairs, one report's key.
using Held = std::set<std::pair<int64_t, std::string>>;
Held steps_of(const json& report, const char* key) {
  Held out;
  if (!report.contains(key)) return out;
  for (const json& e : report.at(key)) out.emplace(e.at(0).get<int64_t>(), e.at(1).get<std::string>());
  return out;
}

/// The two rules of which memory step a load tries, shared by the ranks' agreement and by prefetch()'s
/// guess of it: a step is loadable only by as many ranks as wrote it, and it goes before the disk tier only
/// when no disk step is newer.
bool loadable_here(const Session& s, const MemoryStep& m) { return m.world_size == s.world; }
bool memory_before_disk(int64_t memory_step, int64_t disk_newest) { return memory_step >= disk_newest; }

/// This rank's memory-tier steps that the job's world size can load, as a report's list (the others logged).
json usable_steps(const Session& s, const std::vector<MemoryStep>& steps, const char* what) {
  json out = json::array();
  for (const MemoryStep& m : steps) {
    if (loadable_here(s, m)) {
      out.push_back(json::array({m.step, m.run_id}));
    } else {
      ETTKIT_LOG_INFO("checkpoint memory tier: ", what, " step ", m.step, " in '", s.memory->dir(), "' was written by ",
                      m.world_size, " ranks; this job has ", s.world, ": not used");
    }
  }
  return out;
}

/// The steps every rank can restore (its own, and with a peer replica the replicas its partner keeps of
/// them), from all ranks' reports; `missing` names the first rank that lacks one.
Held common_steps(const Session& s, const std::vector<json>& reports, std::string& missing) {
  auto available = [&](int r) {
    Held out = steps_of(reports[static_cast<size_t>(r)], "held");
    if (s.replica) {
      Held kept = steps_of(reports[static_cast<size_t>(s.replica->partner_of(r))], "replica");
      out.insert(kept.begin(), kept.end());
    }
    return out;
  };
  Held common = available(0);
  for (int r = 1; r < static_cast<int>(reports.size()) && !common.empty(); ++r) {
    Held theirs = available(r), both;
    std::set_intersection(common.begin(), common.end(), theirs.begin(), theirs.end(), std::inserter(both, both.end()));
    if (both.size() < common.size() && missing.empty()) missing = " (rank " + std::to_string(r) + " lacks it)";
    common = std::move(both);
  }
  return common;
}

}  // namespace

/// The memory step load_latest tries first: the newest that every rank holds from one and the same run
/// (a rank's snapshot of another run is another timeline), unless a step committed on disk has a larger
/// number. With a peer replica a rank also "holds" a step its partner keeps a replica of. nullopt:
/// restore from the disk tier. Every rank returns the same step.
std::optional<Loader::MemoryChoice> Loader::agree_on_memory_step(const std::vector<MemoryStep>& held, uint64_t seq) {
  const Session& s = s_;
  json report{{"held", usable_steps(s, held, "")}};
  if (s.replica) {
    report["replica"] = usable_steps(
        s, s.memory->committed_in(s.memory->replica_dir(s.replica->held_for()), /*warn=*/true), "the replica's");
  }
  report["disk"] = s.rank == 0 ? newest_disk_step(s.opt.directory) : int64_t{-1};
  std::vector<json> reports{report};
  if (s.world > 1) {
    reports = s.exchange->all_gather(s.key_prefix + "load/" + std::to_string(seq) + "/memory/", s.rank, s.world, report,
                                     "load_latest: the other ranks' memory-tier steps", kMemoryReportShape,
                                     check_memory_report);
  }
  std::string missing;
  Held common = common_steps(s, reports, missing);
  const int64_t disk_newest = reports[0].at("disk").get<int64_t>();
  if (common.empty()) {
    if (!held.empty()) {
      ETTKIT_LOG_WARN("checkpoint memory tier: this rank holds step ", held.front().step, " in memory, but not every "
                      "rank holds it", missing, ": all ranks restore from the disk tier");
    }
    return std::nullopt;
  }
  auto best = *common.rbegin();
  if (!memory_before_disk(best.first, disk_newest)) {
    ETTKIT_LOG_INFO("checkpoint memory tier: step ", best.first, " is older than step ", disk_newest,
                    " on disk: restoring from the disk tier");
    return std::nullopt;
  }
  MemoryChoice choice;
  choice.step = best.first;
  if (s.replica) {
    auto lacks = [&](int r) { return steps_of(reports[static_cast<size_t>(r)], "held").count(best) == 0; };
    choice.take = lacks(s.rank);
    choice.give = lacks(s.replica->held_for());
  }
  return choice;
}

std::vector<int64_t> Loader::prefetch() {
  // The steps load_latest will most likely take, in the order it considers them: this rank's newest memory
  // step when no disk step has a larger number (agree_on_memory_step's rule), then the newest disk step.
  // The worker stops at the first that verifies; a step the ranks do not agree on is simply checked again.
  std::vector<PrefetchTarget> targets;
  const int64_t disk_newest = newest_disk_step(s_.opt.directory);
  if (s_.memory) {
    int64_t best = -1;
    for (const MemoryStep& m : s_.memory->committed(/*warn=*/false)) {
      if (loadable_here(s_, m)) best = std::max(best, m.step);
    }
    if (best >= 0 && memory_before_disk(best, disk_newest)) targets.push_back({s_.memory->dir(), best});
  }
  if (disk_newest >= 0) targets.push_back({s_.opt.directory, disk_newest});
  std::vector<int64_t> steps;
  for (const PrefetchTarget& t : targets) steps.push_back(t.step);
  prefetch_.start(std::move(targets), s_.rank, s_.world, load_threads(s_.opt));
  return steps;
}

std::pair<Verdict, std::string> Loader::vote(const std::string& key, const ReadPlan& plan) {
  if (s_.world == 1) return {plan.verdict, plan.reason};
  // A verdict outside the enum or a missing reason is no rank's: StoreExchange refuses it.
  RankVerdict all = s_.exchange->worst_verdict(
      s_.key_prefix + key + "/", s_.rank, s_.world, {static_cast<int>(plan.verdict), plan.reason},
      static_cast<int>(Verdict::kVanished), [](int v) { return severity(static_cast<Verdict>(v)); },
      "load_latest: the other ranks' verdicts (" + key + ")");
  return {static_cast<Verdict>(all.verdict), all.why};
}

void Loader::record_restore(int64_t begin_us, int64_t step, Tier tier, const LoadResult& out) {
  s_.ledger.record_restore(step, tier, begin_us, epoch_us());
  // The restore phase above is only the copy: the note says where the verification went (the report's
  // attempts[].notes), so that a short checkpoint_restore is not read as a load without checksums.
  if (out.prefetched) s_.ledger.note_prefetched_restore(step, tier, prefetch_.seconds(), out.prefetch_reverified_bytes);
}

void Loader::run(ReadPlan& plan, const LoadRequest& req, int64_t step, LoadResult& out) {
  out.read = run_read_plan(plan, req.tensors, req.threads);
  out.step = step;
  out.extra = std::move(plan.extra);
  out.saved_world_size = plan.reshard ? plan.saved_world : s_.world;
  out.resharded = plan.reshard;
  out.prefetched = plan.prefetched;
  out.prefetch_reverified_bytes = plan.reverified;
  if (plan.reshard) {
    out.reshard_bytes_read = plan.planned;
    out.reshard_bytes_verified = plan.verified;
  }
}

bool Loader::load_memory(const LoadRequest& disk_request, LoadResult& out, std::string& reasons) {
  const Session& im = s_;
  std::optional<MemoryChoice> choice = agree_on_memory_step(im.memory->committed(), seq_++);
  if (!choice) return false;
  const int64_t step = choice->step;
  std::string taken;
  if (im.replica) {
    // Every rank takes part (the vote's sequence numbers must stay in step), most with nothing to do.
    taken = im.replica->restore_exchange(seq_++, choice->give ? step : -1, choice->take ? step : -1);
  }
  LoadRequest req{disk_request.tensors, disk_request.validate_extra, disk_request.read_prefixes,
                  im.rank, im.world,
                  im.opt.verify_on_load && im.opt.memory_tier.verify,
                  disk_request.threads, /*whole_from_rank0=*/false, /*reads_other_ranks=*/false};
  req.partial = disk_request.partial;
  req.global_shapes = disk_request.global_shapes;
  ReadPlan plan;
  if (!taken.empty()) {
    plan.reason = "its replica did not come back from rank " + std::to_string(im.replica->partner()) + ": " + taken;
  } else {
    plan = plan_read(im.memory->dir(), step, req, prefetch_.take(im.memory->dir(), step));
  }
  auto [all, why] = vote("load/" + std::to_string(seq_++) + "/memory-" + std::to_string(step), plan);
  if (all == Verdict::kMismatch) ETTKIT_THROW(InvalidArgument, why);
  if (all != Verdict::kOk) {
    ETTKIT_LOG_WARN("checkpoint: memory-tier step ", step, " is not loadable, restoring from the disk tier '",
                    im.opt.directory, "': ", why);
    out.memory_fallback = "memory-tier step " + std::to_string(step) + ": " + why;
    reasons += "\n  " + out.memory_fallback;
    return false;
  }
  run(plan, req, step, out);
  out.tier = Tier::kMemory;
  if (choice->take) out.memory_from_rank = im.replica->partner();
  // The loaded step's run becomes this run's lineage; every other step is another timeline.
  std::string loaded_run;
  for (const MemoryStep& m : im.memory->committed(/*warn=*/false)) {
    if (m.step == step) loaded_run = m.run_id;
  }
  im.memory->adopt(loaded_run);
  auto other = [&](const MemoryStep& m) { return m.step != step; };
  im.memory->retire_everywhere(other);
  ETTKIT_LOG_INFO("checkpoint: restored step ", step, " from the memory tier '", im.memory->dir(), "'",
                  choice->take ? " (given back by rank " + std::to_string(im.replica->partner()) + ")" : "");
  record_restore(begin_us_, step, Tier::kMemory, out);
  return true;
}

std::vector<int64_t> Loader::agreed_candidates(uint64_t seq) {
  std::vector<int64_t> steps;
  if (s_.rank == 0) steps = load_candidates(s_.opt.directory);
  if (s_.world > 1) {
    // Every rank must see the same candidate list: take rank 0's.
    std::string key = s_.key_prefix + "load/" + std::to_string(seq) + "/steps";
    std::string listed = s_.exchange->from_rank0(key, s_.rank, json(steps).dump(), "load_latest: rank 0's list of steps");
    if (s_.rank != 0) {
      steps = decode_step_list(listed, "load_latest: rank 0's list of steps (the Store key '" + key + "')");
    }
  }
  return steps;
}

bool Loader::load_disk(const LoadRequest& req, LoadResult& out, std::string& reasons, bool& listed_any) {
  // A round tries every candidate of one listing. Only retention removing steps under the loader (a writer
  // in another job) makes a new round necessary: the steps it committed meanwhile are in the next listing.
  constexpr int kRounds = 8;
  for (int round = 0; round < kRounds; ++round) {
    const uint64_t lseq = seq_++;
    std::vector<int64_t> steps = agreed_candidates(lseq);
    listed_any = listed_any || !steps.empty();
    bool vanished = false;
    for (int64_t step : steps) {
      // Known bad from an earlier round (every rank agrees on it: the verdict was voted).
      if (std::find(out.skipped_steps.begin(), out.skipped_steps.end(), step) != out.skipped_steps.end()) continue;
      run_before_open_step_hook(step);
      ReadPlan plan = plan_read(s_.opt.directory, step, req, prefetch_.take(s_.opt.directory, step));
      auto [all, why] = vote("load/" + std::to_string(lseq) + "/" + std::to_string(step), plan);
      if (all == Verdict::kMismatch) ETTKIT_THROW(InvalidArgument, why);
      if (all == Verdict::kVanished) {
        ETTKIT_LOG_INFO("checkpoint load: ", why, "; trying the next one");
        vanished = true;
        continue;
      }
      if (all == Verdict::kBad) {
        ETTKIT_LOG_WARN("checkpoint step ", step, " in '", s_.opt.directory, "' is not loadable, falling back: ", why);
        out.skipped_steps.push_back(step);
        reasons += "\n  step " + std::to_string(step) + ": " + why;
        continue;
      }
      run(plan, req, step, out);
      if (plan.reshard) {
        ETTKIT_LOG_INFO("checkpoint: step ", step, " was written by ", plan.saved_world, " ranks",
                        plan.saved_world == s_.world ? " under another layout" : "", "; rank ", s_.rank, " of ",
                        s_.world, " resharded it, reading ", plan.planned, " bytes (", plan.verified, " verified)");
      }
      // The memory tier holds no step this one does not supersede: it is another timeline, or older.
      if (s_.memory) {
        auto all_steps = [](const MemoryStep&) { return true; };
        s_.memory->retire_everywhere(all_steps);
      }
      record_restore(begin_us_, step, Tier::kDisk, out);
      return true;
    }
    if (!vanished) break;
  }
  return false;
}

std::optional<LoadResult> Loader::load_latest(const NamedTensors& tensors,
                                              const std::function<void(const std::string&)>& validate_extra,
                                              const std::vector<std::string>& read_prefixes, bool partial,
                                              const std::map<std::string, std::vector<int64_t>>& global_shapes) {
  begin_us_ = epoch_us();
  // The prefetch's open files and verdicts serve this load only: released on every way out.
  struct ReleasePrefetch {
    RestorePrefetch& p;
    ~ReleasePrefetch() { p.cancel(); }
  } release_prefetch{prefetch_};
  LoadRequest req{tensors, validate_extra, read_prefixes, s_.rank, s_.world, s_.opt.verify_on_load,
                  load_threads(s_.opt), s_.opt.reshard_whole_from_rank0};
  req.partial = partial;
  req.global_shapes = &global_shapes;
  LoadResult out;
  std::string reasons;
  bool listed_any = false;
  if (s_.memory && load_memory(req, out, reasons)) return out;
  if (load_disk(req, out, reasons, listed_any)) return out;
  if ((!listed_any || out.skipped_steps.empty()) && out.memory_fallback.empty()) return std::nullopt;
  ETTKIT_THROW(checkpoint::CorruptCheckpoint, "no committed checkpoint in '", s_.opt.directory, "'",
               s_.memory ? " or its memory tier '" + s_.memory->dir() + "'" : std::string(), " is valid:", reasons);
}

}  // namespace detail
}  // namespace ettkit::checkpoint
