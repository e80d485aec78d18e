// A small strict JSON reader for tests that read nested documents back (distgrad-trace merge writes one
// Chrome trace document; tools/flat_json.h reads only flat objects). Numbers are doubles. Throws
// std::runtime_error with the offset on anything that is not JSON.
// Thread-safety: pure functions on values.
#pragma once

#include <cctype>
#include <charconv>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <string_view>
#include <tuple>
#include <vector>

namespace distgrad::tools::testing {

struct JsonValue {
  enum class Type { kNull, kBool, kNumber, kString, kArray, kObject };
  Type type = Type::kNull;
  bool boolean = false;
  double number = 0;
  std::string string;
  std::vector<JsonValue> array;
  std::map<std::string, JsonValue> object;

  bool has(const std::string& key) const { return type == Type::kObject && object.count(key) > 0; }
  const JsonValue& operator[](const std::string& key) const {
    auto it = object.find(key);
    if (type != Type::kObject || it == object.end()) throw std::runtime_error("no key \"" + key + "\"");
    return it->second;
  }
  const std::string& str(const std::string& key) const { return (*this)[key].string; }
  double num(const std::string& key) const { return (*this)[key].number; }
};

class JsonReader {
 public:
  explicit JsonReader(std::string_view text) : text_(text) {}
  JsonValue document() {
    JsonValue v = value();
    space();
    if (pos_ != text_.size()) fail("trailing characters");
    return v;
  }

 private:
  [[noreturn]] void fail(const std::string& what) {
    throw std::runtime_error("JSON: " + what + " at offset " + std::to_string(pos_));
  }
  void space() {
    while (pos_ < text_.size() && std::isspace(static_cast<unsigned char>(text_[pos_]))) ++pos_;
  }
  bool eat(char c) {
    space();
    if (pos_ < text_.size() && text_[pos_] == c) {
      ++pos_;
      return true;
    }
    return false;
  }
  std::string stringBody() {
    if (!eat('"')) fail("expected a string");
    std::string out;
    while (pos_ < text_.size()) {
      char c = text_[pos_++];
      if (c == '"') return out;
      if (static_cast<unsigned char>(c) < 0x20) fail("control character in a string");
      if (c != '\\') {
        out += c;
        continue;
      }
      if (pos_ >= text_.size()) break;
      char e = text_[pos_++];
      switch (e) {
        case '"':
        case '\\':
        case '/': out += e; break;
        case 'n': out += '\n'; break;
        case 't': out += '\t'; break;
        case 'r': out += '\r'; break;
        case 'b': out += '\b'; break;
        case 'f': out += '\f'; break;
        case 'u': {
          if (pos_ + 4 > text_.size()) fail("short \\u escape");
          unsigned code = 0;
          auto [p, ec] = std::from_chars(text_.data() + pos_, text_.data() + pos_ + 4, code, 16);
          if (ec != std::errc() || p != text_.data() + pos_ + 4) fail("bad \\u escape");
          pos_ += 4;
          if (code < 0x80)
            out += static_cast<char>(code);
          else
            out += '?';  // tests never compare non-ASCII escapes
          break;
        }
        default: fail("bad escape");
      }
    }
    fail("unterminated string");
  }
  JsonValue value() {
    space();
    if (pos_ >= text_.size()) fail("unexpected end");
    JsonValue v;
    const char c = text_[pos_];
    if (c == '{') {
      ++pos_;
      v.type = JsonValue::Type::kObject;
      if (eat('}')) return v;
      do {
        space();
        std::string key = stringBody();
        if (!eat(':')) fail("expected ':'");
        if (!v.object.emplace(key, value()).second) fail("duplicate key \"" + key + "\"");
      } while (eat(','));
      if (!eat('}')) fail("expected '}'");
      return v;
    }
    if (c == '[') {
      ++pos_;
      v.type = JsonValue::Type::kArray;
      if (eat(']')) return v;
      do {
        v.array.push_back(value());
      } while (eat(','));
      if (!eat(']')) fail("expected ']'");
      return v;
    }
    if (c == '"') {
      v.type = JsonValue::Type::kString;
      v.string = stringBody();
      return v;
    }
    for (auto [word, type, b] :
         {std::tuple{"true", JsonValue::Type::kBool, true}, std::tuple{"false", JsonValue::Type::kBool, false},
          std::tuple{"null", JsonValue::Type::kNull, false}}) {
      const std::string_view w(word);
      if (text_.substr(pos_, w.size()) == w) {
        pos_ += w.size();
        v.type = type;
        v.boolean = b;
        return v;
      }
    }
    const size_t start = pos_;
    if (text_[pos_] == '-') ++pos_;
    while (pos_ < text_.size() &&
           (std::isdigit(static_cast<unsigned char>(text_[pos_])) || text_[pos_] == '.' || text_[pos_] == 'e' ||
            text_[pos_] == 'E' || text_[pos_] == '+' || text_[pos_] == '-')) {
      ++pos_;
    }
    if (pos_ == start) fail("unexpected character");
    auto [p, ec] = std::from_chars(text_.data() + start, text_.data() + pos_, v.number);
    if (ec != std::errc() || p != text_.data() + pos_) fail("bad number");
    v.type = JsonValue::Type::kNumber;
    return v;
  }

  std::string_view text_;
  size_t pos_ = 0;
};

inline JsonValue parseJson(std::string_view text) { return JsonReader(text).document(); }

}  // namespace distgrad::tools::testing
