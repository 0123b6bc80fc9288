// SPDX-License-Identifier: Apache-2.0
#include "spec.hpp"

#include <charconv>
#include <cmath>

#include "gradcomp/error.hpp"

namespace gradcomp::detail {

ParsedSpec parse_spec(std::string_view spec) {
  ParsedSpec out;
  out.text = std::string(spec);
  const size_t colon = spec.find(':');
  out.name = std::string(spec.substr(0, colon));
  GRADCOMP_CHECK(!out.name.empty(), InvalidArgument, "codec spec '", spec,
                 "': empty codec name; expected name[:key=value,...], e.g. 'topk:ratio=0.01'");
  if (colon == std::string_view::npos) return out;
  std::string_view rest = spec.substr(colon + 1);
  GRADCOMP_CHECK(!rest.empty(), InvalidArgument, "codec spec '", spec, "': nothing after ':'; expected name[:key=value,...], e.g. 'topk:ratio=0.01'");
  while (true) {
    const size_t comma = rest.find(',');
    const std::string_view item = rest.substr(0, comma);
    const size_t eq = item.find('=');
    GRADCOMP_CHECK(eq != std::string_view::npos && eq > 0 && eq + 1 < item.size(), InvalidArgument, "codec spec '",
                   spec, "': option '", item, "' is not key=value; expected name[:key=value,...], e.g. 'topk:ratio=0.01'");
    std::string key(item.substr(0, eq));
    GRADCOMP_CHECK(!out.options.count(key), InvalidArgument, "codec spec '", spec, "': key '", key,
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
    throw InvalidArgument(detail::concat("codec spec '", s.text, "': unknown key '", key, "' for codec '", s.name,
                                         "'; accepted keys: ", list.empty() ? "(none)" : list));
  }
}

double parse_double(const ParsedSpec& s, std::string_view key, std::string_view value, std::string_view accepted) {
  double v = 0;
  auto [ptr, ec] = std::from_chars(value.data(), value.data() + value.size(), v);
  GRADCOMP_CHECK(ec == std::errc() && ptr == value.data() + value.size() && std::isfinite(v), InvalidArgument,
                 "codec spec '", s.text, "': ", key, "='", value, "' is not a finite number",
                 accepted.empty() ? "" : "; accepted: ", accepted);
  return v;
}

int64_t parse_int(const ParsedSpec& s, std::string_view key, std::string_view value, std::string_view accepted) {
  int64_t v = 0;
  auto [ptr, ec] = std::from_chars(value.data(), value.data() + value.size(), v);
  GRADCOMP_CHECK(ec == std::errc() && ptr == value.data() + value.size(), InvalidArgument, "codec spec '", s.text,
                 "': ", key, "='", value, "' is not an integer",
                 accepted.empty() ? "" : "; accepted: ", accepted);
  return v;
}

std::string format_double(double v) {
  char buf[64];
  auto [ptr, ec] = std::to_chars(buf, buf + sizeof buf, v);
  return std::string(buf, ptr);
}

} // namespace gradcomp::detail
