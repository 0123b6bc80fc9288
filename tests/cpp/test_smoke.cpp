#include <gtest/gtest.h>
#include "gradcomp/gradcomp.hpp"
TEST(Smoke, Create) { auto c = gradcomp::Codec::create("topk:ratio=0.01"); EXPECT_EQ(c->spec(), "topk:ratio=0.01"); }
