// Writing a checkpoint directory so that a crash, kill -9 or full disk at any moment leaves the
// previous checkpoint and `latest` loadable. Files go into a temporary directory beside the
// target, <save_dir>/.tmp-<tag>-<random>, each fsync'd when closed; commit() fsyncs that
// directory and renames it onto <save_dir>/<tag>, then replaces <save_dir>/latest (the tag as
// text, as DeepSpeed writes it) by write + fsync + rename (the write comes before the directory's
// rename, so a disk too full for `latest` fails the save before anything is replaced). A tag
// that exists already is swapped out with renameat2(RENAME_EXCHANGE); where the filesystem
// lacks it, the old copy is first renamed to <save_dir>/.aside-<tag>, which
// find_checkpoint_dir() reads and the next save restores or removes, so some complete copy of
// <tag> exists at every moment.
//
// The next save's create() removes the .tmp-* directories crashed saves left. A StagedCheckpoint
// that is destroyed neither committed nor released removes its temporary directory, so an error
// (ENOSPC from a reservation or a write, named with the bytes needed and available) leaves
// nothing behind. One job saves into a save_dir at a time.
//
// Many ranks, one directory (the caller runs the protocol):
//   rank 0:      auto s = StagedCheckpoint::create(dir, tag);  broadcast s.temp_name();
//   other ranks: auto s = StagedCheckpoint::attach(dir, tag, name);
//   every rank:  writes its files at s.file("..."); s.release() on ranks other than 0;
//   all ranks:   agree that every rank succeeded (an all-reduce), then rank 0: s.commit().
// If any rank failed, rank 0 lets its handle go uncommitted (or calls abort()).
#pragma once
#include <filesystem>
#include <optional>
#include <string>

namespace zeroshard::checkpoint {

namespace fs = std::filesystem;

// A tag names one directory in save_dir: not empty, no '/', not starting with '.', and not
// "latest" or "latest.tmp". UsageError saying what is allowed.
void validate_tag(const std::string& tag);

class StagedCheckpoint {
 public:
  // One process (rank 0), before any rank writes: creates save_dir, cleans what crashed saves
  // left (stale .tmp-* removed; an .aside-<tag> restored or removed) and creates the temporary
  // directory.
  static StagedCheckpoint create(const fs::path& save_dir, const std::string& tag);
  // The other ranks, after rank 0's create(): the same temporary directory, by its temp_name().
  static StagedCheckpoint attach(const fs::path& save_dir, const std::string& tag, const std::string& temp_name);

  StagedCheckpoint(StagedCheckpoint&& other) noexcept;
  StagedCheckpoint& operator=(StagedCheckpoint&&) = delete;
  StagedCheckpoint(const StagedCheckpoint&) = delete;
  // abort() unless commit() or release() was reached.
  ~StagedCheckpoint();

  const fs::path& save_dir() const { return save_dir_; }
  const std::string& tag() const { return tag_; }
  const fs::path& temp_dir() const { return temp_dir_; }
  std::string temp_name() const { return temp_dir_.filename().string(); }
  fs::path final_dir() const { return save_dir_ / tag_; }
  // Where to write file `name` (a plain file name) of this checkpoint.
  fs::path file(const std::string& name) const;

  // This handle's writes are done and closed; the directory is rank 0's to commit or remove.
  void release();
  // After every rank's files are closed: fsyncs the temporary directory, moves it onto
  // <save_dir>/<tag> (replacing an existing one), fsyncs save_dir, then, if save_latest,
  // replaces `latest`. On an error before the rename the temporary directory is removed.
  void commit(bool save_latest = true);
  // Removes the temporary directory (never throws; what the destructor does on an error path).
  void abort() noexcept;

 private:
  StagedCheckpoint(fs::path save_dir, std::string tag, fs::path temp_dir);
  void replace_existing(const fs::path& final_dir);

  fs::path save_dir_;
  std::string tag_;
  fs::path temp_dir_;
  bool owns_ = true;  // false once committed, released, aborted or moved from
};

// Replaces <save_dir>/latest with `tag`: latest.tmp written and fsync'd, renamed, save_dir fsync'd.
void write_latest(const fs::path& save_dir, const std::string& tag);
// The two halves: latest.tmp written and fsync'd (nothing else changes; a full disk fails here),
// then renamed onto latest and save_dir fsync'd.
void prepare_latest(const fs::path& save_dir, const std::string& tag);
void publish_latest(const fs::path& save_dir);
// The tag in <load_dir>/latest (surrounding whitespace trimmed); nullopt when there is none.
std::optional<std::string> read_latest(const fs::path& load_dir);
// The directory holding <tag>'s checkpoint: <load_dir>/<tag>, or <load_dir>/.aside-<tag> when a
// save crashed between moving the old copy aside and renaming the new one; nullopt for neither.
std::optional<fs::path> find_checkpoint_dir(const fs::path& load_dir, const std::string& tag);

}  // namespace zeroshard::checkpoint
