// SPDX-License-Identifier: Apache-2.0
// Codec spec parsing: "name[:key=value,...]" (docs/contracts.md section 3).
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <vector>

namespace gradcomp::detail {

//! The spec key every codec accepts: integrity=none|crc32c (kernels/core/integrity.hpp).
inline constexpr std::string_view kIntegrityKey = "integrity";

struct ParsedSpec {
  std::string name;
  std::map<std::string, std::string, std::less<>> options;
  std::string text; //!< the spec as given, for messages: display() form (escaped, at most ~120 chars)
};

//! `s` as it may appear in a message: bytes outside printable ASCII as \xNN (so a NUL cannot cut
//! the message), and no more than `limit` characters (then "...(N bytes)").
std::string display(std::string_view s, size_t limit = 120);

//! Split a spec into name and key=value pairs. Throws InvalidArgument on empty names/keys/values,
//! a missing '=', or a repeated key.
ParsedSpec parse_spec(std::string_view spec);

//! Throw InvalidArgument for a key of `s` not in `allowed`, listing the accepted keys.
void check_keys(const ParsedSpec& s, const std::vector<std::string_view>& allowed);

//! Parse a binary64 / int64 option value (decimal, one leading '+' allowed); InvalidArgument naming
//! key and value on failure -- what is wrong (not a number, not an integer, out of the range of
//! binary64 / int64) -- and listing `accepted` (e.g. "0 < ratio <= 1") when given.
double parse_double(const ParsedSpec& s, std::string_view key, std::string_view value,
                    std::string_view accepted = {});
int64_t parse_int(const ParsedSpec& s, std::string_view key, std::string_view value, std::string_view accepted = {});

//! Shortest decimal string that parses back to exactly `v` (std::to_chars).
std::string format_double(double v);

//! The one builder of canonical specs (Codec::spec(), whose FNV-1a hash every packet header
//! carries, so its bytes must never change): the codec name, then one key=value per add(), in the
//! order of the calls, as "name:k1=v1,k2=v2" (just "name" without any). Each family adds its
//! non-default keys in its fixed order (topk its ratio= or k= first, always); integers print in
//! decimal, binary64 values in their shortest round-trip form (format_double), so that
//! create(spec()) yields an equal codec.
class CanonicalSpec {
 public:
  explicit CanonicalSpec(std::string_view name) : text_(name) {}
  CanonicalSpec& add(std::string_view key, std::string_view value);
  CanonicalSpec& add(std::string_view key, int64_t value);
  CanonicalSpec& add(std::string_view key, double value);
  const std::string& str() const noexcept { return text_; }

 private:
  std::string text_;
  bool any_ = false;
};

//! The `ratio=r` / `k=K` choice of the sparsifiers (topk, randomk): exactly one of ratio in (0, 1]
//! or k >= 0. InvalidArgument otherwise, naming the codec, the value and what is accepted.
struct SparseCount {
  bool has_k = false;
  double ratio = 0;
  int64_t k = 0;
  static SparseCount parse(const ParsedSpec& s, std::string_view codec);
  //! k of n elements: min(n, max(1, ceil(ratio * n))) in binary64, or min(k=, n).
  int64_t of(int64_t n) const;
  //! Its key first: k= or ratio= (the canonical order of both families).
  void add_to(CanonicalSpec& c) const;
};

} // namespace gradcomp::detail
