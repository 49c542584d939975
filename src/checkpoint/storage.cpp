#include "checkpoint/storage.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <memory>
#include <nlohmann/json.hpp>
#include <random>

#include "common/logging.h"
#include "ettkit/common/error.h"

namespace fs = std::filesystem;
using nlohmann::json;

namespace ettkit::checkpoint::detail {

namespace {
// Large writes go out in slices: the kernel caps one write(2) at ~2 GiB, a failing write's error stays
// close to the bytes it concerns, and each slice's writeback is started as soon as it is written.
constexpr size_t kWriteSlice = size_t{16} << 20;
// Writeback pipeline depth: the writer waits for the slice this many slices back, so at most
// kWritebackDepth * kWriteSlice bytes of this file are dirty at a time.
constexpr size_t kWritebackDepth = 4;

struct Fd {
  int fd = -1;
  ~Fd() {
    if (fd >= 0) ::close(fd);
  }
};

struct Xxh3 {
  XXH3_state_t* s = XXH3_createState();
  Xxh3() { XXH3_64bits_reset(s); }
  ~Xxh3() { XXH3_freeState(s); }
  void update(const void* p, size_t n) { XXH3_64bits_update(s, p, n); }
  uint64_t digest() const { return XXH3_64bits_digest(s); }
};

[[noreturn]] void throw_errno(const char* what, const std::string& path, int err) {
  ETTKIT_THROW(IoError, what, " '", path, "' failed: ", std::strerror(err), " (errno ", err, ")");
}
}  // namespace

std::string hex64(uint64_t v) {
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(v));
  return buf;
}

FileDigest write_file_durably(const std::string& path, const std::vector<ConstBuffer>& buffers) {
  Fd f;
  f.fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (f.fd < 0) throw_errno("creating checkpoint file", path, errno);
  Xxh3 h;
  uint64_t total = 0;
  // Why not plain write + one fsync: the kernel would start writeback only when dirty limits are hit,
  // and the final fsync would then wait for most of the file at once. Starting each slice's writeback
  // right after its write(2) keeps the disk busy while the next slice is hashed and copied into the
  // page cache, so write and writeback overlap and the closing fsync has little left to do. Waiting on
  // older slices bounds the dirty memory, and dropping their pages keeps a checkpoint (written once,
  // read only on restart) from evicting the training job's page cache. sync_file_range is only a hint
  // here: where the file system does not support it, the fsync below still makes the file durable.
  bool writeback = true;
  std::vector<std::pair<uint64_t, uint64_t>> inflight;  // slices whose writeback was started
  auto drain_oldest = [&] {
    auto [off, len] = inflight.front();
    inflight.erase(inflight.begin());
    if (writeback &&
        ::sync_file_range(f.fd, static_cast<off64_t>(off), static_cast<off64_t>(len),
                          SYNC_FILE_RANGE_WAIT_BEFORE | SYNC_FILE_RANGE_WRITE | SYNC_FILE_RANGE_WAIT_AFTER) == 0) {
      ::posix_fadvise(f.fd, static_cast<off_t>(off), static_cast<off_t>(len), POSIX_FADV_DONTNEED);
    }
  };
  for (const ConstBuffer& b : buffers) {
    const char* p = static_cast<const char*>(b.data);
    size_t left = b.size;
    while (left > 0) {
      size_t n = std::min(left, kWriteSlice);
      h.update(p, n);
      size_t done = 0;
      while (done < n) {
        ssize_t w = ::write(f.fd, p + done, n - done);
        if (w < 0) {
          if (errno == EINTR) continue;
          throw_errno("writing checkpoint file", path, errno);
        }
        if (w == 0) throw_errno("writing checkpoint file", path, ENOSPC);
        done += static_cast<size_t>(w);
      }
      if (writeback && n >= (size_t{1} << 20)) {
        if (::sync_file_range(f.fd, static_cast<off64_t>(total), static_cast<off64_t>(n), SYNC_FILE_RANGE_WRITE) == 0) {
          inflight.emplace_back(total, n);
          if (inflight.size() > kWritebackDepth) drain_oldest();
        } else {
          writeback = false;  // ENOSYS / EINVAL / ESPIPE: this file system does not take the hint
        }
      }
      p += n;
      left -= n;
      total += n;
    }
  }
  if (::fsync(f.fd) != 0) throw_errno("fsync of checkpoint file", path, errno);
  // After the fsync every page is clean: drop the rest of the file's pages from the cache as well.
  if (!inflight.empty()) ::posix_fadvise(f.fd, 0, 0, POSIX_FADV_DONTNEED);
  int fd = f.fd;
  f.fd = -1;
  if (::close(fd) != 0) throw_errno("closing checkpoint file", path, errno);
  return FileDigest{total, hex64(h.digest())};
}

std::string file_xxh3(const std::string& path) {
  Fd f;
  f.fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (f.fd < 0) throw_errno("opening", path, errno);
  Xxh3 h;
  std::unique_ptr<char[]> buf(new char[size_t{8} << 20]);
  for (;;) {
    ssize_t n = ::read(f.fd, buf.get(), size_t{8} << 20);
    if (n < 0) {
      if (errno == EINTR) continue;
      throw_errno("reading", path, errno);
    }
    if (n == 0) break;
    h.update(buf.get(), static_cast<size_t>(n));
  }
  return hex64(h.digest());
}

void fsync_directory(const std::string& path) {
  Fd f;
  f.fd = ::open(path.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (f.fd < 0) throw_errno("opening directory", path, errno);
  if (::fsync(f.fd) != 0) throw_errno("fsync of directory", path, errno);
}

void make_directories(const std::string& path) {
  std::error_code ec;
  fs::create_directories(path, ec);
  if (ec) ETTKIT_THROW(IoError, "creating directory '", path, "' failed: ", ec.message());
}

void remove_tree_quietly(const std::string& path) {
  std::error_code ec;
  fs::remove_all(path, ec);
  if (ec) ETTKIT_LOG_WARN("checkpoint: could not remove '", path, "': ", ec.message());
}

std::optional<uint64_t> file_size(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0 || !S_ISREG(st.st_mode)) return std::nullopt;
  return static_cast<uint64_t>(st.st_size);
}

void read_exact(int fd, void* dst, uint64_t size, uint64_t offset, const std::string& path) {
  char* p = static_cast<char*>(dst);
  while (size > 0) {
    ssize_t n = ::pread(fd, p, std::min<uint64_t>(size, kWriteSlice), static_cast<off_t>(offset));
    if (n < 0) {
      if (errno == EINTR) continue;
      throw_errno("reading", path, errno);
    }
    if (n == 0) ETTKIT_THROW(CorruptData, "checkpoint file '", path, "' ends early at byte ", offset);
    p += n;
    size -= static_cast<uint64_t>(n);
    offset += static_cast<uint64_t>(n);
  }
}

std::string read_small_file(const std::string& path) {
  Fd f;
  f.fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (f.fd < 0) throw_errno("opening", path, errno);
  std::string out;
  char buf[65536];
  for (;;) {
    ssize_t n = ::read(f.fd, buf, sizeof buf);
    if (n < 0) {
      if (errno == EINTR) continue;
      throw_errno("reading", path, errno);
    }
    if (n == 0) break;
    out.append(buf, static_cast<size_t>(n));
  }
  return out;
}

// ---- safetensors -------------------------------------------------------------------------------------

int safetensors_dtype_size(const std::string& d) {
  static const std::map<std::string, int> sizes = {
      {"BOOL", 1}, {"U8", 1},  {"I8", 1},  {"F8_E4M3", 1}, {"F8_E5M2", 1}, {"I16", 2}, {"U16", 2},
      {"F16", 2},  {"BF16", 2}, {"I32", 4}, {"U32", 4},     {"F32", 4},     {"I64", 8}, {"U64", 8},
      {"F64", 8},  {"C64", 8}};
  auto it = sizes.find(d);
  return it == sizes.end() ? 0 : it->second;
}

std::string encode_safetensors_header(const std::vector<SafetensorsEntry>& entries,
                                      const std::map<std::string, std::string>& metadata) {
  json h = json::object();
  if (!metadata.empty()) h["__metadata__"] = metadata;
  for (const auto& e : entries) {
    h[e.name] = {{"dtype", e.dtype}, {"shape", e.shape}, {"data_offsets", {e.begin, e.end}}};
  }
  std::string text = h.dump();
  // The data section should start 8-byte aligned (the format's recommendation; readers mmap it).
  while ((text.size() + 8) % 8 != 0) text.push_back(' ');
  std::string out(8, '\0');
  uint64_t n = text.size();
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  out += text;
  return out;
}

SafetensorsIndex read_safetensors_index(const std::string& path, uint64_t size) {
  ETTKIT_CHECK(size >= 8, CorruptData, "safetensors file '", path, "' has ", size, " bytes; at least 8 needed");
  Fd f;
  f.fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (f.fd < 0) throw_errno("opening", path, errno);
  unsigned char len_bytes[8];
  read_exact(f.fd, len_bytes, 8, 0, path);
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | len_bytes[i];
  ETTKIT_CHECK(n <= size - 8 && n <= (uint64_t{100} << 20), CorruptData, "safetensors file '", path,
               "' declares a header of ", n, " bytes but the file has ", size, " bytes");
  std::string text(n, '\0');
  read_exact(f.fd, text.data(), n, 8, path);
  json h = json::parse(text, nullptr, /*allow_exceptions=*/false);
  ETTKIT_CHECK(h.is_object(), CorruptData, "safetensors file '", path, "' has a header that is not a JSON object");
  SafetensorsIndex idx;
  idx.data_offset = 8 + n;
  idx.data_size = size - idx.data_offset;
  std::vector<std::pair<uint64_t, uint64_t>> ranges;
  for (auto it = h.begin(); it != h.end(); ++it) {
    if (it.key() == "__metadata__") continue;
    const json& v = it.value();
    bool ok = v.is_object() && v.contains("dtype") && v["dtype"].is_string() && v.contains("shape") &&
              v["shape"].is_array() && v.contains("data_offsets") && v["data_offsets"].is_array() &&
              v["data_offsets"].size() == 2 && v["data_offsets"][0].is_number_unsigned() &&
              v["data_offsets"][1].is_number_unsigned();
    ETTKIT_CHECK(ok, CorruptData, "safetensors file '", path, "': entry '", it.key(),
                 "' lacks dtype/shape/data_offsets");
    SafetensorsEntry e;
    e.name = it.key();
    e.dtype = v["dtype"].get<std::string>();
    uint64_t elems = 1;
    for (const json& d : v["shape"]) {
      ETTKIT_CHECK(d.is_number_unsigned(), CorruptData, "safetensors file '", path, "': entry '", e.name,
                   "' has a bad shape");
      e.shape.push_back(d.get<int64_t>());
      elems *= d.get<uint64_t>();
    }
    e.begin = v["data_offsets"][0].get<uint64_t>();
    e.end = v["data_offsets"][1].get<uint64_t>();
    int es = safetensors_dtype_size(e.dtype);
    ETTKIT_CHECK(es > 0, CorruptData, "safetensors file '", path, "': entry '", e.name, "' has unknown dtype '",
                 e.dtype, "'");
    ETTKIT_CHECK(e.begin <= e.end && e.end <= idx.data_size && e.end - e.begin == elems * es, CorruptData,
                 "safetensors file '", path, "': entry '", e.name, "' has data_offsets [", e.begin, ", ", e.end,
                 "] inconsistent with its shape or the data size ", idx.data_size);
    ranges.emplace_back(e.begin, e.end);
    idx.tensors.emplace(e.name, std::move(e));
  }
  std::sort(ranges.begin(), ranges.end());
  for (size_t i = 1; i < ranges.size(); ++i) {
    ETTKIT_CHECK(ranges[i].first >= ranges[i - 1].second, CorruptData, "safetensors file '", path,
                 "' has overlapping tensors");
  }
  return idx;
}

// ---- manifest ----------------------------------------------------------------------------------------

std::string encode_manifest(const Manifest& m) {
  json j;
  j["format"] = "ettkit-checkpoint";
  j["version"] = 1;
  j["step"] = m.step;
  j["world_size"] = m.world_size;
  j["created_unix_us"] = m.created_unix_us;
  j["torch_version"] = m.torch_version;
  json files = json::object();
  for (const auto& [name, d] : m.files) files[name] = {{"size", d.size}, {"xxh3", d.xxh3}};
  j["files"] = files;
  j["metadata"] = m.metadata;
  return j.dump(2) + "\n";
}

Manifest decode_manifest(const std::string& text, const std::string& source) {
  json j = json::parse(text, nullptr, false);
  ETTKIT_CHECK(j.is_object(), CorruptData, "manifest '", source, "' is not a JSON object");
  ETTKIT_CHECK(j.value("format", "") == "ettkit-checkpoint", CorruptData, "manifest '", source,
               "' lacks format=ettkit-checkpoint");
  ETTKIT_CHECK(j.contains("version") && j["version"].is_number_integer(), CorruptData, "manifest '", source,
               "' lacks an integer 'version'");
  ETTKIT_CHECK(j["version"].get<int>() <= 1, Unsupported, "manifest '", source, "' has version ",
               j["version"].get<int>(), "; this ettkit reads version 1");
  Manifest m;
  try {
    m.step = j.at("step").get<int64_t>();
    m.world_size = j.at("world_size").get<int>();
    m.created_unix_us = j.value("created_unix_us", int64_t{0});
    m.torch_version = j.value("torch_version", "");
    for (auto it = j.at("files").begin(); it != j.at("files").end(); ++it) {
      m.files[it.key()] = FileDigest{it.value().at("size").get<uint64_t>(), it.value().at("xxh3").get<std::string>()};
    }
    if (j.contains("metadata")) m.metadata = j["metadata"].get<std::map<std::string, std::string>>();
  } catch (const json::exception& e) {
    ETTKIT_THROW(CorruptData, "manifest '", source, "' has a missing or mistyped field: ", e.what());
  }
  ETTKIT_CHECK(m.world_size > 0, CorruptData, "manifest '", source, "' has world_size=", m.world_size);
  return m;
}

// ---- layout ------------------------------------------------------------------------------------------

std::string step_dir_name(int64_t step) { return "step-" + std::to_string(step); }
std::string temp_dir_name(int64_t step, const std::string& run_id) {
  return ".tmp-step-" + std::to_string(step) + "-" + run_id;
}

std::vector<int64_t> list_step_dirs(const std::string& dir) {
  std::vector<int64_t> steps;
  std::error_code ec;
  for (const auto& de : fs::directory_iterator(dir, ec)) {
    std::string n = de.path().filename().string();
    if (n.rfind("step-", 0) != 0 || n.size() <= 5) continue;
    std::string digits = n.substr(5);
    if (!std::all_of(digits.begin(), digits.end(), [](char c) { return c >= '0' && c <= '9'; })) continue;
    if (digits.size() > 18) continue;
    steps.push_back(std::stoll(digits));
  }
  std::sort(steps.rbegin(), steps.rend());
  return steps;
}

int remove_stale_temporaries(const std::string& dir, const std::string& run_id) {
  int removed = 0;
  std::error_code ec;
  std::vector<fs::path> victims;
  for (const auto& de : fs::directory_iterator(dir, ec)) {
    std::string n = de.path().filename().string();
    bool stale_tmp = n.rfind(".tmp-step-", 0) == 0 && (n.size() < run_id.size() || n.substr(n.size() - run_id.size()) != run_id);
    bool trash = n.rfind(".trash-", 0) == 0;
    bool latest_tmp = n.rfind("latest.tmp", 0) == 0;
    if (stale_tmp || trash || latest_tmp) victims.push_back(de.path());
  }
  for (const auto& p : victims) {
    remove_tree_quietly(p.string());
    ++removed;
  }
  return removed;
}

void update_latest(const std::string& dir, int64_t step) {
  std::string tmp = dir + "/latest.tmp-" + random_id();
  std::string text = step_dir_name(step) + "\n";
  write_file_durably(tmp, {ConstBuffer{text.data(), text.size()}});
  if (::rename(tmp.c_str(), (dir + "/latest").c_str()) != 0) throw_errno("renaming latest pointer", tmp, errno);
  fsync_directory(dir);
}

void apply_retention(const std::string& dir, int keep_last) {
  if (keep_last <= 0) return;
  std::vector<int64_t> steps = list_step_dirs(dir);
  for (size_t i = static_cast<size_t>(keep_last); i < steps.size(); ++i) {
    std::string from = dir + "/" + step_dir_name(steps[i]);
    std::string to = dir + "/.trash-" + step_dir_name(steps[i]) + "-" + random_id();
    // Rename first: a crash mid-delete must never leave a half-deleted step-<N> that looks committed.
    if (::rename(from.c_str(), to.c_str()) != 0) {
      ETTKIT_LOG_WARN("checkpoint retention: could not retire '", from, "': ", std::strerror(errno));
      continue;
    }
    remove_tree_quietly(to);
  }
  try {
    fsync_directory(dir);
  } catch (const Error& e) {
    ETTKIT_LOG_WARN("checkpoint retention: ", e.message());
  }
}

std::string random_id() {
  static thread_local std::mt19937_64 gen{std::random_device{}() ^ (static_cast<uint64_t>(::getpid()) << 32)};
  return hex64(gen());
}

}  // namespace ettkit::checkpoint::detail
