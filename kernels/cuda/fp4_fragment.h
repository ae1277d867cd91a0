// Register-fragment layouts of the CUDA expert GEMMs, shared by the device kernels, the host-side
// weight repacking and the CPU tests that check the two agree bit for bit.
//
// The GEMMs run mma.sync.m16n8k16 (bf16 in, fp32 accumulate) with the weight tile as the 16-row
// A operand and up to 8 tokens as the N side. Weights are repacked once (PrepareLayer) so that
// one 16-byte load per lane, coalesced across the warp, yields the A fragments of 4 k-steps
// (a "chunk" of 64 K elements x 16 rows), and E2M1 codes turn into bf16 with shifts and masks:
//   - Each 32-bit word holds the 8 codes of one lane for one k-step, placed so that
//     reg j = (rotr(w, MagRotation(j)) & kMagMask) | (rotr(w, SignRotation(j)) & kSignMask)
//     puts the 3 magnitude bits at bf16 bits 8..6 and the sign at bit 15 of each half. That bf16
//     equals the E2M1 value times 2^-126 (code 1, i.e. 0.5, becomes the subnormal 2^-127); the
//     block-scale multiply (mul.bf16x2) restores the range, so its factor carries 2^126.
//   - Fragment regs (PTX ISA, m16n8k16 A): reg0 = (row g, k 2t..2t+1), reg1 = (row g+8, same k),
//     reg2 = (row g, k 2t+8..2t+9), reg3 = (row g+8, k 2t+8..2t+9); g = lane / 4, t = lane % 4;
//     the low half holds the even k.
// Activations (the B operand) are stored as bf16 rows permuted inside each 64-element chunk so a
// lane's B fragments for the 4 k-steps are 32 contiguous bytes (two 16-byte loads).
//
// Pure functions of their arguments; thread-safe. No CUDA, abseil or protobuf headers.
#ifndef MOE_KERNELS_CUDA_FP4_FRAGMENT_H_
#define MOE_KERNELS_CUDA_FP4_FRAGMENT_H_

#include <cstdint>

#if defined(__CUDACC__)
#define MOE_HD __host__ __device__ __forceinline__
#else
#define MOE_HD inline
#endif

namespace moe::cuda {

inline constexpr int kChunkK = 64;      // K elements per chunk (4 mma k-steps of 16)
inline constexpr int kStepsPerChunk = 4;
inline constexpr int kTileRows = 16;    // weight rows per mma tile (the M of m16n8k16)
inline constexpr int kTileTokens = 8;   // tokens per mma (the N of m16n8k16)
inline constexpr int kWarpLanes = 32;
// A chunk of one tile: 32 lanes x 16 bytes of packed codes.
inline constexpr int kChunkBytes = kWarpLanes * 16;
// One permuted activation chunk: 64 bf16 = 128 bytes = 8 uint4.
inline constexpr int kActChunkVectors = 8;

inline constexpr uint32_t kMagMask = 0x01C001C0u;   // bf16 bits 8..6 of both halves
inline constexpr uint32_t kSignMask = 0x80008000u;  // bf16 bit 15 of both halves

// Rotations (right) of the packed word that bring fragment register j's magnitude and sign bits
// into place: the four (magnitude, sign) translates of the bf16 bit pattern tile the 32 bits of
// the word. Chosen so that no kept bit wraps around: each rotation is a plain shift (left by 0,
// 3, 6 / 0, 3, 2, 1; right by 3 for register 3's magnitude), and the compiler can issue left
// shifts as IMAD.SHL on the FMA pipe instead of funnel shifts on the integer ALU pipe, which the
// masks and the rest of the decode keep busy. Still 11 instructions per word (registers 0 and 1
// need a single shift); ptxas puts about half of the shifts on the FMA pipe (~8.5 ALU
// instructions per word instead of 11, NOTES-cuda.md).
MOE_HD constexpr int MagRotation(int j) { return j == 0 ? 0 : j == 1 ? 29 : j == 2 ? 26 : 3; }
MOE_HD constexpr int SignRotation(int j) { return j == 0 ? 0 : j == 1 ? 29 : j == 2 ? 30 : 31; }

MOE_HD uint32_t RotateRight(uint32_t w, int n) {
#if defined(__CUDA_ARCH__)
  return __funnelshift_r(w, w, n);
#else
  return n == 0 ? w : (w >> n) | (w << (32 - n));
#endif
}

// Word bit that holds bit `q` (0..2 magnitude, 3 sign) of the code in half `h` of register `j`.
inline int PackedBitPosition(int j, int h, int q) {
  const int dest = q < 3 ? 16 * h + 6 + q : 16 * h + 15;
  const int rot = q < 3 ? MagRotation(j) : SignRotation(j);
  return (dest + rot) & 31;
}

// codes[2 * j + h] = E2M1 code (low nibble) of register j, half h -> packed word. Host only.
inline uint32_t PackFragmentWord(const uint8_t codes[8]) {
  uint32_t w = 0;
  for (int j = 0; j < 4; ++j) {
    for (int h = 0; h < 2; ++h) {
      for (int q = 0; q < 4; ++q) {
        if ((codes[2 * j + h] >> q) & 1u) w |= 1u << PackedBitPosition(j, h, q);
      }
    }
  }
  return w;
}

// Packed word -> 4 bf16x2 registers holding E2M1 * 2^-126 (see the header comment). Equal to
// the rotate-and-mask form for MagRotation / SignRotation (no kept bit wraps: repack_test checks
// both forms): rotr by 29, 26, 30, 31 = shift left by 3, 6, 2, 1; rotr by 3 = shift right by 3.
// The left shifts are written as multiplies by m = {2, 4, 8, 64} (m[4] = 128 is MxScalePairMul's):
// with those constants the compiler emits shifts (UnpackFragmentWord), and a kernel can instead
// pass them as values it cannot see (ExpertGemmParams::shift_mul), which keeps them multiplies on
// the FMA pipe (IMAD) when ptxas would put every shift on the busy integer ALU (NOTES-cuda.md).
MOE_HD void UnpackFragmentWordMul(uint32_t w, const uint32_t (&m)[5], uint32_t regs[4]) {
  regs[0] = w & (kMagMask | kSignMask);
  regs[1] = (w * m[2]) & (kMagMask | kSignMask);
  regs[2] = ((w * m[3]) & kMagMask) | ((w * m[1]) & kSignMask);
  regs[3] = ((w >> 3) & kMagMask) | ((w * m[0]) & kSignMask);
}
MOE_HD void UnpackFragmentWord(uint32_t w, uint32_t regs[4]) {
  constexpr uint32_t kShifts[5] = {2u, 4u, 8u, 64u, 128u};
  UnpackFragmentWordMul(w, kShifts, regs);
}

// Row of the 16-row tile and K offset inside the k-step of register j, half h, for lane (g, t).
MOE_HD int FragmentRow(int j, int g) { return g + 8 * (j & 1); }
MOE_HD int FragmentK(int j, int h, int t) { return 2 * t + 8 * (j >> 1) + h; }

// MXFP4 scales: one 32-bit word per (tile, chunk, g) holding the biased exponent bytes
// [row g blk 0, row g blk 1, row g+8 blk 0, row g+8 blk 1] (blk = 32-element block of the chunk).
// The byte is an exponent field: bf16 2^(byte - 127) in both halves, 0 for byte 0.
// x128 = 128 (the shift into the exponent field; see UnpackFragmentWordMul).
MOE_HD uint32_t MxScalePairMul(uint32_t scale_word, int byte_index, uint32_t x128) {
#if defined(__CUDA_ARCH__)
  // PRMT [byte, 0, byte, 0] then the shift into the exponent field: two instructions.
  return __byte_perm(scale_word, 0u, 0x4040u | (byte_index << 8) | byte_index) * x128;
#else
  return ((scale_word >> (8 * byte_index)) & 0xFFu) * (0x00010001u * x128);
#endif
}
MOE_HD uint32_t MxScalePair(uint32_t scale_word, int byte_index) {
  return MxScalePairMul(scale_word, byte_index, 128u);
}
// Byte index of the scale of fragment row half `row8` (0: row g, 1: row g+8) at k-step `step`.
MOE_HD int MxScaleByte(int step, int row8) { return 2 * row8 + (step >> 1); }

// NVFP4 scales: four 32-bit words per (tile, chunk, g); word `step` holds bf16 scales
// [low: row g, high: row g+8] of the 16-element block of that k-step.
MOE_HD uint32_t NvScalePair(uint32_t step_word, int row8) {
#if defined(__CUDA_ARCH__)
  return __byte_perm(step_word, 0u, row8 == 0 ? 0x1010u : 0x3232u);
#else
  return (row8 == 0 ? (step_word & 0xFFFFu) : (step_word >> 16)) * 0x00010001u;
#endif
}

// Position (bf16 elements) of element k (0..63) of a chunk inside the permuted activation chunk:
// lane t's B registers for k-steps 0..3 are elements [16 t, 16 t + 16).
MOE_HD int ActPermIndex(int k) {
  const int step = k >> 4;
  const int r = k & 15;
  return ((r & 7) >> 1) * 16 + step * 4 + (r >> 3) * 2 + (r & 1);
}
// Inverse of ActPermIndex.
MOE_HD int ActPermSource(int pos) {
  const int t = pos >> 4;
  const int step = (pos >> 2) & 3;
  const int hi = (pos >> 1) & 1;
  const int e = pos & 1;
  return step * 16 + hi * 8 + 2 * t + e;
}

}  // namespace moe::cuda

#endif  // MOE_KERNELS_CUDA_FP4_FRAGMENT_H_
