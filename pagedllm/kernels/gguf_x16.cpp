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
#endif

/* ---- the layout (gguf_x16.h) ---- */

/* quant n (0..31) of a raw Q4 block's 16 bytes */
static inline int raw_q4(const uint8_t *qs, int n) { return n < 16 ? qs[n] & 0x0f : qs[n - 16] >> 4; }

/* bytes of a raw block's scales ahead of its quants */
static inline int raw_head_bytes(int type) { return type == GGUF_Q4_1 ? 4 : 2; }

/* one tile block from the 16 raw blocks src[c] (c = 0..15) of ggml `type` */
static void interleave_block(int type, const uint8_t *const *src, uint8_t *dst) {
    for (int c = 0; c < X16_TILE; c++) {
        memcpy(dst + 2 * c, src[c], 2);                                      // d
        if (type == GGUF_Q4_1) memcpy(dst + 32 + 2 * c, src[c] + 2, 2);      // m
    }
    uint8_t *qs = dst + (type == GGUF_Q4_1 ? 64 : 32);
    for (int c = 0; c < X16_TILE; c++) {
        const uint8_t *q = src[c] + raw_head_bytes(type);
        if (type == GGUF_Q8_0) {
            for (int n = 0; n < 32; n++) qs[64 * (n / 4) + 4 * c + n % 4] = (uint8_t)(q[n] ^ 0x80);
            continue;
        }
        for (int j = 0; j < 4; j++)
            for (int i = 0; i < 4; i++)
                qs[64 * j + 4 * c + i] = (uint8_t)(raw_q4(q, 8 * j + i) | raw_q4(q, 8 * j + 4 + i) << 4);
    }
}

/* the raw block of channel c from a tile block (the inverse of interleave_block) */
static void raw_block(int type, const uint8_t *tile_block, int c, uint8_t *dst) {
    memcpy(dst, tile_block + 2 * c, 2);
    if (type == GGUF_Q4_1) memcpy(dst + 2, tile_block + 32 + 2 * c, 2);
    const uint8_t *qs = tile_block + (type == GGUF_Q4_1 ? 64 : 32);
    uint8_t *q = dst + raw_head_bytes(type);
    if (type == GGUF_Q8_0) {
        for (int n = 0; n < 32; n++) q[n] = (uint8_t)(qs[64 * (n / 4) + 4 * c + n % 4] ^ 0x80);
        return;
    }
    int v[32];
    for (int j = 0; j < 4; j++)
        for (int i = 0; i < 4; i++) {
            v[8 * j + i] = qs[64 * j + 4 * c + i] & 0x0f;
            v[8 * j + 4 + i] = qs[64 * j + 4 * c + i] >> 4;
        }
    for (int n = 0; n < 16; n++) q[n] = (uint8_t)(v[n] | v[n + 16] << 4);
}

void gguf_x16_interleave(uint8_t *weight, int type, int64_t in_features, int64_t tile0, int64_t tile1) {
    const int64_t block_bytes = gguf_block_bytes(type), num_blocks = in_features / GGUF_BLOCK;
    const int64_t row_bytes = num_blocks * block_bytes, tile_bytes = X16_TILE * row_bytes;
    uint8_t *copy = new uint8_t[tile_bytes];  // the tile's rows as the file has them
    for (int64_t t = tile0; t < tile1; t++) {
        uint8_t *tile = weight + t * tile_bytes;
        memcpy(copy, tile, (size_t)tile_bytes);
        for (int64_t b = 0; b < num_blocks; b++) {
            const uint8_t *src[X16_TILE];
            for (int c = 0; c < X16_TILE; c++) src[c] = copy + c * row_bytes + b * block_bytes;
            interleave_block(type, src, tile + b * X16_TILE * block_bytes);
        }
    }
    delete[] copy;
}

void gguf_x16_row(int x16_type, const uint8_t *table, int64_t row, int64_t in_features, float *out) {
    const int type = x16_base_type(x16_type);
    const int64_t block_bytes = gguf_block_bytes(type), num_blocks = in_features / GGUF_BLOCK;
    const uint8_t *tile = table + row / X16_TILE * X16_TILE * num_blocks * block_bytes;
    uint8_t raw[34];  // one raw block (Q8_0's are the largest)
    for (int64_t b = 0; b < num_blocks; b++) {
        raw_block(type, tile + b * X16_TILE * block_bytes, (int)(row % X16_TILE), raw);
        gguf_row(type, raw, GGUF_BLOCK, out + b * GGUF_BLOCK);
    }
}

/* ---- 8-bit activations ---- */

int64_t gguf_x16_scratch_bytes(int64_t rows, int64_t in_features) {
    const int64_t quants = (rows * in_features + 63) / 64 * 64;
    return quants + rows * (in_features / GGUF_BLOCK) * 8;
}

typedef struct {
    const int8_t *q; /* [rows, k] */
    const float *d;  /* [rows, k / 32]: each block's dx */
    const int32_t *s; /* [rows, k / 32]: each block's sx */
} QRows;

static QRows scratch_rows(const LinearNode *n) {
    uint8_t *base = (uint8_t *)n->scratch;
    const int64_t quants = (n->rows * n->in_features + 63) / 64 * 64, nb = n->rows * (n->in_features / GGUF_BLOCK);
    return {(const int8_t *)base, (const float *)(base + quants), (const int32_t *)(base + quants + 4 * nb)};
}

/* one row's k inputs as int8 blocks of 32 (scalar code: the same integers in every build; nearbyintf
   rounds half to even, as the vector conversions would) */
static void quantize_row(const float *x, int64_t k, int8_t *q, float *d, int32_t *s) {
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
        }
        d[b] = dx;
        s[b] = sum;
    }
}

/* ---- the tile kernel ---- */

/* rows [r0, r0 + MR) against tile t, lanes [h * X16_VL, (h + 1) * X16_VL) of its 16 channels; TYPE the
   ggml type */
template <int MR, int TYPE>
static inline __attribute__((always_inline)) void tile_rows(const LinearNode *n, const QRows &qr, int64_t t,
                                                            int64_t r0, int h) {
    constexpr int type = TYPE;
    const int64_t k = n->in_features, nb = k / GGUF_BLOCK, block_bytes = gguf_block_bytes(type);
    const uint8_t *tile = (const uint8_t *)n->weight + t * X16_TILE * nb * block_bytes;
    const int head = type == GGUF_Q4_1 ? 64 : 32, lane_bytes = 4 * X16_VL;
    const int32_t offset = type == GGUF_Q4_0 ? 8 : (type == GGUF_Q8_0 ? X16_Q8_OFFSET : 0);
    fvec acc[MR];
    for (int r = 0; r < MR; r++) acc[r] = fzero();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = tile + b * X16_TILE * block_bytes, *qs = blk + head + lane_bytes * h;
        ivec isum[MR];
        for (int r = 0; r < MR; r++) isum[r] = izero();
        if (type == GGUF_Q8_0) {
            for (int j = 0; j < 8; j++) {
                const ivec w = iload(qs + 64 * j);
                for (int r = 0; r < MR; r++) isum[r] = dot_q8(isum[r], w, iquad(qr.q + (r0 + r) * k + b * 32 + 4 * j));
            }
        } else {
            for (int j = 0; j < 4; j++) {
                const ivec w = iload(qs + 64 * j), lo = nib_lo(w), hi = nib_hi(w);
                for (int r = 0; r < MR; r++) {
                    const int8_t *xq = qr.q + (r0 + r) * k + b * 32 + 8 * j;
                    isum[r] = dot_u4(isum[r], lo, iquad(xq));
                    isum[r] = dot_u4(isum[r], hi, iquad(xq + 4));
                }
            }
        }
        const fvec d = fhalves(blk + 2 * X16_VL * h);
        for (int r = 0; r < MR; r++) {
            const int64_t i = (r0 + r) * nb + b;
            const ivec sum = offset ? isub_all(isum[r], offset * qr.s[i]) : isum[r];
            acc[r] = ffma(fcvt(sum), fmul(d, fset1(qr.d[i])), acc[r]);
        }
        if (type == GGUF_Q4_1) {
            const fvec m = fhalves(blk + 32 + 2 * X16_VL * h);
            for (int r = 0; r < MR; r++) {
                const int64_t i = (r0 + r) * nb + b;
                acc[r] = ffma(m, fset1(qr.d[i] * (float)qr.s[i]), acc[r]);
            }
        }
    }
    const int64_t c0 = t * X16_TILE + h * X16_VL, cols = n->out_features;
    for (int r = 0; r < MR; r++) {
        const fvec v = n->bias ? fadd(acc[r], fload(n->bias + c0)) : acc[r];
        fstore(n->y + (r0 + r) * cols + c0, v);
    }
}

/* rows [row0, row0 + m) against tile t */
template <int TYPE>
static void tile_team_rows(const LinearNode *n, const QRows &qr, int64_t t, int64_t row0, int64_t m) {
    for (int h = 0; h < X16_TILE / X16_VL; h++) {
        int64_t r = row0;
        for (; r + X16_MR <= row0 + m; r += X16_MR) tile_rows<X16_MR, TYPE>(n, qr, t, r, h);
        switch (row0 + m - r) {
            case 3: tile_rows<3, TYPE>(n, qr, t, r, h); break;
            case 2: tile_rows<2, TYPE>(n, qr, t, r, h); break;
            case 1: tile_rows<1, TYPE>(n, qr, t, r, h); break;
            default: break;
        }
    }
}

/* int8 rows per block: a block's copies (k bytes and 8 per 32 inputs each) stay in L2 across the tiles */
#define X16_BLOCK_BYTES (192 * 1024)

void gguf_x16_linear_team(const LinearNode *n) {
    const int64_t k = n->in_features, nb = k / GGUF_BLOCK, num_tiles = n->out_features / X16_TILE;
    const int type = x16_base_type(n->weight_type);
    const QRows qr = scratch_rows(n);
#pragma omp for schedule(static)
    for (int64_t r = 0; r < n->rows; r++)
        quantize_row(n->x + r * k, k, (int8_t *)qr.q + r * k, (float *)qr.d + r * nb, (int32_t *)qr.s + r * nb);
    int64_t block_rows = X16_BLOCK_BYTES / (k + 8 * nb) / X16_MR * X16_MR;
    if (block_rows < X16_MR) block_rows = X16_MR;
    for (int64_t row0 = 0; row0 < n->rows; row0 += block_rows) {
        const int64_t m = n->rows - row0 < block_rows ? n->rows - row0 : block_rows;
#pragma omp for schedule(static)
        for (int64_t t = 0; t < num_tiles; t++) {
            if (type == GGUF_Q4_0)
                tile_team_rows<GGUF_Q4_0>(n, qr, t, row0, m);
            else if (type == GGUF_Q4_1)
                tile_team_rows<GGUF_Q4_1>(n, qr, t, row0, m);
            else
                tile_team_rows<GGUF_Q8_0>(n, qr, t, row0, m);
        }
    }
}
