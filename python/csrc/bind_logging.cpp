// The bridge from the C++ core's log messages into Python's `logging` (python/ettkit/_logging.py).
//
// Why a queue: messages come from any thread, often ettkit's background threads, sometimes while they hold
// ettkit's locks. Taking the GIL there could deadlock (a thread holding the GIL may be waiting on the very
// thread that logs, e.g. close() joining a writer) and, at interpreter shutdown, could end the thread in
// the middle of C++ frames. So the sink never touches Python: it appends the record to a bounded queue and
// writes one byte into a pipe. A Python daemon thread blocks in os.read() on that pipe (CPython releases and
// retakes the GIL there, with no C++ frame on the stack) and then drains the queue with the GIL held, as
// does ettkit._logging.flush(). Nothing that holds the queue's mutex ever waits for the GIL.
//
// Lifetime: one bridge per process, created by install() and never destroyed (the core keeps every sink
// alive until exit; log_sink.h). After close() (the interpreter is exiting) and in a forked child (no
// drain thread there) the sink declines, and the core writes to stderr as without a bridge.
#include <fcntl.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include "bindings.h"
#include "common/logging.h"
#include "ettkit/common/error.h"
#include "ettkit/common/log_sink.h"

namespace py = pybind11;

namespace ettkit::python {

namespace {

// (level, message, file, line, epoch_us, thread_id)
using Item = std::tuple<int, std::string, std::string, int, int64_t, uint64_t>;

class LogQueue {
 public:
  static constexpr size_t kCapacity = 10000;

  LogQueue() : owner_(::getpid()) {
    int fds[2];
    ETTKIT_CHECK(::pipe2(fds, O_CLOEXEC) == 0, IoError, "cannot create the log bridge's pipe: ", std::strerror(errno));
    read_fd_ = fds[0];
    write_fd_ = fds[1];
    // The writer never blocks: a full pipe already holds a wake-up.
    ::fcntl(write_fd_, F_SETFL, ::fcntl(write_fd_, F_GETFL) | O_NONBLOCK);
  }

  // The sink: any thread, any locks held, never the GIL.
  bool push(const LogRecord& r) {
    if (closed_.load(std::memory_order_acquire) || ::getpid() != owner_) return false;
    bool wake = false;
    {
      std::lock_guard lock(mutex_);
      if (items_.size() >= kCapacity) {
        ++dropped_;
      } else {
        items_.emplace_back(static_cast<int>(r.level), std::string(r.message), r.file ? r.file : "", r.line,
                            r.epoch_us, r.thread_id);
      }
      wake = !wake_pending_;
      wake_pending_ = true;
    }
    if (wake) {
      char byte = 1;
      // EAGAIN: the pipe is full of wake-ups already. Anything else: the reader will still drain at exit.
      [[maybe_unused]] ssize_t n = ::write(write_fd_, &byte, 1);
    }
    return true;
  }

  // With the GIL held: takes everything queued so far, and how many records were dropped since the last call.
  std::pair<std::vector<Item>, uint64_t> take() {
    std::lock_guard lock(mutex_);
    std::vector<Item> out(std::make_move_iterator(items_.begin()), std::make_move_iterator(items_.end()));
    items_.clear();
    wake_pending_ = false;
    return {std::move(out), std::exchange(dropped_, 0)};
  }

  void close() { closed_.store(true, std::memory_order_release); }
  void reopen() { closed_.store(false, std::memory_order_release); }
  int read_fd() const { return read_fd_; }

 private:
  const pid_t owner_;
  int read_fd_ = -1;
  int write_fd_ = -1;
  std::atomic<bool> closed_{false};
  std::mutex mutex_;  // guards the three fields below
  std::deque<Item> items_;
  uint64_t dropped_ = 0;
  bool wake_pending_ = false;  // a byte is in the pipe (or about to be) that no drain has answered yet
};

// The process's bridge (see the file comment): created once, never destroyed.
LogQueue* bridge = nullptr;

}  // namespace

void bind_logging(py::module_& m) {
  m.def(
      "install",
      [](int level) {
        if (bridge == nullptr) {
          bridge = new LogQueue();  // never deleted: the sink that points at it lives until exit
          set_log_sink([q = bridge](const LogRecord& r) { return q->push(r); }, static_cast<LogLevel>(level));
        } else {
          bridge->reopen();
          set_log_sink([q = bridge](const LogRecord& r) { return q->push(r); }, static_cast<LogLevel>(level));
        }
        return bridge->read_fd();
      },
      py::arg("level"),
      "Routes the core's messages at `level` (0 trace .. 4 error) and above into the bridge's queue; returns the "
      "pipe's read end, readable whenever records are waiting. Idempotent.");
  m.def(
      "drain",
      []() {
        py::list records;
        uint64_t dropped = 0;
        if (bridge != nullptr) {
          auto [items, n] = bridge->take();
          dropped = n;
          for (auto& [level, message, file, line, epoch_us, tid] : items) {
            // Messages quote paths and user strings: never fail on bytes that are not UTF-8.
            py::object text = py::reinterpret_steal<py::object>(
                PyUnicode_DecodeUTF8(message.data(), static_cast<Py_ssize_t>(message.size()), "replace"));
            if (!text) throw py::error_already_set();
            records.append(py::make_tuple(level, text, py::str(file), line, epoch_us, tid));
          }
        }
        return py::make_tuple(records, dropped);
      },
      "(records, dropped): the queued records as (level, message, file, line, epoch_us, thread_id) tuples, and "
      "how many were dropped because the queue was full.");
  m.def(
      "close",
      []() {
        if (bridge != nullptr) bridge->close();
      },
      "From now on the core writes to stderr again (interpreter exit).");
  m.def(
      "env_level", []() -> py::object {
        auto level = log_level_from_env();
        return level ? py::cast(static_cast<int>(*level)) : py::none();
      },
      "The level ETTKIT_LOG_LEVEL names (0 trace .. 4 error, 6 off), or None.");
  m.def(
      "log",
      [](int level, const std::string& message) {
        if (detail::log_enabled(static_cast<LogLevel>(level))) {
          detail::log_message(static_cast<LogLevel>(level), message, __FILE__, __LINE__);
        }
      },
      py::arg("level"), py::arg("message"), "Logs through the core's logger (tests).");
  m.def(
      "_log_from_threads_for_testing",
      [](int threads, int messages) {
        // Joined with the GIL held: a sink that took the GIL would deadlock here; the queue never does.
        std::vector<std::thread> pool;
        for (int t = 0; t < threads; ++t) {
          pool.emplace_back([t, messages] {
            for (int i = 0; i < messages; ++i) ETTKIT_LOG_WARN("test message ", t, "/", i);
          });
        }
        for (auto& th : pool) th.join();
      },
      py::arg("threads"), py::arg("messages"));
}

}  // namespace ettkit::python
