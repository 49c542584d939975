#pragma once
// A Chrome Trace Event Format file written event by event (docs/ett.md §9): the report streams a
// million-segment timeline into it without ever holding the trace, or the timeline as JSON, in memory.
//
// The file appears atomically: events go to a temporary file beside `path`, which commit() renames over it;
// a writer destroyed before commit() removes the temporary file, so readers see the old file or the
// complete new one.

#include <cstdint>
#include <cstdio>
#include <optional>
#include <string>
#include <string_view>

namespace ettkit::ett::detail {

class ChromeTraceFile {
 public:
  /// Opens the temporary file; throws IoError naming `path` if it cannot.
  explicit ChromeTraceFile(std::string path);
  ~ChromeTraceFile();
  ChromeTraceFile(const ChromeTraceFile&) = delete;
  ChromeTraceFile& operator=(const ChromeTraceFile&) = delete;

  /// Metadata naming process `pid` and sorting it by pid (Perfetto would sort "rank 10" before "rank 2").
  void process(int pid, std::string_view name);
  void thread(int pid, int tid, std::string_view name);
  /// A complete ("X") event; `bucket` and `step` go into args (a null bucket when empty, no step when absent).
  void complete(int pid, int tid, std::string_view name, std::string_view cat, int64_t ts, int64_t dur,
                std::optional<int> attempt, std::string_view bucket, std::optional<int64_t> step);
  /// A process-scoped instant ("i") event; `args_json` is a JSON object, written as given.
  void instant(int pid, int tid, std::string_view name, std::string_view cat, int64_t ts, std::string_view args_json);
  /// A counter ("C") event with one value.
  void counter(int pid, int tid, std::string_view name, int64_t ts, double value);
  /// Ends the event list with the document's other members (`other_data_json`: a JSON object), flushes,
  /// and renames the file into place. Throws IoError if any write failed.
  void commit(std::string_view other_data_json);

 private:
  void begin_event();
  void append(std::string_view text);
  void append_int(int64_t v);
  void append_string(std::string_view s);  // as a JSON string literal
  void flush();

  std::string path_;
  std::string tmp_path_;
  std::FILE* file_ = nullptr;
  std::string buffer_;
  bool first_event_ = true;
  bool failed_ = false;
  bool committed_ = false;
};

}  // namespace ettkit::ett::detail
