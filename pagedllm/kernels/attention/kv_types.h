/*
 * The KV cache element types of paged decode attention, as traits structs
 * the kernels of paged_attention_kv.h are templates over (one instantiation
 * per type). Each struct gives:
 *
 *   T             the cache's element type (float, or uint16_t / int8_t / uint8_t bits)
 *   vector        whether the vector kernels read this type in this build
 *                 (vectors, and F16C for float16 and fp8, which widen through it)
 *   load1(p)      one element at p as a float
 *   load8(p)      eight elements at p as an f32x8  (AVX2 builds; simd.h)
 *   load16(p)     sixteen elements at p as an f32x16 (AVX-512 builds)
 *   head_stride(d)  elements from one head's row to the next: d, or d + 4
 *                 for int8 and fp8 (each head's float32 scale follows it)
 *   scale(h, d)   the factor of head row h's values: 1.0f, or the row's scale
 *   elem1(p, i)   element i of the row at p as a float (load1(p + i); int4
 *                 packs two elements a byte)
 *   at(p, d)      where the vector loads of element d start (p + d; int4: p + d / 2)
 *
 * Every member is forced inline: the kernels compile to what they would be
 * with the expressions written in place, and the float types' scale of 1
 * is a constant the compiler drops.
 */
#ifndef PAGEDLLM_KV_TYPES_H
#define PAGEDLLM_KV_TYPES_H

#define KV_INLINE inline __attribute__((always_inline))

/* what most types share: rows of whole elements, element i at p + i */
template <class Self, class Elem>
struct KvRowsOf {
    typedef Elem T;
    static KV_INLINE float elem1(const T *p, int i) { return Self::load1(p + i); }
    template <class I>
    static KV_INLINE const T *at(const T *p, I d) { return p + d; }
};

/* float caches: heads are head_dim elements apart and carry no scale */
template <class Self, class Elem>
struct KvFloatRows : KvRowsOf<Self, Elem> {
    static KV_INLINE int64_t head_stride(int d) { return d; }
    static KV_INLINE float scale(const Elem *, int) { return 1.0f; }
};

/* int8 and fp8 caches: head_dim values, then the row's float32 scale */
template <class Self, class Elem>
struct KvScaledRows : KvRowsOf<Self, Elem> {
    static KV_INLINE int64_t head_stride(int d) { return d + KV_I8_SCALE_BYTES; }
};

struct KvF32 : KvFloatRows<KvF32, float> {
    static constexpr bool vector = PA_VECTOR;
    static KV_INLINE float load1(const float *p) { return *p; }
#if PA_VECTOR
    static KV_INLINE f32x8 load8(const float *p) { return f32x8_load(p); }
#endif
#if SIMD_F32X16
    static KV_INLINE f32x16 load16(const float *p) { return f32x16_load(p); }
#endif
};

#if PA_VECTOR && defined(__F16C__)
#define KV_F16C_VECTOR 1
#else
#define KV_F16C_VECTOR 0
#endif

struct KvF16 : KvFloatRows<KvF16, uint16_t> {
    static constexpr bool vector = KV_F16C_VECTOR;
    static KV_INLINE float load1(const uint16_t *p) { return f16_bits_to_f32(*p); }
#if KV_F16C_VECTOR
    static KV_INLINE f32x8 load8(const uint16_t *p) { return f32x8_load_f16(p); }
#endif
#if KV_F16C_VECTOR && SIMD_F32X16
    static KV_INLINE f32x16 load16(const uint16_t *p) { return f32x16_load_f16(p); }
#endif
};

struct KvBF16 : KvFloatRows<KvBF16, uint16_t> {
    static constexpr bool vector = PA_VECTOR;
    static KV_INLINE float load1(const uint16_t *p) { return bf16_bits_to_f32(*p); }
#if PA_VECTOR
    static KV_INLINE f32x8 load8(const uint16_t *p) { return f32x8_load_bf16(p); }
#endif
#if SIMD_F32X16
    static KV_INLINE f32x16 load16(const uint16_t *p) { return f32x16_load_bf16(p); }
#endif
};

/* int8: a head row is head_dim values and a float32 scale; the scale is
   applied once per dot product (keys) or per weight (values), not per
   element */
struct KvI8 : KvScaledRows<KvI8, int8_t> {
    static constexpr bool vector = PA_VECTOR;
    static KV_INLINE float load1(const int8_t *p) { return (float)*p; }
#if PA_VECTOR
    static KV_INLINE f32x8 load8(const int8_t *p) { return f32x8_load_i8(p); }
#endif
#if SIMD_F32X16
    static KV_INLINE f32x16 load16(const int8_t *p) { return f32x16_load_i8(p); }
#endif
    static KV_INLINE float scale(const int8_t *head, int d) { return kv_i8_scale(head, d); }
};

/* int4: a head row is head_dim / 2 bytes of nibbles and a float32 scale;
   element d of a row sits at byte d / 2 (at: the vector loads start at
   even d), unpacked to floats in registers */
struct KvI4 {
    typedef uint8_t T;
    static constexpr bool vector = PA_VECTOR;
#if PA_VECTOR
    static KV_INLINE f32x8 load8(const uint8_t *p) { return f32x8_load_u4(p); }
#endif
#if SIMD_F32X16
    static KV_INLINE f32x16 load16(const uint8_t *p) { return f32x16_load_u4(p); }
#endif
    static KV_INLINE float elem1(const uint8_t *p, int i) { return kv_i4_elem(p, i); }
    template <class I>
    static KV_INLINE const uint8_t *at(const uint8_t *p, I d) { return p + d / 2; }
    static KV_INLINE int64_t head_stride(int d) { return d / 2 + KV_I4_SCALE_BYTES; }
    static KV_INLINE float scale(const uint8_t *head, int d) { return kv_i4_scale(head, d); }
};

/* fp8, read as float16 bits (simd.h's fp8 loads) and widened by F16C where
   the build has it. E5M2 is the top byte of a float16: exact. E4M3 gets its
   exponent and mantissa shifted into a float16's, which reads as the value
   times 2^-8 (normals and subnormals alike), so its scale is the stored
   scale times 2^8 (exact). Neither has NaN or inf in its values: the write
   clamps them, a NaN head has a NaN scale. */
struct KvE4M3 : KvScaledRows<KvE4M3, uint8_t> {
    static constexpr bool vector = KV_F16C_VECTOR;
    static KV_INLINE float load1(const uint8_t *p) { return f16_bits_to_f32(fp8e4m3_f16_bits(*p)); }
#if KV_F16C_VECTOR
    static KV_INLINE f32x8 load8(const uint8_t *p) { return f32x8_load_e4m3(p); }
#endif
#if KV_F16C_VECTOR && SIMD_F32X16
    static KV_INLINE f32x16 load16(const uint8_t *p) { return f32x16_load_e4m3(p); }
#endif
    static KV_INLINE float scale(const uint8_t *head, int d) { return kv_fp8_scale(head, d) * 256.0f; }
};

struct KvE5M2 : KvScaledRows<KvE5M2, uint8_t> {
    static constexpr bool vector = KV_F16C_VECTOR;
    static KV_INLINE float load1(const uint8_t *p) { return f16_bits_to_f32((uint16_t)(*p << 8)); }
#if KV_F16C_VECTOR
    static KV_INLINE f32x8 load8(const uint8_t *p) { return f32x8_load_e5m2(p); }
#endif
#if KV_F16C_VECTOR && SIMD_F32X16
    static KV_INLINE f32x16 load16(const uint8_t *p) { return f32x16_load_e5m2(p); }
#endif
    static KV_INLINE float scale(const uint8_t *head, int d) { return kv_fp8_scale(head, d); }
};

#endif
