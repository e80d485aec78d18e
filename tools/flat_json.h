// A reader for flat JSON objects, one per line: the format of distgrad's trace files (docs/tracing.md) and
// of the JSON lines the benchmarks and examples print. Values are strings, integers, other numbers, bools
// or null; a nested object or array is refused (the writers never produce one, so a line with one is not
// a line this reader is meant for). Integers keep all 64 bits (nanosecond times, flow ids), which a double
// would round. Header-only so that tools, benchmarks and tests share it without a library.
// Thread-safety: pure functions on values.
#pragma once

#include <cctype>
#include <charconv>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <variant>

namespace distgrad::tools {

using FlatValue = std::variant<std::monostate, bool, int64_t, double, std::string>;

// One parsed line: its keys in sorted order with typed accessors (nullopt when the key is missing or has
// another type).
class FlatObject {
 public:
  std::map<std::string, FlatValue, std::less<>> values;

  bool has(std::string_view key) const { return values.find(key) != values.end(); }
  std::optional<std::string> string(std::string_view key) const {
    auto it = values.find(key);
    if (it == values.end()) return std::nullopt;
    if (const auto* s = std::get_if<std::string>(&it->second)) return *s;
    return std::nullopt;
  }
  std::optional<int64_t> integer(std::string_view key) const {
    auto it = values.find(key);
    if (it == values.end()) return std::nullopt;
    if (const auto* i = std::get_if<int64_t>(&it->second)) return *i;
    return std::nullopt;
  }
  // Any number (an integer converts).
  std::optional<double> number(std::string_view key) const {
    auto it = values.find(key);
    if (it == values.end()) return std::nullopt;
    if (const auto* d = std::get_if<double>(&it->second)) return *d;
    if (const auto* i = std::get_if<int64_t>(&it->second)) return static_cast<double>(*i);
    return std::nullopt;
  }
  std::optional<bool> boolean(std::string_view key) const {
    auto it = values.find(key);
    if (it == values.end()) return std::nullopt;
    if (const auto* b = std::get_if<bool>(&it->second)) return *b;
    return std::nullopt;
  }
};

namespace detail {

inline void appendUtf8(std::string& out, uint32_t code) {
  if (code < 0x80) {
    out += static_cast<char>(code);
  } else if (code < 0x800) {
    out += static_cast<char>(0xc0 | (code >> 6));
    out += static_cast<char>(0x80 | (code & 0x3f));
  } else if (code < 0x10000) {
    out += static_cast<char>(0xe0 | (code >> 12));
    out += static_cast<char>(0x80 | ((code >> 6) & 0x3f));
    out += static_cast<char>(0x80 | (code & 0x3f));
  } else {
    out += static_cast<char>(0xf0 | (code >> 18));
    out += static_cast<char>(0x80 | ((code >> 12) & 0x3f));
    out += static_cast<char>(0x80 | ((code >> 6) & 0x3f));
    out += static_cast<char>(0x80 | (code & 0x3f));
  }
}

class FlatParser {
 public:
  explicit FlatParser(std::string_view text) : text_(text) {}

  std::optional<FlatObject> parse(std::string* error) {
    FlatObject object;
    skipSpace();
    if (!consume('{')) return fail(error, "expected '{'");
    skipSpace();
    if (!consume('}')) {
      while (true) {
        skipSpace();
        auto key = parseString();
        if (!key) return fail(error, "expected a string key");
        skipSpace();
        if (!consume(':')) return fail(error, "expected ':' after key \"" + *key + "\"");
        skipSpace();
        auto value = parseValue();
        if (!value) return fail(error, "bad value for key \"" + *key + "\"");
        if (!object.values.emplace(*key, std::move(*value)).second) {
          return fail(error, "duplicate key \"" + *key + "\"");
        }
        skipSpace();
        if (consume(',')) continue;
        if (consume('}')) break;
        return fail(error, "expected ',' or '}'");
      }
    }
    skipSpace();
    if (pos_ != text_.size()) return fail(error, "trailing characters after the object");
    return object;
  }

 private:
  std::optional<FlatObject> fail(std::string* error, const std::string& what) {
    if (error != nullptr) *error = what + " at offset " + std::to_string(pos_);
    return std::nullopt;
  }
  void skipSpace() {
    while (pos_ < text_.size() && std::isspace(static_cast<unsigned char>(text_[pos_]))) ++pos_;
  }
  bool consume(char c) {
    if (pos_ < text_.size() && text_[pos_] == c) {
      ++pos_;
      return true;
    }
    return false;
  }
  std::optional<uint32_t> hex4() {
    if (pos_ + 4 > text_.size()) return std::nullopt;
    uint32_t code = 0;
    auto [end, ec] = std::from_chars(text_.data() + pos_, text_.data() + pos_ + 4, code, 16);
    if (ec != std::errc() || end != text_.data() + pos_ + 4) return std::nullopt;
    pos_ += 4;
    return code;
  }
  std::optional<std::string> parseString() {
    if (!consume('"')) return std::nullopt;
    std::string out;
    while (pos_ < text_.size()) {
      const char c = text_[pos_++];
      if (c == '"') return out;
      if (static_cast<unsigned char>(c) < 0x20) return std::nullopt;  // raw control characters are invalid
      if (c != '\\') {
        out += c;
        continue;
      }
      if (pos_ >= text_.size()) return std::nullopt;
      const char e = text_[pos_++];
      switch (e) {
        case '"':
        case '\\':
        case '/': out += e; break;
        case 'b': out += '\b'; break;
        case 'f': out += '\f'; break;
        case 'n': out += '\n'; break;
        case 'r': out += '\r'; break;
        case 't': out += '\t'; break;
        case 'u': {
          auto code = hex4();
          if (!code) return std::nullopt;
          if (*code >= 0xd800 && *code < 0xdc00) {  // a surrogate pair
            if (!consume('\\') || !consume('u')) return std::nullopt;
            auto low = hex4();
            if (!low || *low < 0xdc00 || *low >= 0xe000) return std::nullopt;
            *code = 0x10000 + ((*code - 0xd800) << 10) + (*low - 0xdc00);
          }
          appendUtf8(out, *code);
          break;
        }
        default: return std::nullopt;
      }
    }
    return std::nullopt;
  }
  std::optional<FlatValue> parseValue() {
    if (pos_ >= text_.size()) return std::nullopt;
    const char c = text_[pos_];
    if (c == '"') {
      auto s = parseString();
      if (!s) return std::nullopt;
      return FlatValue(std::move(*s));
    }
    if (text_.substr(pos_, 4) == "true") {
      pos_ += 4;
      return FlatValue(true);
    }
    if (text_.substr(pos_, 5) == "false") {
      pos_ += 5;
      return FlatValue(false);
    }
    if (text_.substr(pos_, 4) == "null") {
      pos_ += 4;
      return FlatValue(std::monostate{});
    }
    // A number: JSON's grammar, read as int64 when it has no fraction or exponent (and fits).
    const size_t start = pos_;
    if (consume('-')) {
    }
    if (pos_ >= text_.size() || !std::isdigit(static_cast<unsigned char>(text_[pos_]))) return std::nullopt;
    if (text_[pos_] == '0' && pos_ + 1 < text_.size() && std::isdigit(static_cast<unsigned char>(text_[pos_ + 1]))) {
      return std::nullopt;  // leading zeros are not JSON
    }
    bool integral = true;
    while (pos_ < text_.size() && std::isdigit(static_cast<unsigned char>(text_[pos_]))) ++pos_;
    if (consume('.')) {
      integral = false;
      if (pos_ >= text_.size() || !std::isdigit(static_cast<unsigned char>(text_[pos_]))) return std::nullopt;
      while (pos_ < text_.size() && std::isdigit(static_cast<unsigned char>(text_[pos_]))) ++pos_;
    }
    if (pos_ < text_.size() && (text_[pos_] == 'e' || text_[pos_] == 'E')) {
      integral = false;
      ++pos_;
      if (pos_ < text_.size() && (text_[pos_] == '+' || text_[pos_] == '-')) ++pos_;
      if (pos_ >= text_.size() || !std::isdigit(static_cast<unsigned char>(text_[pos_]))) return std::nullopt;
      while (pos_ < text_.size() && std::isdigit(static_cast<unsigned char>(text_[pos_]))) ++pos_;
    }
    const char* first = text_.data() + start;
    const char* last = text_.data() + pos_;
    if (integral) {
      int64_t i = 0;
      auto [end, ec] = std::from_chars(first, last, i);
      if (ec == std::errc() && end == last) return FlatValue(i);
    }
    double d = 0;
    auto [end, ec] = std::from_chars(first, last, d);
    if (ec != std::errc() || end != last) return std::nullopt;
    return FlatValue(d);
  }

  std::string_view text_;
  size_t pos_ = 0;
};

}  // namespace detail

// Parses one flat JSON object (surrounding whitespace allowed, nothing else). On failure returns nullopt
// and, when `error` is given, says what and where.
inline std::optional<FlatObject> parseFlatJson(std::string_view text, std::string* error = nullptr) {
  return detail::FlatParser(text).parse(error);
}

}  // namespace distgrad::tools
