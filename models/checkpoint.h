// Checkpoints: a versioned binary file holding a StateDict, written atomically and validated on load.
//
// Layout (little-endian), version 1:
//   header   magic "DGCKPT\r\n" (8 bytes), u32 version, u32 flags (0), u64 entry count
//   entry    u32 name length, name bytes (UTF-8), u8 dtype, u8 ndim, i64 dims[ndim], u64 byte count, bytes
//   footer   u32 CRC-32 (zlib) of everything before it, u32 footer magic "DGND"
// The magic's "\r\n" catches text-mode mangling, as PNG's does.
//
// writeCheckpoint() writes to a temporary file in the destination's directory, fsyncs it, renames it over
// the destination and fsyncs the directory: a crash at any point leaves either the old checkpoint or the
// new one, never a torn file. readCheckpoint() trusts nothing: it checks the magic, the version, every
// length against the file size, dtype codes, shapes against byte counts, duplicate names and the checksum,
// and names the file and the problem in the error.
// Thread-safety: save/load of different paths may run concurrently; saving one path from two threads
// leaves one of the two complete files.
#pragma once

#include <cstdint>
#include <string>

#include "models/state_dict.h"

namespace distgrad::models {

class Module;

inline constexpr uint32_t kCheckpointVersion = 1;

// Writes `state` to `path` atomically. Throws ValueError naming the path (and the OS error) on failure; the
// previous file at `path`, if any, is untouched then.
void writeCheckpoint(const StateDict& state, const std::string& path);
// Reads and validates a checkpoint; tensors come back as contiguous CPU tensors.
StateDict readCheckpoint(const std::string& path);

// Module helpers: save module.stateDict(); load a file and copy it into the module (see
// Module::loadStateDict for `strict`).
void saveCheckpoint(const Module& module, const std::string& path);
void loadCheckpoint(Module& module, const std::string& path, bool strict = true);

}  // namespace distgrad::models
