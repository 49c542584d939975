#include "ett/chrome_trace.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <charconv>
#include <cstring>
#include <filesystem>
#include <functional>
#include <nlohmann/json.hpp>
#include <random>
#include <thread>

#include "ettkit/common/error.h"

namespace ettkit::ett::detail {

namespace {

// Large enough that a million events cost a few hundred writes, small enough not to matter in memory.
constexpr size_t kFlushBytes = 1 << 20;

// Same directory, so the rename stays on one file system; pid and thread keep concurrent writers apart, and a
// random part keeps anyone else from planting an entry under the name ahead of the writer.
std::string temporary_path_for(const std::string& path) {
  std::filesystem::path p(path);
  std::random_device random;
  std::string name = ".";
  name += p.filename().string();
  for (const uint64_t part : {static_cast<uint64_t>(::getpid()),
                              static_cast<uint64_t>(std::hash<std::thread::id>{}(std::this_thread::get_id())),
                              static_cast<uint64_t>(random())}) {
    name += '.';
    name += std::to_string(part);
  }
  name += ".tmp";
  return (p.parent_path() / name).string();
}

// The temporary file, new: O_EXCL|O_NOFOLLOW refuse any entry already there (fopen followed a planted link
// and truncated its target). Mode 0666 less the umask, as any file the user writes, not mkstemp's 0600.
std::FILE* create_new(const std::string& tmp_path, const std::string& path) {
  const int fd = ::open(tmp_path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0666);
  const int err = errno;
  ETTKIT_CHECK(fd >= 0, IoError, "cannot write the Chrome trace '", path, "': creating '", tmp_path, "' failed: ",
               std::strerror(err),
               err == EEXIST ? " (an entry of that name exists; ettkit never writes through one)" : "");
  std::FILE* file = ::fdopen(fd, "wb");
  if (file == nullptr) {
    const int fdopen_err = errno;
    ::close(fd);
    ::unlink(tmp_path.c_str());
    ETTKIT_THROW(IoError, "cannot write the Chrome trace '", path, "': ", std::strerror(fdopen_err));
  }
  return file;
}

}  // namespace

ChromeTraceFile::ChromeTraceFile(std::string path) : path_(std::move(path)), tmp_path_(temporary_path_for(path_)) {
  file_ = create_new(tmp_path_, path_);
  buffer_.reserve(kFlushBytes + 4096);
  append(R"({"traceEvents":[)");
}

ChromeTraceFile::~ChromeTraceFile() {
  if (file_ != nullptr) std::fclose(file_);
  if (!committed_) std::remove(tmp_path_.c_str());
}

void ChromeTraceFile::process(int pid, std::string_view name) {
  begin_event();
  append(R"({"ph":"M","pid":)");
  append_int(pid);
  append(R"(,"tid":0,"name":"process_name","args":{"name":)");
  append_string(name);
  append("}}");
  begin_event();
  append(R"({"ph":"M","pid":)");
  append_int(pid);
  append(R"(,"tid":0,"name":"process_sort_index","args":{"sort_index":)");
  append_int(pid);
  append("}}");
}

void ChromeTraceFile::thread(int pid, int tid, std::string_view name) {
  begin_event();
  append(R"({"ph":"M","pid":)");
  append_int(pid);
  append(R"(,"tid":)");
  append_int(tid);
  append(R"(,"name":"thread_name","args":{"name":)");
  append_string(name);
  append("}}");
}

void ChromeTraceFile::complete(int pid, int tid, std::string_view name, std::string_view cat, int64_t ts, int64_t dur,
                               std::optional<int> attempt, std::string_view bucket, std::optional<int64_t> step) {
  begin_event();
  append(R"({"ph":"X","name":)");
  append_string(name);
  append(R"(,"cat":)");
  append_string(cat);
  append(R"(,"pid":)");
  append_int(pid);
  append(R"(,"tid":)");
  append_int(tid);
  append(R"(,"ts":)");
  append_int(ts);
  append(R"(,"dur":)");
  append_int(dur);
  append(R"(,"args":{"attempt":)");
  if (attempt) {
    append_int(*attempt);
  } else {
    append("null");
  }
  append(R"(,"bucket":)");
  if (bucket.empty()) {
    append("null");
  } else {
    append_string(bucket);
  }
  if (step) {
    append(R"(,"step":)");
    append_int(*step);
  }
  append("}}");
}

void ChromeTraceFile::instant(int pid, int tid, std::string_view name, std::string_view cat, int64_t ts,
                              std::string_view args_json) {
  begin_event();
  append(R"({"ph":"i","s":"p","name":)");
  append_string(name);
  append(R"(,"cat":)");
  append_string(cat);
  append(R"(,"pid":)");
  append_int(pid);
  append(R"(,"tid":)");
  append_int(tid);
  append(R"(,"ts":)");
  append_int(ts);
  append(R"(,"args":)");
  append(args_json);
  append("}");
}

void ChromeTraceFile::counter(int pid, int tid, std::string_view name, int64_t ts, double value) {
  begin_event();
  append(R"({"ph":"C","name":)");
  append_string(name);
  append(R"(,"pid":)");
  append_int(pid);
  append(R"(,"tid":)");
  append_int(tid);
  append(R"(,"ts":)");
  append_int(ts);
  append(R"(,"args":{"value":)");
  append(nlohmann::json(value).dump());
  append("}}");
}

void ChromeTraceFile::commit(std::string_view other_data_json) {
  append(R"(],"displayTimeUnit":"ms","otherData":)");
  append(other_data_json);
  append("}");
  flush();
  failed_ = failed_ || std::fflush(file_) != 0;
  failed_ = std::fclose(file_) != 0 || failed_;
  file_ = nullptr;
  ETTKIT_CHECK(!failed_, IoError, "cannot write the Chrome trace '", path_, "' (", tmp_path_, ")");
  ETTKIT_CHECK(std::rename(tmp_path_.c_str(), path_.c_str()) == 0, IoError, "cannot rename '", tmp_path_, "' to '",
               path_, "': ", std::strerror(errno));
  committed_ = true;
}

void ChromeTraceFile::begin_event() {
  if (!first_event_) buffer_.push_back(',');
  first_event_ = false;
  if (buffer_.size() >= kFlushBytes) flush();
}

void ChromeTraceFile::append(std::string_view text) { buffer_.append(text); }

void ChromeTraceFile::append_int(int64_t v) {
  char digits[24];
  auto [end, err] = std::to_chars(digits, digits + sizeof(digits), v);
  buffer_.append(digits, end);
}

void ChromeTraceFile::append_string(std::string_view s) {
  buffer_.push_back('"');
  for (char c : s) {
    switch (c) {
      case '"': buffer_.append("\\\""); break;
      case '\\': buffer_.append("\\\\"); break;
      case '\n': buffer_.append("\\n"); break;
      case '\r': buffer_.append("\\r"); break;
      case '\t': buffer_.append("\\t"); break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) {
          char esc[8];
          std::snprintf(esc, sizeof(esc), "\\u%04x", static_cast<unsigned>(c));
          buffer_.append(esc);
        } else {
          buffer_.push_back(c);  // UTF-8 passes through: names come from parsed JSON
        }
    }
  }
  buffer_.push_back('"');
}

void ChromeTraceFile::flush() {
  if (buffer_.empty() || file_ == nullptr) return;
  failed_ = failed_ || std::fwrite(buffer_.data(), 1, buffer_.size(), file_) != buffer_.size();
  buffer_.clear();
}

}  // namespace ettkit::ett::detail
