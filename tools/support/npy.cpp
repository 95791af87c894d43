#include "tools/support/npy.hpp"

#include <bit>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <string_view>
#include <vector>

namespace flashattn::support {
namespace {

// The .npy payload is little-endian; on such a host it can be copied without swapping.
static_assert(std::endian::native == std::endian::little,
              "npy.cpp assumes a little-endian host");

constexpr char kMagic[] = "\x93NUMPY";
constexpr std::size_t kMagicLen = 6;
constexpr std::size_t kAlign = 64;

// Header text as a message shows it: at most 160 characters, control and non-ASCII bytes as
// '?' (a binary header, or a NUL that would cut the message short).
std::string shown(std::string_view text) {
  constexpr std::size_t kShown = 160;
  std::string r(text.substr(0, kShown));
  for (char& c : r)
    if (static_cast<unsigned char>(c) < 0x20 || static_cast<unsigned char>(c) >= 0x7F) c = '?';
  if (text.size() > kShown) r += "...";
  return r;
}

[[noreturn]] void fail(const std::string& path, const std::string& what) {
  throw Error("npy: " + path + ": " + what);
}

struct Header {
  std::string descr;
  bool fortran_order = false;
  std::vector<std::int64_t> shape;
};

// Parses the Python dict literal numpy writes, e.g.
//   {'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }
// Only the literal forms numpy can produce are accepted; every access is bounds-checked
// because the header comes straight from an untrusted file.
class HeaderParser {
 public:
  HeaderParser(std::string_view text, const std::string& path) : s_(text), path_(path) {}

  Header parse() {
    Header h;
    bool have_descr = false, have_fortran = false, have_shape = false;
    expect('{');
    while (!eat('}')) {
      const std::string key = string_literal();
      expect(':');
      if (key == "descr" && !have_descr) {
        skip_ws();
        if (peek() == '[')
          fail(path_, "unsupported dtype: structured arrays are not supported "
                      "(plain '<f4', '<f2', '<i4', '|b1' or '|u1' arrays are)");
        h.descr = string_literal();
        have_descr = true;
      } else if (key == "fortran_order" && !have_fortran) {
        h.fortran_order = bool_literal();
        have_fortran = true;
      } else if (key == "shape" && !have_shape) {
        h.shape = shape_literal();
        have_shape = true;
      } else {
        malformed("unexpected or repeated key '" + key + "'");
      }
      if (!eat(',')) {
        expect('}');
        break;
      }
    }
    skip_ws();
    if (pos_ != s_.size()) malformed("unexpected characters after the closing '}'");
    if (!have_descr) malformed("missing key 'descr'");
    if (!have_fortran) malformed("missing key 'fortran_order'");
    if (!have_shape) malformed("missing key 'shape'");
    return h;
  }

 private:
  [[noreturn]] void malformed(const std::string& why) const {
    fail(path_, "malformed header: " + why + " (at offset " + std::to_string(pos_) + " of header \"" + shown(s_) +
                    "\")");
  }

  char peek() const { return pos_ < s_.size() ? s_[pos_] : '\0'; }
  void skip_ws() {
    while (pos_ < s_.size() && (s_[pos_] == ' ' || s_[pos_] == '\t' || s_[pos_] == '\n' ||
                                s_[pos_] == '\r'))
      ++pos_;
  }
  bool eat(char c) {
    skip_ws();
    if (pos_ < s_.size() && s_[pos_] == c) {
      ++pos_;
      return true;
    }
    return false;
  }
  void expect(char c) {
    if (!eat(c)) malformed(std::string("expected '") + c + "'");
  }

  std::string string_literal() {
    skip_ws();
    const char quote = peek();
    if (quote != '\'' && quote != '"') malformed("expected a quoted string");
    const std::size_t end = s_.find(quote, pos_ + 1);
    if (end == std::string_view::npos) malformed("unterminated string");
    std::string out(s_.substr(pos_ + 1, end - pos_ - 1));
    pos_ = end + 1;
    return out;
  }

  bool bool_literal() {
    skip_ws();
    for (const auto& [word, value] : {std::pair{std::string_view("True"), true},
                                      std::pair{std::string_view("False"), false}}) {
      if (s_.substr(pos_, word.size()) == word) {
        pos_ += word.size();
        return value;
      }
    }
    malformed("expected True or False");
  }

  std::int64_t int_literal() {
    skip_ws();
    if (peek() == '-') fail(path_, "malformed header: shape values must be non-negative");
    if (peek() < '0' || peek() > '9') malformed("expected a non-negative integer");
    std::int64_t value = 0;
    while (peek() >= '0' && peek() <= '9') {
      const int digit = peek() - '0';
      if (value > (std::numeric_limits<std::int64_t>::max() - digit) / 10)
        fail(path_, "malformed header: shape value too large");
      value = value * 10 + digit;
      ++pos_;
    }
    if (peek() == 'L') ++pos_;  // Python 2 wrote longs as e.g. 3L
    return value;
  }

  // "()", "(3,)", "(2, 3)" and "(2, 3,)"; "(3)" is an int in Python, not a tuple.
  std::vector<std::int64_t> shape_literal() {
    expect('(');
    std::vector<std::int64_t> dims;
    if (eat(')')) return dims;
    while (true) {
      dims.push_back(int_literal());
      if (eat(',')) {
        if (eat(')')) return dims;
      } else if (eat(')')) {
        if (dims.size() == 1) malformed("shape is not a tuple (a 1-D shape needs a trailing comma)");
        return dims;
      } else {
        malformed("expected ',' or ')' in shape");
      }
    }
  }

  std::string_view s_;
  std::size_t pos_ = 0;
  const std::string& path_;
};

// Reads up to n bytes; returns how many arrived so short files become clear errors.
std::size_t read_up_to(std::istream& in, void* dst, std::size_t n) {
  in.read(static_cast<char*>(dst), static_cast<std::streamsize>(n));
  return static_cast<std::size_t>(in.gcount());
}

}  // namespace

flashattn::Tensor read_npy(const std::string& path) {
  namespace fs = std::filesystem;
  std::error_code ec;
  const fs::file_status status = fs::status(path, ec);
  if (!fs::exists(status)) fail(path, "file not found");
  if (fs::is_directory(status)) fail(path, "is a directory, not a .npy file");
  std::ifstream in(path, std::ios::binary);
  if (!in) fail(path, "cannot open file for reading");
  // The size bounds the header and data before anything is allocated for them.
  in.seekg(0, std::ios::end);
  const std::streamoff end = in.tellg();
  in.seekg(0, std::ios::beg);
  if (end < 0 || !in) fail(path, "cannot determine file size");
  const std::uint64_t file_size = static_cast<std::uint64_t>(end);

  unsigned char prefix[12] = {};
  const std::size_t got = read_up_to(in, prefix, 8);
  if (got < kMagicLen || std::memcmp(prefix, kMagic, kMagicLen) != 0)
    fail(path, "bad magic: not a .npy file (expected \\x93NUMPY at the start)");
  if (got < 8) fail(path, "truncated header: file is only " + std::to_string(got) + " bytes");
  const int major = prefix[6], minor = prefix[7];
  if (major < 1 || major > 3 || minor != 0)
    fail(path, "unsupported .npy format version " + std::to_string(major) + "." +
                   std::to_string(minor) + " (supported: 1.0, 2.0, 3.0)");

  // Version 1.0 stores the header length in 2 bytes, 2.0 and 3.0 (UTF-8 header) in 4.
  const std::size_t len_bytes = major == 1 ? 2 : 4;
  if (read_up_to(in, prefix + 8, len_bytes) != len_bytes)
    fail(path, "truncated header: file ends inside the header length field");
  std::uint64_t header_len = 0;
  for (std::size_t i = 0; i < len_bytes; ++i)
    header_len |= static_cast<std::uint64_t>(prefix[8 + i]) << (8 * i);
  const std::uint64_t data_offset = 8 + len_bytes + header_len;
  if (data_offset > file_size)
    fail(path, "truncated header (expected " + std::to_string(header_len) + " bytes, got " +
                   std::to_string(file_size - 8 - len_bytes) + ")");
  std::string header_text(static_cast<std::size_t>(header_len), '\0');
  if (read_up_to(in, header_text.data(), header_text.size()) != header_text.size())
    fail(path, "cannot read header");
  const Header header = HeaderParser(header_text, path).parse();

  DType dtype;
  if (header.descr == "<f4") {
    dtype = DType::f32;
  } else if (header.descr == "<f2") {
    dtype = DType::f16;
  } else if (header.descr == "<i4") {
    dtype = DType::i32;
  } else if (header.descr == "|u1" || header.descr == "|b1") {
    dtype = DType::u8;
  } else {
    fail(path, "unsupported dtype '" + shown(header.descr) +
                   "' (supported: little-endian float32 '<f4' and float16 '<f2'; int32 '<i4' and "
                   "bool/uint8 '|b1'/'|u1' for offsets and masks)");
  }
  if (header.fortran_order)
    fail(path, "fortran_order True is not supported (save a C-ordered array, "
               "e.g. with numpy.ascontiguousarray)");
  if (header.shape.size() > static_cast<std::size_t>(kMaxRank))
    fail(path, "rank " + std::to_string(header.shape.size()) + " is not supported (at most " +
                   std::to_string(kMaxRank) + ")");

  // Bound the product of the non-zero dims so that no multiplication order overflows,
  // not even the one Tensor::numel uses when a zero dim comes last.
  const std::uint64_t item = dtype_size(dtype);
  const std::uint64_t limit = static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max());
  std::uint64_t nonzero_bytes = item;
  bool empty = false;
  for (const std::int64_t d : header.shape) {
    if (d == 0) {
      empty = true;
      continue;
    }
    if (static_cast<std::uint64_t>(d) > limit / nonzero_bytes)
      fail(path, "shape is too large: total byte size overflows");
    nonzero_bytes *= static_cast<std::uint64_t>(d);
  }
  const std::uint64_t bytes = empty ? 0 : nonzero_bytes;
  // Like numpy, bytes after the array are ignored.
  const std::uint64_t available = file_size - data_offset;
  if (available < bytes)
    fail(path, "truncated data (expected " + std::to_string(bytes) + " bytes, got " +
                   std::to_string(available) + ")");

  Tensor tensor(dtype, header.shape);
  if (bytes > 0 && read_up_to(in, tensor.data(), static_cast<std::size_t>(bytes)) != bytes)
    fail(path, "cannot read data (expected " + std::to_string(bytes) + " bytes)");
  return tensor;
}

void write_npy(const std::string& path, const flashattn::Tensor& tensor) {
  std::string descr;
  switch (tensor.dtype()) {
    case DType::f32: descr = "<f4"; break;
    case DType::f16: descr = "<f2"; break;
    case DType::i32: descr = "<i4"; break;
    case DType::u8: descr = "|u1"; break;
    case DType::bf16:
      fail(path, "cannot write dtype bf16: numpy has no bfloat16 (convert to f32 first)");
  }
  const std::int64_t numel = tensor.numel();
  // A default-constructed Tensor has rank 0 (numel 1) but no storage.
  if (numel > 0 && tensor.data() == nullptr) fail(path, "tensor has no data");

  std::string header = "{'descr': '" + descr + "', 'fortran_order': False, 'shape': (";
  for (std::size_t d = 0; d < tensor.shape().size(); ++d)
    header += (d ? ", " : "") + std::to_string(tensor.shape()[d]);
  if (tensor.shape().size() == 1) header += ',';
  header += "), }";
  // Pad with spaces before the final newline so the data starts 64-byte aligned.
  const std::size_t prefix_len = kMagicLen + 2 + 2;
  header.append((kAlign - (prefix_len + header.size() + 1) % kAlign) % kAlign, ' ');
  header += '\n';

  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out) fail(path, "cannot open file for writing");
  const unsigned char prefix[prefix_len] = {
      0x93, 'N', 'U', 'M', 'P', 'Y', 1, 0,
      static_cast<unsigned char>(header.size() & 0xFF),
      static_cast<unsigned char>(header.size() >> 8)};
  out.write(reinterpret_cast<const char*>(prefix), prefix_len);
  out.write(header.data(), static_cast<std::streamsize>(header.size()));
  out.write(static_cast<const char*>(tensor.data()),
            static_cast<std::streamsize>(numel * static_cast<std::int64_t>(dtype_size(tensor.dtype()))));
  out.close();
  if (!out) fail(path, "write failed");
}

}  // namespace flashattn::support
