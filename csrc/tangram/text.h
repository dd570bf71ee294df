// Text: the core's messages (explain(), validation errors) built without iostreams.
//
// Numbers are written by std::to_chars, as an ostream would by default (six significant
// digits, printf's %g) but independent of any locale: an ostringstream follows the global
// C++ locale (a program that sets one gets "0,5"), and a Python module built by a compiler
// that links libstdc++ statically crashed in the locale's facets beside numpy's shared
// libstdc++ (docs/development.md, "C++").
#pragma once

#include <charconv>
#include <string>
#include <string_view>
#include <type_traits>

namespace tangram {

class Text {
 public:
  Text& operator<<(std::string_view s) {
    out_.append(s);
    return *this;
  }
  Text& operator<<(char c) {
    out_.push_back(c);
    return *this;
  }
  template <typename T, std::enable_if_t<std::is_arithmetic_v<T> && !std::is_same_v<T, bool> &&
                                             !std::is_same_v<T, char>, int> = 0>
  Text& operator<<(T value) {
    char buf[64];
    std::to_chars_result r;
    if constexpr (std::is_floating_point_v<T>)
      r = std::to_chars(buf, buf + sizeof buf, static_cast<double>(value), std::chars_format::general, 6);
    else
      r = std::to_chars(buf, buf + sizeof buf, value);
    out_.append(buf, r.ptr);
    return *this;
  }
  const std::string& str() const { return out_; }

 private:
  std::string out_;
};

}  // namespace tangram
