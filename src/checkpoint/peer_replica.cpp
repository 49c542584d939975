// The peer replica's protocol (peer_replica.h).
//
// Store keys, under the checkpointer run's prefix + "replica/":
//   announce/<src>/<k>   the k-th snapshot rank src sends: {"manifest": its manifest.json text}
//   ack/<src>/<k>        set by src's partner once that snapshot is committed there ("") or refused (why)
//   done/<src>           set by src's close(): how many snapshots it announced
//   restore/<seq>/<r>    load_latest exchange <seq>: rank r's snapshot is coming ({"manifest"}) or not ({"error"})
// The bytes of each file follow the announcement over the process group, in chunks of kChunkBytes, on one
// tag per purpose (kStreamTag, kRestoreTag); both sides derive the chunks from the manifest's file sizes.
// Any client of the Store can write these keys: a message is decoded strictly (decode_announcement) before
// a byte is received for it, and one that fails is ignored with a warning (peer_replica.h, "Trust").
#include "checkpoint/peer_replica.h"

#include <fcntl.h>
#include <unistd.h>

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <ATen/ops/empty.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <optional>
#include <nlohmann/json.hpp>
#include <vector>

#include "checkpoint/peer_monitor.h"
#include "checkpoint/store_exchange.h"
#include "common/background_thread.h"
#include "common/describe.h"
#include "common/logging.h"
#include "ettkit/common/error.h"

namespace ettkit::checkpoint::detail {

namespace {

using ettkit::detail::first_line;

using nlohmann::json;

constexpr int kStreamTag = 0x4554;   // snapshots sent after each memory-tier commit
constexpr int kRestoreTag = 0x4555;  // snapshots given back during load_latest
constexpr uint64_t kChunkBytes = uint64_t{32} << 20;
// The receiver's Store poll: quick right after a snapshot, backing off to kPollMax while idle (a TCPStore
// serves every rank's polls: 5 a second per rank at most).
constexpr auto kPollMin = std::chrono::milliseconds(10);
constexpr auto kPollMax = std::chrono::milliseconds(200);
// What a snapshot announcement (and a replica given back) is.
constexpr const char* kAnnouncementShape = "{\"manifest\": the snapshot's manifest.json text}";

/// What the sender of rank `owner`'s snapshot must name: that rank's two files, nothing else and nothing
/// with a path in it (the names become file names in this rank's memory tier).
void check_names(const Manifest& m, int owner, const std::string& source) {
  const std::string base = "rank-" + std::to_string(owner);
  for (const auto& [name, d] : m.files) {
    ETTKIT_CHECK(name == base + ".safetensors" || name == base + ".extra", CorruptData, source, " names a file '",
                 name, "'; a snapshot of rank ", owner, " holds only ", base, ".safetensors and ", base, ".extra");
  }
  ETTKIT_CHECK(m.files.size() == 2, CorruptData, source, " lists ", m.files.size(), " file(s); a snapshot of rank ",
               owner, " holds ", base, ".safetensors and ", base, ".extra");
}

/// The bytes the snapshot's files hold together (CorruptData when the sizes overflow: no sender wrote those).
uint64_t bytes_in(const Manifest& m, const std::string& source) {
  uint64_t n = 0;
  for (const auto& [name, d] : m.files) {
    ETTKIT_CHECK(!__builtin_add_overflow(n, d.size, &n), CorruptData, source, ": the file sizes overflow");
  }
  return n;
}

/// The count a rank's close() publishes under done/<src> (decimal digits), or nullopt for anything else.
std::optional<int64_t> decode_count(const std::string& text) {
  const bool digits = std::all_of(text.begin(), text.end(), [](char c) { return c >= '0' && c <= '9'; });
  if (text.empty() || text.size() > 18 || !digits) return std::nullopt;
  return std::stoll(text);
}

std::string pwrite_all(int fd, const void* data, uint64_t n, uint64_t offset) {
  const char* p = static_cast<const char*>(data);
  while (n > 0) {
    ssize_t w = ::pwrite(fd, p, n, static_cast<off_t>(offset));
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return std::strerror(w < 0 ? errno : EIO);
    p += w;
    n -= static_cast<uint64_t>(w);
    offset += static_cast<uint64_t>(w);
  }
  return "";
}

}  // namespace

PeerReplica::PeerReplica(c10::intrusive_ptr<c10d::Backend> group, c10::intrusive_ptr<c10d::Store> store,
                         std::string prefix, std::string run_id, PeerMonitor* peers, int rank, int world,
                         int ranks_per_host, MemoryTier& tier, double timeout_s)
    : group_(std::move(group)),
      store_(std::move(store)),
      prefix_(std::move(prefix)),
      run_id_(std::move(run_id)),
      peers_(peers),
      rank_(rank),
      world_(world),
      ranks_per_host_(ranks_per_host),
      tier_(tier),
      timeout_s_(timeout_s) {
  ETTKIT_EXPECTS(group_, "peer replica: the process group is null");
  ETTKIT_EXPECTS(store_ && peers_, "peer replica: needs the checkpointer's Store (world_size > 1)");
  ETTKIT_EXPECTS(is_run_id(run_id_), "peer replica: run id '", run_id_, "' is not 16 lowercase hex digits");
  ETTKIT_EXPECTS(group_->getRank() == rank && group_->getSize() == world, "peer replica: the process group has rank ",
                 group_->getRank(), " of ", group_->getSize(), "; the checkpointer is rank ", rank, " of ", world);
  ETTKIT_EXPECTS(ranks_per_host >= 1 && ranks_per_host < world, "ranks_per_host=", ranks_per_host, " leaves rank ",
                 rank, " no partner on another node among world_size=", world, " ranks: it must be in [1, ",
                 world - 1, "] (the number of ranks each node runs, e.g. torchrun's LOCAL_WORLD_SIZE)");
  receiver_ = std::thread([this] { receive_loop(); });
}

PeerReplica::~PeerReplica() { close(); }

void PeerReplica::wait(const c10::intrusive_ptr<c10d::Work>& work, const std::string& what) {
  bool done = false;
  try {
    done = work->wait(std::chrono::milliseconds(static_cast<int64_t>(timeout_s_ * 1000)));
  } catch (const std::exception& e) {
    ETTKIT_THROW(IoError, "peer replica: ", what, " failed: ", first_line(e));
  }
  ETTKIT_CHECK(done, IoError, "peer replica: ", what, " did not complete");
}

void PeerReplica::send_files(int dst, int tag, const std::string& step_dir, const Manifest& m) {
  at::Tensor buf;
  for (const auto& [name, d] : m.files) {
    std::string path = step_dir + "/" + name;
    OwnedFd f;  // file_io.h
    f.fd = ::open(path.c_str(), O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
    ETTKIT_CHECK(f.fd >= 0, IoError, "peer replica: cannot open '", path, "': ", std::strerror(errno));
    if (!buf.defined() && d.size > 0) buf = at::empty({static_cast<int64_t>(kChunkBytes)}, at::kByte);
    for (uint64_t off = 0; off < d.size; off += kChunkBytes) {
      uint64_t n = std::min(kChunkBytes, d.size - off);
      read_exact(f.fd, buf.data_ptr(), n, off, path);
      std::vector<at::Tensor> t{buf.narrow(0, 0, static_cast<int64_t>(n))};
      wait(group_->send(t, dst, tag), "sending '" + path + "' to rank " + std::to_string(dst));
    }
  }
}

std::string PeerReplica::receive_files(int src, int tag, const Manifest& m, const std::string& tmp) {
  std::string local = tmp.empty() ? "not kept" : "";
  at::Tensor buf;
  for (const auto& [name, d] : m.files) {
    std::string path = tmp + "/" + name;
    OwnedFd f;
    if (local.empty()) {
      f.fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
      if (f.fd < 0) local = ettkit::detail::concat("cannot create '", path, "': ", std::strerror(errno));
    }
    if (!buf.defined() && d.size > 0) buf = at::empty({static_cast<int64_t>(kChunkBytes)}, at::kByte);
    for (uint64_t off = 0; off < d.size; off += kChunkBytes) {
      uint64_t n = std::min(kChunkBytes, d.size - off);
      std::vector<at::Tensor> t{buf.narrow(0, 0, static_cast<int64_t>(n))};
      wait(group_->recv(t, src, tag), "receiving '" + name + "' from rank " + std::to_string(src));
      if (local.empty()) {
        std::string why = pwrite_all(f.fd, buf.data_ptr(), n, off);
        if (!why.empty()) local = ettkit::detail::concat("writing '", path, "' failed: ", why);
      }
    }
  }
  if (!local.empty()) return local;
  // The bytes as received, against the checksums the sender's snapshot was committed with.
  try {
    for (const auto& [name, d] : m.files) {
      std::string path = tmp + "/" + name;
      ReadFile file(::open(path.c_str(), O_RDONLY | O_NOFOLLOW | O_CLOEXEC), path);
      ETTKIT_CHECK(file.fd() >= 0, IoError, "cannot open '", path, "': ", std::strerror(errno));
      ETTKIT_CHECK(file.size() == d.size, CorruptData, "'", path, "' has ", file.size(), " bytes; the manifest says ",
                   d.size);
      if (!d.chunks.empty()) {
        verify_file_chunks(file, d, 2);
      } else {
        std::string h = file_xxh3(file);
        ETTKIT_CHECK(h == d.xxh3, CorruptData, "'", path, "' has XXH3 ", h, "; the manifest says ", d.xxh3);
      }
    }
  } catch (const Error& e) {
    return e.message();
  }
  return "";
}

std::string PeerReplica::send(const std::string& step_dir, int64_t step) {
  if (broken_) {
    ++failed_;
    return "replication is off for this run after an earlier failure of the process group";
  }
  const int64_t k = announced_++;
  const std::string who = std::to_string(rank_) + "/" + std::to_string(k);
  const std::string what = "peer replica of step " + std::to_string(step) + " to rank " + std::to_string(partner());
  try {
    std::string text = read_small_file(step_dir + "/manifest.json");
    Manifest m = decode_manifest(text, step_dir + "/manifest.json");
    StoreExchange exchange(*store_, peers_, timeout_s_);
    exchange.publish(prefix_ + "announce/" + who, json{{"manifest", text}});
    send_files(partner(), kStreamTag, step_dir, m);
    const std::string ack_key = prefix_ + "ack/" + who;
    std::string ack = exchange.await_from(ack_key, partner(), what + ": its acknowledgement");
    store_->deleteKey(ack_key);
    if (!ack.empty()) {
      ++failed_;
      return ack;
    }
    ++sent_;
    return "";
  } catch (const std::exception& e) {
    ++failed_;
    if (!broken_.exchange(true)) {
      ETTKIT_LOG_WARN(what, " failed; replication is off for the rest of this run: ", first_line(e));
    }
    return first_line(e);
  }
}

void PeerReplica::receive_loop() {
  ettkit::detail::mark_background_thread();
  const int src = held_for();
  const std::string shelf = tier_.replica_dir(src);
  // k advances only past announcements that were acted on: a malformed one is ignored, and the sender's
  // own k-th announcement is still awaited under the same key.
  for (int64_t k = 0;;) {
    const std::string who = std::to_string(src) + "/" + std::to_string(k);
    const std::string key = prefix_ + "announce/" + who;
    if (!await_announcement(src, k, key)) return;
    std::optional<std::string> why;
    try {
      why = receive_announced(src, key, shelf);
    } catch (const std::exception& e) {
      // The process group (or the Store) failed mid-snapshot: the stream is out of step for good.
      broken_ = true;
      ++failed_;
      ETTKIT_LOG_WARN("peer replica: receiving rank ", src, "'s snapshots stops: ", first_line(e));
      try {
        StoreExchange(*store_, peers_, timeout_s_).publish(prefix_ + "ack/" + who,
                                                           "rank " + std::to_string(rank_) + ": " + first_line(e));
      } catch (...) {
      }
      return;
    }
    if (!why) continue;
    try {
      StoreExchange(*store_, peers_, timeout_s_)
          .publish(prefix_ + "ack/" + who, why->empty() ? "" : "rank " + std::to_string(rank_) + ": " + *why);
    } catch (const std::exception& e) {
      ETTKIT_LOG_DEBUG("peer replica: receiver for rank ", src, " stops: ", first_line(e));
      return;
    }
    ++k;
  }
}

bool PeerReplica::await_announcement(int src, int64_t k, const std::string& key) {
  const std::string done_key = prefix_ + "done/" + std::to_string(src);
  // Idle: poll the Store (a TCPStore wait would hold its client connection, which the heartbeat and
  // the commit votes share).
  try {
    std::optional<std::chrono::steady_clock::time_point> deadline;
    auto nap = kPollMin;
    for (;;) {
      if (store_->check({key})) return true;
      bool stopping;
      {
        std::unique_lock<std::mutex> lk(mu_);
        if (!stop_) cv_.wait_for(lk, nap, [&] { return stop_; });
        stopping = stop_;
      }
      nap = std::min(nap * 2, kPollMax);
      if (!stopping) continue;
      // Closing: the snapshots the sender announced are still received; it publishes its count at its
      // close. The short wait is the poll's nap and sees a sender that is gone (PeerLost).
      auto now = std::chrono::steady_clock::now();
      if (!deadline) deadline = now + std::chrono::milliseconds(static_cast<int64_t>(timeout_s_ * 1000));
      try {
        StoreExchange poll(*store_, peers_, std::chrono::duration<double>(kPollMin).count());
        const std::string count =
            poll.await_from(done_key, src, "peer replica: rank " + std::to_string(src) + "'s count of snapshots");
        const std::optional<int64_t> announced = decode_count(count);
        if (!announced) {
          ++refused_;
          ETTKIT_LOG_WARN("peer replica: the Store key '", done_key, "' holds no count of snapshots; the receiver "
                          "for rank ", src, " stops");
          return false;
        }
        if (k >= *announced) return false;
      } catch (const Timeout&) {
        if (now > *deadline) return false;
      }
    }
  } catch (const std::exception& e) {
    ETTKIT_LOG_DEBUG("peer replica: receiver for rank ", src, " stops: ", first_line(e));
    return false;
  }
}

std::optional<std::string> PeerReplica::receive_announced(int src, const std::string& key, const std::string& shelf) {
  const std::string text = string_of(store_->get(key));
  store_->deleteKey(key);
  const std::string source = "rank " + std::to_string(src) + "'s snapshot announcement '" + key + "'";
  std::optional<Manifest> announced;
  try {
    announced = decode_announcement(text, src, run_id_, source);
  } catch (const Error& e) {
    // Not what a rank of this run announces: nothing is received, written or removed for it, and no
    // acknowledgement is given (the sender's would be answered with it).
    ++refused_;
    ETTKIT_LOG_WARN("peer replica: ignored a malformed snapshot announcement: ", e.message());
    return std::nullopt;
  }
  Manifest& m = *announced;
  std::string why;
  std::string tmp;
  try {
    tmp = tier_.begin_replica(src, m.step, manifest_run_id(m, source), bytes_in(m, source));
  } catch (const Error& e) {
    why = e.message();
  }
  std::string local = receive_files(src, kStreamTag, m, tmp);
  if (why.empty() && local.empty()) {
    tier_.commit_in(shelf, tmp, std::move(m));
    ++received_;
    return why;
  }
  if (why.empty()) why = local;
  if (!tmp.empty()) tier_.abort(tmp);
  ++failed_;
  ETTKIT_LOG_WARN("peer replica: rank ", src, "'s snapshot is not kept: ", why);
  return why;
}

Manifest PeerReplica::decode_announcement(const std::string& text, int owner, const std::string& run,
                                          const std::string& source) const {
  const json a = StoreExchange::decode(text, source, kAnnouncementShape);
  ETTKIT_CHECK(a.is_object() && a.contains("manifest") && a["manifest"].is_string(), CorruptData, source, " is not ",
               kAnnouncementShape);
  Manifest m = decode_manifest(a["manifest"].get<std::string>(), source);
  check_names(m, owner, source);
  const std::string id = manifest_run_id(m, source);
  ETTKIT_CHECK(run.empty() || id == run, CorruptData, source, " is a snapshot of run ", id,
               "; the ranks of this checkpointer share run ", run);
  ETTKIT_CHECK(m.world_size == world_, CorruptData, source, " was written by ", m.world_size, " ranks; this job has ",
               world_);
  bytes_in(m, source);
  return m;
}

std::string PeerReplica::restore_exchange(uint64_t seq, int64_t give_step, int64_t take_step) {
  const std::string base = prefix_ + "restore/" + std::to_string(seq) + "/";
  std::string give_error;
  std::thread giver;
  if (give_step >= 0) {
    giver = std::thread([&] {
      const int to = held_for();
      const std::string key = base + std::to_string(to);
      try {
        std::string dir = tier_.replica_dir(to) + "/" + step_dir_name(give_step);
        std::string text = read_small_file(dir + "/manifest.json");
        Manifest m = decode_manifest(text, dir + "/manifest.json");
        ETTKIT_CHECK(m.step == give_step, CorruptData, "'", dir, "/manifest.json' is step ", m.step);
        StoreExchange(*store_, peers_, timeout_s_).publish(key, json{{"manifest", text}});
        send_files(to, kRestoreTag, dir, m);
      } catch (const std::exception& e) {
        give_error = first_line(e);
        try {
          StoreExchange(*store_, peers_, timeout_s_).publish(key, json{{"error", give_error}});
        } catch (...) {
        }
      }
    });
  }
  std::string why;
  if (take_step >= 0) {
    const int from = partner();
    const std::string key = base + std::to_string(rank_);
    try {
      const std::string text = StoreExchange(*store_, peers_, timeout_s_)
                                   .await_from(key, from, "load_latest: rank " + std::to_string(from) +
                                                              "'s replica of this rank");
      const std::string source = "rank " + std::to_string(from) + "'s replica of step " + std::to_string(take_step) +
                                 " ('" + key + "')";
      json a = json::parse(text, nullptr, /*allow_exceptions=*/false);
      std::optional<Manifest> given;
      if (a.is_object() && a.contains("error") && a["error"].is_string()) {
        why = "rank " + std::to_string(from) + " cannot give its replica: " + a["error"].get<std::string>();
      } else {
        try {
          given = decode_announcement(text, rank_, "", source);
          ETTKIT_CHECK(given->step == take_step, CorruptData, source, " is step ", given->step);
        } catch (const Error& e) {
          // Nothing is received for it: the giver's real message, if any, was replaced.
          ++refused_;
          given.reset();
          why = e.message();
          ETTKIT_LOG_WARN("peer replica: ignored a malformed replica message: ", why);
        }
      }
      if (given) {
        Manifest& m = *given;
        std::string tmp;
        try {
          tmp = tier_.begin(m.step, manifest_run_id(m, source), bytes_in(m, source));
        } catch (const Error& e) {
          why = e.message();
        }
        std::string local = receive_files(from, kRestoreTag, m, tmp);
        if (why.empty() && local.empty()) {
          tier_.commit(tmp, std::move(m));
          ETTKIT_LOG_INFO("checkpoint memory tier: step ", take_step, " came back from rank ", from, "'s replica");
        } else {
          if (why.empty()) why = source + ": " + local;
          if (!tmp.empty()) tier_.abort(tmp);
        }
      }
    } catch (const std::exception& e) {
      why = first_line(e);
    }
  }
  if (giver.joinable()) giver.join();
  if (!give_error.empty()) {
    ETTKIT_LOG_WARN("peer replica: could not give rank ", held_for(), " its step ", give_step, ": ", give_error);
  }
  return why;
}

void PeerReplica::close() noexcept {
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (closed_) return;
    closed_ = true;
    stop_ = true;
  }
  try {
    peers_->set(prefix_ + "done/" + std::to_string(rank_), std::to_string(announced_));
  } catch (const std::exception& e) {
    ETTKIT_LOG_DEBUG("peer replica: could not publish rank ", rank_, "'s count: ", first_line(e));
  }
  cv_.notify_all();
  if (receiver_.joinable()) receiver_.join();
}

}  // namespace ettkit::checkpoint::detail
