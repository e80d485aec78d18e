// HMAC-SHA256, constant-time comparison and random bytes for the handshake and the launcher.
//
// The agent's handshake proves both ends know the cluster secret (DISTGRAD_SECRET) without sending it:
// each side sends a random nonce and answers the other's with HMAC-SHA256(secret, nonce || context).
// Everything here wraps OpenSSL's libcrypto (one-shot HMAC(), CRYPTO_memcmp, RAND_bytes); no state is
// kept between calls.
// Thread-safety: stateless; safe from any thread.
#pragma once

#include <array>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace distgrad::rpc::detail {

inline constexpr size_t kHmacSha256Bytes = 32;
using HmacDigest = std::array<uint8_t, kHmacSha256Bytes>;

// HMAC-SHA256(key, message). Any key length is allowed (RFC 2104: longer keys are hashed first).
HmacDigest hmacSha256(std::span<const uint8_t> key, std::span<const uint8_t> message);
HmacDigest hmacSha256(std::string_view key, std::string_view message);

// Equality whose running time depends only on the lengths, not on where the first difference is, so a
// peer probing the handshake cannot learn a correct MAC byte by byte.
bool constantTimeEqual(std::span<const uint8_t> a, std::span<const uint8_t> b);

// `count` cryptographically random bytes (RAND_bytes). Throws distgrad::InternalError if the system RNG
// fails (it does not fail on a healthy Linux).
std::vector<uint8_t> randomBytes(size_t count);

// A fresh nonce for one handshake.
inline constexpr size_t kNonceBytes = 32;
std::array<uint8_t, kNonceBytes> makeNonce();

// Lower-case hex of bytes, and its inverse (throws distgrad::ValueError on odd length or a non-hex digit).
std::string toHex(std::span<const uint8_t> bytes);
std::vector<uint8_t> fromHex(std::string_view hex);

// A new cluster secret: the hex of 32 random bytes (64 characters). The launcher generates one per job and
// gives it to every worker in DISTGRAD_SECRET.
std::string generateSecret();

}  // namespace distgrad::rpc::detail
