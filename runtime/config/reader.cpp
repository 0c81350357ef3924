// The JSON walker behind every config block: one place for message formats, "auto", did-you-mean.
#include "runtime/config/reader.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <sstream>

#include "runtime/error.h"

namespace zeroshard::config {

namespace {

std::string lower(std::string s) {
  for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<size_t> prev(b.size() + 1), cur(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) prev[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    cur[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      size_t sub = prev[j - 1] + (a[i - 1] == b[j - 1] ? 0 : 1);
      cur[j] = std::min({prev[j] + 1, cur[j - 1] + 1, sub});
    }
    std::swap(prev, cur);
  }
  return prev[b.size()];
}

// Doubles print the shortest way that reads back exactly (6e-4, not 0.00059999999999999995).
std::string format_double(double x) {
  std::ostringstream o;
  o.precision(17);
  for (int p = 1; p <= 17; ++p) {
    std::ostringstream t;
    t.precision(p);
    t << x;
    if (std::stod(t.str()) == x) return t.str();
  }
  o << x;
  return o.str();
}

}  // namespace

std::string source_prefix(const std::string& source) {
  if (source.empty() || source.front() == '<') return "";
  return source + ": ";
}

void Context::fail(const std::string& path, const std::string& what) const {
  throw ConfigError(source_prefix(source_) + (path.empty() ? "" : path + ": ") + what);
}

void Context::note(const std::string& line) {
  if (std::find(notes_->begin(), notes_->end(), line) == notes_->end()) notes_->push_back(line);
}

void Context::warn_ignored(const std::string& path, const json& value, const std::string& why) {
  note("warning: " + path + ": got " + show(value) + ", accepted and ignored: " + why);
}

std::string show(const json& v) {
  if (v.is_number_float()) return format_double(v.get<double>());
  std::string s = v.dump();
  if (s.size() > 60) s = s.substr(0, 57) + "...";
  return s;
}

std::string show_typed(const json& v) { return show(v) + " (" + v.type_name() + ")"; }

std::string join_path(const std::string& path, const std::string& key) {
  return path.empty() ? key : path + "." + key;
}

std::string quoted_list(const std::vector<std::string>& items) {
  std::string s;
  for (size_t i = 0; i < items.size(); ++i) s += (i ? ", \"" : "\"") + items[i] + "\"";
  return s;
}

std::string closest(const std::string& key, const std::vector<std::string>& candidates) {
  // A typo is a few edits away; allow more for longer names (one per three characters, max 4).
  size_t limit = std::min<size_t>(4, std::max<size_t>(1, key.size() / 3));
  std::string best;
  size_t best_d = limit + 1;
  for (const auto& c : candidates) {
    size_t d = edit_distance(lower(key), lower(c));
    if (d < best_d) best_d = d, best = c;
  }
  return best;
}

std::optional<int64_t> as_integer(const json& v) {
  if (v.is_number_integer()) return v.get<int64_t>();
  if (v.is_number_float()) {
    // DeepSpeed configs write sizes as 5e8; JSON makes that a float, pydantic accepts it as int.
    double d = v.get<double>();
    if (std::isfinite(d) && std::floor(d) == d && std::fabs(d) < 9.2e18)
      return static_cast<int64_t>(d);
  }
  return std::nullopt;
}

Block::Block(const json* obj, std::string path, Context& ctx, json& out)
    : obj_(obj && !obj->is_null() ? obj : nullptr), path_(std::move(path)), ctx_(ctx), out_(out) {
  if (obj_ && !obj_->is_object()) ctx_.fail(path_, "got " + show_typed(*obj_) + ", expected an object");
  if (!out_.is_object()) out_ = json::object();
}

const json* Block::lookup(const std::string& key, bool* was_auto) {
  known_.push_back(key);
  *was_auto = false;
  if (!obj_) return nullptr;
  auto it = obj_->find(key);
  if (it == obj_->end() || it->is_null()) return nullptr;
  if (it->is_string() && it->get<std::string>() == "auto") {
    *was_auto = true;
    return nullptr;
  }
  return &*it;
}

void Block::note_auto(const std::string& key, bool was_auto, const json& def) {
  if (was_auto) ctx_.note("\"" + path_of(key) + "\": \"auto\" -> " + show(def) + " (default)");
}

bool Block::has(const std::string& key) {
  bool was_auto;
  bool r = lookup(key, &was_auto) != nullptr;
  known_.pop_back();  // has() only peeks; the read that follows marks the key
  return r;
}

bool Block::get_bool(const std::string& key, bool def) {
  bool was_auto;
  const json* v = lookup(key, &was_auto);
  bool r = def;
  if (v) {
    if (!v->is_boolean()) fail(key, "got " + show_typed(*v) + ", expected a boolean");
    r = v->get<bool>();
  } else {
    note_auto(key, was_auto, def);
  }
  out_[key] = r;
  return r;
}

int64_t Block::get_int(const std::string& key, int64_t def, int64_t min, int64_t max) {
  auto r = get_opt_int(key, min);
  int64_t value = r.value_or(def);
  if (r && *r > max) {
    fail(key, "got " + show(obj_->at(key)) + ", expected an integer in [" + std::to_string(min) +
                  ", " + std::to_string(max) + "]");
  }
  if (!r) {
    bool was_auto = obj_ && obj_->contains(key) && obj_->at(key) == "auto";
    note_auto(key, was_auto, def);
  }
  out_[key] = value;
  return value;
}

std::optional<int64_t> Block::get_opt_int(const std::string& key, int64_t min) {
  bool was_auto;
  const json* v = lookup(key, &was_auto);
  if (!v) {
    out_[key] = nullptr;
    return std::nullopt;
  }
  auto i = as_integer(*v);
  if (!i) {
    fail(key, "got " + (v->is_number() ? show(*v) : show_typed(*v)) + ", expected an integer");
  }
  if (*i < min) fail(key, "got " + show(*v) + ", expected an integer >= " + std::to_string(min));
  out_[key] = *i;
  return i;
}

int64_t Block::get_int_choice(const std::string& key, int64_t def,
                              const std::vector<int64_t>& allowed) {
  bool was_auto;
  const json* v = lookup(key, &was_auto);
  int64_t r = def;
  if (v) {
    auto i = as_integer(*v);
    if (!i || std::find(allowed.begin(), allowed.end(), *i) == allowed.end()) {
      std::string list;
      for (size_t k = 0; k < allowed.size(); ++k) list += (k ? ", " : "") + std::to_string(allowed[k]);
      fail(key, "got " + (v->is_number() ? show(*v) : show_typed(*v)) + ", expected one of " + list);
    }
    r = *i;
  } else {
    note_auto(key, was_auto, def);
  }
  out_[key] = r;
  return r;
}

std::optional<double> Block::get_opt_number(const std::string& key, double min) {
  bool was_auto;
  const json* v = lookup(key, &was_auto);
  if (!v) {
    out_[key] = nullptr;
    return std::nullopt;
  }
  if (!v->is_number()) fail(key, "got " + show_typed(*v) + ", expected a number");
  double d = v->get<double>();
  if (!(d >= min)) fail(key, "got " + show(*v) + ", expected a number >= " + format_double(min));
  out_[key] = d;
  return d;
}

double Block::get_number(const std::string& key, double def, double min, double max) {
  bool was_auto;
  const json* v = lookup(key, &was_auto);
  double r = def;
  if (v) {
    if (!v->is_number()) fail(key, "got " + show_typed(*v) + ", expected a number");
    r = v->get<double>();
    bool lo = std::isfinite(min), hi = std::isfinite(max);
    if (!std::isfinite(r) || r < min || r > max) {
      std::string want = lo && hi ? "a number in [" + format_double(min) + ", " + format_double(max) + "]"
                         : lo     ? "a number >= " + format_double(min)
                         : hi     ? "a number <= " + format_double(max)
                                  : "a finite number";
      fail(key, "got " + show(*v) + ", expected " + want);
    }
  } else {
    note_auto(key, was_auto, def);
  }
  out_[key] = r;
  return r;
}

std::optional<std::string> Block::get_opt_string(const std::string& key) {
  bool was_auto;
  const json* v = lookup(key, &was_auto);
  if (!v) {
    out_[key] = nullptr;
    return std::nullopt;
  }
  if (!v->is_string()) fail(key, "got " + show_typed(*v) + ", expected a string");
  out_[key] = *v;
  return v->get<std::string>();
}

std::string Block::get_string(const std::string& key, const std::string& def) {
  bool was_auto = obj_ && obj_->contains(key) && obj_->at(key) == "auto";
  auto r = get_opt_string(key);
  if (!r) {
    // A key whose default is literally "auto" (pipeline.stages) keeps it without a note.
    if (def != "auto") note_auto(key, was_auto, def);
    out_[key] = def;
    return def;
  }
  return *r;
}

std::string Block::get_enum(const std::string& key, const std::string& def,
                            const std::vector<std::string>& allowed) {
  bool was_auto;
  const json* v = lookup(key, &was_auto);
  std::string r = def;
  if (v) {
    if (!v->is_string()) {
      fail(key, "got " + show_typed(*v) + ", expected one of " + quoted_list(allowed));
    }
    auto it = std::find_if(allowed.begin(), allowed.end(),
                           [&](const std::string& a) { return lower(a) == lower(v->get<std::string>()); });
    if (it == allowed.end()) fail(key, "got " + show(*v) + ", expected one of " + quoted_list(allowed));
    r = *it;
  } else {
    note_auto(key, was_auto, def);
  }
  out_[key] = r;
  return r;
}

Block Block::child(const std::string& key) {
  bool was_auto;
  const json* v = lookup(key, &was_auto);
  if (!out_.contains(key) || !out_[key].is_object()) out_[key] = json::object();
  return Block(v, path_of(key), ctx_, out_[key]);
}

const json* Block::raw(const std::string& key) {
  bool was_auto;
  return lookup(key, &was_auto);
}

void Block::reject_unless_default(const std::string& key, const json& def, const std::string& feature) {
  bool was_auto;
  const json* v = lookup(key, &was_auto);
  if (v && *v != def) {
    fail(key, "got " + show(*v) + ", expected " + show(def) + " (" + feature + ": not supported by zeroshard)");
  }
  out_[key] = def;
}

void Block::finish() {
  if (!obj_) return;
  for (auto it = obj_->begin(); it != obj_->end(); ++it) {
    if (std::find(known_.begin(), known_.end(), it.key()) != known_.end()) continue;
    std::string msg = "unknown key \"" + it.key() + "\"; ";
    std::string near = closest(it.key(), known_);
    if (!near.empty()) {
      msg += "did you mean \"" + near + "\"?";
    } else {
      std::vector<std::string> sorted(known_);
      std::sort(sorted.begin(), sorted.end());
      sorted.erase(std::unique(sorted.begin(), sorted.end()), sorted.end());
      msg += "expected one of " + quoted_list(sorted);
    }
    ctx_.fail(path_, msg);
  }
}

}  // namespace zeroshard::config
