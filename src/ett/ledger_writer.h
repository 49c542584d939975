#pragma once
// ettkit::ett::detail::LedgerWriter: the one writer of a rank's ledger file, RUN_DIR/ett/rank-<r>.jsonl
// (format: ett/ledger_format.h). The Recorder measures; this unit owns the file.
//
// What it promises
//  - Construction opens the ledger for appending relative to its directory's handle (a directory this uid
//    owns, never reached through a link), creating it 0600 (0644 with readable_by_others), O_NOFOLLOW and
//    O_NONBLOCK, and checks the descriptor: a regular file of this uid with one link. A link, a FIFO, another
//    user's file or a hard link to one of this user's files is refused with IoError naming the path, and
//    nothing is written to it. Then it reads, through the same descriptor and streamed (the file may be huge
//    or sparse), what earlier attempts left (how many attempts it holds, which numbers this one, and the
//    latest timestamp of its tail). A line that a killed attempt tore is terminated first, so this attempt's
//    first record stands alone. Nothing else is written before start().
//  - start() launches the writer thread. Each round (every flush_interval_s, or at once for flush() and
//    close()) writes, in one write(2) on the O_APPEND descriptor: the lines queued with append_line() since
//    the last round (the attempt header first), the events drained from the queue, a `dropped` record when
//    the drop count moved, and a heartbeat every heartbeat_s; then it fdatasyncs per FsyncPolicy. A crash
//    therefore tears at most the last line.
//  - The writer thread never throws and never stops training for the ledger: a failed write is logged
//    once, and that round's records are lost.
//  - close() queues the end record, stops the thread and waits for it at most `timeout_s`; a thread stuck
//    in write(2) (a hung network file system) is detached rather than waited for, and the loss is logged.
//  - There is no rotation: one file per rank, which every attempt appends to.
// Who owns what
//  - The Recorder owns the LedgerWriter; the LedgerWriter owns the thread and joins it (or, past close()'s
//    deadline, detaches it). The queue, the phase names and the descriptor live in a state the thread
//    shares, so a detached thread keeps them alive; the descriptor closes with their last owner.
//  - enqueue() and names().name_of() are for any thread (lock-free, no allocation). Everything else may be
//    called from any thread too, except close() and destruction, which must not race with other calls.

#include <array>
#include <atomic>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <unordered_map>

#include "ett/event_queue.h"
#include "ettkit/common/clock.h"
#include "ettkit/ett/recorder.h"

namespace ettkit::ett::detail {

inline constexpr uint32_t kMaxPhases = 4096;

enum class EventKind : uint8_t {
  kPhaseSteady,      // a, b: steady ns
  kPhaseEpoch,       // a, b: epoch us
  kLauncherEpoch,    // a, b: epoch us; a phase the launcher reported (before this process existed)
  kBackgroundEpoch,  // a, b: epoch us
  kStepSteady,       // a, b: steady ns; value: step index
};

// One measurement on its way to the ledger. 32 bytes: two events per cache line.
struct Event {
  int64_t a;
  int64_t b;
  int64_t value;  // step index (or -1)
  uint32_t id;    // phase id (PhaseNames); unused for steps
  EventKind kind;
};

// Interned phase names. Ids are dense and never reused; a name's string lives as long as the table, so the
// hot path and the writer read it through a published pointer without a lock.
class PhaseNames {
 public:
  /// The id of `name`, interning it (validated as a phase name) on first use. Throws InvalidArgument for a
  /// bad name or past kMaxPhases distinct names.
  uint32_t intern(std::string_view name);
  /// The name of `id`, or "unknown" for an id never handed out. Lock-free.
  const char* name_of(uint32_t id) const noexcept;

 private:
  std::mutex mutex_;  // guards names_ and index_
  std::deque<std::string> names_;  // deque: stable addresses for the published pointers
  std::unordered_map<std::string, uint32_t> index_;
  std::array<std::atomic<const char*>, kMaxPhases> published_{};
  std::atomic<uint32_t> count_{0};
};

// The facts of the attempt record, the first line each attempt writes (ledger_format.h: `attempt`).
struct AttemptHeader {
  int attempt = 0;
  int rank = 0;
  int world = 1;
  int64_t pid = 0;
  std::string host;
  int64_t ts_us = 0;
  std::optional<int64_t> proc_start_us;
  std::optional<int64_t> restart_count;
  std::optional<std::string> run_id;
  std::map<std::string, std::string> metadata;
};

// A ledger line of a non-hot record (attempt, config, note, end): compact JSON plus '\n'. Invalid UTF-8 in
// user text is replaced rather than refused (a note often carries an exception's text).
std::string record_line(const nlohmann::json& record);

// The `process_exit` line (ledger_format.h) of attempt `attempt`, closed by process `pid`, at `ts_us`.
std::string process_exit_line(int attempt, int64_t pid, int64_t ts_us);

// Appends `line` in one write(2) to the closed ledger open as `fd` (LedgerWriter::duplicate_descriptor()):
// a descriptor, never the path again, which could name a FIFO by the time the process exits and block its
// exit forever. Takes no lock and never throws: it runs while the process exits.
void append_to_closed_ledger(int fd, const std::string& line) noexcept;

struct LedgerWriterOptions {
  std::string path;
  double heartbeat_s = 1.0;
  double flush_interval_s = 0.1;
  FsyncPolicy fsync = FsyncPolicy::kHeartbeat;
  uint32_t queue_capacity = 1u << 16;  // raised to at least 1024
  // Opt-in: the ledger 0644 and its directory 0755, for reports run by other users; otherwise 0600 and 0700.
  bool readable_by_others = false;
};

class LedgerWriter {
 public:
  /// Creates RUN_DIR/ett (0700; 0755 when `readable_by_others`) or checks the one there (this uid's, not a
  /// link: IoError naming it otherwise) and returns rank `rank`'s ledger path in it.
  static std::string prepare_path(const std::string& run_dir, int rank, bool readable_by_others = false);

  explicit LedgerWriter(LedgerWriterOptions options);
  /// Stops and joins a thread that close() did not (a Recorder constructor that threw after start()).
  ~LedgerWriter();
  LedgerWriter(const LedgerWriter&) = delete;
  LedgerWriter& operator=(const LedgerWriter&) = delete;

  /// Attempts already recorded in the file when it was opened: this attempt's number.
  int attempts_before() const { return attempts_before_; }
  /// The latest timestamp (`ts` or `e`) among the file's last records when it was opened; 0 if none.
  int64_t last_ts_us() const { return last_ts_us_; }
  const std::string& path() const;
  /// A new descriptor of the ledger (close-on-exec), for the process_exit record; -1 on failure.
  int duplicate_descriptor() const noexcept;
  /// The anchor that maps the steady clock onto the epoch in every record this writer formats.
  const ClockAnchor& anchor() const;
  PhaseNames& names();

  /// Queues an event; when the queue is full the event is dropped and counted. Lock-free, never blocks;
  /// inline, as it was when it lived in the Recorder: it is the hot path's one shared write.
  void enqueue(const Event& event) noexcept {
    if (!queue_->try_push(event)) dropped_->fetch_add(1, std::memory_order_relaxed);
  }
  /// Events dropped so far.
  uint64_t dropped() const noexcept;
  /// Queues the attempt record; call before start() so that it is the attempt's first line.
  void append_attempt_header(const AttemptHeader& header);
  /// Queues one whole record line (record_line()); the next round writes it before that round's events.
  void append_line(std::string line);

  /// Starts the writer thread. Call once.
  void start();
  /// Blocks until everything enqueued before the call is written (and synced per policy); throws
  /// InvalidArgument after close() and Timeout after `timeout_s`.
  void flush(double timeout_s);
  /// Queues `end_line`, stops the thread and waits at most `timeout_s` for its last round. True when the
  /// thread finished and was joined; false when it was detached (the last records may be lost).
  bool close(std::string end_line, double timeout_s);
  /// Test hook: blocks until the writer thread has completed `n` more rounds.
  void wait_for_iterations_for_testing(int n);

 private:
  struct State;
  std::shared_ptr<State> state_;
  // The hot path's view of the state's queue and drop count (the state outlives the writer's use of them).
  BoundedMpscQueue<Event>* queue_ = nullptr;
  std::atomic<uint64_t>* dropped_ = nullptr;
  std::thread thread_;
  int attempts_before_ = 0;
  int64_t last_ts_us_ = 0;
};

}  // namespace ettkit::ett::detail
