// Host build of the element conversions in native/kv_codecs.cu, checked against torch by
// tests/codecs/test_native.py. Input: N float32 x, then N float32 inv. Output: N e4m3 codes of
// x, N bf16 patterns of x, N int8 codes of (x, inv), N fp8 codes of (x, inv), 256 float32 values
// of every e4m3 code.
#include <cstdio>
#include <vector>

#include "../../native/kv_codecs.cu"

int main(int argc, char** argv) {
  if (argc != 3) { std::fprintf(stderr, "usage: native_check IN OUT\n"); return 2; }
  std::FILE* in = std::fopen(argv[1], "rb");
  if (!in) return 3;
  std::vector<float> buf;
  float f;
  while (std::fread(&f, 4, 1, in) == 1) buf.push_back(f);
  std::fclose(in);
  size_t n = buf.size() / 2;
  std::vector<u8> e4(n), qi(n), qf(n);
  std::vector<u16> b16(n);
  for (size_t i = 0; i < n; ++i) {
    float x = buf[i], inv = buf[n + i];
    e4[i] = kvb_f32_to_e4m3(x);
    b16[i] = kvb_f32_to_bf16(x);
    qi[i] = (u8)kvb_q_int8(x, inv);
    qf[i] = kvb_q_fp8(x, inv);
  }
  std::vector<float> table(256);
  for (int c = 0; c < 256; ++c) table[c] = kvb_e4m3_to_f32((u8)c);
  std::FILE* out = std::fopen(argv[2], "wb");
  if (!out) return 4;
  std::fwrite(e4.data(), 1, n, out);
  std::fwrite(b16.data(), 2, n, out);
  std::fwrite(qi.data(), 1, n, out);
  std::fwrite(qf.data(), 1, n, out);
  std::fwrite(table.data(), 4, 256, out);
  std::fclose(out);
  return 0;
}
