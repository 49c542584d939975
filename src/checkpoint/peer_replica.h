#pragma once
// The peer replica: the memory tier survives a process crash but not the loss of its node. With a peer
// replica, each memory-tier snapshot of rank r is also kept by its partner, rank (r + ranks_per_host) % world
// (the same local rank on the next node), in the partner's memory tier (memory_tier.h, replica-of-rank-<r>).
// A rank that comes back on a new node, its own tier gone, gets its snapshot back from that partner during
// load_latest, verified against the snapshot's own chunk checksums, before the ranks vote on it.
//
// Transport: the bytes go over a side c10d process group given by the caller (a ProcessGroupGloo on its own
// PrefixStore in Python): c10d's engine, no home-made sockets. The group carries only bytes; what is sent
// (the snapshot's manifest: step, run, files, sizes, checksums) and the acknowledgement travel through the
// checkpointer's c10d Store, polled like the commit votes, so an idle replica never waits inside the
// process group (a gloo wait that times out breaks every pair of the group).
//
// Why the snapshot's host bytes and gloo, also on GPU jobs: the snapshot is already in host memory (the
// staging arena, then tmpfs); NCCL would first need a device buffer of the snapshot's size on each side.
//
// Threads: send() runs on the checkpointer's writer thread, the receiver on its own thread (started by the
// constructor), restore_exchange() on the caller's thread of load_latest (before any save). All Store keys
// live under `prefix`, one namespace per checkpointer run.
//
// Trust: every message read from the Store is decoded strictly before anything is done with it (its
// manifest decodes; it names exactly the owner's two files; its run id is a run id, and this run's for a
// streamed snapshot; its world size is this job's). A message that fails is ignored with a warning and
// nothing is received, written or removed for it: any client of the Store can write these keys, and a value
// from one never becomes a path. What stays trusted is the partner rank itself: the checksums come with the
// snapshot, so a hostile partner can hand back any self-consistent snapshot of the right files.
#include <ATen/core/Tensor.h>

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <optional>
#include <string>
#include <thread>

#include "checkpoint/memory_tier.h"

namespace c10d {
class Backend;
class Store;
class Work;
}  // namespace c10d

#pragma GCC visibility push(default)

namespace ettkit::checkpoint::detail {

class PeerMonitor;

/// One rank's side of the replica ring. Borrows `tier` and `peers` (owned by the checkpointer, which
/// outlives this object: it closes this before them).
class PeerReplica {
 public:
  /// `run_id`: the checkpointer run's id (every snapshot streamed in this run carries it). InvalidArgument
  /// when the group does not match (rank, world), when ranks_per_host leaves no partner on another node
  /// (ranks_per_host < 1 or >= world), or when `run_id` is not a run id.
  PeerReplica(c10::intrusive_ptr<c10d::Backend> group, c10::intrusive_ptr<c10d::Store> store, std::string prefix,
              std::string run_id, PeerMonitor* peers, int rank, int world, int ranks_per_host, MemoryTier& tier,
              double timeout_s);
  ~PeerReplica();
  PeerReplica(const PeerReplica&) = delete;
  PeerReplica& operator=(const PeerReplica&) = delete;

  /// The rank that keeps this rank's replica, and the rank whose replica this rank keeps.
  int partner() const { return partner_of(rank_); }
  int partner_of(int r) const { return (r + ranks_per_host_) % world_; }
  int held_for() const { return (rank_ - ranks_per_host_ % world_ + world_) % world_; }

  /// Writer thread, after this rank committed memory step `step` (its directory `step_dir`): sends it to
  /// partner() and waits until the partner has verified and committed its copy. Returns "" on success, else
  /// why the partner holds no copy of this step (the local snapshot stands either way). After a failure of
  /// the process group itself, replication stays off for the rest of this run (one warning).
  std::string send(const std::string& step_dir, int64_t step);

  /// load_latest, on every rank, with every rank's decision (agreed through the Store vote): `give_step`
  /// >= 0 sends this rank's replica of held_for()'s step to it; `take_step` >= 0 receives this rank's own
  /// snapshot of that step from partner() into its own memory tier (verified, then committed). `seq`
  /// names this exchange in the Store. Returns "" or why the taken step is not in the tier (the caller's
  /// vote then falls back to the disk tier).
  std::string restore_exchange(uint64_t seq, int64_t give_step, int64_t take_step);

  /// Publishes how many snapshots this rank sent, lets the receiver finish the ones its sender announced
  /// (until the sender is done or gone, at most timeout_s), then stops it. Idempotent; never throws.
  void close() noexcept;

  int64_t sent() const { return sent_.load(); }
  int64_t received() const { return received_.load(); }
  int64_t failed() const { return failed_.load(); }
  /// Store messages refused as malformed (each warned about; none was acted on).
  int64_t refused() const { return refused_.load(); }

 private:
  void receive_loop();
  /// Waits, polling the Store, for the sender's k-th announcement `key` (true), or stops the receiver
  /// (false): at close() once the sender's published count shows no k-th snapshot, or it is gone or silent
  /// for timeout_s; at once when the Store fails.
  bool await_announcement(int src, int64_t k, const std::string& key);
  /// Receives the snapshot announced under `key` and commits it to `shelf`: "" when kept, else why not (the
  /// acknowledgement's text); nullopt when the announcement is malformed and was ignored. Throws when the
  /// process group or the Store fails (the stream is then out of step).
  std::optional<std::string> receive_announced(int src, const std::string& key, const std::string& shelf);
  /// Receives the files of manifest `m` from `src` on `tag` into the directory `tmp` and checks them against
  /// the manifest's checksums. Every chunk is received, also when it cannot be kept (`tmp` empty, or a local
  /// write failed), so that the sender's sends complete and the stream stays in step. Returns "" or why the
  /// files are not usable (the stream is still in step); throws IoError when the process group fails.
  std::string receive_files(int src, int tag, const Manifest& m, const std::string& tmp);
  /// The manifest of rank `owner`'s snapshot that the Store message `text` announces, checked field by field
  /// (see "Trust" above); `run` non-empty: the run it must come from. CorruptData naming `source` otherwise.
  Manifest decode_announcement(const std::string& text, int owner, const std::string& run,
                               const std::string& source) const;
  void send_files(int dst, int tag, const std::string& step_dir, const Manifest& m);
  void wait(const c10::intrusive_ptr<c10d::Work>& work, const std::string& what);

  c10::intrusive_ptr<c10d::Backend> group_;
  c10::intrusive_ptr<c10d::Store> store_;
  std::string prefix_;
  std::string run_id_;
  PeerMonitor* peers_;
  int rank_, world_, ranks_per_host_;
  MemoryTier& tier_;
  double timeout_s_;
  std::atomic<bool> broken_{false};
  std::atomic<int64_t> sent_{0}, received_{0}, failed_{0}, refused_{0};
  int64_t announced_ = 0;  // writer thread only
  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;   // guarded by mu_
  bool closed_ = false;  // guarded by mu_
  std::thread receiver_;
};

}  // namespace ettkit::checkpoint::detail

#pragma GCC visibility pop
