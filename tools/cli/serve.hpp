// The serving bench case (`bench --ops serve`): one step of an inference server's batch —
// prefill chunks and decode rows of many sequences over their own pages of one bf16 pool —
// as one forward_varlen_paged call, against one call per sequence, and its decode rows
// alone (their K/V read rate beside the copy bandwidth); and one decode step of sequences
// that share a prefix's pages, with the prefix shared (cascade) against read by each; and a
// step of sequences that each add a few tokens (a speculative draft checked, a small prefill
// chunk), with pack_gqa's shared Q tiles against one head's rows a tile.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "flashattn/flashattn.hpp"

namespace flashattn::cli {

struct ServeCase {
  std::string name;
  std::int64_t prefill_rows = 512;             // new tokens of each prefill chunk
  std::vector<std::int64_t> prefill_cached;    // cached tokens under each chunk
  std::vector<std::int64_t> decode_keys;       // keys of each decode row (its cache and itself)
  // Shared prefix: shared_sequences decode rows over shared_prefix keys of one prefix (whole
  // pages) and shared_own keys each of their own.
  std::int64_t shared_sequences = 32, shared_prefix = 4096, shared_own = 256;
  // Small chunks: chunk_sequences sequences of chunk_rows new tokens over chunk_cached
  // cached ones each.
  std::int64_t chunk_sequences = 8, chunk_rows = 8, chunk_cached = 4096;
  std::int64_t heads = 32, heads_kv = 8, dim = 128, page_size = 16;
  DType dtype = DType::bf16;
  int threads = 0;

  // Issue 23's batch: 4 chunks of 512 over 0–8k cached tokens, 60 decode rows over 512–16k;
  // 32 sequences sharing a 4096-token prefix with 256 tokens each of their own.
  static ServeCase issue();
  // A small one of the same kinds, for the CLI smoke test.
  static ServeCase smoke();
};

struct ServeMeasurement {
  double seconds = 0.0;               // the batch in one call (median)
  double per_sequence_seconds = 0.0;  // one call per sequence, all of them (median)
  double decode_seconds = 0.0;        // the decode rows alone, in one call (median)
  double decode_gbps = 0.0;           // their K and V bytes per decode_seconds
  std::size_t pool_bytes = 0;         // K and V pools
  double shared_prefix_seconds = 0.0;    // the shared-prefix decode step, prefix shared (median)
  double unshared_prefix_seconds = 0.0;  // the same step, each sequence reading the prefix (median)
  double chunk_seconds = 0.0;            // the small-chunk step, pack_gqa on (median)
  double chunk_unpacked_seconds = 0.0;   // the same step, pack_gqa off (median)
  double chunk_gbps = 0.0;               // its K and V bytes per chunk_seconds
};
ServeMeasurement measure_serve(const ServeCase& c, int repeats);

}  // namespace flashattn::cli
