/*
 * Matmuls over x16-interleaved GGUF blocks with 8-bit activations and
 * integer dot products (the layout and the sum: gguf_x16.h).
 *
 * A call first rounds its rows to int8, block by block, into the node's
 * scratch (the team shares the rows out), then the team shares the tiles of
 * 16 channels out; a thread runs X16_MR rows at a time against a tile, each
 * row keeping one vector of 16 channel sums (AVX-512; two of 8 on AVX2, one
 * float per channel in the scalar build):
 *
 *   for each block b:                     tile block: d[16] (m[16]) | chunks of 64 B
 *     isum[r] = 0                         row r's block b: qx[32] int8, dx, sx
 *     for each chunk: w = 64 B (+ nibbles split) ; isum[r] += dot4(w, broadcast qx[r][4 inputs])
 *     acc[r] = fma(float(isum[r] - o sx), d dx, acc[r])   (+ fma(m, dx sx, acc[r]) for Q4_1)
 *
 * The weights of one tile (18 blocks x 320 B for a 576-input Q4_1 row) stay
 * in L1 while the rows stream past; long inputs go in blocks of rows whose
 * int8 copies stay in L2.
 */
#include "gguf_x16.h"

#include <math.h>
#include <string.h>

#if defined(__AVX512F__) && defined(__AVX512BW__)
/* 16 lanes: a whole tile */
#define X16_VL 16
#define X16_MR 4
typedef __m512i ivec;
typedef __m512 fvec;
static inline ivec iload(const uint8_t *p) { return _mm512_loadu_si512((const void *)p); }
static inline ivec izero() { return _mm512_setzero_si512(); }
static inline ivec iquad(const int8_t *p) { int32_t v; memcpy(&v, p, 4); return _mm512_set1_epi32(v); }
static inline ivec nib_lo(ivec v) { return _mm512_and_si512(v, _mm512_set1_epi8(0x0f)); }
static inline ivec nib_hi(ivec v) { return _mm512_and_si512(_mm512_srli_epi16(v, 4), _mm512_set1_epi8(0x0f)); }
static inline ivec isub_all(ivec a, int32_t b) { return _mm512_sub_epi32(a, _mm512_set1_epi32(b)); }
#if defined(__AVX512VNNI__)
#define X16_Q8_OFFSET 128 /* vpdpbusd takes the weights as uint8: q + 128 */
static inline ivec dot_u4(ivec acc, ivec w, ivec x) { return _mm512_dpbusd_epi32(acc, w, x); }
static inline ivec dot_q8(ivec acc, ivec w, ivec x) { return _mm512_dpbusd_epi32(acc, w, x); }
#else
#define X16_Q8_OFFSET 0
static inline ivec dot_u4(ivec acc, ivec w, ivec x) {
    return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(w, x), _mm512_set1_epi16(1)));
}
/* signed weights: |q| times x with q's sign (vpmaddubsw takes its first operand unsigned) */
static inline ivec dot_q8(ivec acc, ivec w, ivec x) {
    const ivec q = _mm512_xor_si512(w, _mm512_set1_epi8((char)0x80));
    const __mmask64 neg = _mm512_movepi8_mask(q);
    const ivec xs = _mm512_mask_sub_epi8(x, neg, _mm512_setzero_si512(), x);
    return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(_mm512_abs_epi8(q), xs), _mm512_set1_epi16(1)));
}
#endif
static inline fvec fzero() { return _mm512_setzero_ps(); }
static inline fvec fset1(float v) { return _mm512_set1_ps(v); }
static inline fvec fhalves(const uint8_t *p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)); }
static inline fvec fmul(fvec a, fvec b) { return _mm512_mul_ps(a, b); }
static inline fvec ffma(fvec a, fvec b, fvec c) { return _mm512_fmadd_ps(a, b, c); }
static inline fvec fcvt(ivec a) { return _mm512_cvtepi32_ps(a); }
static inline void fstore(float *p, fvec v) { _mm512_storeu_ps(p, v); }
static inline fvec fload(const float *p) { return _mm512_loadu_ps(p); }
static inline fvec fadd(fvec a, fvec b) { return _mm512_add_ps(a, b); }
/* byte ops for the k-quants' upper bits (16-bit shifts: the masks drop what crosses a byte) */
static inline ivec ibits(ivec v, int s, int mask) { return _mm512_and_si512(_mm512_srli_epi16(v, s), _mm512_set1_epi8((char)mask)); }
static inline ivec ishl4(ivec v) { return _mm512_slli_epi16(v, 4); }
static inline ivec ishl2(ivec v) { return _mm512_slli_epi16(v, 2); }
static inline ivec ior(ivec a, ivec b) { return _mm512_or_si512(a, b); }
/* 32-bit lane ops: one lane per channel */
static inline ivec lanes_u8(const uint8_t *p) { return _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p)); }
static inline ivec lanes_s8(const uint8_t *p) { return _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)); }
static inline ivec lmul(ivec a, ivec b) { return _mm512_mullo_epi32(a, b); }
static inline ivec ladd(ivec a, ivec b) { return _mm512_add_epi32(a, b); }
static inline ivec lset1(int32_t v) { return _mm512_set1_epi32(v); }
static inline ivec land(ivec a, int32_t m) { return _mm512_and_si512(a, _mm512_set1_epi32(m)); }
static inline ivec lsrl(ivec a, int s) { return _mm512_srli_epi32(a, s); }
static inline ivec lsll(ivec a, int s) { return _mm512_slli_epi32(a, s); }
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
/* 8 lanes: a tile in two halves */
#define X16_VL 8
#define X16_MR 4
#define X16_Q8_OFFSET 0
typedef __m256i ivec;
typedef __m256 fvec;
static inline ivec iload(const uint8_t *p) { return _mm256_loadu_si256((const __m256i *)p); }
static inline ivec izero() { return _mm256_setzero_si256(); }
static inline ivec iquad(const int8_t *p) { int32_t v; memcpy(&v, p, 4); return _mm256_set1_epi32(v); }
static inline ivec nib_lo(ivec v) { return _mm256_and_si256(v, _mm256_set1_epi8(0x0f)); }
static inline ivec nib_hi(ivec v) { return _mm256_and_si256(_mm256_srli_epi16(v, 4), _mm256_set1_epi8(0x0f)); }
static inline ivec isub_all(ivec a, int32_t b) { return _mm256_sub_epi32(a, _mm256_set1_epi32(b)); }
static inline ivec dot_u4(ivec acc, ivec w, ivec x) {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1)));
}
static inline ivec dot_q8(ivec acc, ivec w, ivec x) {
    const ivec q = _mm256_xor_si256(w, _mm256_set1_epi8((char)0x80));
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(q), _mm256_sign_epi8(x, q)),
                                                   _mm256_set1_epi16(1)));
}
static inline fvec fzero() { return _mm256_setzero_ps(); }
static inline fvec fset1(float v) { return _mm256_set1_ps(v); }
static inline fvec fhalves(const uint8_t *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }
static inline fvec fmul(fvec a, fvec b) { return _mm256_mul_ps(a, b); }
static inline fvec ffma(fvec a, fvec b, fvec c) { return _mm256_fmadd_ps(a, b, c); }
static inline fvec fcvt(ivec a) { return _mm256_cvtepi32_ps(a); }
static inline void fstore(float *p, fvec v) { _mm256_storeu_ps(p, v); }
static inline fvec fload(const float *p) { return _mm256_loadu_ps(p); }
static inline fvec fadd(fvec a, fvec b) { return _mm256_add_ps(a, b); }
static inline ivec ibits(ivec v, int s, int mask) { return _mm256_and_si256(_mm256_srli_epi16(v, s), _mm256_set1_epi8((char)mask)); }
static inline ivec ishl4(ivec v) { return _mm256_slli_epi16(v, 4); }
static inline ivec ishl2(ivec v) { return _mm256_slli_epi16(v, 2); }
static inline ivec ior(ivec a, ivec b) { return _mm256_or_si256(a, b); }
static inline ivec lanes_u8(const uint8_t *p) { return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p)); }
static inline ivec lanes_s8(const uint8_t *p) { return _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)); }
static inline ivec lmul(ivec a, ivec b) { return _mm256_mullo_epi32(a, b); }
static inline ivec ladd(ivec a, ivec b) { return _mm256_add_epi32(a, b); }
static inline ivec lset1(int32_t v) { return _mm256_set1_epi32(v); }
static inline ivec land(ivec a, int32_t m) { return _mm256_and_si256(a, _mm256_set1_epi32(m)); }
static inline ivec lsrl(ivec a, int s) { return _mm256_srli_epi32(a, s); }
static inline ivec lsll(ivec a, int s) { return _mm256_slli_epi32(a, s); }
#else
/* one lane: a channel at a time; a "vector" of bytes is the channel's 4 bytes of a chunk */
#define X16_VL 1
#define X16_MR 4
#define X16_Q8_OFFSET 0
typedef int32_t ivec;
typedef float fvec;
static inline ivec iload(const uint8_t *p) { int32_t v; memcpy(&v, p, 4); return v; }
static inline ivec izero() { return 0; }
static inline ivec iquad(const int8_t *p) { return iload((const uint8_t *)p); }
static inline ivec nib_lo(ivec v) { return (int32_t)((uint32_t)v & 0x0f0f0f0fu); }
static inline ivec nib_hi(ivec v) { return (int32_t)(((uint32_t)v >> 4) & 0x0f0f0f0fu); }
static inline ivec isub_all(ivec a, int32_t b) { return a - b; }
static inline ivec dot_u4(ivec acc, ivec w, ivec x) {
    for (int i = 0; i < 4; i++) acc += (int32_t)(uint8_t)((uint32_t)w >> (8 * i)) * (int32_t)(int8_t)((uint32_t)x >> (8 * i));
    return acc;
}
static inline ivec dot_q8(ivec acc, ivec w, ivec x) {
    for (int i = 0; i < 4; i++)
        acc += (int32_t)(int8_t)(((uint32_t)w >> (8 * i)) ^ 0x80u) * (int32_t)(int8_t)((uint32_t)x >> (8 * i));
    return acc;
}
static inline fvec fzero() { return 0.0f; }
static inline fvec fset1(float v) { return v; }
static inline fvec fhalves(const uint8_t *p) { return gguf_half(p); }
static inline fvec fmul(fvec a, fvec b) { return a * b; }
static inline fvec ffma(fvec a, fvec b, fvec c) { return fmaf(a, b, c); }
static inline fvec fcvt(ivec a) { return (float)a; }
static inline void fstore(float *p, fvec v) { *p = v; }
static inline fvec fload(const float *p) { return *p; }
static inline fvec fadd(fvec a, fvec b) { return a + b; }
static inline ivec ibits(ivec v, int s, int mask) { return (int32_t)(((uint32_t)v >> s) & ((uint32_t)mask * 0x01010101u)); }
static inline ivec ishl4(ivec v) { return (int32_t)((uint32_t)v << 4); }
static inline ivec ishl2(ivec v) { return (int32_t)((uint32_t)v << 2); }
static inline ivec ior(ivec a, ivec b) { return a | b; }
static inline ivec lanes_u8(const uint8_t *p) { return p[0]; }
static inline ivec lanes_s8(const uint8_t *p) { return (int8_t)p[0]; }
static inline ivec lmul(ivec a, ivec b) { return a * b; }
static inline ivec ladd(ivec a, ivec b) { return a + b; }
static inline ivec lset1(int32_t v) { return v; }
static inline ivec land(ivec a, int32_t m) { return a & m; }
static inline ivec lsrl(ivec a, int s) { return (int32_t)((uint32_t)a >> s); }
static inline ivec lsll(ivec a, int s) { return (int32_t)((uint32_t)a << s); }
#endif

/* ---- the layout (gguf_x16.h) ---- */

/* quant n (0..31) of a raw Q4 block's 16 bytes */
static inline int raw_q4(const uint8_t *qs, int n) { return n < 16 ? qs[n] & 0x0f : qs[n - 16] >> 4; }

static inline bool is_q5(int type) { return type == GGUF_Q5_0 || type == GGUF_Q5_1; }

/* quant n (0..31) of a raw Q4_0 / Q4_1 / Q5_0 / Q5_1 block, unsigned (Q5: with its fifth bit) */
static inline int raw_quant(int type, const uint8_t *blk, int n) {
    const int low = raw_q4(blk + gguf_quants_at(type), n);
    return is_q5(type) ? low | (int)((gguf_q5_high(type, blk) >> n) & 1) << 4 : low;
}

/* bytes of a tile block's scales (and mins) ahead of its chunks */
static inline int tile_head_bytes(int type) { return gguf_has_min(type) ? 64 : 32; }

/* one tile block from the 16 raw blocks src[c] (c = 0..15) of ggml `type` */
static void interleave_block(int type, uint8_t *const *src, uint8_t *dst) {
    for (int c = 0; c < X16_TILE; c++) {
        memcpy(dst + 2 * c, src[c], 2);                                         // d
        if (gguf_has_min(type)) memcpy(dst + 32 + 2 * c, src[c] + 2, 2);        // m
    }
    uint8_t *qs = dst + tile_head_bytes(type);
    for (int c = 0; c < X16_TILE; c++) {
        if (type == GGUF_Q8_0) {
            const uint8_t *q = src[c] + 2;
            for (int n = 0; n < 32; n++) qs[64 * (n / 4) + 4 * c + n % 4] = (uint8_t)(q[n] ^ 0x80);
            continue;
        }
        for (int j = 0; j < 4; j++)
            for (int i = 0; i < 4; i++) {
                const int lo = raw_quant(type, src[c], 8 * j + i), hi = raw_quant(type, src[c], 8 * j + 4 + i);
                qs[64 * j + 4 * c + i] = (uint8_t)((lo & 0x0f) | (hi & 0x0f) << 4);
                if (!is_q5(type)) continue;
                uint8_t *top = qs + 256 + 4 * c + i;  // the fifth bits, as a Q5_K run's (gguf_x16.h)
                if (j == 0) *top = 0;
                *top |= (uint8_t)((lo >> 4) << j | (hi >> 4) << (4 + j));
            }
    }
}

/* the raw block of channel c from a tile block (the inverse of interleave_block) */
static void raw_block(int type, const uint8_t *tile_block, int c, uint8_t *dst) {
    memcpy(dst, tile_block + 2 * c, 2);
    if (gguf_has_min(type)) memcpy(dst + 2, tile_block + 32 + 2 * c, 2);
    const uint8_t *qs = tile_block + tile_head_bytes(type);
    uint8_t *q = dst + gguf_quants_at(type);
    if (type == GGUF_Q8_0) {
        for (int n = 0; n < 32; n++) q[n] = (uint8_t)(qs[64 * (n / 4) + 4 * c + n % 4] ^ 0x80);
        return;
    }
    int v[32];
    for (int j = 0; j < 4; j++)
        for (int i = 0; i < 4; i++) {
            const int top = is_q5(type) ? qs[256 + 4 * c + i] : 0;
            v[8 * j + i] = (qs[64 * j + 4 * c + i] & 0x0f) | ((top >> j) & 1) << 4;
            v[8 * j + 4 + i] = (qs[64 * j + 4 * c + i] >> 4) | ((top >> (4 + j)) & 1) << 4;
        }
    uint32_t qh = 0;
    for (int n = 0; n < 16; n++) q[n] = (uint8_t)((v[n] & 0x0f) | (v[n + 16] & 0x0f) << 4);
    for (int n = 0; n < 32; n++) qh |= (uint32_t)(v[n] >> 4) << n;
    if (is_q5(type)) memcpy(dst + (type == GGUF_Q5_1 ? 4 : 2), &qh, 4);
}

/* ---- the k-quants' layout ---- */

/* the 256 quants of a raw k-quant super-block, unsigned: Q4_K 0..15, Q5_K 0..31, Q6_K 0..63 */
static void unpack_raw_kquants(int type, const uint8_t *blk, int *q) {
    if (type == GGUF_Q6_K) {
        for (int half = 0; half < 2; half++) {
            const uint8_t *ql = blk + 64 * half, *qh = blk + 128 + 32 * half;
            int *out = q + 128 * half;
            for (int l = 0; l < 32; l++) {
                out[l] = (ql[l] & 0x0f) | (qh[l] & 3) << 4;
                out[l + 32] = (ql[l + 32] & 0x0f) | ((qh[l] >> 2) & 3) << 4;
                out[l + 64] = (ql[l] >> 4) | ((qh[l] >> 4) & 3) << 4;
                out[l + 96] = (ql[l + 32] >> 4) | ((qh[l] >> 6) & 3) << 4;
            }
        }
        return;
    }
    const uint8_t *qs = blk + (type == GGUF_Q5_K ? 48 : 16), *qh = blk + 16;
    for (int pair = 0; pair < 4; pair++)
        for (int l = 0; l < 32; l++) {
            const int byte = qs[32 * pair + l];
            q[64 * pair + l] = byte & 0x0f;
            q[64 * pair + 32 + l] = byte >> 4;
            if (type == GGUF_Q5_K) {
                q[64 * pair + l] |= ((qh[l] >> (2 * pair)) & 1) << 4;
                q[64 * pair + 32 + l] |= ((qh[l] >> (2 * pair + 1)) & 1) << 4;
            }
        }
}

/* the quants q[256] written into a raw k-quant super-block (its quant bytes zeroed first) */
static void pack_raw_kquants(int type, const int *q, uint8_t *blk) {
    if (type == GGUF_Q6_K) {
        memset(blk, 0, 192);
        for (int n = 0; n < 256; n++) {
            const int half = n / 128, p = n % 128, l = p % 32, g = p / 32;
            blk[64 * half + l + (g & 1) * 32] |= (uint8_t)((q[n] & 0x0f) << (g < 2 ? 0 : 4));
            blk[128 + 32 * half + l] |= (uint8_t)((q[n] >> 4) << (2 * g));
        }
        return;
    }
    uint8_t *qs = blk + (type == GGUF_Q5_K ? 48 : 16);
    memset(qs, 0, 128);
    if (type == GGUF_Q5_K) memset(blk + 16, 0, 32);
    for (int n = 0; n < 256; n++) {
        const int sub = n / 32, l = n % 32;
        qs[32 * (sub / 2) + l] |= (uint8_t)((q[n] & 0x0f) << (sub % 2 ? 4 : 0));
        if (type == GGUF_Q5_K) blk[16 + l] |= (uint8_t)(((q[n] >> 4) & 1) << sub);
    }
}

/* offsets in a tile super-block (gguf_x16.h): run j's low 4 bits (4 chunks of 64 B), then the bits above them,
   runs back to back after the headers (one stream of loads) */
static inline int kq_run_bytes(int type) { return type == GGUF_Q6_K ? 384 : (type == GGUF_Q5_K ? 320 : 256); }
static inline int kq_qs_offset(int type, int j) { return (type == GGUF_Q6_K ? 288 : 256) + kq_run_bytes(type) * j; }
static inline int kq_qh_offset(int type, int j) { return kq_qs_offset(type, j) + 256; }

/* one tile super-block from the 16 raw super-blocks raw[c] of k-quant `type` (to_tile; c0 = 0, c1 = 16),
   or back: channels [c0, c1)'s raw super-blocks from the tile's, into raw[c] */
static void move_kblock(int type, uint8_t *const *raw, uint8_t *tile, bool to_tile, int c0, int c1) {
    if (to_tile) memset(tile + kq_qs_offset(type, 0), 0, (size_t)(X16_TILE * gguf_block_bytes(type) - kq_qs_offset(type, 0)));
    for (int c = c0; c < c1; c++) {
        uint8_t *src = raw[c];
        // headers: fp16 d (and dmin), the packed scales byte by byte
        const int num_halves = type == GGUF_Q6_K ? 1 : 2, num_scales = type == GGUF_Q6_K ? 16 : 12;
        uint8_t *src_halves = type == GGUF_Q6_K ? src + 208 : src, *src_scales = type == GGUF_Q6_K ? src + 192 : src + 4;
        uint8_t *tile_scales = tile + 32 * num_halves;
        for (int i = 0; i < num_halves; i++) {
            if (to_tile) memcpy(tile + 32 * i + 2 * c, src_halves + 2 * i, 2);
            else memcpy(src_halves + 2 * i, tile + 32 * i + 2 * c, 2);
        }
        for (int i = 0; i < num_scales; i++) {
            if (to_tile) tile_scales[16 * i + c] = src_scales[i];
            else src_scales[i] = tile_scales[16 * i + c];
        }
        int q[256];
        if (to_tile) unpack_raw_kquants(type, src, q);
        for (int j = 0; j < 8; j++)
            for (int u = 0; u < 4; u++)
                for (int i = 0; i < 4; i++) {
                    int *lo = q + 32 * j + 8 * u + i, *hi = lo + 4;  // the pair one chunk byte holds
                    uint8_t *byte = tile + kq_qs_offset(type, j) + 64 * u + 4 * c + i;
                    uint8_t *top = tile + kq_qh_offset(type, j) + (type == GGUF_Q6_K ? 64 * (u / 2) : 0) + 4 * c + i;
                    const int shift = type == GGUF_Q6_K ? 4 * (u % 2) : u, bits = type == GGUF_Q6_K ? 3 : 1,
                              step = type == GGUF_Q6_K ? 2 : 4;
                    if (to_tile) {
                        *byte = (uint8_t)((*lo & 0x0f) | (*hi & 0x0f) << 4);
                        if (type != GGUF_Q4_K) *top |= (uint8_t)((*lo >> 4) << shift | (*hi >> 4) << (shift + step));
                    } else {
                        *lo = *byte & 0x0f;
                        *hi = *byte >> 4;
                        if (type != GGUF_Q4_K) {
                            *lo |= ((*top >> shift) & bits) << 4;
                            *hi |= ((*top >> (shift + step)) & bits) << 4;
                        }
                    }
                }
        if (!to_tile) pack_raw_kquants(type, q, src);
    }
}

/* ---- Q2_K and Q3_K's layout ---- */

/* offsets in a tile super-block of Q2_K / Q3_K (gguf_x16.h): run j's two vectors of 2-bit quants, then (Q3_K)
   its vector of high bits */
static inline int lk_run_bytes(int type) { return type == GGUF_Q3_K ? 192 : 128; }
static inline int lk_run_offset(int type, int j) { return (type == GGUF_Q3_K ? 224 : 320) + lk_run_bytes(type) * j; }

/* a raw Q2_K / Q3_K super-block's 256 quants' low 2 bits, and (Q3_K) their high bits: weight 128h + 32g + l
   is bits 2g, 2g + 1 of qs[32h + l] and bit 4h + g of hmask[l] */
static void unpack_raw_lowk(int type, const uint8_t *blk, int *q2, int *hbit) {
    const uint8_t *qs = blk + (type == GGUF_Q3_K ? 32 : 16);
    for (int n = 0; n < 256; n++) {
        const int h = n / 128, g = n % 128 / 32, l = n % 32;
        q2[n] = (qs[32 * h + l] >> (2 * g)) & 3;
        hbit[n] = type == GGUF_Q3_K ? (blk[l] >> (4 * h + g)) & 1 : 0;
    }
}

static void pack_raw_lowk(int type, const int *q2, const int *hbit, uint8_t *blk) {
    uint8_t *qs = blk + (type == GGUF_Q3_K ? 32 : 16);
    memset(qs, 0, 64);
    if (type == GGUF_Q3_K) memset(blk, 0, 32);
    for (int n = 0; n < 256; n++) {
        const int h = n / 128, g = n % 128 / 32, l = n % 32;
        qs[32 * h + l] |= (uint8_t)(q2[n] << (2 * g));
        if (type == GGUF_Q3_K) blk[l] |= (uint8_t)(hbit[n] << (4 * h + g));
    }
}

/* one tile super-block from the 16 raw super-blocks raw[c] of Q2_K / Q3_K (to_tile; c0 = 0, c1 = 16), or
   back: channels [c0, c1)'s raw super-blocks from the tile's, into raw[c]. Q2_K: d[16] | dmin[16] |
   scales[16 sub-blocks][16]; Q3_K: d[16] | S[12][16]; then 8 runs, chunk u (inputs 4u..4u + 3) of run j
   at bits 2 (u % 4) of vector u / 4, byte 4c + i, and (Q3_K) its high bits at bit u of the third */
static void move_lowk_block(int type, uint8_t *const *raw, uint8_t *tile, bool to_tile, int c0, int c1) {
    const bool q3 = type == GGUF_Q3_K;
    if (to_tile) memset(tile + lk_run_offset(type, 0), 0, (size_t)(8 * lk_run_bytes(type)));
    for (int c = c0; c < c1; c++) {
        uint8_t *src = raw[c];
        uint8_t *halves = src + (q3 ? 108 : 80), *scales = src + (q3 ? 96 : 0);
        const int num_halves = q3 ? 1 : 2, num_scales = q3 ? 12 : 16, scales_at = 32 * num_halves;
        for (int i = 0; i < num_halves; i++) {
            if (to_tile) memcpy(tile + 32 * i + 2 * c, halves + 2 * i, 2);
            else memcpy(halves + 2 * i, tile + 32 * i + 2 * c, 2);
        }
        for (int i = 0; i < num_scales; i++) {
            if (to_tile) tile[scales_at + 16 * i + c] = scales[i];
            else scales[i] = tile[scales_at + 16 * i + c];
        }
        int q2[256], hbit[256];
        if (to_tile) unpack_raw_lowk(type, src, q2, hbit);
        for (int n = 0; n < 256; n++) {
            const int j = n / 32, u = n % 32 / 4, i = n % 4;
            uint8_t *lo = tile + lk_run_offset(type, j) + 64 * (u / 4) + 4 * c + i, *hi = tile + lk_run_offset(type, j) + 128 + 4 * c + i;
            if (to_tile) {
                *lo |= (uint8_t)(q2[n] << (2 * (u % 4)));
                if (q3) *hi |= (uint8_t)(hbit[n] << u);
            } else {
                q2[n] = (*lo >> (2 * (u % 4))) & 3;
                hbit[n] = q3 ? (*hi >> u) & 1 : 0;
            }
        }
        if (!to_tile) pack_raw_lowk(type, q2, hbit, src);
    }
}

/* the tile super-block's way in and out, by type */
static void move_block256(int type, uint8_t *const *raw, uint8_t *tile, bool to_tile, int c0, int c1) {
    if (type == GGUF_Q2_K || type == GGUF_Q3_K) move_lowk_block(type, raw, tile, to_tile, c0, c1);
    else move_kblock(type, raw, tile, to_tile, c0, c1);
}

/* ---- the grouped types' layout ---- */

static inline int64_t group_head_bytes(int type) { return type == GROUP_I4 ? 128 : 64; }
static inline int64_t group_run_bytes(int type) { return type == GROUP_I8 ? 512 : 256; }

/* one tile group from the 16 raw groups src[c] of GROUP_I8 / GROUP_I4 `type`, `group` weights each */
static void interleave_group(int type, uint8_t *const *src, uint8_t *dst, int64_t group) {
    const int raw_head = type == GROUP_I4 ? 8 : 4, raw_run = type == GROUP_I8 ? 32 : 16;
    for (int c = 0; c < X16_TILE; c++) {
        memcpy(dst + 4 * c, src[c], 4);                                  // scale
        if (type == GROUP_I4) memcpy(dst + 64 + 4 * c, src[c] + 4, 4);   // min
        for (int64_t j = 0; j < group / GGUF_BLOCK; j++) {
            const uint8_t *q = src[c] + raw_head + raw_run * j;
            uint8_t *run = dst + group_head_bytes(type) + group_run_bytes(type) * j;
            if (type == GROUP_I8) {
                for (int n = 0; n < 32; n++) run[64 * (n / 4) + 4 * c + n % 4] = (uint8_t)(q[n] ^ 0x80);
                continue;
            }
            for (int u = 0; u < 4; u++)
                for (int i = 0; i < 4; i++)
                    run[64 * u + 4 * c + i] = (uint8_t)(raw_q4(q, 8 * u + i) | raw_q4(q, 8 * u + 4 + i) << 4);
        }
    }
}

void gguf_x16_interleave(uint8_t *weight, int type, int64_t in_features, int64_t group, int64_t tile0, int64_t tile1) {
    const bool grouped = is_group_type(type);
    const int64_t block_bytes = grouped ? group_block_bytes(type, group) : gguf_block_bytes(type);
    const int64_t num_blocks = in_features / (grouped ? group : gguf_block_weights(type));
    const int64_t row_bytes = num_blocks * block_bytes, tile_bytes = X16_TILE * row_bytes;
    uint8_t *copy = new uint8_t[tile_bytes];  // the tile's rows in their blocks' own order
    for (int64_t t = tile0; t < tile1; t++) {
        uint8_t *tile = weight + t * tile_bytes;
        memcpy(copy, tile, (size_t)tile_bytes);
        for (int64_t b = 0; b < num_blocks; b++) {
            uint8_t *src[X16_TILE], *dst = tile + b * X16_TILE * block_bytes;
            for (int c = 0; c < X16_TILE; c++) src[c] = copy + c * row_bytes + b * block_bytes;
            if (grouped)
                interleave_group(type, src, dst, group);
            else if (gguf_block_weights(type) == 256)
                move_block256(type, src, dst, true, 0, X16_TILE);
            else
                interleave_block(type, src, dst);
        }
    }
    delete[] copy;
}

/* row `row` of an x16 GROUP_I8 / GROUP_I4 table as float32: what the groups' own order gives (one rounding a
   weight: scale q, or fma(q, scale, min)) */
static void group_x16_row(int type, const uint8_t *table, int64_t row, int64_t in_features, int64_t group,
                          float *out) {
    const int64_t group_bytes = group_block_bytes(type, group), num_groups = in_features / group, c = row % X16_TILE;
    const uint8_t *tile = table + row / X16_TILE * X16_TILE * num_groups * group_bytes;
    for (int64_t g = 0; g < num_groups; g++) {
        const uint8_t *blk = tile + g * X16_TILE * group_bytes;
        float scale, min = 0.0f;
        memcpy(&scale, blk + 4 * c, 4);
        if (type == GROUP_I4) memcpy(&min, blk + 64 + 4 * c, 4);
        for (int64_t j = 0; j < group / GGUF_BLOCK; j++) {
            const uint8_t *run = blk + group_head_bytes(type) + group_run_bytes(type) * j;
            float *w = out + g * group + j * GGUF_BLOCK;
            if (type == GROUP_I8) {
                for (int n = 0; n < 32; n++) w[n] = scale * (float)(int8_t)(run[64 * (n / 4) + 4 * c + n % 4] ^ 0x80);
                continue;
            }
            for (int u = 0; u < 4; u++)
                for (int i = 0; i < 4; i++) {
                    const int byte = run[64 * u + 4 * c + i];
                    w[8 * u + i] = fmaf((float)(byte & 0x0f), scale, min);
                    w[8 * u + 4 + i] = fmaf((float)(byte >> 4), scale, min);
                }
        }
    }
}

void gguf_x16_row(int x16_type, const uint8_t *table, int64_t row, int64_t in_features, int64_t group, float *out) {
    const int type = x16_base_type(x16_type);
    if (is_group_type(type)) {
        group_x16_row(type, table, row, in_features, group, out);
        return;
    }
    const int64_t block_bytes = gguf_block_bytes(type), block_weights = gguf_block_weights(type);
    const int64_t num_blocks = in_features / block_weights, c = row % X16_TILE;
    const uint8_t *tile = table + row / X16_TILE * X16_TILE * num_blocks * block_bytes;
    uint8_t raw[210];  // channel c's raw block (Q6_K's are the largest)
    uint8_t *raws[X16_TILE];
    for (int i = 0; i < X16_TILE; i++) raws[i] = raw;
    for (int64_t b = 0; b < num_blocks; b++) {
        uint8_t *tile_block = (uint8_t *)tile + b * X16_TILE * block_bytes;
        if (block_weights == 256)
            move_block256(type, raws, tile_block, false, (int)c, (int)c + 1);
        else
            raw_block(type, tile_block, (int)c, raw);
        gguf_row(type, raw, block_weights, out + b * block_weights);
    }
}

/* ---- 8-bit activations ---- */

int64_t gguf_x16_scratch_bytes(int64_t rows, int64_t in_features) {
    const int64_t quants = (rows * in_features + 63) / 64 * 64;
    return quants + rows * (in_features / GGUF_BLOCK) * 12;
}

typedef struct {
    const int8_t *q;  /* [rows, k] */
    const float *d;   /* [rows, k / 32]: each block's dx */
    const int32_t *s; /* [rows, k / 32]: each block's sx */
    const int32_t *h; /* [rows, k / 32]: the sum of each block's first 16 quants (Q6_K's sub-blocks) */
} QRows;

static QRows scratch_rows(const LinearNode *n) {
    uint8_t *base = (uint8_t *)n->scratch;
    const int64_t quants = (n->rows * n->in_features + 63) / 64 * 64, nb = n->rows * (n->in_features / GGUF_BLOCK);
    return {(const int8_t *)base, (const float *)(base + quants), (const int32_t *)(base + quants + 4 * nb),
            (const int32_t *)(base + quants + 8 * nb)};
}

/* one row's k inputs as int8 blocks of 32 (scalar code: the same integers in every build; nearbyintf
   rounds half to even, as the vector conversions would) */
static void quantize_row(const float *x, int64_t k, int8_t *q, float *d, int32_t *s, int32_t *h) {
    for (int64_t b = 0; b < k / GGUF_BLOCK; b++) {
        const float *xb = x + b * GGUF_BLOCK;
        float amax = 0.0f;
        for (int i = 0; i < GGUF_BLOCK; i++) amax = fmaxf(amax, fabsf(xb[i]));
        const float dx = amax / 127.0f, inv = dx > 0.0f ? 1.0f / dx : 0.0f;
        int32_t sum = 0;
        for (int i = 0; i < GGUF_BLOCK; i++) {
            float v = nearbyintf(xb[i] * inv);
            v = fminf(fmaxf(v, -127.0f), 127.0f);
            q[b * GGUF_BLOCK + i] = (int8_t)v;
            sum += (int32_t)v;
            if (i == 15) h[b] = sum;
        }
        d[b] = dx;
        s[b] = sum;
    }
}

/* ---- the tile kernel ---- */

/* one run of 32 inputs of a tile's lanes against rows xq, xq + k, ...: isum[r] += the integer dot products,
   from 8 chunks of signed 8-bit quants (q8, the sign flipped as stored) or 4 chunks of nibble pairs */
template <int MR>
static inline __attribute__((always_inline)) void run_sums(bool q8, const uint8_t *qs, const int8_t *xq, int64_t k,
                                                           ivec *isum) {
    if (q8) {
        for (int u = 0; u < 8; u++) {
            const ivec w = iload(qs + 64 * u);
            for (int r = 0; r < MR; r++) isum[r] = dot_q8(isum[r], w, iquad(xq + r * k + 4 * u));
        }
        return;
    }
    for (int u = 0; u < 4; u++) {
        const ivec w = iload(qs + 64 * u), lo = nib_lo(w), hi = nib_hi(w);
        for (int r = 0; r < MR; r++) {
            isum[r] = dot_u4(isum[r], lo, iquad(xq + r * k + 8 * u));
            isum[r] = dot_u4(isum[r], hi, iquad(xq + r * k + 8 * u + 4));
        }
    }
}

/* y[r0 + r][the lanes' channels of tile t] = acc[r] (+ bias) */
template <int MR>
static inline __attribute__((always_inline)) void store_rows(const LinearNode *n, const fvec *acc, int64_t t,
                                                             int64_t r0, int h) {
    const int64_t c0 = t * X16_TILE + h * X16_VL, cols = n->out_features;
    for (int r = 0; r < MR; r++) {
        const fvec v = n->bias ? fadd(acc[r], fload(n->bias + c0)) : acc[r];
        fstore(n->y + (r0 + r) * cols + c0, v);
    }
}

/* chunks u0, u0 + 1 of a k-quant run (qs: its low 4 bits, qh: the bits above) against rows xq, xq + k, ...:
   isum[r] += the integer dot products of their 16 inputs */
template <int MR, int TYPE>
static inline __attribute__((always_inline)) void kchunks(const uint8_t *qs, const uint8_t *qh, int u0,
                                                          const int8_t *xq, int64_t k, ivec *isum) {
    for (int u = u0; u < u0 + 2; u++) {
        const ivec w = iload(qs + 64 * u);
        ivec lo = nib_lo(w), hi = nib_hi(w);
        if (TYPE == GGUF_Q5_K) {
            const ivec top = iload(qh);
            lo = ior(lo, ishl4(ibits(top, u, 1)));
            hi = ior(hi, ishl4(ibits(top, u + 4, 1)));
        } else if (TYPE == GGUF_Q6_K) {
            const ivec top = iload(qh + 64 * (u / 2));
            lo = ior(lo, ishl4(ibits(top, 4 * (u % 2), 3)));
            hi = ior(hi, ishl4(ibits(top, 4 * (u % 2) + 2, 3)));
        }
        for (int r = 0; r < MR; r++) {
            isum[r] = dot_u4(isum[r], lo, iquad(xq + r * k + 8 * u));
            isum[r] = dot_u4(isum[r], hi, iquad(xq + r * k + 8 * u + 4));
        }
    }
}

/* rows [r0, r0 + MR) against tile t, lanes [h * X16_VL, (h + 1) * X16_VL) of its 16 channels; TYPE the
   ggml type */
template <int MR, int TYPE>
static inline __attribute__((always_inline)) void tile_rows(const LinearNode *n, const QRows &qr, int64_t t,
                                                            int64_t r0, int h) {
    constexpr int type = TYPE;
    const int64_t k = n->in_features, nb = k / GGUF_BLOCK, block_bytes = gguf_block_bytes(type);
    const uint8_t *tile = (const uint8_t *)n->weight + t * X16_TILE * nb * block_bytes;
    const int head = tile_head_bytes(type), lane_bytes = 4 * X16_VL;
    const int32_t offset = type == GGUF_Q4_0 ? 8 : (type == GGUF_Q5_0 ? 16 : (type == GGUF_Q8_0 ? X16_Q8_OFFSET : 0));
    fvec acc[MR];
    for (int r = 0; r < MR; r++) acc[r] = fzero();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = tile + b * X16_TILE * block_bytes, *qs = blk + head + lane_bytes * h;
        ivec isum[MR];
        for (int r = 0; r < MR; r++) isum[r] = izero();
        if constexpr (TYPE == GGUF_Q5_0 || TYPE == GGUF_Q5_1) {  // nibbles and fifth bits as a Q5_K run's
            kchunks<MR, GGUF_Q5_K>(qs, qs + 256, 0, qr.q + r0 * k + b * 32, k, isum);
            kchunks<MR, GGUF_Q5_K>(qs, qs + 256, 2, qr.q + r0 * k + b * 32, k, isum);
        } else {
            run_sums<MR>(type == GGUF_Q8_0, qs, qr.q + r0 * k + b * 32, k, isum);
        }
        const fvec d = fhalves(blk + 2 * X16_VL * h);
        for (int r = 0; r < MR; r++) {
            const int64_t i = (r0 + r) * nb + b;
            const ivec sum = offset ? isub_all(isum[r], offset * qr.s[i]) : isum[r];
            acc[r] = ffma(fcvt(sum), fmul(d, fset1(qr.d[i])), acc[r]);
        }
        if (gguf_has_min(type)) {
            const fvec m = fhalves(blk + 32 + 2 * X16_VL * h);
            for (int r = 0; r < MR; r++) {
                const int64_t i = (r0 + r) * nb + b;
                acc[r] = ffma(m, fset1(qr.d[i] * (float)qr.s[i]), acc[r]);
            }
        }
    }
    store_rows<MR>(n, acc, t, r0, h);
}

/* sub-block j's 6-bit scale and min of the lanes' channels: S = the tile's S[12][16] + the lanes' first
   channel (gguf_k_scale_min, for X16_VL channels at once) */
static inline __attribute__((always_inline)) void k_scale_min(const uint8_t *S, int j, ivec *scale, ivec *min) {
    if (j < 4) {
        *scale = land(lanes_u8(S + 16 * j), 63);
        *min = land(lanes_u8(S + 16 * (j + 4)), 63);
        return;
    }
    const ivec low = lanes_u8(S + 16 * (j + 4)), top_s = lanes_u8(S + 16 * (j - 4)), top_m = lanes_u8(S + 16 * j);
    *scale = ior(land(low, 15), lsll(lsrl(top_s, 6), 4));
    *min = ior(lsrl(low, 4), lsll(lsrl(top_m, 6), 4));
}

/* The k-quants (Q4_K, Q5_K, Q6_K): rows [r0, r0 + MR) against tile t, lanes [h * X16_VL, (h + 1) * X16_VL),
   a 32-input run at a time, summed in integers per run and scaled as gguf_x16.h writes */
template <int MR, int TYPE>
static inline __attribute__((always_inline)) void ktile_rows(const LinearNode *n, const QRows &qr, int64_t t,
                                                             int64_t r0, int h) {
    constexpr int type = TYPE;
    const int64_t k = n->in_features, nb = k / GGUF_BLOCK, nsb = k / 256, sb_bytes = gguf_block_bytes(type);
    const uint8_t *tile = (const uint8_t *)n->weight + t * X16_TILE * nsb * sb_bytes;
    const int lane_bytes = 4 * X16_VL;
    fvec acc[MR];
    for (int r = 0; r < MR; r++) acc[r] = fzero();
    for (int64_t sb = 0; sb < nsb; sb++) {
        const uint8_t *blk = tile + sb * X16_TILE * sb_bytes;
        const fvec d = fhalves(blk + 2 * X16_VL * h);
        const fvec neg_dmin = type == GGUF_Q6_K ? fzero() : fmul(fhalves(blk + 32 + 2 * X16_VL * h), fset1(-1.0f));
        for (int j = 0; j < 8; j++) {
            const uint8_t *qs = blk + kq_qs_offset(type, j) + lane_bytes * h;
            const uint8_t *qh = blk + kq_qh_offset(type, j) + lane_bytes * h;
            ivec isum[MR], isum_hi[MR];  // Q6_K: isum over the run's first 16 inputs, isum_hi the last 16
            for (int r = 0; r < MR; r++) isum[r] = izero(), isum_hi[r] = izero();
            const int8_t *xq = qr.q + r0 * k + sb * 256 + 32 * j;
            if (type == GGUF_Q6_K) {  // chunks 0, 1 are the first 16 inputs, 2, 3 the last (two sums)
                kchunks<MR, TYPE>(qs, qh, 0, xq, k, isum);
                kchunks<MR, TYPE>(qs, qh, 2, xq, k, isum_hi);
            } else {
                kchunks<MR, TYPE>(qs, qh, 0, xq, k, isum);
                kchunks<MR, TYPE>(qs, qh, 2, xq, k, isum);
            }
            if (type == GGUF_Q6_K) {
                const uint8_t *sc = blk + 32 + X16_VL * h;
                const ivec sc_lo = lanes_s8(sc + 16 * (2 * j)), sc_hi = lanes_s8(sc + 16 * (2 * j + 1));
                for (int r = 0; r < MR; r++) {
                    const int64_t i = (r0 + r) * nb + sb * 8 + j;
                    const int32_t sx_lo = qr.h[i], sx_hi = qr.s[i] - qr.h[i];
                    const ivec sum = ladd(lmul(isub_all(isum[r], 32 * sx_lo), sc_lo), lmul(isub_all(isum_hi[r], 32 * sx_hi), sc_hi));
                    acc[r] = ffma(fcvt(sum), fmul(d, fset1(qr.d[i])), acc[r]);
                }
            } else {
                ivec scale, min;
                k_scale_min(blk + 64 + X16_VL * h, j, &scale, &min);
                for (int r = 0; r < MR; r++) {
                    const int64_t i = (r0 + r) * nb + sb * 8 + j;
                    const fvec dx = fset1(qr.d[i]);
                    acc[r] = ffma(fcvt(lmul(isum[r], scale)), fmul(d, dx), acc[r]);
                    acc[r] = ffma(fcvt(lmul(min, lset1(qr.s[i]))), fmul(neg_dmin, dx), acc[r]);
                }
            }
        }
    }
    store_rows<MR>(n, acc, t, r0, h);
}

/* GROUP_I8 / GROUP_I4: rows [r0, r0 + MR) against tile t, lanes [h * X16_VL, (h + 1) * X16_VL), a group at a
   time: its runs summed in integers, scaled by each run's dx into one float per channel, then by the group's
   scale (gguf_x16.h) */
template <int MR, int TYPE>
static inline __attribute__((always_inline)) void gtile_rows(const LinearNode *n, const QRows &qr, int64_t t,
                                                             int64_t r0, int h) {
    const int64_t k = n->in_features, nb = k / GGUF_BLOCK, group = n->group_size, num_groups = k / group;
    const int64_t num_runs = group / GGUF_BLOCK, group_bytes = group_block_bytes(TYPE, group);
    const uint8_t *tile = (const uint8_t *)n->weight + t * X16_TILE * num_groups * group_bytes;
    const int lane_bytes = 4 * X16_VL;
    fvec acc[MR];
    for (int r = 0; r < MR; r++) acc[r] = fzero();
    for (int64_t g = 0; g < num_groups; g++) {
        const uint8_t *blk = tile + g * X16_TILE * group_bytes;
        fvec gacc[MR];
        float xsum[MR];  // GROUP_I4: the group's sum of the rounded inputs, sum_j dx_j sx_j
        for (int r = 0; r < MR; r++) gacc[r] = fzero(), xsum[r] = 0.0f;
        for (int64_t j = 0; j < num_runs; j++) {
            const uint8_t *qs = blk + group_head_bytes(TYPE) + group_run_bytes(TYPE) * j + lane_bytes * h;
            const int64_t b = g * num_runs + j;
            ivec isum[MR];
            for (int r = 0; r < MR; r++) isum[r] = izero();
            run_sums<MR>(TYPE == GROUP_I8, qs, qr.q + r0 * k + b * 32, k, isum);
            for (int r = 0; r < MR; r++) {
                const int64_t i = (r0 + r) * nb + b;
                const ivec sum = TYPE == GROUP_I8 && X16_Q8_OFFSET ? isub_all(isum[r], X16_Q8_OFFSET * qr.s[i]) : isum[r];
                gacc[r] = ffma(fcvt(sum), fset1(qr.d[i]), gacc[r]);
                if (TYPE == GROUP_I4) xsum[r] = fmaf(qr.d[i], (float)qr.s[i], xsum[r]);  // fmaf: one rounding in every build
            }
        }
        const fvec scale = fload((const float *)(blk + 4 * X16_VL * h));
        for (int r = 0; r < MR; r++) acc[r] = ffma(gacc[r], scale, acc[r]);
        if (TYPE == GROUP_I4) {
            const fvec min = fload((const float *)(blk + 64 + 4 * X16_VL * h));
            for (int r = 0; r < MR; r++) acc[r] = ffma(min, fset1(xsum[r]), acc[r]);
        }
    }
    store_rows<MR>(n, acc, t, r0, h);
}

/* Q3_K sub-block s's 6-bit scale less 32 for the lanes' channels (S: the tile's S[12][16] + the lanes' first
   channel): low 4 bits in the nibbles of bytes 0..7, high 2 in pairs of bytes 8..11 */
static inline __attribute__((always_inline)) ivec q3k_scale(const uint8_t *S, int s) {
    const ivec low = s < 8 ? land(lanes_u8(S + 16 * s), 15) : lsrl(lanes_u8(S + 16 * (s - 8)), 4);
    const ivec high = land(lsrl(lanes_u8(S + 16 * (8 + s % 4)), 2 * (s / 4)), 3);
    return ladd(ior(low, lsll(high, 4)), lset1(-32));
}

/* Q2_K / Q3_K: rows [r0, r0 + MR) against tile t, lanes [h * X16_VL, (h + 1) * X16_VL), a 32-input run (two
   sub-blocks of 16) at a time, summed in integers per sub-block and scaled as gguf_x16.h writes */
template <int MR, int TYPE>
static inline __attribute__((always_inline)) void lktile_rows(const LinearNode *n, const QRows &qr, int64_t t,
                                                              int64_t r0, int h) {
    const int64_t k = n->in_features, nb = k / GGUF_BLOCK, nsb = k / 256, sb_bytes = gguf_block_bytes(TYPE);
    const uint8_t *tile = (const uint8_t *)n->weight + t * X16_TILE * nsb * sb_bytes;
    const int lane_bytes = 4 * X16_VL;
    fvec acc[MR];
    for (int r = 0; r < MR; r++) acc[r] = fzero();
    for (int64_t sb = 0; sb < nsb; sb++) {
        const uint8_t *blk = tile + sb * X16_TILE * sb_bytes;
        const fvec d = fhalves(blk + 2 * X16_VL * h);
        const fvec neg_dmin = TYPE == GGUF_Q2_K ? fmul(fhalves(blk + 32 + 2 * X16_VL * h), fset1(-1.0f)) : fzero();
        for (int j = 0; j < 8; j++) {
            const uint8_t *run = blk + lk_run_offset(TYPE, j) + lane_bytes * h;
            ivec isum_lo[MR], isum_hi[MR];  // over the run's first 16 inputs (sub-block 2j), its last 16
            for (int r = 0; r < MR; r++) isum_lo[r] = izero(), isum_hi[r] = izero();
            const int8_t *xq = qr.q + r0 * k + sb * 256 + 32 * j;
            const ivec w0 = iload(run), w1 = iload(run + 64);
            const ivec top = TYPE == GGUF_Q3_K ? iload(run + 128) : izero();
            for (int u = 0; u < 8; u++) {
                ivec q = ibits(u < 4 ? w0 : w1, 2 * (u % 4), 3);
                if (TYPE == GGUF_Q3_K) q = ior(q, ishl2(ibits(top, u, 1)));
                for (int r = 0; r < MR; r++) {
                    ivec *isum = u < 4 ? isum_lo : isum_hi;
                    isum[r] = dot_u4(isum[r], q, iquad(xq + r * k + 4 * u));
                }
            }
            if (TYPE == GGUF_Q3_K) {
                const uint8_t *S = blk + 32 + X16_VL * h;
                const ivec sc_lo = q3k_scale(S, 2 * j), sc_hi = q3k_scale(S, 2 * j + 1);
                for (int r = 0; r < MR; r++) {
                    const int64_t i = (r0 + r) * nb + sb * 8 + j;
                    const int32_t sx_lo = qr.h[i], sx_hi = qr.s[i] - qr.h[i];
                    const ivec sum = ladd(lmul(isub_all(isum_lo[r], 4 * sx_lo), sc_lo), lmul(isub_all(isum_hi[r], 4 * sx_hi), sc_hi));
                    acc[r] = ffma(fcvt(sum), fmul(d, fset1(qr.d[i])), acc[r]);
                }
            } else {
                const uint8_t *sc = blk + 64 + X16_VL * h;
                const ivec b_lo = lanes_u8(sc + 16 * (2 * j)), b_hi = lanes_u8(sc + 16 * (2 * j + 1));
                const ivec sc_lo = land(b_lo, 15), sc_hi = land(b_hi, 15), m_lo = lsrl(b_lo, 4), m_hi = lsrl(b_hi, 4);
                for (int r = 0; r < MR; r++) {
                    const int64_t i = (r0 + r) * nb + sb * 8 + j;
                    const int32_t sx_lo = qr.h[i], sx_hi = qr.s[i] - qr.h[i];
                    const fvec dx = fset1(qr.d[i]);
                    const ivec sum = ladd(lmul(isum_lo[r], sc_lo), lmul(isum_hi[r], sc_hi));
                    const ivec mins = ladd(lmul(m_lo, lset1(sx_lo)), lmul(m_hi, lset1(sx_hi)));
                    acc[r] = ffma(fcvt(sum), fmul(d, dx), acc[r]);
                    acc[r] = ffma(fcvt(mins), fmul(neg_dmin, dx), acc[r]);
                }
            }
        }
    }
    store_rows<MR>(n, acc, t, r0, h);
}

template <int MR, int TYPE>
static inline __attribute__((always_inline)) void rows_against_tile(const LinearNode *n, const QRows &qr, int64_t t,
                                                                    int64_t r0, int h) {
    if constexpr (TYPE == GGUF_Q4_K || TYPE == GGUF_Q5_K || TYPE == GGUF_Q6_K)
        ktile_rows<MR, TYPE>(n, qr, t, r0, h);
    else if constexpr (TYPE == GROUP_I8 || TYPE == GROUP_I4)
        gtile_rows<MR, TYPE>(n, qr, t, r0, h);
    else if constexpr (TYPE == GGUF_Q2_K || TYPE == GGUF_Q3_K)
        lktile_rows<MR, TYPE>(n, qr, t, r0, h);
    else
        tile_rows<MR, TYPE>(n, qr, t, r0, h);
}

/* rows [row0, row0 + m) against tile t */
template <int TYPE>
static void tile_team_rows(const LinearNode *n, const QRows &qr, int64_t t, int64_t row0, int64_t m) {
    for (int h = 0; h < X16_TILE / X16_VL; h++) {
        int64_t r = row0;
        for (; r + X16_MR <= row0 + m; r += X16_MR) rows_against_tile<X16_MR, TYPE>(n, qr, t, r, h);
        switch (row0 + m - r) {
            case 3: rows_against_tile<3, TYPE>(n, qr, t, r, h); break;
            case 2: rows_against_tile<2, TYPE>(n, qr, t, r, h); break;
            case 1: rows_against_tile<1, TYPE>(n, qr, t, r, h); break;
            default: break;
        }
    }
}

/* int8 rows per block: a block's copies (k bytes and 12 per 32 inputs each) stay in L2 across the tiles */
#define X16_BLOCK_BYTES (192 * 1024)

void gguf_x16_linear_team(const LinearNode *n) {
    const int64_t k = n->in_features, nb = k / GGUF_BLOCK, num_tiles = n->out_features / X16_TILE;
    const int type = x16_base_type(n->weight_type);
    const QRows qr = scratch_rows(n);
#pragma omp for schedule(static)
    for (int64_t r = 0; r < n->rows; r++)
        quantize_row(n->x + r * k, k, (int8_t *)qr.q + r * k, (float *)qr.d + r * nb, (int32_t *)qr.s + r * nb,
                     (int32_t *)qr.h + r * nb);
    int64_t block_rows = X16_BLOCK_BYTES / (k + 12 * nb) / X16_MR * X16_MR;
    if (block_rows < X16_MR) block_rows = X16_MR;
    for (int64_t row0 = 0; row0 < n->rows; row0 += block_rows) {
        const int64_t m = n->rows - row0 < block_rows ? n->rows - row0 : block_rows;
#pragma omp for schedule(static)
        for (int64_t t = 0; t < num_tiles; t++) {
            switch (type) {
                case GGUF_Q4_0: tile_team_rows<GGUF_Q4_0>(n, qr, t, row0, m); break;
                case GGUF_Q4_1: tile_team_rows<GGUF_Q4_1>(n, qr, t, row0, m); break;
                case GGUF_Q5_0: tile_team_rows<GGUF_Q5_0>(n, qr, t, row0, m); break;
                case GGUF_Q5_1: tile_team_rows<GGUF_Q5_1>(n, qr, t, row0, m); break;
                case GGUF_Q8_0: tile_team_rows<GGUF_Q8_0>(n, qr, t, row0, m); break;
                case GGUF_Q4_K: tile_team_rows<GGUF_Q4_K>(n, qr, t, row0, m); break;
                case GGUF_Q5_K: tile_team_rows<GGUF_Q5_K>(n, qr, t, row0, m); break;
                case GGUF_Q2_K: tile_team_rows<GGUF_Q2_K>(n, qr, t, row0, m); break;
                case GGUF_Q3_K: tile_team_rows<GGUF_Q3_K>(n, qr, t, row0, m); break;
                case GROUP_I8: tile_team_rows<GROUP_I8>(n, qr, t, row0, m); break;
                case GROUP_I4: tile_team_rows<GROUP_I4>(n, qr, t, row0, m); break;
                default: tile_team_rows<GGUF_Q6_K>(n, qr, t, row0, m); break;
            }
        }
    }
}
