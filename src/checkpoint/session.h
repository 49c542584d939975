#pragma once
// What one AsyncCheckpointer's writer and loader share for its whole life: the options, who this rank is in
// which run, the Store and the exchange every vote goes through, the memory tier and the peer replica, and the
// ledger adaptor. open_session() (session.cpp), called by AsyncCheckpointer's constructor, fills it once
// (options checked, directory locked, run id agreed, memory tier opened); afterwards the writer and the
// loader each take it by reference and read it.
//
// Ownership: the Session owns the memory tier, the peer replica, the PeerMonitor and the StoreExchange over
// it, rank 0's directory lock and the ledger adaptor; the Store is shared with the caller. Threading: the fields set at construction are read-only after it;
// `memory` and `replica` are used by the writer thread for saves and by the caller's thread for loads, never
// at once (load_latest and close run after the writer is drained: checkpointer.cpp's wait_all).
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <cstdint>
#include <memory>
#include <string>

#include "checkpoint/checkpoint_ledger.h"
#include "checkpoint/directory_lock.h"
#include "checkpoint/memory_tier.h"
#include "checkpoint/peer_monitor.h"
#include "checkpoint/peer_replica.h"
#include "checkpoint/store_exchange.h"
#include "ettkit/checkpoint/checkpointer.h"

namespace ettkit::checkpoint::detail {

struct Session {
  CheckpointerOptions opt;
  c10::intrusive_ptr<c10d::Store> store;  // null for one rank without a Store
  int rank = 0;
  int world = 1;
  std::string run_id;      // agreed by every rank of this run (validated: it names Store keys and directories)
  std::string key_prefix;  // this run's Store keys: "ettkit_ckpt:<directory>/<run id>/"
  // Every ETT record and counter of the checkpointer goes through it (checkpoint_ledger.h).
  CheckpointLedger ledger;
  // Rank 0 of a writer: held from open_session() to close(), before anything touches the directory.
  DirectoryLock lock;
  // The memory tier (null without one) and where its job directory is.
  std::unique_ptr<MemoryTier> memory;
  std::string job_id;
  std::string memory_dir;
  // The peer replica (null unless enable_peer_replica()); closed before `memory` and `peers`, which it borrows.
  std::unique_ptr<PeerReplica> replica;
  std::unique_ptr<PeerMonitor> peers;       // world > 1
  std::unique_ptr<StoreExchange> exchange;  // world > 1: every vote and agreement of the ranks, over `peers`
};

/// Fills `s` for `options` and `store` (null for one rank): checks the options (InvalidArgument naming the
/// field), creates and canonicalizes the directory, takes rank 0's directory lock (DirectoryLocked, on every
/// rank), agrees on the run id through the Store, starts the PeerMonitor and StoreExchange (world > 1),
/// attaches the ledger and opens the memory tier. Called once, before the writer thread starts.
void open_session(Session& s, CheckpointerOptions options, c10::intrusive_ptr<c10d::Store> store);

}  // namespace ettkit::checkpoint::detail
