// The bench's peaks (tools/cli/peaks.hpp): confirm_peaks measures a peak again when a case
// ran faster than it, and keeps each peak's best measurement.
#include <gtest/gtest.h>

#include "tools/cli/peaks.hpp"

namespace flashattn::cli {
namespace {

TEST(Peaks, ConfirmMeasuresAgainAPeakBelowACase) {
  Peaks first = measure_peaks(1, 1);
  if (!first.fma.gflops) GTEST_SKIP() << "no FMA peak on this target: " << first.fma.reason;
  // A peak of 1 GFLOP/s under a case at 2 (as a core held back by the host would leave it):
  // measured again, the machine's loop gives far more.
  Peaks low = first;
  low.fma.gflops = 1.0;
  confirm_peaks(low, {{"tiled", 2.0}}, 1, 1);
  ASSERT_TRUE(low.fma.gflops.has_value());
  EXPECT_GT(*low.fma.gflops, 2.0);
  // A peak above every measurement stays: each peak keeps its best.
  Peaks high = first;
  high.fma.gflops = 1e12;
  confirm_peaks(high, {{"tiled", 2.0}}, 1, 1);
  EXPECT_EQ(*high.fma.gflops, 1e12);
  // A case no loop can reach (10^15 GFLOP/s) ends the retries (at most four measurements) and
  // stays above its peak, for the report to show.
  Peaks unreachable = first;
  confirm_peaks(unreachable, {{"tiled", 1e15}}, 1, 1);
  EXPECT_LT(*unreachable.fma.gflops, 1e15);
  EXPECT_GE(*unreachable.fma.gflops, *first.fma.gflops);
  // A peak the CPU cannot run is not measured by confirming it either.
  if (!first.bf16_dot.gflops) {
    Peaks none = first;
    confirm_peaks(none, {{"tiled_bf16", 5.0}}, 1, 1);
    EXPECT_FALSE(none.bf16_dot.gflops.has_value()) << none.bf16_dot.reason;
  }
}

}  // namespace
}  // namespace flashattn::cli
