// parse_config: JSON text (comments allowed, duplicate keys rejected) -> typed Config.
#include <string>
#include <vector>

#include "runtime/config/blocks.h"
#include "runtime/error.h"

namespace zeroshard {

namespace {

using config::json;

// nlohmann reports a byte offset; people fix files by line and column.
std::pair<size_t, size_t> line_column(const std::string& text, size_t byte) {
  size_t line = 1, col = 1;
  for (size_t i = 0; i + 1 < byte && i < text.size(); ++i) {
    if (text[i] == '\n') {
      ++line;
      col = 1;
    } else {
      ++col;
    }
  }
  return {line, col};
}

// nlohmann's what() is "[json.exception.parse_error.101] parse error at line 1, column 5: <why>";
// keep only <why> since the location is printed the way compilers do.
std::string parse_error_reason(const std::string& what) {
  size_t at = what.find("parse error");
  size_t colon = at == std::string::npos ? std::string::npos : what.find(": ", at);
  return colon == std::string::npos ? what : what.substr(colon + 2);
}

json parse_json(const std::string& text, const std::string& source) {
  // DeepSpeed rejects duplicate keys (hjson object_pairs_hook); nlohmann keeps the last silently,
  // so track the keys of every open object through the parser callback.
  struct Frame {
    std::string path;
    std::vector<std::string> keys;
  };
  std::vector<Frame> frames;
  std::string last_key;
  std::vector<bool> container_is_array;
  auto callback = [&](int /*depth*/, json::parse_event_t event, json& parsed) {
    switch (event) {
      case json::parse_event_t::object_start: {
        std::string path;
        if (!frames.empty()) {
          bool parent_array = !container_is_array.empty() && container_is_array.back();
          path = config::join_path(frames.back().path, parent_array ? "[]" : last_key);
        }
        frames.push_back({path, {}});
        container_is_array.push_back(false);
        break;
      }
      case json::parse_event_t::key: {
        Frame& f = frames.back();
        last_key = parsed.get<std::string>();
        for (const auto& k : f.keys) {
          if (k == last_key) {
            throw ConfigError(config::source_prefix(source) + (f.path.empty() ? "" : f.path + ": ") +
                              "duplicate key \"" + last_key + "\"");
          }
        }
        f.keys.push_back(last_key);
        break;
      }
      case json::parse_event_t::object_end:
        frames.pop_back();
        container_is_array.pop_back();
        break;
      case json::parse_event_t::array_start:
        container_is_array.push_back(true);
        break;
      case json::parse_event_t::array_end:
        container_is_array.pop_back();
        break;
      case json::parse_event_t::value:
        break;
    }
    return true;
  };
  try {
    return json::parse(text, callback, /*allow_exceptions=*/true, /*ignore_comments=*/true);
  } catch (const json::parse_error& e) {
    auto [line, col] = line_column(text, e.byte);
    throw ConfigError(source + ":" + std::to_string(line) + ":" + std::to_string(col) +
                      ": invalid JSON: " + parse_error_reason(e.what()));
  }
}

}  // namespace

Config parse_config(const std::string& json_text, const std::string& source) {
  json root = parse_json(json_text, source);
  Config c;
  c.source = source;
  config::Context ctx(source, &c.notes);
  config::Block top(&root, "", ctx, c.resolved);
  // Order matters only for which error a config with several problems reports first: the
  // batch and optimizer keys come first because they are what people most often get wrong.
  config::read_batch(top, c);
  config::read_optimizer(top, c);
  config::read_scheduler(top, c);
  config::read_precision(top, c);
  config::read_training_scalars(top, c);
  config::read_zero(top, c);
  config::read_aio(top, c);
  config::read_features(top, c);
  config::read_unsupported(top, c);
  // Unlike DeepSpeed (which ignores unknown top-level keys), a typo here is an error: a silently
  // ignored "gradient_clipp1ng" trains without clipping (DeepSpeed issue #653).
  top.finish();
  return c;
}

}  // namespace zeroshard
