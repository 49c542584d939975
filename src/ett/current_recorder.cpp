// The process-wide stack of open Recorders (current_recorder() in recorder.h): how a recorder made anywhere
// in the process (C++, Python) is found by components made anywhere else, and by a report that wants what
// open recorders have not written yet (open_recorders.h).

#include <pthread.h>

#include <algorithm>
#include <atomic>
#include <filesystem>
#include <mutex>
#include <string>
#include <vector>

#include "common/logging.h"
#include "ett/open_recorders.h"
#include "ettkit/common/error.h"
#include "ettkit/ett/recorder.h"

namespace fs = std::filesystem;

namespace ettkit::ett {

namespace {

// The current-recorder stack (see current_recorder() in recorder.h). Global mutable state with a reason:
// it is the one place where a recorder made anywhere in the process (C++, Python) is found by components
// made anywhere else. `mutex` guards both fields. Never destroyed: a Recorder with static storage duration
// may close during static destruction, after a function-local static stack would already be gone.
struct CurrentRecorders {
  std::mutex mutex;
  std::vector<Recorder*> open;             // construction order; the back is current
  std::vector<std::string> warned_about;  // components already told that no recorder is open
};

std::atomic<CurrentRecorders*> g_current_recorders{nullptr};

CurrentRecorders& current_recorders() {
  static std::once_flag once;
  std::call_once(once, [] {
    g_current_recorders.store(new CurrentRecorders());
    // A forked child (a DataLoader worker) gets an empty stack: the parent's recorders have no writer
    // thread there and their attempts are the parent's, and the inherited mutex may be held by a parent
    // thread that does not exist in the child (a report flushing under it). The old one is left behind.
    ::pthread_atfork(nullptr, nullptr, [] { g_current_recorders.store(new CurrentRecorders()); });
  });
  return *g_current_recorders.load();
}

}  // namespace

Recorder* current_recorder() {
  CurrentRecorders& c = current_recorders();
  std::lock_guard lock(c.mutex);
  return c.open.empty() ? nullptr : c.open.back();
}

Recorder* recorder_for(const char* component, Recorder* explicit_recorder, bool use_current) {
  if (explicit_recorder != nullptr || !use_current) return explicit_recorder;
  CurrentRecorders& c = current_recorders();
  {
    std::lock_guard lock(c.mutex);
    if (!c.open.empty()) return c.open.back();
    std::string name(component ? component : "ettkit");
    if (std::find(c.warned_about.begin(), c.warned_about.end(), name) != c.warned_about.end()) return nullptr;
    c.warned_about.push_back(std::move(name));
  }
  // Logged outside the lock: a log sink may be slow.
  ETTKIT_LOG_WARN(component, ": no ETT recorder is open, so its phases are not recorded (ETT% counts that time "
                  "as training); construct an ettkit::ett::Recorder first, pass one in the options, or set "
                  "use_current_recorder = false to record nothing without this warning");
  return nullptr;
}

namespace detail {
std::vector<std::pair<std::string, int>> flush_open_ledgers_in(const std::string& ledger_dir, double timeout_s) {
  std::error_code ec;
  const fs::path dir = fs::weakly_canonical(ledger_dir, ec);
  std::vector<std::pair<std::string, int>> out;
  CurrentRecorders& c = current_recorders();
  // Held while flushing: close() takes it first, so none of these recorders closes (or is destroyed) under
  // the flush. The writers never take it.
  std::lock_guard lock(c.mutex);
  for (Recorder* r : c.open) {
    fs::path path = fs::weakly_canonical(r->ledger_path(), ec);
    if (ec || path.parent_path() != dir) continue;
    try {
      r->flush(timeout_s);
    } catch (const Error& e) {
      ETTKIT_LOG_WARN("report: the open ETT ledger '", path.string(), "' did not flush: ", e.message());
    }
    out.emplace_back(path.string(), r->attempt());
  }
  return out;
}
}  // namespace detail

void Recorder::make_current() {
  CurrentRecorders& c = current_recorders();
  std::lock_guard lock(c.mutex);
  c.open.push_back(this);
}

void Recorder::stop_being_current() {
  CurrentRecorders& c = current_recorders();
  std::lock_guard lock(c.mutex);
  // Usually the back (nesting); anywhere when recorders close out of order.
  if (auto it = std::find(c.open.rbegin(), c.open.rend(), this); it != c.open.rend()) {
    c.open.erase(std::next(it).base());
  }
}

}  // namespace ettkit::ett
