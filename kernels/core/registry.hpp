// SPDX-License-Identifier: Apache-2.0
// The codec registry: an explicit table (gradcomp_core is a static library, so self-registering
// objects would be dropped by the linker). Codec::create, the "accepted codecs" message and
// list_codecs() read it. Adding a codec family = its own files + one line in registry.cpp.
#pragma once

#include <memory>
#include <string_view>
#include <vector>

#include "gradcomp/codec.hpp"
#include "spec.hpp"

namespace gradcomp::detail {

//! Builds a codec from a parsed spec whose keys the registry has already checked.
using FactoryFn = std::unique_ptr<Codec>(const ParsedSpec&);

struct RegistryEntry {
  std::string_view name;                 //!< the spec's name part
  CodecId id;                            //!< header bytes 6-7 of its packets
  std::vector<std::string_view> keys;    //!< accepted keys
  FactoryFn* make;                       //!< the family's factory
  std::vector<std::string_view> examples; //!< example specs (the contract suite runs each)
  std::string_view summary;              //!< one line: what it does, and its source
};

//! The table, in a fixed order.
const std::vector<RegistryEntry>& registry();

} // namespace gradcomp::detail
