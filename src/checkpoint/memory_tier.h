#pragma once
// The memory tier: this rank's latest snapshots kept in a shared-memory file system (/dev/shm), where they
// survive the process (kill -9, an OOM kill, a torchrun restart) but not the node. A restarted process on the
// same node restores from it at memory speed instead of reading the disk tier back.
//
// Layout (one directory per user, job and checkpoint directory, one per rank inside):
//   <root>/ettkit-mem-<uid>-<key>/owner.json          {"job", "directory", "host"}: whose tier this is
//   <root>/ettkit-mem-<uid>-<key>/rank-<r>/.lock      held by the rank's process for its life (flock)
//   <root>/ettkit-mem-<uid>-<key>/rank-<r>/step-<N>/  rank-<r>.safetensors, rank-<r>.extra, manifest.json
//   <root>/ettkit-mem-<uid>-<key>/rank-<r>/.tmp-step-...   a snapshot being written
//   <root>/ettkit-mem-<uid>-<key>/rank-<r>/.arena-<id>     the stager's arenas: a memory step's data file is a
//                                                    hard link to the arena that staged it (no second copy)
//   <root>/ettkit-mem-<uid>-<key>/rank-<r>/replica-of-rank-<s>/step-<N>/   with a peer replica: rank s's
//                                                    snapshot, received from s (peer_replica.h); same layout and rule
// uid = this process's effective uid; key = XXH3-64 of the job id and the checkpoint directory's canonical path.
//
// Created, never adopted (docs/security.md): the root is shared with every user of the node and the name
// is predictable, so another user can create it first, to plant a step that the restart would load or to
// read the snapshots written into it. Every directory of the tier is created with mode 0700 and every file
// 0600; an existing job, rank or replica directory is used only when its handle (opened O_NOFOLLOW) shows a
// directory owned by this uid with mode exactly 0700, and the root must not let other users rename entries
// (not writable by them, or sticky as /dev/shm is). Otherwise the constructor throws IoError naming the path,
// the owner and the mode, and touches nothing. The tier keeps its job and rank directories open; what it
// creates, renames and removes inside them goes through those handles (mkdirat, renameat, unlinkat,
// remove_tree_at), never through a path walk that a planted link could redirect. The readers of the tier's
// steps (open_step, list_steps) and the writers of its data files (the checkpointer, the peer replica) take
// dir()'s path: it names the verified directory for the tier's life, since no other user can rename or
// replace an entry of the root nor write below the job directory.
//
// Why files in tmpfs and not a raw mapping with a hand-made header: the step directory gives the memory
// tier the disk tier's commit rule unchanged (a step exists exactly when step-<N>/manifest.json does, and
// the manifest is written after the bytes and their checksums) and the same verified, parallel read path
// on load; tmpfs pages live in the page cache, so writing and reading them costs a memcpy each.
//
// Each rank commits on its own (no collective at save time); which step to restore is agreed at load
// (AsyncCheckpointer::load_latest: the newest step every rank holds from the same run).
#include <cstdint>
#include <functional>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "checkpoint/storage.h"

#pragma GCC visibility push(default)

namespace ettkit::checkpoint::detail {

/// One committed snapshot of the tier.
struct MemoryStep {
  int64_t step = -1;
  std::string run_id;  ///< the AsyncCheckpointer run that wrote it (agreed by all ranks of that run)
  int world_size = 0;
  uint64_t bytes = 0;  ///< data + extra
};

/// This rank's part of a job's memory tier. Owns its rank directory's lock from construction to discard()
/// or destruction. Two shelves: this rank's own snapshots (begin() / commit() / abort(), written by the
/// checkpointer's writer thread) and, with a peer replica, the partner's (begin_replica() / commit_in(),
/// written by the replica's receiver thread). Retention and the budget see both; they are serialized by an
/// internal mutex.
class MemoryTier {
 public:
  /// The mode of every file the tier writes (the data files through write_file_durably's `mode` too).
  static constexpr unsigned kFileMode = 0600;
  /// The mode of every directory of the tier; an existing one with another mode is never used.
  static constexpr unsigned kDirectoryMode = 0700;

  /// Creates <root>/ettkit-mem-<uid>-<key>/rank-<rank>/ and its owner.json, or opens them when this user
  /// created them before (module comment: created, never adopted). InvalidArgument when `job_id` is empty,
  /// `rank` negative, or `root` is not a directory or lets other users rename its entries (writable by
  /// them without the sticky bit). IoError naming the path, its owner and its mode when an existing job,
  /// rank or replica directory is a symbolic link, not a directory, another uid's, or not mode 0700.
  /// `budget_bytes` <= 0: no bound.
  MemoryTier(const std::string& root, const std::string& job_id, const std::string& directory, int rank,
             int64_t budget_bytes);
  ~MemoryTier();
  MemoryTier(const MemoryTier&) = delete;
  MemoryTier& operator=(const MemoryTier&) = delete;

  /// The job id given, else $TORCHELASTIC_RUN_ID (when not "none"), else $SLURM_JOB_ID, else "".
  static std::string job_id_from_environment(const std::string& given);
  /// The name of the job directory under the root: ettkit-mem-<euid>-<XXH3-64 of job id and directory>.
  static std::string job_dir_name(const std::string& job_id, const std::string& directory);

  /// Takes the rank directory's lock for this object's life, then removes what a killed writer of this rank
  /// left half-done. Returns the holder's description when another process holds it (nothing is touched).
  std::optional<std::string> try_lock();

  /// The rank directory (a checkpoint-directory layout holding only this rank's files).
  const std::string& dir() const { return dir_; }
  const std::string& job_dir() const { return job_dir_; }

  /// The committed steps, newest commit first, with the manifest fields the load vote needs. A step whose
  /// manifest does not decode is left out with a warning (load_latest then uses the disk tier).
  std::vector<MemoryStep> committed(bool warn = true) const { return committed_in(dir_, warn); }
  /// The same for another shelf of this rank directory (replica_dir()).
  std::vector<MemoryStep> committed_in(const std::string& shelf, bool warn) const;
  /// Where this rank keeps rank `src`'s replicas: <dir()>/replica-of-rank-<src>.
  std::string replica_dir(int src) const;

  /// Marks a run's snapshots as this process's lineage: its own run (when the checkpointer opens the tier,
  /// so that the partner's replicas of it are kept before this rank's first begin(); begin() adopts its run
  /// too) and the run of a memory step it restored. Snapshots of other runs are other timelines, retired by
  /// the next begin() and by a disk commit (Writer::retire_superseded_memory).
  void adopt(const std::string& run_id) {
    std::lock_guard<std::mutex> lk(lineage_mu_);
    lineage_.insert(run_id);
  }
  bool in_lineage(const std::string& run_id) const {
    std::lock_guard<std::mutex> lk(lineage_mu_);
    return lineage_.count(run_id) > 0;
  }

  /// Before a snapshot of `bytes` is written: InvalidArgument when it alone exceeds the budget. Retires
  /// every committed step but the newest of the lineage, so that the tier holds at most two snapshots at
  /// any moment (the previous and the next until the next commits; the two newest after it), and more when
  /// the budget needs it (with a bounded budget a crash while writing can then leave no memory step: the
  /// disk tier is the fallback). Why two: a rank killed while writing step N leaves the other ranks with N
  /// committed; the previous step is what every rank still holds. Returns the temporary directory to write
  /// rank-<r>.safetensors / .extra into.
  std::string begin(int64_t step, const std::string& run_id, uint64_t bytes);
  /// Before rank `src`'s replica of `bytes` is received: retires every replica but the newest of `src`,
  /// and that one too when the budget needs it. InvalidArgument when it does not fit next to this rank's
  /// own snapshots (the own snapshots come first). Returns the temporary directory to receive into.
  std::string begin_replica(int src, int64_t step, const std::string& run_id, uint64_t bytes);
  /// Writes the manifest (this rank's files only, run id and job in its metadata) and renames the temporary
  /// directory to step-<N> (replacing an older step-<N>).
  void commit(const std::string& tmp, Manifest manifest) { commit_in(dir_, tmp, std::move(manifest)); }
  void commit_in(const std::string& shelf, const std::string& tmp, Manifest manifest);
  /// Removes a temporary directory of a failed or refused snapshot (one begin() or begin_replica()
  /// returned). Never throws.
  void abort(const std::string& tmp) noexcept;
  /// Retires the committed steps for which `drop` is true, and every step-* entry that is not a committed
  /// step (nothing else writes a rank directory). Never throws (failures are logged).
  void retire_if(const std::function<bool(const MemoryStep&)>& drop) noexcept { retire_in(dir_, drop); }
  void retire_in(const std::string& shelf, const std::function<bool(const MemoryStep&)>& drop) noexcept;
  /// retire_if() on this rank's own shelf, then retire_in() on every replica shelf: a disk step or a
  /// restore that supersedes snapshots supersedes the replicas kept of them too.
  void retire_everywhere(const std::function<bool(const MemoryStep&)>& drop);
  /// The stager's arenas as this tier's files (host_arena.h, ArenaFiles): a new file `.arena-<random>` in
  /// dir(), created O_CREAT | O_EXCL | O_NOFOLLOW with mode 0600 through the rank directory's handle and sized
  /// to `bytes` (memory_tier_arenas.cpp). A name that is taken (a link, a FIFO, a file, a directory: whatever
  /// it is) is never opened nor removed: another random name is tried, up to kArenaNameAttempts. Returns its
  /// descriptor (the caller owns it) and its name in `name`. IoError naming the path, and what was found there
  /// when every name tried was taken.
  int create_arena(uint64_t bytes, std::string& name);
  static constexpr int kArenaNameAttempts = 8;
  /// Where every tier's arena names after ".arena-" come from, process-wide (random_id() when empty). For
  /// tests, which plant entries under the names a tier will try, also behind an AsyncCheckpointer.
  static void set_arena_names_for_testing(std::function<std::string()> next);
  /// Removes the arena name (never throws; a step linking the file keeps its bytes).
  void remove_arena(const std::string& name) noexcept;
  /// Links the arena file `arena` into the temporary directory `tmp` (begin()'s) as `file`: the memory
  /// step's data file, without a copy. IoError naming both.
  void link_arena(const std::string& arena, const std::string& tmp, const std::string& file);
  /// Every replica shelf of this rank directory.
  std::vector<std::string> replica_shelves() const;
  /// Removes this rank's directory (and the job directory once no rank's is left), releases the lock.
  /// Idempotent; never throws.
  void discard() noexcept;

 private:
  std::string job_id_;
  std::string job_name_;  // job_dir_name(): the job directory's entry in the root
  std::string job_dir_;
  std::string dir_;
  // The root, the job directory and this rank's directory, opened O_NOFOLLOW (the root as the user named
  // it) and verified at construction; open for the tier's life (module comment).
  Dir root_;
  Dir job_;
  Dir rank_dir_;
  int rank_ = 0;
  int64_t budget_ = 0;
  DirectoryLock lock_;
  bool discarded_ = false;
  std::set<std::string> lineage_;
  mutable std::mutex mu_;          // begin/commit/retire of both shelves (never held while taking lineage_mu_'s
                                   // callers: retire predicates call in_lineage)
  mutable std::mutex lineage_mu_;  // lineage_

  void retire_locked(const std::string& shelf, const std::function<bool(const MemoryStep&)>& drop) noexcept;
  uint64_t held_bytes_locked() const;
  /// A handle of `shelf`: dir() itself, or a replica-of-rank-<s> directory of it opened without following a
  /// link. InvalidArgument for any other path; IoError when it cannot be opened.
  Dir open_shelf(const std::string& shelf) const;
  /// The last component of `path` when `path` is `shelf` + "/" + a plain name (no '/', not "." or "..");
  /// InvalidArgument otherwise.
  static std::string entry_of(const std::string& shelf, const std::string& path);
  /// Removes the .tmp-step-*, .trash-* and .arena-* entries of `shelf` (a killed writer's; an arena's bytes
  /// stay where a committed step links them).
  static void remove_temporaries_in(const Dir& shelf) noexcept;
};

/// Removes every tier of this user under `root` that belongs to `directory` but another job and whose ranks'
/// locks are all free (that job's processes are gone), and this user's tiers of `directory` named as before
/// the uid was part of the name (ettkit-mem-<key>: no later version uses them). Tiers of other checkpoint
/// directories are left alone: they may belong to a job that is between two restarts. Another user's tier
/// is never touched, whatever its owner.json says (it is not this user's to judge, and its name, which
/// carries its uid, is never this user's tier). Returns the directories removed. Never throws.
std::vector<std::string> remove_stale_memory_tiers(const std::string& root, const std::string& job_id,
                                                   const std::string& directory) noexcept;

}  // namespace ettkit::checkpoint::detail

#pragma GCC visibility pop
