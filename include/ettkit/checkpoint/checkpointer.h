#pragma once
// ettkit::checkpoint: async checkpoint stager and crash-consistent checkpointer (docs/checkpoint.md).
//
// What it promises
//  - Staging: save() copies the state into a host arena that was allocated once (exact size, pinned
//    when CUDA is available) and is reused by every later save. CPU tensors are copied by worker threads
//    (tensors at most `sync_copy_max_bytes`, and inference tensors, are copied synchronously inside
//    save()); CUDA tensors are copied on a dedicated stream that first waits on an event recorded on the
//    caller's current stream.
//  - Integrity: a committed step is never a torn snapshot of what the version counters can see. save()
//    records every tensor's version counter (bumped by every in-place op); a tensor whose counter moved
//    before its copy was known complete may hold bytes of two steps, and such a save is refused on every
//    rank (TornSnapshot, naming the tensors) instead of committed. Writes that bypass the counter
//    (`.data`, raw pointers, kernels that write their inputs in place without autograd) are invisible:
//    protect those tensors with wait_for() before the write. docs/checkpoint.md has the exact rules.
//  - Overlap: with CheckpointerOptions::overlap = kAuto (default), save() returns only once the copies
//    are complete, until the caller calls enable_overlap() to promise that it fences every mutation of a
//    saved tensor (wait_staged_on_current_stream() before the optimizer step, wait_for() before a module
//    writes its buffers or an in-backward update writes a parameter). The Python attach() does both.
//  - Persistence: a background writer thread writes rank-<r>.safetensors (+ rank-<r>.extra) into
//    CKPT_DIR/.tmp-step-<N>-<run>/, fsyncs them, and commits (docs/checkpoint.md, "How a save works"):
//    every rank reports through the c10d Store, rank 0 writes + fsyncs manifest.json, renames the
//    directory to step-<N>, fsyncs CKPT_DIR, updates `latest` atomically and applies keep_last. A step is committed exactly when
//    step-<N>/manifest.json exists; a crash at any point leaves earlier committed steps intact.
//  - Errors on the writer thread are values: they travel to SaveHandle::wait() / error(); training goes on.
//  - Memory tier (CheckpointerOptions::memory_tier, off by default): save(..., Tier::kMemory) commits the
//    snapshot into a shared-memory file system (/dev/shm) under the same rule as the disk commit (bytes and
//    checksums first, then the manifest, then the rename), per rank and without any collective. It survives
//    the process, not the node. load_latest restores from it when every rank holds the same step of one run
//    and no newer step is on disk; otherwise, or when it fails verification, from the disk tier (warning).
//  - Peer replica (enable_peer_replica(), off by default): each memory-tier snapshot is also sent to a
//    partner rank on another node, which keeps it in its memory tier; a rank whose node was lost gets its
//    snapshot back from that partner in load_latest. Survives the loss of one node of each partner pair.
//
// Threads and ownership
//  - The *owner* thread is the one that calls save(). Source tensors (the caller's) are referenced by a
//    snapshot until its copies are done and are released only on the owner thread (in save(), the fences
//    and close()), never on ettkit's threads: dropping the last reference of a Python-owned tensor needs
//    the GIL, which a background thread must never wait for.
//  - save/load_latest/close/enable_overlap: the owner thread. wait_staged_on_current_stream() and
//    wait_for(): the owner or the autograd thread (hooks). SaveHandle: any thread.

// The Tensor class only: the header is included by every trainer; ATen.h (every operator) is theirs to include.
#include <ATen/core/Tensor.h>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <atomic>
#include <cstdint>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "ettkit/common/error.h"
#include "ettkit/common/export.h"

namespace c10d {
class Backend;
}

namespace ettkit::ett {
class Recorder;
}

namespace ettkit::checkpoint {

/// No committed checkpoint passes verification (Python: ettkit.CorruptCheckpointError).
class ETTKIT_API CorruptCheckpoint : public CorruptData {
  using CorruptData::CorruptData;
};

/// A save was refused because saved tensors changed while they were being copied: committing it could
/// have mixed two steps (Python: ettkit.TornSnapshotError). The message names the tensors.
class ETTKIT_API TornSnapshot : public Error {
  using Error::Error;
};

/// Another checkpointer (another job, or another AsyncCheckpointer of this process) holds the directory's
/// lock (Python: ettkit.CheckpointLockedError). The message names the holder.
class ETTKIT_API DirectoryLocked : public Error {
  using Error::Error;
};

/// A rank this save needs is gone (its heartbeat stopped, it closed without taking part, or the c10d Store
/// is unreachable): every queued save fails with it at once (Python: ettkit.PeerLostError).
class ETTKIT_API PeerLost : public Error {
  using Error::Error;
};

/// Whether save() may return before its copies are complete.
enum class Overlap : uint8_t {
  kAuto,  ///< blocking until enable_overlap() is called (the caller fences its mutations), then overlapped
  kOn,    ///< always overlapped: unfenced mutations during staging make the save refused (TornSnapshot)
  kOff,   ///< save() always waits for the copies
};
ETTKIT_API Overlap parse_overlap(const std::string& s);

/// What save() does while every arena is still held by earlier saves.
enum class OnBusy : uint8_t {
  kWait,   ///< block until an arena is free (the wait counts as blocking time)
  kSkip,   ///< return a handle whose skipped() is true; nothing is saved
  kError,  ///< throw InvalidArgument
};
ETTKIT_API OnBusy parse_on_busy(const std::string& s);

using NamedTensors = std::vector<std::pair<std::string, at::Tensor>>;

/// What a caller that hands over the same list save after save (the Python bound save's TensorList) may
/// vouch for, so that the save does less per tensor on its thread (issue #65). Empty: nothing is vouched for.
struct SaveBinding {
  /// Nonzero: the names of the list saved are exactly those of every earlier save with the same token (a
  /// token is never reused for other names: new_names_token()). The names are then not compared with the
  /// plan's; dtypes, shapes, devices and storages are checked every save all the same.
  uint64_t names_token = 0;
  /// The list saved itself (`&*held == &tensors`), not modified while anyone holds it (copy-on-write): the
  /// save keeps this one reference until its copies are done instead of one per tensor.
  std::shared_ptr<const NamedTensors> held;
};
/// A names token no other call returned (SaveBinding::names_token).
ETTKIT_API uint64_t new_names_token();

/// Where a save is committed.
enum class Tier : uint8_t {
  kDisk,    ///< CKPT_DIR: durable, all ranks commit together (the default)
  kMemory,  ///< the memory tier: survives a killed process on the same node, per-rank commit
};
ETTKIT_API Tier parse_tier(const std::string& s);
ETTKIT_API const char* tier_name(Tier t);

/// The memory tier (docs/checkpoint.md, "The memory tier"). Off while `root` is empty.
struct ETTKIT_API MemoryTierOptions {
  /// A directory on a memory file system that outlives the process (e.g. "/dev/shm"); empty: no memory tier.
  std::string root;
  /// Names the job, so that a restarted process finds its own snapshots and a later job never restores an
  /// earlier job's. Empty: $TORCHELASTIC_RUN_ID (unless "none"), else $SLURM_JOB_ID, else an error.
  std::string job_id;
  /// Upper bound on the tier's bytes per rank (<= 0: none). When two snapshots do not fit, the held one is
  /// retired before the next is written; a snapshot larger than the budget is refused (InvalidArgument).
  int64_t budget_bytes = 0;
  /// Checksums of a memory step are verified on load when this and CheckpointerOptions::verify_on_load are
  /// both true. Verification reads the bytes once more before copying them (docs/benchmarks.md: restore).
  bool verify = true;
};

namespace detail {
class DeviceCopyBackend;
}  // namespace detail

struct ETTKIT_API StagerOptions {
  /// Upper bound on host arena bytes (all arenas together); <= 0: no bound.
  int64_t memory_budget_bytes = 0;
  /// 1, or 2 for double-buffering (a new save stages while the previous one persists). 2 needs a budget
  /// that fits two arenas (or no budget). With a memory tier (AsyncCheckpointer) there are two arenas, the
  /// tier's files, whenever the budget fits them (Stager::set_arena_files).
  int num_arenas = 1;
  /// Threads that copy CPU tensors (0 = min(4, hardware threads)).
  int copy_threads = 0;
  /// Tensors this small are copied synchronously inside save() (step counters, BatchNorm statistics).
  int64_t sync_copy_max_bytes = 4096;
  /// -1: pinned when torch::cuda::is_available(); 0: never; 1: always (fails without CUDA).
  int pin_memory = -1;
  /// Opt-in, off by default (0): contiguous CUDA tensors up to this many bytes (at most 1 MiB) are copied
  /// into a pinned arena by one kernel per save and copy class instead of a cudaMemcpyAsync each. Measured on
  /// an H200 with 20,001 tensors of 13 KB (docs/benchmarks.md, "GPU"): staging alone 1.8x faster (5.67
  /// against 3.17 GB/s), but save() beside a training step blocked the host twice as long (200 against
  /// 100 ms), for a reason not yet found; hence off. The kernel runs on the SMs; cudaMemcpyAsync uses the
  /// copy engine only.
  int64_t cuda_gather_max_bytes = 0;
  /// How CUDA tensors are copied (issue #65): "per_tensor", a cudaMemcpyAsync and a recordStream each on the
  /// caller's thread (measured on an H200: ~5 us a tensor); "batched", one event recorded on the caller's
  /// stream and the copies queued as a batch by a staging thread (cudaMemcpyBatchAsync on CUDA >= 12.8), the
  /// sources' storages held until the copies are seen complete (src/checkpoint/device_stager.h). "" (the
  /// default): the environment's ETTKIT_CUDA_COPY, else "per_tensor" — "batched" is proven on a fake device
  /// in the C++ tests, not yet measured on a GPU (docs/checkpoint.md).
  std::string cuda_copy;
  /// Internal, for tests: the device backend of the "batched" path (nullptr: CUDA's).
  std::shared_ptr<detail::DeviceCopyBackend> device_copy_backend;
};

/// The order in which the copies run: class 0 first (e.g. buffers a forward pass writes), then 1 (e.g.
/// parameters updated inside backward), then the rest. Keyed by storage, so a parameter and the detached
/// view a state dict holds match, and so do the tables that share one fused embedding storage.
using CopyPriority = std::vector<std::pair<const void*, int>>;

/// One entry of the cached snapshot plan: where a tensor lives in the arena.
struct PlanEntry {
  std::string name;
  at::ScalarType dtype;
  std::vector<int64_t> shape;
  c10::Device device{c10::kCPU};
  int64_t nbytes = 0;
  int64_t offset = 0;
};

/// What a save's copies also hash as they write (Stager::stage).
enum class StageHashing : uint8_t { kNone, kMemoryTier, kDiskTier };

/// The disk tier's safetensors header of a plan, as far as the copies need it (Stager::set_disk_header_planner):
/// its length in bytes and the plan entries whose whole-tensor digest it records.
struct DiskHeaderPlan {
  uint64_t bytes = 0;
  std::vector<size_t> whole;
};

class Stager;
namespace detail {
struct Arena;
struct ArenaFiles;
class InOrderDigest;
}  // namespace detail

/// One staged copy of a state dict, holding one arena until released.
class ETTKIT_API Snapshot {
 public:
  ~Snapshot();
  /// Blocks the host until every copy has landed in the arena (rethrows a copy error). On the thread that
  /// staged the snapshot this is also a fence (see wait_for).
  void wait_staged();
  /// GPU copies: makes the caller's current CUDA stream wait for them (no host block); CPU copies: waits
  /// on the host.
  void wait_staged_on_current_stream();
  /// Fences the entries whose storage is one of `tensors`' storages (tensors not in the snapshot are
  /// ignored): CPU copies are waited for on the host, CUDA copies make the caller's current stream wait.
  /// Afterwards the caller may write those tensors. Thread-safe (autograd hooks call it). Returns
  /// whether anything was still being copied.
  bool wait_for(const std::vector<at::Tensor>& tensors);
  /// The names of entries that changed while being copied (decides the undecided ones now; call after
  /// wait_staged()). Empty: the snapshot is consistent.
  std::vector<std::string> changed_entries();
  /// Waits for the CPU copies, then drops the references to the source tensors, on the calling thread
  /// (the destructor does it too). Call it from a thread that may drop the caller's tensors.
  void drop_sources();
  /// Non-blocking query.
  bool staged() const;
  /// Whether every entry has its verdict (no fence has anything left to decide).
  bool all_decided() const;
  const std::vector<PlanEntry>& plan() const { return *plan_; }
  /// The plan itself: the same object for every snapshot of one plan, until the structure changes.
  std::shared_ptr<const std::vector<PlanEntry>> shared_plan() const { return plan_; }
  int64_t total_bytes() const;
  /// The arena bytes (valid until release()).
  const uint8_t* data() const { return data_; }
  uint8_t* mutable_data() { return data_; }
  /// Returns the arena to the stager (idempotent; waits for staging first).
  void release();
  /// The memory tier's commit without a copy (writer.cpp): the arena when it is a file of the memory tier
  /// (Stager::set_arena_files), else nullptr. Valid until release() or publish().
  const detail::Arena* arena_file() const;
  /// Instead of release(): returns the arena to the stager as the data file of the memory step `step`,
  /// which links it. The stager stages into it again only once no step links it (that step retired, by the
  /// tier's retention or by the stager itself when it needs the arena for a later save).
  void publish(int64_t step);
  /// The digest of the step's data file that the copies computed as they wrote it (Stager::stage's
  /// `hashing`), for the writer to finish once the header is known; nullptr when not asked or not possible.
  /// Valid while the snapshot lives.
  detail::InOrderDigest* file_digest() const;
  /// The whole tensors' digests the copies computed (a kDiskTier stage; DiskHeaderPlan::whole, in that
  /// order); nullptr otherwise. Valid while the snapshot lives.
  detail::InOrderDigest* tensor_digest() const;
  /// Views of the arena as CPU tensors, one per plan entry (valid until release()).
  NamedTensors tensors();
  int64_t stage_begin_us() const { return stage_begin_us_; }
  /// Epoch microseconds when the host observed staging complete (0 while unknown).
  int64_t staged_us() const;

 private:
  friend class Stager;
  struct State;
  Snapshot() = default;
  /// Host wait for every copy, deciding nothing.
  void wait_copies() const;
  Stager* stager_ = nullptr;
  int arena_ = -1;
  uint8_t* data_ = nullptr;
  std::shared_ptr<const std::vector<PlanEntry>> plan_;
  std::shared_ptr<State> state_;
  int64_t stage_begin_us_ = 0;
  std::atomic<bool> released_{false};
};

/// Arena pool + snapshot plan + copy engine. Used by AsyncCheckpointer and by the DCP adapter.
class ETTKIT_API Stager {
 public:
  explicit Stager(StagerOptions options = {});
  ~Stager();
  Stager(const Stager&) = delete;
  Stager& operator=(const Stager&) = delete;

  /// Starts copying `tensors` into a free arena. Returns nullptr when on_busy == kSkip and no arena is
  /// free. Throws InvalidArgument when the state exceeds the memory budget or on_busy == kError.
  /// `sync_copy_max_bytes` raises StagerOptions::sync_copy_max_bytes for this save.
  /// `hashing`: what the copies also hash as they write (Snapshot::file_digest, tensor_digest), so that the
  /// writer needs no pass of its own: kMemoryTier, when the arena is a file of the memory tier, that file's
  /// chunks; kDiskTier, when a disk header planner is set, the disk data file's chunks and its whole tensors.
  std::shared_ptr<Snapshot> stage(const NamedTensors& tensors, OnBusy on_busy,
                                  const CopyPriority& priority = {}, int64_t sync_copy_max_bytes = 0,
                                  StageHashing hashing = StageHashing::kNone, const SaveBinding& binding = {});
  /// Does now what the first stage() of `tensors`' structure (names, dtypes, shapes) would: builds the plan,
  /// allocates the arenas and backs every page of them, so that the first save blocks like the later ones
  /// (faulting in a fresh arena costs about as much as the copy itself). For a thread other than the
  /// training thread, as soon as the state exists; stage() waits for a prepare() in progress. Only the
  /// structure is read, never the tensors' data. When the structure changed since the plan, the arenas are
  /// reallocated as stage() would (waiting for busy ones). Returns the bytes backed now (0: nothing was left
  /// to do). InvalidArgument as stage() for a state beyond the memory budget.
  int64_t prepare(const NamedTensors& tensors);

  /// Internal to AsyncCheckpointer: with a memory tier, the arenas become files of that tier (two of them
  /// when the budget allows, whatever num_arenas says), so that a memory-tier save commits the arena that
  /// staged it instead of copying it. nullptr: anonymous memory again. Waits for every busy arena and frees
  /// all of them; the next stage() or prepare() allocates them anew.
  void set_arena_files(std::shared_ptr<detail::ArenaFiles> files);
  /// Internal to AsyncCheckpointer: how long the disk tier's safetensors header of a plan is (its whole-tensor
  /// digests are 16 hex digits whatever the bytes, so the length is the plan's) and which entries those
  /// digests cover; asked once per plan. With it, a kDiskTier stage hashes as it copies. Returning 0 bytes
  /// (a plan the header cannot describe): that save hashes after staging, as without a planner.
  void set_disk_header_planner(std::function<DiskHeaderPlan(const std::vector<PlanEntry>&)> planner);

  int64_t arena_bytes() const;
  int num_arenas() const;
  bool pinned() const;
  /// How often the plan was (re)built and the arenas (re)allocated: for tests and benchmarks.
  int64_t plan_builds() const;
  int64_t arena_allocations() const;
  /// Seconds spent waiting for a free arena (kWait), cumulative.
  double busy_wait_s() const;

 private:
  friend class Snapshot;
  struct Impl;
  void release_arena(int arena);
  void publish_arena(int arena, int64_t step);
  std::unique_ptr<Impl> impl_;
};

/// Returned by AsyncCheckpointer::save().
class ETTKIT_API SaveHandle {
 public:
  struct State;
  explicit SaveHandle(std::shared_ptr<State> state) : state_(std::move(state)) {}
  int64_t step() const;
  Tier tier() const;
  bool skipped() const;
  bool staged() const;
  /// Committed: on disk (Tier::kDisk) or in the memory tier (Tier::kMemory).
  bool durable() const;
  /// The writer's error, or nullptr.
  std::exception_ptr error() const;
  /// Blocks until durable (returns true) or failed (rethrows the error); timeout_s < 0: no bound
  /// (throws Timeout when it runs out).
  bool wait(double timeout_s = -1.0);
  void wait_staged();
  /// Epoch microseconds; 0 when not reached.
  int64_t durable_us() const;
  double blocking_s() const;

 private:
  std::shared_ptr<State> state_;
};

struct ETTKIT_API CheckpointerOptions {
  std::string directory;
  int keep_last = 3;
  OnBusy on_busy = OnBusy::kWait;
  Overlap overlap = Overlap::kAuto;
  /// Overlapped saves copy CPU tensors up to this size synchronously inside save(), so that writes the
  /// version counter cannot see (BatchNorm statistics written by the next forward) cannot race their
  /// copy; set_unfenced_sync_max_bytes(0) once those writers are fenced (the Python attach(model=...) does).
  int64_t unfenced_sync_max_bytes = 64 * 1024;
  bool verify_on_load = true;
  StagerOptions stager;
  /// -1: from the Store's world (rank 0 / size 1 without a store).
  int rank = -1;
  int world_size = -1;
  /// How long a rank waits for the others at commit (seconds).
  double commit_timeout_s = 600.0;
  /// A peer whose heartbeat (published through the Store every peer_timeout_s / 6) stops for this long is
  /// gone: the commit it blocks, and every queued save, fail with PeerLost instead of waiting out
  /// commit_timeout_s.
  double peer_timeout_s = 3.0;
  /// Non-owning; must outlive the checkpointer. Receives checkpoint_blocking (foreground) and
  /// checkpoint_staging / checkpoint_persist (background) records. Null: see use_current_recorder.
  ett::Recorder* recorder = nullptr;
  /// When `recorder` is null: true records into ett::current_recorder() as of construction (which must
  /// then outlive the checkpointer; a warning, once per process, when none is open); false records nothing.
  bool use_current_recorder = true;
  /// Written into every manifest.
  std::map<std::string, std::string> metadata;
  /// Only loads: takes no directory lock, removes nothing, and save() throws InvalidArgument. For jobs and
  /// tools that read a directory another job writes.
  bool read_only = false;
  MemoryTierOptions memory_tier;
  /// A step written by another number of ranks gives every new rank one old rank's copy of each tensor
  /// saved whole (no `@offsets`). When the copies differ between old ranks (the digests in their headers
  /// say so), false refuses the load naming them (per-rank state has no right value at another world
  /// size); true takes old rank 0's copy with a warning: right for state that rank 0 is the authority on,
  /// such as the buffers of a DDP model with broadcast_buffers (synced from rank 0 at every forward).
  bool reshard_whole_from_rank0 = false;
};

struct LoadResult {
  int64_t step = -1;
  std::string extra;
  std::vector<int64_t> skipped_steps;  // newer steps that failed validation
  /// The loaded step's tensors that had no destination and are under one of load_latest()'s
  /// `read_prefixes`, read into new contiguous CPU tensors, in the checkpoint's name order.
  NamedTensors read;
  /// Where the step came from.
  Tier tier = Tier::kDisk;
  /// Why a memory-tier step that every rank held was not loaded (it failed verification on some rank);
  /// empty otherwise.
  std::string memory_fallback;
  /// With a peer replica: the rank that gave this rank its memory-tier snapshot back (its own was gone);
  /// -1 when the snapshot was this rank's own, or came from disk.
  int memory_from_rank = -1;
  /// The number of ranks that wrote the loaded step (== world_size unless it was resharded), and for a
  /// resharded load the bytes of the old files this rank read into its tensors and the bytes it verified
  /// (the checksum chunks those reads touch).
  int saved_world_size = 0;
  /// This rank read the step by resharding: it was written by another number of ranks, or by as many with
  /// this rank's shards in another layout (another sharding plan, mesh shape or placements). Per rank: at the
  /// same world size a rank whose shards did not move reads its own file.
  bool resharded = false;
  uint64_t reshard_bytes_read = 0;
  uint64_t reshard_bytes_verified = 0;
  /// The step's checksums were verified ahead by prefetch(); the bytes load_latest hashed again because
  /// their pages had left the page cache since.
  bool prefetched = false;
  uint64_t prefetch_reverified_bytes = 0;
};

class ETTKIT_API AsyncCheckpointer {
 public:
  /// Creates the directory, (rank 0) takes the directory lock for the checkpointer's life (DirectoryLocked
  /// naming the holder when another checkpointer has it; released by close()), agrees on a run id through
  /// the store (world > 1), and (rank 0) removes temporaries left by earlier runs. read_only: no lock, no
  /// removal.
  AsyncCheckpointer(CheckpointerOptions options, c10::intrusive_ptr<c10d::Store> store = {});
  ~AsyncCheckpointer();
  AsyncCheckpointer(const AsyncCheckpointer&) = delete;
  AsyncCheckpointer& operator=(const AsyncCheckpointer&) = delete;

  /// Stages `tensors` and queues their persistence as step `step`, with `extra` (opaque bytes) as the
  /// rank's non-tensor state. Blocking time (including waits for a busy arena) is recorded. Throws
  /// InvalidArgument for a step outside [0, 10^18), the name "__metadata__" (reserved by safetensors), a
  /// dtype safetensors cannot store, or Tier::kMemory without a memory tier. A conjugate or negative-bit
  /// view (whose storage holds other values than it shows) saves the values it shows: save() copies it
  /// resolved (resolve_conj() / resolve_neg()) before staging.
  /// Tier::kMemory commits this rank's snapshot into the memory tier only (no Store traffic); a later
  /// committed disk save of a step >= it retires it.
  /// `call_begin_us` (epoch µs, -1: now): when the caller's save began. A binding that flattens and encodes the
  /// state before this call (the Python AsyncCheckpointer) passes its own start, so that the blocking recorded
  /// is the whole call the training thread made, not only this part of it.
  /// `binding`: what the caller vouches for about `tensors` (SaveBinding), to save per-tensor work.
  SaveHandle save(int64_t step, const NamedTensors& tensors, const std::string& extra = {}, Tier tier = Tier::kDisk,
                  int64_t call_begin_us = -1, const SaveBinding& binding = {});
  /// Sizes, allocates and backs the host arenas for `tensors` now (Stager::prepare): the first save() of
  /// that structure then blocks like the later ones instead of paying for the arena's page faults. Call it
  /// from a thread other than the training thread once the state exists (e.g. beside the compile); a
  /// save() that comes meanwhile waits for it. Thread-safe against save(). Returns the bytes backed now.
  /// InvalidArgument as save() for a reserved name, a dtype safetensors cannot store, a state beyond the
  /// memory budget, or a read_only checkpointer.
  int64_t prepare(const NamedTensors& tensors);
  /// Makes the caller's current stream (GPU) or the host (CPU) wait until the latest save is staged, and
  /// records the wait as checkpoint_blocking. Call before mutating saved tensors.
  void wait_staged_on_current_stream();
  /// The same, for the saved tensors that share storage with `tensors` only (e.g. one module's buffers
  /// before its forward, one parameter before its in-backward update). Thread-safe.
  void wait_for(const std::vector<at::Tensor>& tensors);
  /// The caller promises to fence every mutation of a saved tensor (see the header comment); with
  /// Overlap::kAuto, later saves return before their copies are complete.
  void enable_overlap();
  bool overlapped() const;
  /// Whether the latest save has entries no fence has decided yet (hooks skip their work otherwise).
  bool fence_pending() const;
  /// Tests only: while held, the writer stops with a save's bytes written, before it releases the arena and
  /// gives the integrity verdict, so that a test can write a saved tensor "during" the save, or find the arena
  /// busy, deterministically. close() ends a hold (and counts the held save as one it waits for).
  void hold_commits_for_testing(bool hold);
  /// Tests only: blocks until the writer waits in a hold (a save reached it), so that what a test does next
  /// happens with the save stopped there, not merely queued.
  void wait_until_held_for_testing();
  void set_unfenced_sync_max_bytes(int64_t bytes);
  /// Copy order for later saves (see CopyPriority); replaces the previous one.
  void set_copy_priority(CopyPriority priority);
  /// Loads the most recently committed step that validates into `tensors` in place. nullopt when nothing
  /// is committed; CorruptCheckpoint when steps exist but none validates; InvalidArgument naming every key
  /// that differs (missing in the checkpoint, unexpected in it, another dtype or shape) when the state dict
  /// does not match the checkpoint. `validate_extra` (optional) is called with each candidate's extra bytes
  /// last among a candidate's checks (after its manifest, file sizes, checksums and tensor names) and before
  /// any tensor is copied; an exception from it makes that step not loadable (fallback to an older one, as
  /// for a bad checksum), except InvalidArgument, which means the caller's state does not match
  /// that step and is thrown like a tensor mismatch. A step that retention removes while it is being
  /// considered is skipped silently and the directory is listed again.
  ///
  /// `read_prefixes`: a tensor of the checkpoint that `tensors` has no destination for is a mismatch unless
  /// its name is under one of these prefixes ("p" covers "p" and "p.<anything>"; "" covers every name);
  /// those are read into new CPU tensors (LoadResult::read) from the same step, after the same checks
  /// (checksums included) and only once the step is chosen. For state that does not exist before it is
  /// loaded: an optimizer whose lazy state its first step() would create.
  ///
  /// `partial`: `tensors` may be a part of the step (a model without its optimizer, for evaluation or
  /// export): a tensor of the checkpoint that no destination asks for and no read prefix covers is not read,
  /// not a mismatch (nor are a sharded tensor's pieces that no destination wants). Every destination must
  /// still be in the step. The checksums are those of the whole files, as for a full load.
  ///
  /// Layouts: a destination named "key@offsets" is a shard (a box) of the tensor `key`; one without is a
  /// whole tensor. A step that holds a tensor in another layout than the state is read by resharding: shards
  /// of another plan, mesh or world size; a tensor saved in pieces (a sharded table) wanted whole (a plain
  /// model on one rank, a data-parallel table), its pieces having to make up exactly the destination's shape;
  /// a tensor saved whole (proven the same on every old rank by its digests) wanted as shards, which needs its
  /// global shape in `global_shapes` (key -> shape; it must equal the saved tensor's) and is refused naming
  /// the key without it. A `global_shapes` entry is also checked against the extent of the saved pieces.
  ///
  /// With a memory tier: the ranks agree through the Store on the newest step that every one of them holds
  /// in memory from the same run; it is loaded (same checks) when no newer step is committed on disk. All
  /// ranks load from the same tier. Afterwards every memory step but the loaded one is retired.
  ///
  /// With a peer replica, a rank that lacks the step but whose partner holds its replica of it counts as
  /// holding it: the partner sends it back (checked against its checksums) before the ranks vote on it.
  /// Starts verifying, on a background thread, the step load_latest will most likely restore: this rank's
  /// newest memory-tier step when no disk step has a larger number, else (or when it does not verify) the
  /// newest committed disk step. Call it early in a restart (before building the model, compiling, ...):
  /// the checksum pass, and for a disk step the reads from the device into the page cache, then overlap
  /// that work, and load_latest (which waits for the prefetch) is left with the copy into the tensors.
  /// load_latest uses the result only for the step the ranks agree on, only if that step's manifest is
  /// still the one verified, and hashes again every chunk whose pages left the page cache meanwhile; it
  /// checks any other step itself, as without a prefetch. The files stay open until load_latest, the next
  /// save(), close() or the next prefetch(). Returns the steps queued, in order (empty: nothing to
  /// restore). Not collective; the owner thread.
  std::vector<int64_t> prefetch();
  /// Waits up to `timeout_s` seconds (< 0: for ever) for the prefetch; true when it has ended or none runs.
  bool wait_prefetch(double timeout_s = -1);
  /// The last prefetch's seconds and verified bytes (0, 0 while it runs).
  std::pair<double, uint64_t> prefetch_figures() const;
  std::optional<LoadResult> load_latest(const NamedTensors& tensors,
                                        const std::function<void(const std::string&)>& validate_extra = {},
                                        const std::vector<std::string>& read_prefixes = {}, bool partial = false,
                                        const std::map<std::string, std::vector<int64_t>>& global_shapes = {});
  /// Turns on the peer replica (collective: every rank, before its first save and load_latest; needs a
  /// memory tier). `group` is a process group of exactly this checkpointer's ranks, kept for the
  /// checkpointer's life, that carries the snapshots' bytes as CPU tensors (a c10d ProcessGroupGloo on its
  /// own PrefixStore; the checkpointer's Store carries the announcements). Rank r's partner, which keeps
  /// r's replica, is (r + ranks_per_host) % world_size: the same local rank on the next node when each node
  /// runs ranks_per_host consecutive ranks. A memory save's handle completes once the partner has verified
  /// and committed its copy, or refused it (a warning; the local snapshot stands). InvalidArgument for a
  /// group of another size or rank, ranks_per_host outside [1, world_size), no memory tier, or a call after
  /// a save or load.
  void enable_peer_replica(c10::intrusive_ptr<c10d::Backend> group, int ranks_per_host);
  /// Snapshots sent to the partner and committed there, received from the rank this one keeps replicas
  /// for, and not replicated (either direction).
  int64_t replicas_sent() const;
  int64_t replicas_received() const;
  int64_t replica_failures() const;
  /// The run id the ranks agreed on (names this run's Store keys; a side group's PrefixStore can use it).
  const std::string& run_id() const;
  /// Waits for every queued save (durable or failed); rethrows nothing.
  void wait_all();
  /// wait_all() and stop the writer, then release the directory lock. Idempotent. A clean end of the job:
  /// `discard_memory_tier` also removes this rank's memory tier (the destructor, which also runs while an
  /// exception unwinds, keeps it for the restart).
  void close(bool discard_memory_tier = true);

  int rank() const;
  int world_size() const;
  const std::string& directory() const;
  const Stager& stager() const;
  /// Mean measured time a save blocked training and mean time to durable (seconds; 0 before any).
  double mean_blocking_s() const;
  double mean_time_to_durable_s() const;
  /// The same for one tier's saves (the fences' waits count against the tier of the save they wait for);
  /// Tier::kMemory's time to durable is save() -> committed in the memory tier.
  double mean_blocking_s(Tier tier) const;
  double mean_time_to_durable_s(Tier tier) const;
  /// Disk saves committed (memory-tier saves: memory_saves_committed()).
  int64_t saves_committed() const;
  int64_t memory_saves_committed() const;
  /// The rank's memory-tier directory ("" without a memory tier).
  std::string memory_tier_directory() const;
  int64_t saves_failed() const;
  /// Saves refused because tensors changed while being copied (also counted in saves_failed()).
  int64_t saves_refused() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

/// The peer replica's preconditions, checked before its process group is created (enable_peer_replica()
/// checks the same): a memory tier, world_size > 1, and, unless nullopt (not known yet), ranks_per_host in
/// [1, world_size). InvalidArgument naming what is missing otherwise.
ETTKIT_API void check_peer_replica(const CheckpointerOptions& options, std::optional<int> ranks_per_host);

/// The newest committed step of the checkpoint directory `directory`, or nullopt when none is committed (or
/// the directory does not exist). "Committed" and "newest" as for load_latest: step-<N>/manifest.json
/// decodes and names step N, and steps are ordered by commit, not by number. Read-only and cheap: takes no
/// lock, changes nothing and reads only the manifests, so it works beside a live writer and before any
/// checkpointer exists (e.g. to position a data loader before the restore). load_latest may still fall
/// back to an older step when this one's data files fail verification.
ETTKIT_API std::optional<int64_t> latest_step(const std::string& directory);

}  // namespace ettkit::checkpoint
