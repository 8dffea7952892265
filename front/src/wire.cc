#include "wire.h"

namespace front::wire {

bool Reader::Varint(uint64_t& value) {
  value = 0;
  for (int shift = 0; shift < 64; shift += 7) {
    if (at_ >= message_.size()) return false;
    uint8_t byte = static_cast<uint8_t>(message_[at_++]);
    value |= static_cast<uint64_t>(byte & 0x7F) << shift;
    if (!(byte & 0x80)) return true;
  }
  return false;
}

bool Reader::Next(Field& field) {
  if (failed_ || at_ >= message_.size()) return false;
  field = Field{};
  field.begin = at_;
  uint64_t tag;
  if (!Varint(tag) || (tag >> 3) == 0 || (tag >> 3) > 0x1FFFFFFF) {
    failed_ = true;
    return false;
  }
  field.number = static_cast<uint32_t>(tag >> 3);
  field.type = static_cast<int>(tag & 7);
  switch (field.type) {
    case kVarint:
      if (!Varint(field.varint)) failed_ = true;
      break;
    case kFixed64:
    case kFixed32: {
      size_t width = field.type == kFixed64 ? 8 : 4;
      if (message_.size() - at_ < width) failed_ = true;
      else at_ += width;
      break;
    }
    case kLengthDelimited: {
      uint64_t length;
      if (!Varint(length) || length > message_.size() - at_) {
        failed_ = true;
        break;
      }
      field.bytes = message_.substr(at_, length);
      at_ += length;
      break;
    }
    default:
      failed_ = true;  // groups and unknown wire types: no message of the protocol has them
  }
  field.end = at_;
  return !failed_;
}

void PutVarint(std::string& out, uint64_t value) {
  while (value >= 0x80) {
    out.push_back(static_cast<char>((value & 0x7F) | 0x80));
    value >>= 7;
  }
  out.push_back(static_cast<char>(value));
}

void PutTag(std::string& out, uint32_t number, int type) { PutVarint(out, (uint64_t{number} << 3) | type); }

void PutBytes(std::string& out, uint32_t number, std::string_view bytes) {
  PutTag(out, number, kLengthDelimited);
  PutVarint(out, bytes.size());
  out.append(bytes);
}

namespace {

void PutParameter(std::string& out, std::string_view key, const std::string& value) {
  std::string entry;
  PutBytes(entry, 1, key);
  PutBytes(entry, 2, value);
  PutBytes(out, 4, entry);
}

}  // namespace

void PutStringParameter(std::string& out, std::string_view key, std::string_view value) {
  std::string parameter;
  PutBytes(parameter, 3, value);
  PutParameter(out, key, parameter);
}

void PutInt64Parameter(std::string& out, std::string_view key, int64_t value) {
  std::string parameter;
  PutTag(parameter, 2, kVarint);
  PutVarint(parameter, static_cast<uint64_t>(value));
  PutParameter(out, key, parameter);
}

std::optional<std::string_view> FindParameter(std::string_view message, uint32_t number, std::string_view key) {
  std::optional<std::string_view> found;
  Reader fields(message);
  Field field;
  while (fields.Next(field)) {
    if (field.number != number || field.type != kLengthDelimited) continue;
    Reader entry(field.bytes);
    Field part;
    std::string_view name, value;
    while (entry.Next(part)) {
      if (part.type != kLengthDelimited) continue;
      if (part.number == 1) name = part.bytes;
      if (part.number == 2) value = part.bytes;
    }
    if (name == key) found = value;  // the last entry of a key wins, as protobuf merges them
  }
  return found;
}

std::string_view StringParameter(std::string_view parameter) {
  std::string_view value;
  Reader fields(parameter);
  Field field;
  while (fields.Next(field))
    if (field.number == 3 && field.type == kLengthDelimited) value = field.bytes;
  return value;
}

bool BoolParameter(std::string_view parameter) {
  bool value = false;
  Reader fields(parameter);
  Field field;
  while (fields.Next(field))
    if (field.number == 1 && field.type == kVarint) value = field.varint != 0;
  return value;
}

int64_t Int64Parameter(std::string_view parameter) {
  int64_t value = 0;
  Reader fields(parameter);
  Field field;
  while (fields.Next(field))
    if (field.number == 2 && field.type == kVarint) value = static_cast<int64_t>(field.varint);
  return value;
}

std::optional<Field> FindField(std::string_view message, uint32_t number) {
  Reader fields(message);
  Field field;
  while (fields.Next(field))
    if (field.number == number && field.type == kLengthDelimited) return field;
  return std::nullopt;
}

std::optional<std::string> Base64Decode(std::string_view text) {
  auto value = [](char c) -> int {
    if (c >= 'A' && c <= 'Z') return c - 'A';
    if (c >= 'a' && c <= 'z') return c - 'a' + 26;
    if (c >= '0' && c <= '9') return c - '0' + 52;
    if (c == '+' || c == '-') return 62;
    if (c == '/' || c == '_') return 63;
    return -1;
  };
  std::string out;
  uint32_t bits = 0;
  int count = 0;
  for (char c : text) {
    if (c == '=') break;
    int v = value(c);
    if (v < 0) return std::nullopt;
    bits = (bits << 6) | static_cast<uint32_t>(v);
    count += 6;
    if (count >= 8) {
      count -= 8;
      out.push_back(static_cast<char>((bits >> count) & 0xFF));
    }
  }
  return out;
}

}  // namespace front::wire
