// The few pieces of protobuf's wire format the front reads and writes: it passes messages through as bytes
// and never parses a whole one.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace front::wire {

constexpr int kVarint = 0;
constexpr int kFixed64 = 1;
constexpr int kLengthDelimited = 2;
constexpr int kFixed32 = 5;

// One field of a message: its number, wire type, and where it lies in the message's bytes.
struct Field {
  uint32_t number = 0;
  int type = 0;
  uint64_t varint = 0;     // the value of a varint field
  std::string_view bytes;  // the contents of a length-delimited field
  size_t begin = 0;        // the field's first byte (its tag) in the message
  size_t end = 0;          // one past its last byte
};

// Reads a message's top-level fields one by one.
class Reader {
 public:
  explicit Reader(std::string_view message) : message_(message) {}
  // The next field; false at the end of the message, or where its bytes are malformed (then `failed()`).
  bool Next(Field& field);
  bool failed() const { return failed_; }

 private:
  bool Varint(uint64_t& value);
  std::string_view message_;
  size_t at_ = 0;
  bool failed_ = false;
};

void PutVarint(std::string& out, uint64_t value);
void PutTag(std::string& out, uint32_t number, int type);
void PutBytes(std::string& out, uint32_t number, std::string_view bytes);

// A `map<string, InferParameter> parameters = 4` entry of a ModelInferRequest, appended to its bytes:
// protobuf merges map entries, the last of a key winning.
void PutStringParameter(std::string& out, std::string_view key, std::string_view value);
void PutInt64Parameter(std::string& out, std::string_view key, int64_t value);

// The `InferParameter` bytes of parameter `key` in a message whose parameters are field `number`.
std::optional<std::string_view> FindParameter(std::string_view message, uint32_t number, std::string_view key);
// An `InferParameter`'s string_param (field 3), bool_param (field 1) and int64_param (field 2).
std::string_view StringParameter(std::string_view parameter);
bool BoolParameter(std::string_view parameter);
int64_t Int64Parameter(std::string_view parameter);

// The first length-delimited field `number` of a message, if any.
std::optional<Field> FindField(std::string_view message, uint32_t number);

std::optional<std::string> Base64Decode(std::string_view text);

}  // namespace front::wire
