// Which tokens each rank holds: contiguous and zig-zag shards.
#include <algorithm>
#include <string>

#include "flashattn/dist.hpp"
#include "flashattn/error.hpp"

namespace flashattn::dist {
namespace {

// Chunk c of `chunks` near-equal chunks of [0, seqlen): the first seqlen % chunks chunks
// hold one token more.
TokenRange chunk(std::int64_t seqlen, std::int64_t chunks, std::int64_t c) {
  const std::int64_t base = seqlen / chunks, extra = seqlen % chunks;
  const std::int64_t begin = c * base + std::min(c, extra);
  return {begin, begin + base + (c < extra ? 1 : 0)};
}

}  // namespace

std::vector<TokenRange> shard_ranges(std::int64_t seqlen, int ranks, int rank, ShardLayout layout) {
  if (seqlen < 0) throw Error("seqlen: must be >= 0, got " + std::to_string(seqlen));
  if (ranks < 1) throw Error("ranks: must be >= 1, got " + std::to_string(ranks));
  if (rank < 0 || rank >= ranks)
    throw Error("rank: " + std::to_string(rank) + " is not in [0, " + std::to_string(ranks) + ")");
  if (layout == ShardLayout::contiguous) return {chunk(seqlen, ranks, rank)};
  const std::int64_t chunks = 2 * static_cast<std::int64_t>(ranks);
  return {chunk(seqlen, chunks, rank), chunk(seqlen, chunks, chunks - 1 - rank)};
}

std::int64_t shard_length(std::int64_t seqlen, int ranks, int rank, ShardLayout layout) {
  std::int64_t length = 0;
  for (const TokenRange& r : shard_ranges(seqlen, ranks, rank, layout)) length += r.size();
  return length;
}

}  // namespace flashattn::dist
