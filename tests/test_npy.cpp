// .npy reader/writer: round trips, files laid out the way numpy writes them, and one
// test per rejected input checking that the message names the file and the problem.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <string>
#include <system_error>
#include <tuple>
#include <vector>

#include "flashattn/error.hpp"
#include "flashattn/tensor.hpp"
#include "tools/support/npy.hpp"

namespace flashattn::support {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;

// Removes the files (and directories) a test was handed by temp_path when the test ends,
// so that runs leave nothing behind in the temporary directory.
class RemoveTempPaths : public ::testing::EmptyTestEventListener {
 public:
  static RemoveTempPaths& instance() {
    static RemoveTempPaths* const listener = [] {
      auto* created = new RemoveTempPaths;
      ::testing::UnitTest::GetInstance()->listeners().Append(created);  // gtest owns it
      return created;
    }();
    return *listener;
  }
  void add(const std::string& path) { paths_.push_back(path); }
  void OnTestEnd(const ::testing::TestInfo&) override {
    for (const std::string& path : paths_) {
      std::error_code ignored;
      std::filesystem::remove_all(path, ignored);
    }
    paths_.clear();
  }

 private:
  std::vector<std::string> paths_;
};

// A per-test file name so tests never see each other's files; removed when the test ends.
std::string temp_path(const std::string& suffix = "") {
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  std::string name = std::string(info->test_suite_name()) + "_" + info->name() + suffix;
  for (char& c : name)
    if (c == '/') c = '_';
  const std::string path = (std::filesystem::path(::testing::TempDir()) / (name + ".npy")).string();
  RemoveTempPaths::instance().add(path);
  return path;
}

void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  ASSERT_TRUE(out.good()) << path;
}

std::string read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

// Lays out a .npy file the way numpy.lib.format does: magic, version, little-endian
// header length (2 bytes for 1.0, 4 for 2.0/3.0), the dict padded with spaces and a
// newline to a 64-byte boundary, then the raw data.
std::string npy_bytes(int major, const std::string& dict, const std::string& data) {
  const std::size_t len_bytes = major == 1 ? 2 : 4;
  std::string header = dict;
  const std::size_t unpadded = 8 + len_bytes + header.size() + 1;
  header.append((64 - unpadded % 64) % 64, ' ');
  header += '\n';
  std::string out = "\x93NUMPY";
  out += static_cast<char>(major);
  out += '\0';
  for (std::size_t i = 0; i < len_bytes; ++i) out += static_cast<char>((header.size() >> (8 * i)) & 0xFF);
  return out + header + data;
}

template <class T>
std::string raw(const std::vector<T>& values) {
  return std::string(reinterpret_cast<const char*>(values.data()), values.size() * sizeof(T));
}

// The message of the flashattn::Error that `body` throws, or "" (and a failure) if none.
std::string error_of(const std::function<void()>& body) {
  try {
    body();
  } catch (const Error& e) {
    return e.what();
  }
  ADD_FAILURE() << "expected flashattn::Error";
  return "";
}

std::string read_error(const std::string& path) {
  return error_of([&] { read_npy(path); });
}

// ---- round trips ------------------------------------------------------------------------

class NpyRoundTrip
    : public ::testing::TestWithParam<std::tuple<DType, std::vector<std::int64_t>>> {};

TEST_P(NpyRoundTrip, PreservesDtypeShapeAndBits) {
  const auto& [dtype, shape] = GetParam();
  Tensor original(dtype, shape);
  for (std::int64_t i = 0; i < original.numel(); ++i)
    original.set(i, 0.25f * static_cast<float>(i) - 3.0f + 1.0f / 3.0f);
  const std::string path = temp_path();
  write_npy(path, original);

  const std::string bytes = read_bytes(path);
  ASSERT_GE(bytes.size(), 10u);
  EXPECT_EQ(bytes.substr(0, 8), std::string("\x93NUMPY\x01\x00", 8));
  const std::size_t data_bytes = static_cast<std::size_t>(original.numel()) * dtype_size(dtype);
  EXPECT_EQ((bytes.size() - data_bytes) % 64, 0u) << "data must start 64-byte aligned";
  EXPECT_EQ(bytes[bytes.size() - data_bytes - 1], '\n');

  const Tensor loaded = read_npy(path);
  EXPECT_EQ(loaded.dtype(), dtype);
  EXPECT_EQ(loaded.shape(), shape);
  ASSERT_EQ(loaded.numel(), original.numel());
  if (data_bytes > 0) {
    EXPECT_EQ(std::memcmp(loaded.data(), original.data(), data_bytes), 0);
  }
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, NpyRoundTrip,
    ::testing::Combine(::testing::Values(DType::f32, DType::f16),
                       ::testing::Values(std::vector<std::int64_t>{2, 3, 4, 5},
                                         std::vector<std::int64_t>{7},
                                         std::vector<std::int64_t>{},
                                         std::vector<std::int64_t>{0, 3})),
    [](const auto& info) {
      std::string name = std::get<0>(info.param) == DType::f32 ? "f32" : "f16";
      name += "_rank" + std::to_string(std::get<1>(info.param).size());
      for (std::int64_t d : std::get<1>(info.param)) name += "_" + std::to_string(d);
      return name;
    });

TEST(Npy, WriteHeaderMatchesNumpy) {
  Tensor t(DType::f32, {7});
  const std::string path = temp_path();
  write_npy(path, t);
  const std::string bytes = read_bytes(path);
  const std::string dict = "{'descr': '<f4', 'fortran_order': False, 'shape': (7,), }";
  EXPECT_EQ(bytes.substr(10, dict.size()), dict);
  EXPECT_EQ(bytes.size(), 128u + 7u * 4u);  // 10 + 57 + 1 bytes of header pad to 128
}

// ---- files as numpy writes them ---------------------------------------------------------

TEST(Npy, ReadsVersion2HeaderAsNumpyWritesIt) {
  const std::vector<float> values = {0.0f, 1.5f, -2.0f, 3.25f, 1e-3f, -7.0f};
  const std::string path = temp_path();
  write_bytes(path, npy_bytes(2, "{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }",
                              raw(values)));
  const std::string bytes = read_bytes(path);
  ASSERT_EQ((bytes.size() - values.size() * 4) % 64, 0u);  // sanity of the fixture itself

  const Tensor t = read_npy(path);
  EXPECT_EQ(t.dtype(), DType::f32);
  EXPECT_EQ(t.shape(), (std::vector<std::int64_t>{2, 3}));
  for (std::size_t i = 0; i < values.size(); ++i) EXPECT_EQ(t.get(static_cast<std::int64_t>(i)), values[i]);
}

TEST(Npy, ReadsVersion3Float16) {
  // 1.0, -2.0, 0.5 as IEEE half bits.
  const std::vector<std::uint16_t> bits = {0x3C00, 0xC000, 0x3800};
  const std::string path = temp_path();
  write_bytes(path, npy_bytes(3, "{'descr': '<f2', 'fortran_order': False, 'shape': (3,), }",
                              raw(bits)));
  const Tensor t = read_npy(path);
  EXPECT_EQ(t.dtype(), DType::f16);
  EXPECT_EQ(t.shape(), (std::vector<std::int64_t>{3}));
  EXPECT_EQ(t.get(0), 1.0f);
  EXPECT_EQ(t.get(1), -2.0f);
  EXPECT_EQ(t.get(2), 0.5f);
}

TEST(Npy, HeaderParsingIsTolerant) {
  const std::vector<float> values = {1, 2, 3, 4, 5, 6};
  // Any key order, double quotes, odd spacing, no trailing comma, trailing comma in shape.
  const std::vector<std::string> dicts = {
      "{'shape': (2, 3), 'fortran_order': False, 'descr': '<f4'}",
      "{ \"descr\" : \"<f4\" ,\"fortran_order\":False,\"shape\":( 2 ,3 , ) , }",
      "{'fortran_order': False, 'shape': (2,3), 'descr': '<f4', }",
  };
  for (const std::string& dict : dicts) {
    SCOPED_TRACE(dict);
    const std::string path = temp_path();
    write_bytes(path, npy_bytes(1, dict, raw(values)));
    const Tensor t = read_npy(path);
    EXPECT_EQ(t.shape(), (std::vector<std::int64_t>{2, 3}));
    EXPECT_EQ(t.get(5), 6.0f);
  }
}

TEST(Npy, ReadsScalarAndEmptyShapes) {
  const std::string scalar = temp_path("_scalar");
  write_bytes(scalar, npy_bytes(1, "{'descr': '<f4', 'fortran_order': False, 'shape': (), }",
                                raw(std::vector<float>{42.0f})));
  const Tensor s = read_npy(scalar);
  EXPECT_TRUE(s.shape().empty());
  EXPECT_EQ(s.get(0), 42.0f);

  const std::string empty = temp_path("_empty");
  write_bytes(empty, npy_bytes(1, "{'descr': '<f2', 'fortran_order': False, 'shape': (4, 0), }", ""));
  const Tensor e = read_npy(empty);
  EXPECT_EQ(e.shape(), (std::vector<std::int64_t>{4, 0}));
  EXPECT_EQ(e.numel(), 0);
}

TEST(Npy, IgnoresBytesAfterTheData) {
  const std::string path = temp_path();
  write_bytes(path, npy_bytes(1, "{'descr': '<f4', 'fortran_order': False, 'shape': (1,), }",
                              raw(std::vector<float>{9.0f, 10.0f})));
  EXPECT_EQ(read_npy(path).get(0), 9.0f);
}

// ---- errors -----------------------------------------------------------------------------

TEST(NpyErrors, FileNotFound) {
  const std::string path = temp_path();
  std::filesystem::remove(path);
  EXPECT_THAT(read_error(path), AllOf(HasSubstr(path), HasSubstr("not found")));
}

TEST(NpyErrors, Directory) {
  const std::string path = temp_path("_dir");
  std::filesystem::create_directories(path);
  EXPECT_THAT(read_error(path), AllOf(HasSubstr(path), HasSubstr("directory")));
}

TEST(NpyErrors, BadMagic) {
  const std::string path = temp_path();
  write_bytes(path, "PK\x03\x04 this is a zip file, not an npy file");
  EXPECT_THAT(read_error(path), AllOf(HasSubstr(path), HasSubstr("bad magic")));
  write_bytes(path, "");
  EXPECT_THAT(read_error(path), AllOf(HasSubstr(path), HasSubstr("bad magic")));
}

TEST(NpyErrors, UnsupportedVersion) {
  const std::string dict = "{'descr': '<f4', 'fortran_order': False, 'shape': (1,), }";
  const std::string path = temp_path();
  std::string bytes = npy_bytes(2, dict, raw(std::vector<float>{1.0f}));
  bytes[6] = 4;
  write_bytes(path, bytes);
  EXPECT_THAT(read_error(path),
              AllOf(HasSubstr(path), HasSubstr("unsupported .npy format version 4.0")));
  bytes[6] = 1;
  bytes[7] = 1;
  write_bytes(path, bytes);
  EXPECT_THAT(read_error(path), AllOf(HasSubstr(path), HasSubstr("version 1.1")));
}

TEST(NpyErrors, UnsupportedDtypes) {
  for (const std::string descr : {"<f8", ">f4", "<i8", ">i4", ">f2", "<u2"}) {
    SCOPED_TRACE(descr);
    const std::string path = temp_path();
    write_bytes(path, npy_bytes(1, "{'descr': '" + descr + "', 'fortran_order': False, 'shape': (2,), }",
                                std::string(16, '\0')));
    EXPECT_THAT(read_error(path), AllOf(HasSubstr(path), HasSubstr("unsupported dtype '" + descr + "'"),
                                        HasSubstr("'<f4'"), HasSubstr("'<f2'")));
  }
  const std::string path = temp_path("_structured");
  write_bytes(path, npy_bytes(1, "{'descr': [('a', '<f4')], 'fortran_order': False, 'shape': (2,), }",
                              std::string(8, '\0')));
  EXPECT_THAT(read_error(path), AllOf(HasSubstr(path), HasSubstr("unsupported dtype")));
}

TEST(Npy, ReadsInt32OffsetsAndBoolMasks) {
  const std::string offsets = temp_path("_i4");
  std::string data(12, '\0');
  const std::int32_t values[] = {0, 7, -3};
  std::memcpy(data.data(), values, sizeof values);
  write_bytes(offsets, npy_bytes(1, "{'descr': '<i4', 'fortran_order': False, 'shape': (3,), }", data));
  const flashattn::Tensor t = flashattn::support::read_npy(offsets);
  EXPECT_EQ(t.dtype(), flashattn::DType::i32);
  EXPECT_EQ(t.get(1), 7.0f);
  EXPECT_EQ(t.get(2), -3.0f);
  const std::string mask = temp_path("_b1");
  write_bytes(mask, npy_bytes(1, "{'descr': '|b1', 'fortran_order': False, 'shape': (2, 2), }",
                              std::string("\x01\x00\x00\x01", 4)));
  const flashattn::Tensor m = flashattn::support::read_npy(mask);
  EXPECT_EQ(m.dtype(), flashattn::DType::u8);
  EXPECT_EQ(m.get(0), 1.0f);
  EXPECT_EQ(m.get(1), 0.0f);
}

TEST(NpyErrors, FortranOrder) {
  const std::string path = temp_path();
  write_bytes(path, npy_bytes(1, "{'descr': '<f4', 'fortran_order': True, 'shape': (2, 2), }",
                              raw(std::vector<float>{1, 2, 3, 4})));
  EXPECT_THAT(read_error(path), AllOf(HasSubstr(path), HasSubstr("fortran_order True")));
}

TEST(NpyErrors, RankAboveFive) {
  const std::string path = temp_path();
  write_bytes(path, npy_bytes(1, "{'descr': '<f4', 'fortran_order': False, 'shape': (1, 1, 1, 1, 1, 1), }",
                              raw(std::vector<float>{1})));
  EXPECT_THAT(read_error(path), AllOf(HasSubstr(path), HasSubstr("rank 6")));
}

TEST(NpyErrors, TruncatedData) {
  const std::string path = temp_path();
  write_bytes(path, npy_bytes(1, "{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }",
                              raw(std::vector<float>{1, 2, 3, 4, 5})));
  EXPECT_THAT(read_error(path), AllOf(HasSubstr(path), HasSubstr("truncated data"),
                                      HasSubstr("expected 24 bytes, got 20")));
}

TEST(NpyErrors, TruncatedHeader) {
  const std::string path = temp_path();
  const std::string full = npy_bytes(1, "{'descr': '<f4', 'fortran_order': False, 'shape': (1,), }",
                                     raw(std::vector<float>{1}));
  for (const std::size_t keep : {7u, 9u, 30u}) {
    SCOPED_TRACE(keep);
    write_bytes(path, full.substr(0, keep));
    EXPECT_THAT(read_error(path), AllOf(HasSubstr(path), HasSubstr("truncated header")));
  }
  // A version 2.0 header length of 4 GiB - 1 in a tiny file.
  std::string huge = "\x93NUMPY\x02";
  huge += std::string("\x00\xFF\xFF\xFF\xFF{}", 7);
  write_bytes(path, huge);
  EXPECT_THAT(read_error(path), AllOf(HasSubstr(path), HasSubstr("truncated header")));
}

TEST(NpyErrors, MalformedHeaders) {
  const std::vector<std::string> dicts = {
      "",
      "not a dict",
      "{'descr': '<f4', 'fortran_order': False}",                          // no shape
      "{'descr': '<f4', 'shape': (2,)}",                                   // no fortran_order
      "{'fortran_order': False, 'shape': (2,)}",                           // no descr
      "{'descr': '<f4', 'fortran_order': False, 'shape': (2,), 'x': 1}",   // unknown key
      "{'descr': '<f4', 'descr': '<f4', 'fortran_order': False, 'shape': (2,)}",
      "{'descr': '<f4, 'fortran_order': False, 'shape': (2,)}",            // bad quoting
      "{'descr': '<f4', 'fortran_order': false, 'shape': (2,)}",
      "{'descr': '<f4', 'fortran_order': False, 'shape': (2)}",            // int, not tuple
      "{'descr': '<f4', 'fortran_order': False, 'shape': [2]}",
      "{'descr': '<f4', 'fortran_order': False, 'shape': (2, x)}",
      "{'descr': '<f4', 'fortran_order': False, 'shape': (2,,)}",
      "{'descr': '<f4', 'fortran_order': False, 'shape': (2,",
      "{'descr': '<f4', 'fortran_order': False, 'shape': (2,)} extra",
      "{'descr': '<f4' 'fortran_order': False, 'shape': (2,)}",
      "{'descr': '<f4', 'fortran_order': False, 'shape': (-2,)}",
      "{'descr': '<f4', 'fortran_order': False, 'shape': (99999999999999999999,)}",
      std::string("{'descr': '<f4', 'fortran_order': False, 'shape': (2,)}\0", 57),
  };
  for (const std::string& dict : dicts) {
    SCOPED_TRACE(dict);
    const std::string path = temp_path();
    write_bytes(path, npy_bytes(1, dict, std::string(8, '\0')));
    EXPECT_THAT(read_error(path), AllOf(HasSubstr(path), HasSubstr("malformed header")));
  }
}

TEST(NpyErrors, NegativeShapeSaysNonNegative) {
  const std::string path = temp_path();
  write_bytes(path, npy_bytes(1, "{'descr': '<f4', 'fortran_order': False, 'shape': (3, -1), }", ""));
  EXPECT_THAT(read_error(path), AllOf(HasSubstr(path), HasSubstr("non-negative")));
}

TEST(NpyErrors, ByteSizeOverflow) {
  const std::string path = temp_path();
  // Each dim fits in int64, the product does not; the zero must not hide the overflow.
  for (const std::string shape : {"(4294967296, 4294967296)", "(3037000500, 3037000500, 0)",
                                  "(2305843009213693952,)"}) {
    SCOPED_TRACE(shape);
    write_bytes(path, npy_bytes(1, "{'descr': '<f4', 'fortran_order': False, 'shape': " + shape + ", }", ""));
    EXPECT_THAT(read_error(path), AllOf(HasSubstr(path), HasSubstr("overflow")));
  }
}

TEST(NpyErrors, HugeShapeInSmallFileIsTruncatedNotAllocated) {
  const std::string path = temp_path();
  write_bytes(path, npy_bytes(1, "{'descr': '<f4', 'fortran_order': False, 'shape': (1000000000000,), }", ""));
  EXPECT_THAT(read_error(path), AllOf(HasSubstr(path), HasSubstr("expected 4000000000000 bytes, got 0")));
}

TEST(NpyErrors, WriteBf16) {
  const std::string path = temp_path();
  const Tensor t(DType::bf16, {2});
  EXPECT_THAT(error_of([&] { write_npy(path, t); }), AllOf(HasSubstr(path), HasSubstr("bf16")));
}

TEST(NpyErrors, WriteToMissingDirectory) {
  const std::string path = temp_path("_missing_dir") + "/x.npy";
  const Tensor t(DType::f32, {2});
  EXPECT_THAT(error_of([&] { write_npy(path, t); }), AllOf(HasSubstr(path), HasSubstr("cannot open")));
}

}  // namespace
}  // namespace flashattn::support
