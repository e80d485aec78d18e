#include "rpc/detail/hmac.h"

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/rand.h>

#include <climits>

#include "tensor/error.h"

namespace distgrad::rpc::detail {

HmacDigest hmacSha256(std::span<const uint8_t> key, std::span<const uint8_t> message) {
  DG_CHECK(key.size() <= static_cast<size_t>(INT_MAX), "hmacSha256: key of ", key.size(), " bytes is too long");
  HmacDigest out{};
  unsigned int outLen = 0;
  // HMAC() with a null key pointer would be treated as "no key"; an empty key is valid HMAC input, so pass a
  // non-null pointer for it.
  static const uint8_t kEmpty = 0;
  const uint8_t* keyData = key.empty() ? &kEmpty : key.data();
  const uint8_t* messageData = message.empty() ? &kEmpty : message.data();
  const unsigned char* result = HMAC(EVP_sha256(), keyData, static_cast<int>(key.size()), messageData,
                                     message.size(), out.data(), &outLen);
  DG_ASSERT(result != nullptr && outLen == kHmacSha256Bytes, "OpenSSL HMAC-SHA256 failed");
  return out;
}

HmacDigest hmacSha256(std::string_view key, std::string_view message) {
  return hmacSha256(std::span(reinterpret_cast<const uint8_t*>(key.data()), key.size()),
                    std::span(reinterpret_cast<const uint8_t*>(message.data()), message.size()));
}

bool constantTimeEqual(std::span<const uint8_t> a, std::span<const uint8_t> b) {
  // Lengths are public (a MAC has a fixed length); only the contents must not leak through timing.
  if (a.size() != b.size()) return false;
  if (a.empty()) return true;
  return CRYPTO_memcmp(a.data(), b.data(), a.size()) == 0;
}

std::vector<uint8_t> randomBytes(size_t count) {
  std::vector<uint8_t> out(count);
  size_t done = 0;
  while (done < count) {
    // RAND_bytes takes an int length; loop for (absurdly) large requests.
    const size_t chunk = std::min<size_t>(count - done, 1u << 30);
    DG_ASSERT(RAND_bytes(out.data() + done, static_cast<int>(chunk)) == 1, "OpenSSL RAND_bytes failed");
    done += chunk;
  }
  return out;
}

std::array<uint8_t, kNonceBytes> makeNonce() {
  std::array<uint8_t, kNonceBytes> nonce{};
  DG_ASSERT(RAND_bytes(nonce.data(), static_cast<int>(nonce.size())) == 1, "OpenSSL RAND_bytes failed");
  return nonce;
}

std::string toHex(std::span<const uint8_t> bytes) {
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string out;
  out.reserve(bytes.size() * 2);
  for (uint8_t b : bytes) {
    out.push_back(kDigits[b >> 4]);
    out.push_back(kDigits[b & 0xf]);
  }
  return out;
}

namespace {
int hexValue(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}
}  // namespace

std::vector<uint8_t> fromHex(std::string_view hex) {
  DG_CHECK(hex.size() % 2 == 0, "fromHex: expected an even number of hex digits, got ", hex.size());
  std::vector<uint8_t> out(hex.size() / 2);
  for (size_t i = 0; i < out.size(); ++i) {
    const int hi = hexValue(hex[2 * i]);
    const int lo = hexValue(hex[2 * i + 1]);
    DG_CHECK(hi >= 0 && lo >= 0, "fromHex: invalid hex digit at offset ", (hi < 0 ? 2 * i : 2 * i + 1), " in '",
             hex, "'");
    out[i] = static_cast<uint8_t>((hi << 4) | lo);
  }
  return out;
}

std::string generateSecret() {
  const std::vector<uint8_t> bytes = randomBytes(32);
  return toHex(bytes);
}

}  // namespace distgrad::rpc::detail
