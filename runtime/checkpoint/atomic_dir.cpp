// Atomic checkpoint directories (atomic_dir.h): temporary directory, cleanup of crashed saves,
// commit by rename (RENAME_EXCHANGE, or move-aside), and the atomic `latest` file.
#include "runtime/checkpoint/atomic_dir.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <stdio.h>  // renameat2, RENAME_EXCHANGE (glibc 2.28+)

#include <cerrno>
#include <cstdio>
#include <random>
#include <vector>

#include "runtime/checkpoint/file_io.h"
#include "runtime/checkpoint/testing_hooks.h"
#include "runtime/error.h"
#include "runtime/log.h"

namespace zeroshard::checkpoint {
namespace {

constexpr const char* kTempPrefix = ".tmp-";
constexpr const char* kAsidePrefix = ".aside-";
constexpr const char* kLatest = "latest";
constexpr const char* kLatestTmp = "latest.tmp";

// Whether anything (a directory, a file, a dangling link) is at `path`; other errors name it.
bool exists_at(const fs::path& path) {
  std::error_code ec;
  const auto status = fs::symlink_status(path, ec);
  if (ec && ec != std::errc::no_such_file_or_directory)
    throw Error("checkpoint: cannot stat " + path.string() + ": " + ec.message());
  return !ec && fs::exists(status);
}

bool starts_with(const std::string& text, const std::string& prefix) {
  return text.compare(0, prefix.size(), prefix) == 0;
}

void rename_or_throw(const fs::path& from, const fs::path& to) {
  if (::rename(from.c_str(), to.c_str()) != 0) throw_io_error("rename " + from.string() + " ->", to, errno);
}

std::string random_suffix() {
  std::random_device device;
  char text[9];
  std::snprintf(text, sizeof text, "%08x", unsigned(device()));
  return text;
}

void remove_tree(const fs::path& path) {
  std::error_code ec;
  fs::remove_all(path, ec);
  if (ec) throw Error("checkpoint: cannot remove " + path.string() + ": " + ec.message());
}

// What crashed saves left in save_dir: temporary directories (never complete, or holding an old
// copy already replaced) are removed; an .aside-<tag> is the previous copy of <tag> when <tag>
// itself is missing (restored), else the copy <tag> replaced (removed).
void clean_crashed_saves(const fs::path& save_dir) {
  std::vector<fs::path> found;  // listed first: removing entries while iterating is unspecified
  std::error_code ec;
  for (fs::directory_iterator it(save_dir, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    if (starts_with(name, kTempPrefix) || starts_with(name, kAsidePrefix)) found.push_back(it->path());
  }
  if (ec) throw Error("checkpoint: cannot list " + save_dir.string() + ": " + ec.message());
  for (const auto& path : found) {
    const std::string name = path.filename().string();
    if (starts_with(name, kTempPrefix)) {
      warn("checkpoint: removing " + path.string() + ", left by an interrupted save");
      remove_tree(path);
      continue;
    }
    const fs::path original = save_dir / name.substr(std::string(kAsidePrefix).size());
    if (exists_at(original)) {
      remove_tree(path);
    } else {
      warn("checkpoint: restoring " + original.string() + " from " + path.string() +
           ", where an interrupted save had moved it");
      rename_or_throw(path, original);
    }
  }
  if (!found.empty()) fsync_directory(save_dir);
}

}  // namespace

void validate_tag(const std::string& tag) {
  const bool ok = !tag.empty() && tag.find('/') == std::string::npos && tag.find('\0') == std::string::npos &&
                  tag[0] != '.' && tag != kLatest && tag != kLatestTmp;
  ZS_REQUIRE(ok, "checkpoint tag \"", tag, "\": a tag names one directory: not empty, no '/', not starting ",
             "with '.', and not \"latest\" or \"latest.tmp\"");
}

StagedCheckpoint::StagedCheckpoint(fs::path save_dir, std::string tag, fs::path temp_dir)
    : save_dir_(std::move(save_dir)), tag_(std::move(tag)), temp_dir_(std::move(temp_dir)) {}

StagedCheckpoint StagedCheckpoint::create(const fs::path& save_dir, const std::string& tag) {
  validate_tag(tag);
  std::error_code ec;
  fs::create_directories(save_dir, ec);
  if (ec) throw Error("checkpoint: cannot create " + save_dir.string() + ": " + ec.message());
  clean_crashed_saves(save_dir);
  const fs::path temp = save_dir / (kTempPrefix + tag + "-" + random_suffix());
  if (::mkdir(temp.c_str(), 0755) != 0) throw_io_error("mkdir", temp, errno);
  return StagedCheckpoint(save_dir, tag, temp);
}

StagedCheckpoint StagedCheckpoint::attach(const fs::path& save_dir, const std::string& tag,
                                          const std::string& temp_name) {
  validate_tag(tag);
  ZS_REQUIRE(starts_with(temp_name, kTempPrefix + tag + "-") && temp_name.find('/') == std::string::npos,
             "checkpoint: \"", temp_name, "\" is not a temporary directory of tag \"", tag, "\"");
  const fs::path temp = save_dir / temp_name;
  std::error_code ec;
  if (!fs::is_directory(temp, ec))
    throw Error("checkpoint: " + temp.string() + " does not exist: rank 0 creates it before the others attach");
  return StagedCheckpoint(save_dir, tag, temp);
}

StagedCheckpoint::StagedCheckpoint(StagedCheckpoint&& other) noexcept
    : save_dir_(std::move(other.save_dir_)),
      tag_(std::move(other.tag_)),
      temp_dir_(std::move(other.temp_dir_)),
      owns_(other.owns_) {
  other.owns_ = false;
}

StagedCheckpoint::~StagedCheckpoint() { abort(); }

fs::path StagedCheckpoint::file(const std::string& name) const {
  ZS_REQUIRE(!name.empty() && name.find('/') == std::string::npos && name != "." && name != "..",
             "checkpoint file name \"", name, "\": expected a plain file name");
  return temp_dir_ / name;
}

void StagedCheckpoint::release() { owns_ = false; }

void StagedCheckpoint::abort() noexcept {
  if (!owns_) return;
  owns_ = false;
  std::error_code ec;
  fs::remove_all(temp_dir_, ec);  // best effort: the next save's create() removes what remains
}

void StagedCheckpoint::replace_existing(const fs::path& final_dir) {
  if (!testing::hooks().no_rename_exchange) {
    // One atomic step: <tag> becomes the new copy, the temporary name holds the old one.
    if (::renameat2(AT_FDCWD, temp_dir_.c_str(), AT_FDCWD, final_dir.c_str(), RENAME_EXCHANGE) == 0) {
      owns_ = false;
      testing::reached("commit:after_exchange");
      fsync_directory(save_dir_);
      remove_tree(temp_dir_);
      return;
    }
    if (errno != EINVAL && errno != ENOSYS && errno != EOPNOTSUPP)
      throw_io_error("renameat2 (RENAME_EXCHANGE) " + temp_dir_.string() + " <->", final_dir, errno);
  }
  // Without an exchange: two renames, with the old copy at .aside-<tag> in between, where
  // find_checkpoint_dir() and the next create() look for it.
  const fs::path aside = save_dir_ / (kAsidePrefix + tag_);
  remove_tree(aside);  // only from a crash of an earlier commit, and <tag> exists
  rename_or_throw(final_dir, aside);
  fsync_directory(save_dir_);
  testing::reached("commit:after_move_aside");
  rename_or_throw(temp_dir_, final_dir);
  owns_ = false;
  fsync_directory(save_dir_);
  testing::reached("commit:after_rename");
  remove_tree(aside);
}

void StagedCheckpoint::commit(bool save_latest) {
  ZS_REQUIRE(owns_, "checkpoint \"", tag_, "\": commit() after commit, release or abort");
  testing::reached("commit:begin");
  fsync_directory(temp_dir_);  // the entries of the files every rank wrote
  // `latest` is written (not yet renamed) before anything moves, so a full disk there fails the
  // save while the previous checkpoint and `latest` are still untouched.
  if (save_latest) prepare_latest(save_dir_, tag_);
  const fs::path final_dir = save_dir_ / tag_;
  if (exists_at(final_dir)) {
    replace_existing(final_dir);
  } else {
    rename_or_throw(temp_dir_, final_dir);
    owns_ = false;
    fsync_directory(save_dir_);
    testing::reached("commit:after_rename");
  }
  if (save_latest) {
    testing::reached("commit:before_latest");
    publish_latest(save_dir_);
  }
  testing::reached("commit:end");
}

void prepare_latest(const fs::path& save_dir, const std::string& tag) {
  validate_tag(tag);
  write_file_durably(save_dir / kLatestTmp, tag);
  testing::reached("latest:after_write_tmp");
}

void publish_latest(const fs::path& save_dir) {
  rename_or_throw(save_dir / kLatestTmp, save_dir / kLatest);
  fsync_directory(save_dir);
}

void write_latest(const fs::path& save_dir, const std::string& tag) {
  prepare_latest(save_dir, tag);
  publish_latest(save_dir);
}

std::optional<std::string> read_latest(const fs::path& load_dir) {
  const fs::path path = load_dir / kLatest;
  if (!exists_at(path)) return std::nullopt;
  std::string text = read_small_file(path);
  const auto first = text.find_first_not_of(" \t\r\n");
  if (first == std::string::npos) throw Error("checkpoint: " + path.string() + " is empty; it should name a tag");
  const auto last = text.find_last_not_of(" \t\r\n");
  return text.substr(first, last - first + 1);
}

std::optional<fs::path> find_checkpoint_dir(const fs::path& load_dir, const std::string& tag) {
  if (tag.empty() || tag.find('/') != std::string::npos) return std::nullopt;
  std::error_code ec;
  if (fs::is_directory(load_dir / tag, ec)) return load_dir / tag;
  const fs::path aside = load_dir / (kAsidePrefix + tag);
  if (fs::is_directory(aside, ec)) return aside;
  return std::nullopt;
}

}  // namespace zeroshard::checkpoint
