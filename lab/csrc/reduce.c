/* Element-wise reductions for every ncclDataType_t x ncclRedOp_t.  Integers
 * wrap like unsigned arithmetic (no undefined overflow); float16 and bfloat16
 * accumulate in float and round once. */
#include <string.h>

#include "internal.h"

size_t labTypeSize(int dtype) {
    switch (dtype) {
    case ncclInt8:
    case ncclUint8:
        return 1;
    case ncclFloat16:
    case ncclBfloat16:
        return 2;
    case ncclInt32:
    case ncclUint32:
    case ncclFloat32:
        return 4;
    case ncclInt64:
    case ncclUint64:
    case ncclFloat64:
        return 8;
    default:
        return 0;
    }
}

static inline float bf16ToFloat(uint16_t v) {
    uint32_t u = (uint32_t)v << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t floatToBf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* quiet NaN */
    u += 0x7fffu + ((u >> 16) & 1u);                                          /* nearest even */
    return (uint16_t)(u >> 16);
}

static inline float halfToFloat(uint16_t v) {
    _Float16 h;
    memcpy(&h, &v, sizeof h);
    return (float)h;
}

static inline uint16_t floatToHalf(float f) {
    _Float16 h = (_Float16)f;
    uint16_t v;
    memcpy(&v, &h, sizeof v);
    return v;
}

#define ID(x) (x)
#define ADD(a, b) ((a) + (b))
#define MUL(a, b) ((a) * (b))
#define MAX(a, b) ((b) > (a) ? (b) : (a))
#define MIN(a, b) ((b) < (a) ? (b) : (a))

/* dst[i] = FINAL(src0[i] COMBINE src1[i] ...), loading as ACC and storing as T */
#define LOOP(T, ACC, LOAD, STORE, COMBINE, FINAL)                                   \
    for (size_t i = 0; i < count; i++) {                                            \
        ACC acc = LOAD(((const T *)srcs[0])[i]);                                    \
        for (int k = 1; k < nsrc; k++) acc = COMBINE(acc, LOAD(((const T *)srcs[k])[i])); \
        ((T *)dst)[i] = STORE(FINAL(acc));                                          \
    }

#define DEF_FLOAT(NAME, T, ACC, LOAD, STORE)                                               \
    static void NAME(int redop, void *dst, const void *const *srcs, int nsrc, size_t count, \
                     int navg) {                                                           \
        ACC inv = (ACC)navg;                                                               \
        switch (redop) {                                                                   \
        case ncclSum: LOOP(T, ACC, LOAD, STORE, ADD, ID) break;                            \
        case ncclProd: LOOP(T, ACC, LOAD, STORE, MUL, ID) break;                           \
        case ncclMax: LOOP(T, ACC, LOAD, STORE, MAX, ID) break;                            \
        case ncclMin: LOOP(T, ACC, LOAD, STORE, MIN, ID) break;                            \
        case ncclAvg:                                                                      \
            for (size_t i = 0; i < count; i++) {                                           \
                ACC acc = LOAD(((const T *)srcs[0])[i]);                                   \
                for (int k = 1; k < nsrc; k++) acc += LOAD(((const T *)srcs[k])[i]);       \
                ((T *)dst)[i] = STORE(acc / inv);                                          \
            }                                                                              \
            break;                                                                         \
        }                                                                                  \
    }

#define DEF_INT(NAME, T, UT)                                                               \
    static inline T NAME##_add(T a, T b) { return (T)((UT)a + (UT)b); }                   \
    static inline T NAME##_mul(T a, T b) { return (T)((UT)a * (UT)b); }                   \
    static void NAME(int redop, void *dst, const void *const *srcs, int nsrc, size_t count, \
                     int navg) {                                                           \
        T n = (T)navg;                                                                     \
        switch (redop) {                                                                   \
        case ncclSum: LOOP(T, T, ID, ID, NAME##_add, ID) break;                            \
        case ncclProd: LOOP(T, T, ID, ID, NAME##_mul, ID) break;                           \
        case ncclMax: LOOP(T, T, ID, ID, MAX, ID) break;                                   \
        case ncclMin: LOOP(T, T, ID, ID, MIN, ID) break;                                   \
        case ncclAvg:                                                                      \
            for (size_t i = 0; i < count; i++) {                                           \
                T acc = ((const T *)srcs[0])[i];                                           \
                for (int k = 1; k < nsrc; k++) acc = NAME##_add(acc, ((const T *)srcs[k])[i]); \
                ((T *)dst)[i] = (T)(acc / n);                                              \
            }                                                                              \
            break;                                                                         \
        }                                                                                  \
    }

DEF_INT(reduceI8, int8_t, uint8_t)
DEF_INT(reduceU8, uint8_t, uint8_t)
DEF_INT(reduceI32, int32_t, uint32_t)
DEF_INT(reduceU32, uint32_t, uint32_t)
DEF_INT(reduceI64, int64_t, uint64_t)
DEF_INT(reduceU64, uint64_t, uint64_t)
DEF_FLOAT(reduceF16, uint16_t, float, halfToFloat, floatToHalf)
DEF_FLOAT(reduceBF16, uint16_t, float, bf16ToFloat, floatToBf16)
DEF_FLOAT(reduceF32, float, float, ID, ID)
DEF_FLOAT(reduceF64, double, double, ID, ID)

void labReduce(int dtype, int redop, void *dst, const void *const *srcs, int nsrc, size_t count,
               int navg) {
    switch (dtype) {
    case ncclInt8: reduceI8(redop, dst, srcs, nsrc, count, navg); break;
    case ncclUint8: reduceU8(redop, dst, srcs, nsrc, count, navg); break;
    case ncclInt32: reduceI32(redop, dst, srcs, nsrc, count, navg); break;
    case ncclUint32: reduceU32(redop, dst, srcs, nsrc, count, navg); break;
    case ncclInt64: reduceI64(redop, dst, srcs, nsrc, count, navg); break;
    case ncclUint64: reduceU64(redop, dst, srcs, nsrc, count, navg); break;
    case ncclFloat16: reduceF16(redop, dst, srcs, nsrc, count, navg); break;
    case ncclBfloat16: reduceBF16(redop, dst, srcs, nsrc, count, navg); break;
    case ncclFloat32: reduceF32(redop, dst, srcs, nsrc, count, navg); break;
    case ncclFloat64: reduceF64(redop, dst, srcs, nsrc, count, navg); break;
    }
}
