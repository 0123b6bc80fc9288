// SPDX-License-Identifier: Apache-2.0
// Adaptive CPU threads (core/runtime.cpp): a team whose threads start a parallel region more than
// 1 ms apart puts the next calls on one thread (every 16th call probes the full count), a team that
// starts together clears it, and set_adaptive_threads(false) turns it off. The workspace is sized
// for the configured count whatever the state, so a workspace allocated before the state changes
// still fits. (The speed under a busy core is measured by bench/busy_core.py, not here.)
#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <thread>
#include <vector>

#include "core/family.hpp"
#include "cpu/parallel.hpp"
#include "gradcomp/gradcomp.hpp"
#include "ref.hpp"

namespace d = gradcomp::detail;

TEST(AdaptiveThreads, ContendedTeamsFallBackToOneThreadAndProbe) {
  ref::Threads threads(2);
  gradcomp::set_adaptive_threads(true);
  const int64_t n = int64_t(1) << 20;
  d::note_team_skew(2, 0);
  EXPECT_EQ(gradcomp::cpu_threads_state(), "idle");
  EXPECT_EQ(d::cpu_threads_for(n), 2);
  d::note_team_skew(2, 5'000'000);  // a thread started 5 ms late: once is noise
  EXPECT_EQ(gradcomp::cpu_threads_state(), "idle");
  d::note_team_skew(2, 5'000'000);  // twice in a row: a busy core
  EXPECT_EQ(gradcomp::cpu_threads_state(), "contended");
  int ones = 0, twos = 0;
  for (int i = 0; i < 64; ++i) (d::cpu_threads_for(n) == 1 ? ones : twos)++;
  EXPECT_EQ(twos, 64 / 16) << "every 16th call probes the full team";
  EXPECT_EQ(ones, 64 - 64 / 16);
  EXPECT_EQ(d::cpu_threads_max(n), 2) << "workspaces stay sized for the configured count";
  EXPECT_EQ(d::cpu_threads_for(1000), 1);
  d::note_team_skew(2, 500'000);  // in between: no change
  EXPECT_EQ(gradcomp::cpu_threads_state(), "contended");
  d::note_team_skew(2, 10'000);  // a probe whose threads started together clears it
  EXPECT_EQ(gradcomp::cpu_threads_state(), "idle");
  EXPECT_EQ(d::cpu_threads_for(n), 2);
  d::note_team_skew(1, 50'000'000);  // a one-thread team says nothing
  EXPECT_EQ(gradcomp::cpu_threads_state(), "idle");
  gradcomp::set_adaptive_threads(false);
  d::note_team_skew(2, 5'000'000);
  d::note_team_skew(2, 5'000'000);
  EXPECT_EQ(gradcomp::cpu_threads_state(), "idle");
  EXPECT_EQ(d::cpu_threads_for(n), 2);
  gradcomp::set_adaptive_threads(true);
}

TEST(AdaptiveThreads, WorkspaceFromAnIdleStateFitsAContendedCallAndBack) {
  ref::Threads threads(3);
  gradcomp::set_adaptive_threads(true);
  auto c = gradcomp::Codec::create("topk:ratio=0.01");
  const int64_t n = (int64_t(1) << 18) + 5;
  std::mt19937_64 g(ref::test_seed());
  const ref::Input x = ref::Input::from_floats(gradcomp::DType::float32, ref::make_values(ref::Dist::normal, n, g));
  d::note_team_skew(3, 0);
  const int64_t wb_idle = c->workspace_bytes(n, gradcomp::DType::float32, {});
  d::note_team_skew(3, 9'000'000);
  d::note_team_skew(3, 9'000'000);
  EXPECT_EQ(gradcomp::cpu_threads_state(), "contended");
  EXPECT_EQ(c->workspace_bytes(n, gradcomp::DType::float32, {}), wb_idle);
  const auto contended = ref::encode(*c, x, nullptr);  // runs on one thread
  d::note_team_skew(3, 0);
  const auto idle = ref::encode(*c, x, nullptr);
  EXPECT_EQ(std::memcmp(contended.packet.data(), idle.packet.data(), size_t(idle.packet_bytes)), 0);
}

TEST(AdaptiveThreads, TeamClockMeasuresTheStartSpread) {
  d::cpu::TeamClock clock;
  clock.arrive();
  std::this_thread::sleep_for(std::chrono::milliseconds(3));
  clock.arrive();
  gradcomp::set_adaptive_threads(true);
  d::note_team_skew(2, 0);
  clock.report(2);
  clock.report(2);
  EXPECT_EQ(gradcomp::cpu_threads_state(), "contended");
  d::note_team_skew(2, 0);
}
