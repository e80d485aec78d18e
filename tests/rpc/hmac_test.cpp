#include "rpc/detail/hmac.h"

#include <gtest/gtest.h>

#include <set>
#include <string>
#include <vector>

#include "tensor/error.h"

namespace distgrad::rpc::detail {
namespace {

std::vector<uint8_t> repeat(uint8_t byte, size_t count) { return std::vector<uint8_t>(count, byte); }
std::vector<uint8_t> text(const std::string& s) { return std::vector<uint8_t>(s.begin(), s.end()); }

struct Rfc4231Case {
  const char* name;
  std::vector<uint8_t> key;
  std::vector<uint8_t> data;
  const char* hmacSha256Hex;  // the full 32 bytes, except case 5 (truncated to 16 bytes by the RFC)
};

// RFC 4231 section 4, HMAC-SHA-256 results.
std::vector<Rfc4231Case> rfc4231Cases() {
  std::vector<uint8_t> key4;
  for (uint8_t i = 1; i <= 25; ++i) key4.push_back(i);
  return {
      {"case1", repeat(0x0b, 20), text("Hi There"),
       "b0344c61d8db38535ca8afceaf0bf12b881dc200c9833da726e9376c2e32cff7"},
      {"case2", text("Jefe"), text("what do ya want for nothing?"),
       "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843"},
      {"case3", repeat(0xaa, 20), repeat(0xdd, 50),
       "773ea91e36800e46854db8ebd09181a72959098b3ef8c122d9635514ced565fe"},
      {"case4", key4, repeat(0xcd, 50), "82558a389a443c0ea4cc819899f2083a85f0faa3e578f8077a2e3ff46729665b"},
      {"case5", repeat(0x0c, 20), text("Test With Truncation"), "a3b6167473100ee06e0c796c2955552b"},
      {"case6", repeat(0xaa, 131), text("Test Using Larger Than Block-Size Key - Hash Key First"),
       "60e431591ee0b67f0d8a26aacbf5b77f8e0bc6213728c5140546040f0ee37f54"},
      {"case7", repeat(0xaa, 131),
       text("This is a test using a larger than block-size key and a larger than block-size data. The key needs "
            "to be hashed before being used by the HMAC algorithm."),
       "9b09ffa71b942fcb27635fbcd5b0e944bfdc63644f0713938a7f51535c3a35e2"},
  };
}

TEST(Hmac, Rfc4231Vectors) {
  for (const auto& tc : rfc4231Cases()) {
    const HmacDigest digest = hmacSha256(tc.key, tc.data);
    const std::string expected = tc.hmacSha256Hex;
    const std::string got = toHex(digest).substr(0, expected.size());
    EXPECT_EQ(got, expected) << tc.name;
  }
}

TEST(Hmac, StringOverloadMatchesBytes) {
  const HmacDigest a = hmacSha256(std::string_view("Jefe"), std::string_view("what do ya want for nothing?"));
  EXPECT_EQ(toHex(a), "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843");
}

TEST(Hmac, EmptyKeyAndMessageAreValidInputs) {
  // HMAC-SHA256("", "") is a well-known value.
  const HmacDigest d = hmacSha256(std::string_view(""), std::string_view(""));
  EXPECT_EQ(toHex(d), "b613679a0814d9ec772f95d778c35fc5ff1697c493715653c6c712144292c5ad");
}

TEST(Hmac, ConstantTimeEqual) {
  const HmacDigest a = hmacSha256(std::string_view("k"), std::string_view("m1"));
  HmacDigest b = a;
  EXPECT_TRUE(constantTimeEqual(a, b));
  b[31] ^= 1;
  EXPECT_FALSE(constantTimeEqual(a, b));
  b = a;
  b[0] ^= 0x80;
  EXPECT_FALSE(constantTimeEqual(a, b));
  // Different lengths never compare equal, even when one is a prefix of the other.
  EXPECT_FALSE(constantTimeEqual(std::span<const uint8_t>(a).first(16), a));
  EXPECT_TRUE(constantTimeEqual(std::span<const uint8_t>(), std::span<const uint8_t>()));
}

TEST(Hmac, NoncesAndRandomBytesDiffer) {
  std::set<std::string> seen;
  for (int i = 0; i < 16; ++i) {
    auto nonce = makeNonce();
    EXPECT_TRUE(seen.insert(toHex(nonce)).second) << "nonce repeated";
  }
  EXPECT_EQ(randomBytes(0).size(), 0u);
  EXPECT_EQ(randomBytes(1000).size(), 1000u);
  EXPECT_NE(randomBytes(32), randomBytes(32));
}

TEST(Hmac, GenerateSecretIsHexOf32Bytes) {
  const std::string a = generateSecret();
  const std::string b = generateSecret();
  EXPECT_EQ(a.size(), 64u);
  EXPECT_NE(a, b);
  EXPECT_EQ(a.find_first_not_of("0123456789abcdef"), std::string::npos) << a;
  EXPECT_EQ(fromHex(a).size(), 32u);
}

TEST(Hmac, HexRoundTripAndErrors) {
  const std::vector<uint8_t> bytes{0x00, 0x01, 0x7f, 0x80, 0xab, 0xff};
  EXPECT_EQ(toHex(bytes), "00017f80abff");
  EXPECT_EQ(fromHex("00017F80abFF"), bytes);
  EXPECT_THROW(fromHex("abc"), ValueError);
  try {
    fromHex("0g");
    FAIL() << "expected a ValueError";
  } catch (const ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("invalid hex digit"), std::string::npos) << e.what();
  }
}

// The handshake pattern: both sides compute the MAC over the peer's nonce; a wrong secret never verifies.
TEST(Hmac, HandshakeStyleVerification) {
  const std::string secret = generateSecret();
  const auto nonce = makeNonce();
  const HmacDigest answer = hmacSha256(std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(secret.data()), secret.size()), nonce);
  const HmacDigest expected = hmacSha256(std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(secret.data()), secret.size()), nonce);
  EXPECT_TRUE(constantTimeEqual(answer, expected));
  const std::string wrong = generateSecret();
  const HmacDigest forged = hmacSha256(std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(wrong.data()), wrong.size()), nonce);
  EXPECT_FALSE(constantTimeEqual(forged, expected));
}

}  // namespace
}  // namespace distgrad::rpc::detail
