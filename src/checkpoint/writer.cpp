// Writer (writer.h): the writer thread, its queue, and the order a save's steps take in each tier.
#include "checkpoint/writer.h"

#include <algorithm>

#include "checkpoint/host_arena.h"
#include "common/background_thread.h"
#include "common/describe.h"
#include "common/logging.h"
#include "ettkit/common/clock.h"

namespace ettkit::checkpoint::detail {

using ::ettkit::detail::describe;

std::string torn_message(int64_t step, const std::vector<std::string>& changed) {
  std::string names;
  size_t shown = std::min<size_t>(changed.size(), 8);
  for (size_t i = 0; i < shown; ++i) names += (i ? ", '" : "'") + changed[i] + "'";
  if (changed.size() > shown) names += ", ... (" + std::to_string(changed.size() - shown) + " more)";
  return ettkit::detail::concat("checkpoint step ", step, " was refused: ", changed.size(),
                " saved tensor(s) changed while they were being copied, so the snapshot could mix two steps: ",
                names, ". The previous committed step stays the latest. Fence the writers: in Python "
                "ck.attach(model=..., optimizer=...) (or ck.attach(module) for a module that updates its own "
                "weights), in C++ wait_for()/wait_staged_on_current_stream() before the write; or save with "
                "overlap='off' so that save() returns only once the copies are done");
}

namespace {
bool is_torn(std::exception_ptr err) {
  try {
    std::rethrow_exception(err);
  } catch (const TornSnapshot&) {
    return true;
  } catch (...) {
    return false;
  }
}
}  // namespace

Writer::Writer(Session& session)
    : s_(session),
      commit_(DiskCommit::Setup{session.opt.directory, session.opt.keep_last, session.rank, session.world,
                                session.store.get(), session.peers.get(), session.key_prefix,
                                session.opt.commit_timeout_s}),
      thread_([this] {
        ettkit::detail::mark_background_thread();
        run();
      }) {}

Writer::~Writer() { stop(); }

void Writer::rethrow_peer_loss() const {
  std::lock_guard<std::mutex> lk(mu_);
  if (peer_lost_) std::rethrow_exception(peer_lost_);
}

bool Writer::peer_lost() const {
  std::lock_guard<std::mutex> lk(mu_);
  return static_cast<bool>(peer_lost_);
}

void Writer::enqueue(WriteJob job) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    job.seq = seq_++;
    queue_.push_back(std::move(job));
    ++in_flight_;
    ++unfinished_;
  }
  cv_.notify_all();
}

uint64_t Writer::saves_queued() const {
  std::lock_guard<std::mutex> lk(mu_);
  return seq_;
}

void Writer::wait_idle() {
  std::unique_lock<std::mutex> lk(mu_);
  cv_.wait(lk, [&] { return in_flight_ == 0; });
}

void Writer::hold(bool hold) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    hold_ = hold;
  }
  cv_.notify_all();
}

bool Writer::stop() {
  bool pending;
  {
    std::lock_guard<std::mutex> lk(mu_);
    pending = unfinished_ > 0;
    stopping_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
  return pending;
}

void Writer::run() {
  while (std::optional<WriteJob> job = next_job()) finish(*job, write(*job));
}

std::optional<WriteJob> Writer::next_job() {
  std::unique_lock<std::mutex> lk(mu_);
  cv_.wait(lk, [&] { return stopping_ || !queue_.empty(); });
  if (queue_.empty()) return std::nullopt;
  WriteJob job = std::move(queue_.front());
  queue_.pop_front();
  return job;
}

std::exception_ptr Writer::write(WriteJob& job) {
  std::exception_ptr err;
  {
    std::lock_guard<std::mutex> lk(mu_);
    err = peer_lost_;
  }
  if (err) return err;
  try {
    if (job.tier == Tier::kMemory) {
      persist_memory(job);
    } else {
      persist_disk(job);
      retire_superseded_memory(job.step);
    }
  } catch (const PeerLost&) {
    err = std::current_exception();
    std::lock_guard<std::mutex> lk(mu_);
    if (!peer_lost_) peer_lost_ = err;
  } catch (...) {
    err = std::current_exception();
  }
  if (err) ETTKIT_LOG_ERROR("checkpoint step ", job.step, " failed: ", describe(err));
  return err;
}

void Writer::finish(WriteJob& job, std::exception_ptr err) {
  if (job.snapshot) job.snapshot->release();
  {
    std::lock_guard<std::mutex> lk(job.handle->mu);
    job.handle->snapshot.reset();
  }
  const int64_t end = epoch_us();
  // The ledger first, so that a caller woken by the handle sees the figures.
  if (err) {
    s_.ledger.record_failure(job.tier, is_torn(err), job.call_us, end, job.step);
  } else {
    s_.ledger.record_durable(job.tier, job.call_us, end, job.step);
  }
  {
    std::lock_guard<std::mutex> lk(mu_);
    --unfinished_;
  }
  job.handle->finish(err);
  {
    std::lock_guard<std::mutex> lk(mu_);
    --in_flight_;
  }
  cv_.notify_all();
}

void Writer::await_staging(WriteJob& job) {
  job.snapshot->wait_staged();
  {
    std::lock_guard<std::mutex> lk(job.handle->mu);
    job.handle->staged_seen = true;
  }
  s_.ledger.record_staging(job.snapshot->stage_begin_us(),
                           std::max(job.snapshot->staged_us(), job.snapshot->stage_begin_us()), job.step);
}

/// Tests only (hold_commits_for_testing): the writer waits here with a save's bytes written and its arena
/// still held, so that a test can write a saved tensor "during" the save (the verdict follows) or find the
/// arena busy, deterministically. close() ends a hold: it must see the held save as unfinished, and a test
/// cannot release a hold from inside close().
void Writer::wait_while_held() {
  std::unique_lock<std::mutex> lk(mu_);
  if (!hold_ || stopping_) return;
  holding_ = true;
  cv_.notify_all();
  cv_.wait(lk, [&] { return !hold_ || stopping_; });
  holding_ = false;
}

void Writer::wait_until_held() {
  std::unique_lock<std::mutex> lk(mu_);
  cv_.wait(lk, [&] { return holding_ || stopping_; });
}

/// The hold after the data file, and the integrity verdict as late as possible: entries no fence decided
/// are judged after the (slow) write, so that a write that overlapped a copy has had every chance to finish
/// and bump its counter (docs/checkpoint.md: what detection can and cannot see).
StepHooks Writer::hooks_for(WriteJob& job) {
  return StepHooks{[this] { wait_while_held(); },
                   [&job] {
                     std::vector<std::string> changed = job.snapshot->changed_entries();
                     if (!changed.empty()) throw TornSnapshot(torn_message(job.step, changed), __FILE__, __LINE__);
                   }};
}

/// A disk-tier save: this rank's files into the step's temporary directory, then the commit (the vote, and
/// on rank 0 the manifest and the rename). Every file of the save is created and removed relative to the
/// directory's handle (mkdirat, openat, unlinkat): an entry of the checkpoint directory swapped for a link
/// meanwhile redirects nothing.
void Writer::persist_disk(WriteJob& job) {
  await_staging(job);
  const std::string tmp_name = temp_dir_name(job.step, s_.run_id);
  const std::string tmp = s_.opt.directory + "/" + tmp_name;
  StepWriter step(s_, job.step, *job.snapshot, job.extra, /*whole_tensor_digests=*/true);
  std::map<std::string, FileDigest> mine;
  std::optional<Dir> tmp_dir;
  std::exception_ptr local_error;
  try {
    tmp_dir = make_subdirectory(open_directory(s_.opt.directory), tmp_name, 0777);  // the directory's usual mode
    mine = step.write_rank_files(*tmp_dir, 0644, hooks_for(job));
    // Other ranks make their directory entries durable before reporting; rank 0's are covered by the
    // directory fsync that follows its manifest.
    if (s_.rank != 0) fsync_directory(*tmp_dir);
  } catch (...) {
    local_error = std::current_exception();
    // Nothing of a failed or refused save stays behind (a refused one holds mixed bytes).
    if (s_.world == 1) {
      remove_tree_quietly(tmp);
    } else if (tmp_dir) {
      step.remove_rank_files(*tmp_dir);
    }
  }
  commit_.commit(job.seq, tmp, tmp_dir ? &*tmp_dir : nullptr, std::move(mine), local_error, step.manifest());
}

/// A memory-tier save: this rank's snapshot into its memory directory, committed on its own (the load
/// vote, not the save, makes the ranks agree). Same order as the disk commit: data and checksums, the
/// verdict, the manifest, the rename.
void Writer::persist_memory(WriteJob& job) {
  await_staging(job);
  StepWriter step(s_, job.step, *job.snapshot, job.extra, /*whole_tensor_digests=*/false);
  if (header_plan_ != job.snapshot->shared_plan()) {
    memory_header_ = header_of(job.snapshot->plan(), nullptr);  // throws (a dtype) with the cache unchanged
    memory_header_padded_.clear();
    header_plan_ = job.snapshot->shared_plan();
  }
  step.use_cached_header(memory_header_, memory_header_padded_);
  std::string tmp = s_.memory->begin(job.step, s_.run_id, step.bytes());
  try {
    // The arena is a file of the tier (Stager::set_arena_files): it becomes the step's data file by a link.
    // Otherwise (one arena in the budget, an empty state, files that could not be made) the arena is copied
    // into a new file.
    const bool linked = step.links_arena();
    std::map<std::string, FileDigest> files =
        linked
            ? step.link_rank_files(open_directory(tmp), MemoryTier::kFileMode, hooks_for(job),
                                   [&](const std::string& file) { s_.memory->link_arena(
                                       job.snapshot->arena_file()->file, tmp, file); })
            : step.write_rank_files(open_directory(tmp), MemoryTier::kFileMode, hooks_for(job));
    Manifest m = step.manifest();
    m.files = std::move(files);
    m.metadata["ettkit.run_id"] = s_.run_id;
    m.metadata["ettkit.job"] = s_.job_id;
    m.metadata["ettkit.tier"] = "memory";
    s_.memory->commit(tmp, std::move(m));
    // Committed: the arena is this step's data file from now on, and staged into again only once a newer
    // step is committed and this one retired (Stager: free_or_reclaimed).
    if (linked) job.snapshot->publish(job.step);
  } catch (...) {
    s_.memory->abort(tmp);
    throw;
  }
  send_replica(job.step);
}

/// The peer replica of a committed memory step; a failure leaves the step held by this rank only.
void Writer::send_replica(int64_t step) {
  if (!s_.replica) return;
  std::string why = s_.replica->send(s_.memory->dir() + "/" + step_dir_name(step), step);
  if (!why.empty()) {
    ETTKIT_LOG_WARN("checkpoint memory tier: step ", step, " is held by this rank only; rank ",
                    s_.replica->partner(), " keeps no replica of it: ", why);
  }
}

/// A durable disk step supersedes the memory snapshots up to it, and those of other runs (another
/// timeline: this run's saves are what a restart must come back to).
void Writer::retire_superseded_memory(int64_t step) {
  if (!s_.memory) return;
  MemoryTier& memory = *s_.memory;
  memory.retire_everywhere([&](const MemoryStep& s) { return s.step <= step || !memory.in_lineage(s.run_id); });
}

}  // namespace ettkit::checkpoint::detail
