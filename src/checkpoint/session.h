#pragma once
// What one AsyncCheckpointer's writer and loader share for its whole life: the options, who this rank is in
// which run, the Store and the exchange every vote goes through, the memory tier and the peer replica, and the
// ledger's phase ids. The constructor of AsyncCheckpointer fills it once (options checked, run id agreed,
// memory tier opened); afterwards the writer and the loader each take it by reference and read it.
//
// Ownership: the Session owns the memory tier, the peer replica, the PeerMonitor and the StoreExchange over
// it; the Store is shared with the caller. Threading: the fields set at construction are read-only after it;
// `memory` and `replica` are used by the writer thread for saves and by the caller's thread for loads, never
// at once (load_latest and close run after the writer is drained: checkpointer.cpp's wait_all).
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <cstdint>
#include <memory>
#include <string>

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
  // Ledger phase ids, per tier where the tier is in the name (index: Tier; docs/ett.md, "checkpoint tiers").
  uint32_t blocking_id[2] = {0, 0}, refused_id[2] = {0, 0}, failed_id[2] = {0, 0}, restore_id[2] = {0, 0};
  uint32_t persist_id = 0, staging_id = 0, memory_id = 0;
  // close()'s wait for the saves still queued or being written: the end of a job waits for its last save.
  uint32_t drain_id = 0;
  // The memory tier (null without one) and where its job directory is.
  std::unique_ptr<MemoryTier> memory;
  std::string job_id;
  std::string memory_dir;
  // The peer replica (null unless enable_peer_replica()); closed before `memory` and `peers`, which it borrows.
  std::unique_ptr<PeerReplica> replica;
  std::unique_ptr<PeerMonitor> peers;       // world > 1
  std::unique_ptr<StoreExchange> exchange;  // world > 1: every vote and agreement of the ranks, over `peers`
};

}  // namespace ettkit::checkpoint::detail
