// SPDX-License-Identifier: Apache-2.0
//! @file gradcomp.hpp
//! Umbrella header of the gradcomp C++ API.
#pragma once
#include "gradcomp/codec.hpp"
#include "gradcomp/error.hpp"
#include "gradcomp/packet.hpp"
#include "gradcomp/types.hpp"
