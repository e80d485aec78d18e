// Reader for the IDX format (the MNIST family's files), plain or gzip-compressed.
//
// An IDX file is: two zero bytes, a type code (0x08 u8, 0x09 i8, 0x0B i16, 0x0C i32, 0x0D f32, 0x0E f64), the
// number of dims, one big-endian u32 per dim, then the elements big-endian in row-major order. readIdx
// reads through zlib's gzopen/gzread, which handles both plain and gzipped files, and validates everything:
// the magic, the type code, the dim count, that the declared size matches the bytes present exactly
// (neither short nor with trailing data) and, for .gz, the integrity of the stream. Errors name the file.
// Thread-safety: stateless; concurrent reads of different (or the same) files are safe.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "tensor/tensor.h"

namespace distgrad::models::data {

enum class IdxType : uint8_t {
  kUInt8 = 0x08,
  kInt8 = 0x09,
  kInt16 = 0x0B,
  kInt32 = 0x0C,
  kFloat32 = 0x0D,
  kFloat64 = 0x0E,
};

size_t idxItemSize(IdxType type);
const char* idxTypeName(IdxType type);

struct IdxArray {
  IdxType type = IdxType::kUInt8;
  Shape shape;
  // Elements in host byte order, row-major.
  std::vector<uint8_t> bytes;

  int64_t numel() const { return tensor::numelOf(shape); }
  // Converts to a tensor: floats to `floatDType` (float32 by default), integers to int64.
  Tensor toTensor(DType floatDType = DType::kFloat32) const;
};

// Reads a whole IDX file. `maxBytes` bounds the declared payload (protects against a forged header asking
// for terabytes).
IdxArray readIdx(const std::string& path, uint64_t maxBytes = uint64_t{1} << 34);

// Writes an IDX file (gzip-compressed when `gzip`); `bytes` are in host order. For tests and tools that
// produce data sets.
void writeIdx(const std::string& path, IdxType type, const Shape& shape, const void* bytes, bool gzip);

}  // namespace distgrad::models::data
