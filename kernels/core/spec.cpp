// SPDX-License-Identifier: Apache-2.0
#include "spec.hpp"

#include <algorithm>
#include <charconv>
#include <cmath>

#include "gradcomp/error.hpp"

namespace gradcomp::detail {

std::string display(std::string_view s, size_t limit) {
  static const char* hex = "0123456789abcdef";
  std::string out;
  for (unsigned char c : s.substr(0, limit)) {
    if (c >= 0x20 && c < 0x7F && c != '\\') {
      out += char(c);
    } else {
      out += "\\x";
      out += hex[c >> 4];
      out += hex[c & 15];
    }
  }
  if (s.size() > limit) out += "...(" + std::to_string(s.size()) + " bytes)";
  return out;
}

ParsedSpec parse_spec(std::string_view spec) {
  ParsedSpec out;
  out.text = display(spec);
  const size_t colon = spec.find(':');
  out.name = std::string(spec.substr(0, colon));
  GRADCOMP_CHECK(!out.name.empty(), InvalidArgument, "codec spec '", out.text,
                 "': empty codec name; expected name[:key=value,...], e.g. 'topk:ratio=0.01'");
  if (colon == std::string_view::npos) return out;
  std::string_view rest = spec.substr(colon + 1);
  GRADCOMP_CHECK(!rest.empty(), InvalidArgument, "codec spec '", out.text, "': nothing after ':'; expected name[:key=value,...], e.g. 'topk:ratio=0.01'");
  while (true) {
    const size_t comma = rest.find(',');
    const std::string_view item = rest.substr(0, comma);
    const size_t eq = item.find('=');
    GRADCOMP_CHECK(eq != std::string_view::npos && eq > 0 && eq + 1 < item.size(), InvalidArgument, "codec spec '",
                   out.text, "': option '", display(item, 60),
                   "' is not key=value; expected name[:key=value,...], e.g. 'topk:ratio=0.01'");
    std::string key(item.substr(0, eq));
    GRADCOMP_CHECK(!out.options.count(key), InvalidArgument, "codec spec '", out.text, "': key '", display(key, 60),
                   "' given twice");
    out.options.emplace(std::move(key), std::string(item.substr(eq + 1)));
    if (comma == std::string_view::npos) break;
    rest = rest.substr(comma + 1);
  }
  return out;
}

void check_keys(const ParsedSpec& s, const std::vector<std::string_view>& allowed) {
  for (const auto& [key, value] : s.options) {
    bool ok = false;
    for (auto a : allowed) ok = ok || a == key;
    if (ok) continue;
    std::string list;
    for (auto a : allowed) list += (list.empty() ? "" : ", ") + std::string(a);
    throw InvalidArgument(detail::concat("codec spec '", s.text, "': unknown key '", display(key, 60), "' for codec '",
                                         display(s.name, 60), "'; accepted keys: ", list.empty() ? "(none)" : list));
  }
}

namespace {
//! One leading '+' is accepted (not kept in the canonical spec).
std::string_view strip_plus(std::string_view v) {
  return v.size() > 1 && v[0] == '+' && v[1] != '-' && v[1] != '+' ? v.substr(1) : v;
}
//! For a decimal that from_chars found out of range (it then leaves no value): a negative exponent
//! means it underflows, anything else that it overflows.
bool underflows(std::string_view v) {
  const size_t e = v.find_first_of("eE");
  return e != std::string_view::npos && e + 1 < v.size() && v[e + 1] == '-';
}
std::string tail(std::string_view accepted) {
  return accepted.empty() ? std::string() : "; accepted: " + std::string(accepted);
}
} // namespace

double parse_double(const ParsedSpec& s, std::string_view key, std::string_view value, std::string_view accepted) {
  const std::string_view v = strip_plus(value);
  double x = 0;
  auto [ptr, ec] = std::from_chars(v.data(), v.data() + v.size(), x);
  const bool whole = ptr == v.data() + v.size();
  GRADCOMP_CHECK(whole && ec != std::errc::invalid_argument, InvalidArgument, "codec spec '", s.text, "': ", key, "='",
                 display(value, 60), "' is not a number", tail(accepted));
  GRADCOMP_CHECK(ec != std::errc::result_out_of_range, InvalidArgument, "codec spec '", s.text, "': ", key, "='",
                 display(value, 60), "' is out of the range of binary64 (it ",
                 underflows(v) ? "underflows to 0" : "overflows to infinity", ")", tail(accepted));
  GRADCOMP_CHECK(std::isfinite(x), InvalidArgument, "codec spec '", s.text, "': ", key, "='", display(value, 60),
                 "' is not a finite number", tail(accepted));
  return x;
}

int64_t parse_int(const ParsedSpec& s, std::string_view key, std::string_view value, std::string_view accepted) {
  const std::string_view v = strip_plus(value);
  int64_t x = 0;
  auto [ptr, ec] = std::from_chars(v.data(), v.data() + v.size(), x);
  const bool whole = ptr == v.data() + v.size();
  GRADCOMP_CHECK(whole && ec != std::errc::invalid_argument, InvalidArgument, "codec spec '", s.text, "': ", key, "='",
                 display(value, 60), "' is not an integer", tail(accepted));
  GRADCOMP_CHECK(ec != std::errc::result_out_of_range, InvalidArgument, "codec spec '", s.text, "': ", key, "='",
                 display(value, 60), "' is out of range (it does not fit a 64-bit integer)", tail(accepted));
  return x;
}

std::string format_double(double v) {
  char buf[64];
  auto [ptr, ec] = std::to_chars(buf, buf + sizeof buf, v);
  return std::string(buf, ptr);
}

CanonicalSpec& CanonicalSpec::add(std::string_view key, std::string_view value) {
  text_ += any_ ? ',' : ':';
  text_ += key;
  text_ += '=';
  text_ += value;
  any_ = true;
  return *this;
}
CanonicalSpec& CanonicalSpec::add(std::string_view key, int64_t value) { return add(key, std::to_string(value)); }
CanonicalSpec& CanonicalSpec::add(std::string_view key, double value) { return add(key, format_double(value)); }

SparseCount SparseCount::parse(const ParsedSpec& s, std::string_view codec) {
  SparseCount c;
  const bool has_ratio = s.options.count("ratio") > 0;
  c.has_k = s.options.count("k") > 0;
  GRADCOMP_CHECK(has_ratio != c.has_k, InvalidArgument, "codec spec '", s.text, "': ", codec,
                 " needs exactly one of ratio= (in (0, 1]) or k= (an integer >= 0)");
  if (has_ratio) {
    const std::string& v = s.options.find("ratio")->second;
    c.ratio = parse_double(s, "ratio", v, "0 < ratio <= 1");
    GRADCOMP_CHECK(c.ratio > 0.0 && c.ratio <= 1.0, InvalidArgument, "codec spec '", s.text, "': ratio=",
                   display(v, 60), " is out of range; accepted: 0 < ratio <= 1");
  } else {
    const std::string& v = s.options.find("k")->second;
    c.k = parse_int(s, "k", v, "an integer >= 0");
    GRADCOMP_CHECK(c.k >= 0, InvalidArgument, "codec spec '", s.text, "': k=", display(v, 60),
                   " is out of range; accepted: an integer >= 0");
  }
  return c;
}

int64_t SparseCount::of(int64_t n) const {
  if (has_k) return std::min(k, n);
  const double kk = std::ceil(ratio * static_cast<double>(n));
  return std::min<int64_t>(n, std::max<int64_t>(1, static_cast<int64_t>(kk)));
}

void SparseCount::add_to(CanonicalSpec& c) const {
  if (has_k) c.add("k", k);
  else c.add("ratio", ratio);
}

} // namespace gradcomp::detail
