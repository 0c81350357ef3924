// The JSON walker every config block is read through: it knows the key path it stands at, resolves
// "auto" and null to the default (with a note), checks types and ranges with one message format,
// records the value in force into Config::resolved, and after a block is read reports any key it was
// not asked about as unknown, with a did-you-mean. Internal to runtime/config/.
#pragma once
#include <cstdint>
#include <limits>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace zeroshard::config {

using json = nlohmann::json;

// One parse's shared state: where the text came from (for messages) and where notes go.
class Context {
 public:
  Context(std::string source, std::vector<std::string>* notes)
      : source_(std::move(source)), notes_(notes) {}
  // Throws ConfigError "<source>: <path>: <what>" (no source for pseudo-names like "<dict>").
  [[noreturn]] void fail(const std::string& path, const std::string& what) const;
  // Appends a note once: a config read twice (or a warning hit twice) logs one line.
  void note(const std::string& line);
  // A "warning: " note for a key that only affects reporting and that zeroshard ignores.
  void warn_ignored(const std::string& path, const json& value, const std::string& why);
  const std::string& source() const { return source_; }

 private:
  std::string source_;
  std::vector<std::string>* notes_;
};

// "ds_config.json: " for a file name, "" for "", "<dict>" and other angle-bracketed pseudo-names.
std::string source_prefix(const std::string& source);
// `4`, `"cos"`: how a value is quoted in "got ..." when its type was right.
std::string show(const json& v);
// `"high" (string)`: how a value is quoted when its type was wrong.
std::string show_typed(const json& v);
std::string join_path(const std::string& path, const std::string& key);
// `"a", "b", "c"` in the given order.
std::string quoted_list(const std::vector<std::string>& items);
// The closest candidate to `key` when it is close enough to be a typo, else "".
std::string closest(const std::string& key, const std::vector<std::string>& candidates);
// The integer a JSON number stands for, if it is integral (5e8 counts, 2.5 and true do not).
std::optional<int64_t> as_integer(const json& v);

class Block {
 public:
  static constexpr int64_t kNoMin = std::numeric_limits<int64_t>::min();
  static constexpr int64_t kNoMax = std::numeric_limits<int64_t>::max();

  // `obj` may be null (block absent): every read then yields its default. `out` receives the
  // value in force of every key read. Throws when `obj` is present but not an object.
  Block(const json* obj, std::string path, Context& ctx, json& out);

  bool present() const { return obj_ != nullptr; }
  // True when the key is given with a value other than null and "auto".
  bool has(const std::string& key);
  bool get_bool(const std::string& key, bool def);
  int64_t get_int(const std::string& key, int64_t def, int64_t min = kNoMin, int64_t max = kNoMax);
  std::optional<int64_t> get_opt_int(const std::string& key, int64_t min = kNoMin);
  int64_t get_int_choice(const std::string& key, int64_t def, const std::vector<int64_t>& allowed);
  double get_number(const std::string& key, double def,
                    double min = -std::numeric_limits<double>::infinity(),
                    double max = std::numeric_limits<double>::infinity());
  std::optional<double> get_opt_number(const std::string& key, double min);
  std::string get_string(const std::string& key, const std::string& def);
  std::optional<std::string> get_opt_string(const std::string& key);
  // Matches case-insensitively and returns the canonical spelling from `allowed`.
  std::string get_enum(const std::string& key, const std::string& def,
                       const std::vector<std::string>& allowed);
  // A sub-block; absent (or null) gives a Block whose reads all default.
  Block child(const std::string& key);
  // The raw value (nullptr when absent or null) for keys with a shape of their own; marks it known.
  const json* raw(const std::string& key);
  // True when the key is written as "auto" (raw() and has() treat that as absent).
  bool is_auto(const std::string& key) const {
    return obj_ && obj_->contains(key) && obj_->at(key) == "auto";
  }
  // Notes `"<path>.<key>": "auto" -> <def> (default)` when the key is written as "auto".
  void note_if_auto(const std::string& key, const json& def) { note_auto(key, is_auto(key), def); }
  // Marks a key as known without reading it (e.g. an alias read through another name).
  void known(const std::string& key) { known_.push_back(key); }
  // Rejects a value other than the default for a feature zeroshard does not implement.
  void reject_unless_default(const std::string& key, const json& def, const std::string& feature);
  // Throws for the first key present but never read, with a did-you-mean.
  void finish();

  [[noreturn]] void fail(const std::string& key, const std::string& what) const {
    ctx_.fail(join_path(path_, key), what);
  }
  std::string path_of(const std::string& key) const { return join_path(path_, key); }
  const std::string& path() const { return path_; }
  Context& ctx() { return ctx_; }
  json& out() { return out_; }

 private:
  // The value at `key`, or nullptr when absent/null/"auto"; *was_auto tells which.
  const json* lookup(const std::string& key, bool* was_auto);
  void note_auto(const std::string& key, bool was_auto, const json& def);

  const json* obj_;
  std::string path_;
  Context& ctx_;
  json& out_;
  std::vector<std::string> known_;
};

}  // namespace zeroshard::config
