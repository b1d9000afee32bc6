/*
 * kvx_abi.h - the KVX C ABI, version 1.3 (KVX v1 specification, sections 3-8).
 *
 * Paged KV cache descriptors, block tables, slot mappings and the entry points
 * that write and gather K/V through them. C99 and C++ compatible.
 *
 * ABI rules (spec section 3, section 6):
 *  - Every public struct starts with `uint32_t size`, which the caller sets to
 *    sizeof(the struct) as compiled against its header. A consumer rejects a
 *    struct whose `size` is smaller than that struct's v1.0 size and ignores
 *    bytes beyond the fields it knows (a newer minor version only appends).
 *  - Fields typed as enums are 4 bytes (C enums are int-sized on every ABI KVX
 *    targets; static asserts below enforce it, so -fshort-enums fails loudly).
 *  - All strides are in elements, not bytes. Pointers are borrowed for the
 *    duration of a call only (spec section 7.2).
 *
 * v1.1 (minor) adds packed/quantized dtypes, KVX_SCALE_GRANULARITY_PER_GROUP,
 * kvx_quant_format_t, kvx_quant_desc_t and the trailing kvx_cache_desc_t.quant.
 * v1.2 (minor) appends kvx_quant_desc_t.k_smoothing with KVX_QUANT_FLAG_KEY_SMOOTHING:
 * keys stored divided by a per-channel vector. A producer sets the flag, so a v1.1
 * consumer (which rejects quant flags it does not know) refuses the cache instead
 * of reading K / s as K.
 * v1.3 (minor) appends kvx_quant_desc_t.k_center with KVX_QUANT_FLAG_KEY_CENTERING:
 * keys stored as (K - c) / s for a per-channel vector c. A v1.2 (or v1.1) consumer
 * rejects the unknown flag and so refuses a centered cache instead of reading
 * (K - c) / s as K / s.
 * The Python mirror of this file is kvx_core/abi/structs.py; tests/test_abi.py
 * compiles this header and checks every size, offset and constant against it.
 */
#ifndef KVX_ABI_H
#define KVX_ABI_H

#include <stddef.h>
#include <stdint.h>

#ifndef KVX_API
#  if defined(_WIN32)
#    if defined(KVX_BUILDING_LIBRARY)
#      define KVX_API __declspec(dllexport)
#    else
#      define KVX_API __declspec(dllimport)
#    endif
#  elif defined(__GNUC__)
#    define KVX_API __attribute__((visibility("default")))
#  else
#    define KVX_API
#  endif
#endif

#ifdef __cplusplus
extern "C" {
#endif

/* ------------------------------------------------------------------------- */
/* Versioning (spec section 3)                                               */
/* ------------------------------------------------------------------------- */

#define KVX_VERSION_MAJOR 1
#define KVX_VERSION_MINOR 3
#define KVX_VERSION_PATCH 0

/** Maximum tensor rank carried by a descriptor (HND_PACKED needs 5). */
#define KVX_MAX_DIMS 5

/** ABI version of a provider. A consumer rejects a different `major`; it may
 *  accept a newer or older `minor` because every struct is size-guarded. */
typedef struct kvx_version_t {
    uint32_t size;  /**< sizeof(kvx_version_t); set by kvx_get_version */
    uint32_t major; /**< KVX_VERSION_MAJOR: incompatible when different */
    uint32_t minor; /**< KVX_VERSION_MINOR: additive, size-guarded changes */
    uint32_t patch; /**< KVX_VERSION_PATCH: no ABI change */
} kvx_version_t;

/* ------------------------------------------------------------------------- */
/* Enums (values are ABI; mirrored by kvx_core/enums.py and errors.py)       */
/* ------------------------------------------------------------------------- */

/** Status returned by every entry point (spec section 8). */
typedef enum kvx_status_t {
    KVX_STATUS_OK = 0,               /**< success */
    KVX_STATUS_INVALID_ARGUMENT = 1, /**< malformed descriptor or field */
    KVX_STATUS_UNSUPPORTED = 2,      /**< feature or layout not implemented */
    KVX_STATUS_OUT_OF_RANGE = 3,     /**< slot or index out of bounds */
    KVX_STATUS_INCOMPATIBLE = 4,     /**< ABI major version mismatch */
    KVX_STATUS_INTERNAL_ERROR = 5    /**< unexpected internal failure */
} kvx_status_t;

/** Element type (spec section 4.3). 0 is reserved so that a zero-initialised
 *  descriptor is rejected. Values 8..11 are v1.1. */
typedef enum kvx_dtype_t {
    KVX_DTYPE_UNSPECIFIED = 0,
    KVX_DTYPE_F16 = 1,
    KVX_DTYPE_BF16 = 2,
    KVX_DTYPE_F32 = 3,
    KVX_DTYPE_F8_E4M3 = 4,
    KVX_DTYPE_F8_E5M2 = 5,
    KVX_DTYPE_S32 = 6,
    KVX_DTYPE_S64 = 7,
    KVX_DTYPE_U8 = 8,          /**< v1.1: raw byte */
    KVX_DTYPE_FP4_E2M1X2 = 9,  /**< v1.1: two E2M1 codes per byte, element 2i in bits 3..0 */
    KVX_DTYPE_UE8M0 = 10,      /**< v1.1: MX scale byte, exponent bias 127 */
    KVX_DTYPE_INT4X2 = 11      /**< v1.1: two unsigned 4-bit codes per byte, element 2i in bits 3..0 */
} kvx_dtype_t;

/** Block layout of a cache tensor (spec section 4.2). Shapes in layout order. */
typedef enum kvx_layout_t {
    KVX_LAYOUT_UNSPECIFIED = 0,
    KVX_LAYOUT_BLOCK_NHD = 1,        /**< [num_blocks, block_size, num_kv_heads, head_dim] */
    KVX_LAYOUT_BLOCK_HND = 2,        /**< [num_blocks, num_kv_heads, block_size, head_dim] */
    KVX_LAYOUT_BLOCK_HND_PACKED = 3, /**< [num_blocks, num_kv_heads, head_dim/pack, block_size, pack], pack = shape[4] */
    KVX_LAYOUT_BLOCK_CUSTOM = 4      /**< explicit shape/stride; logical order [blocks, block_size, heads, head_dim] */
} kvx_layout_t;

/** Where a buffer lives. Device kernels should accept DEVICE and UNIFIED. */
typedef enum kvx_memory_type_t {
    KVX_MEMORY_HOST = 0,
    KVX_MEMORY_DEVICE = 1,
    KVX_MEMORY_UNIFIED = 2,
    KVX_MEMORY_HOST_PINNED = 3
} kvx_memory_type_t;

/** Encoding of a block table (spec section 5.1). */
typedef enum kvx_block_table_format_t {
    KVX_BLOCK_TABLE_PACKED = 0,    /**< [seq_count, max_blocks_per_seq] physical block ids */
    KVX_BLOCK_TABLE_RAGGED = 1,    /**< per-token block ids + indptr[seq_count + 1] */
    KVX_BLOCK_TABLE_KV_OFFSETS = 2 /**< TRT-LLM [seq_count, beam_width, 2, max_blocks_per_seq] KVCacheIndex */
} kvx_block_table_format_t;

/** What one scale value covers. */
typedef enum kvx_scale_granularity_t {
    KVX_SCALE_GRANULARITY_NONE = 0,
    KVX_SCALE_GRANULARITY_PER_TENSOR = 1,
    KVX_SCALE_GRANULARITY_PER_HEAD = 2,
    KVX_SCALE_GRANULARITY_PER_BLOCK = 3,
    KVX_SCALE_GRANULARITY_PER_TOKEN_HEAD = 4,
    KVX_SCALE_GRANULARITY_PER_GROUP = 5 /**< v1.1: one scale per group_size elements along head_dim */
} kvx_scale_granularity_t;

/** v1.1: quantized cache format recorded in kvx_quant_desc_t. */
typedef enum kvx_quant_format_t {
    KVX_QUANT_FORMAT_NONE = 0,
    KVX_QUANT_FORMAT_FP8_E4M3 = 1, /**< per-tensor/per-head FP32 scale */
    KVX_QUANT_FORMAT_FP8_E5M2 = 2, /**< per-tensor/per-head FP32 scale */
    KVX_QUANT_FORMAT_INT8 = 3,     /**< asymmetric per (token, head): scale and min in the scale pool */
    KVX_QUANT_FORMAT_INT4 = 4,     /**< as INT8 with 4-bit codes, INT4X2 packing */
    KVX_QUANT_FORMAT_MXFP4 = 5,    /**< E2M1 elements, UE8M0 scale per group */
    KVX_QUANT_FORMAT_NVFP4 = 6,    /**< E2M1 elements, E4M3 scale per 16 + FP32 global scale */
    KVX_QUANT_FORMAT_K8V4 = 7      /**< keys FP8 E4M3, values NVFP4 */
} kvx_quant_format_t;

/** kvx_block_table_t.flags: KV_OFFSETS indices are TRT-LLM KVCacheIndex values. */
#define KVX_BLOCK_TABLE_FLAG_KVCACHEINDEX 0x1u
/** KVCacheIndex bit 31: the block lives in the secondary pool. */
#define KVX_KVCACHEINDEX_SECONDARY_BIT 0x80000000u
/** KVCacheIndex null entry (all bits set). */
#define KVX_KVCACHEINDEX_NULL (-1)
/** kvx_quant_desc_t.flags: K, Q and V are rotated by an orthonormal Hadamard
 *  matrix along head_dim (values rotated at write, attention output rotated back). */
#define KVX_QUANT_FLAG_HADAMARD 0x1u
/** MXFP4 scales were chosen with the OCP FLOOR rule (default RCEIL); decode is the same either way. */
#define KVX_QUANT_FLAG_MX_SCALE_FLOOR 0x2u
/** NVFP4 V scale pool interleaved by 4 tokens (TRT-LLM trtllm-gen): in each (block, head) plane of
 *  block_size x S bytes, (token t, group j) is at (t / 4) * 4 * S + j * 4 + t % 4, not t * S + j.
 *  Needs block_size % 4 == 0 and an HND V scale pool with contiguous planes. */
#define KVX_QUANT_FLAG_V_SCALE_INTERLEAVE4 0x4u
/** v1.2: keys are stored divided by kvx_quant_desc_t.k_smoothing (per KV head and channel); readers multiply
 *  decoded keys by it, attention multiplies queries by it. Set iff k_smoothing is non-NULL. */
#define KVX_QUANT_FLAG_KEY_SMOOTHING 0x8u
/** v1.3: keys are stored as (K - c) / s, c = kvx_quant_desc_t.k_center (per KV head and channel; s = k_smoothing,
 *  or 1 without KVX_QUANT_FLAG_KEY_SMOOTHING); readers add c after multiplying decoded keys by s. Attention over
 *  the stored keys is shift invariant (q . (k - c) differs from q . k by q . c, the same for every key of a query);
 *  a consumer that returns a log-sum-exp adds sm_scale * q . c to it. Set iff k_center is non-NULL. A v1.2
 *  consumer does not know the flag and refuses the cache. */
#define KVX_QUANT_FLAG_KEY_CENTERING 0x10u

/* Enum-typed fields are 4 bytes (see the ABI rules above). C99-compatible
 * static assert: a negative array size fails to compile. */
#define KVX_ABI_STATIC_ASSERT_(name, cond) typedef char kvx_abi_static_assert_##name[(cond) ? 1 : -1]
KVX_ABI_STATIC_ASSERT_(status_is_4_bytes, sizeof(kvx_status_t) == 4);
KVX_ABI_STATIC_ASSERT_(dtype_is_4_bytes, sizeof(kvx_dtype_t) == 4);
KVX_ABI_STATIC_ASSERT_(layout_is_4_bytes, sizeof(kvx_layout_t) == 4);
KVX_ABI_STATIC_ASSERT_(memory_type_is_4_bytes, sizeof(kvx_memory_type_t) == 4);
KVX_ABI_STATIC_ASSERT_(block_table_format_is_4_bytes, sizeof(kvx_block_table_format_t) == 4);
KVX_ABI_STATIC_ASSERT_(scale_granularity_is_4_bytes, sizeof(kvx_scale_granularity_t) == 4);
KVX_ABI_STATIC_ASSERT_(quant_format_is_4_bytes, sizeof(kvx_quant_format_t) == 4);

/* ------------------------------------------------------------------------- */
/* Descriptors (spec section 6)                                              */
/* ------------------------------------------------------------------------- */

/** A strided tensor (spec section 6.2). For cache K/V, `ndim` and `shape` must
 *  match `layout` and the cache descriptor. For IO tensors the dense 3D form
 *  [num_tokens, num_kv_heads, head_dim] is always accepted and `layout` is
 *  ignored (may be KVX_LAYOUT_BLOCK_CUSTOM). */
typedef struct kvx_tensor_desc_t {
    uint32_t size;                 /**< sizeof(kvx_tensor_desc_t) */
    kvx_dtype_t dtype;             /**< element type */
    kvx_layout_t layout;           /**< layout enum */
    kvx_memory_type_t memory;      /**< buffer location */
    uint32_t ndim;                 /**< number of dimensions, <= KVX_MAX_DIMS */
    int64_t shape[KVX_MAX_DIMS];   /**< shape in layout order; entries >= ndim unused */
    int64_t stride[KVX_MAX_DIMS];  /**< strides in elements; implementations must honour them */
    void* data;                    /**< buffer pointer */
} kvx_tensor_desc_t;

/** Logical-to-physical block mapping (spec section 5.1, 6.3).
 *  PACKED: indices [seq_count, max_blocks_per_seq], indptr NULL, beam_width 1.
 *  RAGGED: per-token block ids, indptr[seq_count + 1] prefix sums, beam_width 1.
 *  KV_OFFSETS: [seq_count, beam_width, 2, max_blocks_per_seq] S32 KVCacheIndex,
 *  flags has KVX_BLOCK_TABLE_FLAG_KVCACHEINDEX, block_size a power of two. */
typedef struct kvx_block_table_t {
    uint32_t size;                      /**< sizeof(kvx_block_table_t) */
    kvx_block_table_format_t format;    /**< encoding type */
    kvx_dtype_t index_dtype;            /**< S32 or S64 (S32 for KV_OFFSETS) */
    kvx_dtype_t indptr_dtype;           /**< RAGGED only: S32 or S64 */
    uint32_t seq_count;                 /**< number of sequences */
    uint32_t beam_width;                /**< KV_OFFSETS only; 1 otherwise */
    uint32_t max_blocks_per_seq;        /**< max blocks per sequence */
    void* indices;                      /**< indices buffer */
    void* indptr;                       /**< RAGGED only; NULL otherwise */
    uint32_t indices_count;             /**< total indices; must match the format */
    uint32_t indptr_count;              /**< seq_count + 1 for RAGGED, 0 otherwise */
    uint32_t flags;                     /**< KVX_BLOCK_TABLE_FLAG_* (KV_OFFSETS) */
} kvx_block_table_t;

/** Destination slot of each token of a write batch (spec section 5.2).
 *  slot = block_id * block_size + block_offset; `invalid_slot` or any negative
 *  slot is a no-op write. */
typedef struct kvx_slot_mapping_t {
    uint32_t size;        /**< sizeof(kvx_slot_mapping_t) */
    kvx_dtype_t dtype;    /**< S32 or S64 */
    uint32_t token_count; /**< number of tokens (length of slots) */
    int64_t invalid_slot; /**< padding sentinel, usually -1 */
    void* slots;          /**< slot buffer */
} kvx_slot_mapping_t;

/** Cached length of each sequence (spec section 5.3). */
typedef struct kvx_seq_lens_t {
    uint32_t size;      /**< sizeof(kvx_seq_lens_t) */
    kvx_dtype_t dtype;  /**< S32 or S64 */
    uint32_t seq_count; /**< must equal the block table's seq_count */
    void* lengths;      /**< cached lengths buffer */
} kvx_seq_lens_t;

/** Quantization scales (spec section 6.6). `data` NULL means absent. */
typedef struct kvx_scale_desc_t {
    uint32_t size;                       /**< sizeof(kvx_scale_desc_t) */
    kvx_dtype_t dtype;                   /**< scale dtype */
    kvx_scale_granularity_t granularity; /**< what one scale covers */
    uint32_t ndim;                       /**< for non-scalar scales */
    int64_t shape[KVX_MAX_DIMS];         /**< scale shape */
    int64_t stride[KVX_MAX_DIMS];        /**< scale strides in elements */
    void* data;                          /**< scale data */
} kvx_scale_desc_t;

/** Cache pool base pointers (spec section 6.7); required for KV_OFFSETS, where
 *  a block's address is pool base + block index * bytes_per_block. */
typedef struct kvx_pool_desc_t {
    uint32_t size;             /**< sizeof(kvx_pool_desc_t) */
    kvx_memory_type_t memory;  /**< memory location of the pools */
    uint32_t bytes_per_block;  /**< required for KV_OFFSETS */
    void* primary;             /**< primary pool base */
    void* secondary;           /**< optional secondary pool base (KVCacheIndex bit 31) */
} kvx_pool_desc_t;

/** v1.1: how a quantized cache is encoded. The data pools are the cache
 *  descriptor's k/v (dtype k_data_dtype/v_data_dtype); the scale pools are
 *  strided tensors that share block ids with the data pools, allocated and
 *  freed in lockstep. */
typedef struct kvx_quant_desc_t {
    uint32_t size;                /**< sizeof(kvx_quant_desc_t) */
    kvx_quant_format_t format;    /**< cache format */
    uint32_t flags;               /**< KVX_QUANT_FLAG_* */
    uint32_t group_size;          /**< elements per scale group along head_dim (0 when not grouped) */
    kvx_dtype_t k_data_dtype;     /**< storage dtype of the K data pool */
    kvx_dtype_t v_data_dtype;     /**< storage dtype of the V data pool */
    kvx_tensor_desc_t k_scales;   /**< K scale pool, same block ids as the K data pool */
    kvx_tensor_desc_t v_scales;   /**< V scale pool, same block ids as the V data pool */
    const float* k_global_scale;  /**< FP32 global scale(s) for K, or NULL */
    const float* v_global_scale;  /**< FP32 global scale(s) for V, or NULL */
    uint32_t global_scale_count;  /**< 0 = none, 1 = per tensor, num_kv_heads = per head */
    const float* k_smoothing;     /**< v1.2: FP32 [num_kv_heads, head_dim] row-major, > 0, or NULL; with
                                       KVX_QUANT_FLAG_KEY_SMOOTHING */
    const float* k_center;        /**< v1.3: FP32 [num_kv_heads, head_dim] row-major, finite, or NULL; with
                                       KVX_QUANT_FLAG_KEY_CENTERING */
} kvx_quant_desc_t;

/** Size of a v1.1 kvx_quant_desc_t: everything before `k_smoothing`. A v1.2
 *  consumer accepts it and reads k_smoothing as NULL (the flag must then be clear). */
#define KVX_QUANT_DESC_V1_1_SIZE offsetof(kvx_quant_desc_t, k_smoothing)
/** Size of a v1.2 kvx_quant_desc_t: everything before `k_center`. A v1.3
 *  consumer accepts it and reads k_center as NULL (the flag must then be clear). */
#define KVX_QUANT_DESC_V1_2_SIZE offsetof(kvx_quant_desc_t, k_center)

/** A paged KV cache: separate K and V tensors of num_blocks blocks of
 *  block_size tokens (spec section 4.1, 6.1).
 *
 *  Size guard for the v1.1 tail `quant`:
 *   - a v1.0 consumer checks size >= KVX_CACHE_DESC_V1_0_SIZE and ignores the tail;
 *   - a v1.1 consumer treats `quant` as absent when size < sizeof(kvx_cache_desc_t)
 *     or quant == NULL (an unquantized cache described by k/v alone). */
typedef struct kvx_cache_desc_t {
    uint32_t size;          /**< sizeof(kvx_cache_desc_t), or KVX_CACHE_DESC_V1_0_SIZE from a v1.0 producer */
    uint32_t num_blocks;    /**< total physical blocks, non-zero */
    uint32_t block_size;    /**< tokens per block, non-zero */
    uint32_t num_kv_heads;  /**< KV heads, non-zero */
    uint32_t head_dim;      /**< dimension per KV head, non-zero */
    kvx_tensor_desc_t k;    /**< K buffer, layout, dtype, strides */
    kvx_tensor_desc_t v;    /**< V buffer, layout, dtype, strides */
    kvx_pool_desc_t pool;   /**< required for KVX_BLOCK_TABLE_KV_OFFSETS */
    const kvx_quant_desc_t* quant; /**< v1.1: quantization, NULL for an unquantized cache */
} kvx_cache_desc_t;

/** Size of a v1.0 kvx_cache_desc_t: everything before `quant`. */
#define KVX_CACHE_DESC_V1_0_SIZE offsetof(kvx_cache_desc_t, quant)

/** Token-major K/V tensors of a write or gather batch (spec section 6.8).
 *  Dense [num_tokens, num_kv_heads, head_dim] row-major is always accepted. */
typedef struct kvx_kv_io_desc_t {
    uint32_t size;          /**< sizeof(kvx_kv_io_desc_t) */
    kvx_tensor_desc_t key;  /**< keys for num_tokens (input of write, output of gather) */
    kvx_tensor_desc_t value;/**< values for num_tokens */
    uint32_t num_tokens;    /**< tokens in the batch */
    uint32_t num_kv_heads;  /**< must match the cache descriptor */
    uint32_t head_dim;      /**< must match the cache descriptor */
} kvx_kv_io_desc_t;

/** Arguments of kvx_write_kv (spec section 6.9). If k_scale_desc.data /
 *  v_scale_desc.data is NULL, k_scale / v_scale may be used as per-tensor F32. */
typedef struct kvx_write_desc_t {
    uint32_t size;                  /**< sizeof(kvx_write_desc_t) */
    kvx_kv_io_desc_t io;            /**< input K/V tensors */
    kvx_slot_mapping_t slots;       /**< destination slot per token */
    void* k_scale;                  /**< optional per-tensor F32 K scale */
    void* v_scale;                  /**< optional per-tensor F32 V scale */
    kvx_scale_desc_t k_scale_desc;  /**< optional FP8 K scale metadata */
    kvx_scale_desc_t v_scale_desc;  /**< optional FP8 V scale metadata */
} kvx_write_desc_t;

/** Arguments of kvx_gather_kv (spec section 6.10). */
typedef struct kvx_gather_desc_t {
    uint32_t size;                  /**< sizeof(kvx_gather_desc_t) */
    kvx_kv_io_desc_t io;            /**< output K/V tensors */
    kvx_block_table_t block_table;  /**< logical -> physical blocks */
    kvx_seq_lens_t seq_lens;        /**< cached length per sequence; seq_count matches block_table */
    uint32_t max_seq_len;           /**< max gathered tokens per sequence */
} kvx_gather_desc_t;

/* ------------------------------------------------------------------------- */
/* Entry points (spec section 7). Stateless and thread-safe for disjoint     */
/* cache regions; `stream` is an opaque CUDA/HIP stream, NULL = default.     */
/* ------------------------------------------------------------------------- */

/** Fill *version (including version->size). Always KVX_STATUS_OK for a
 *  non-NULL argument. */
KVX_API kvx_status_t kvx_get_version(kvx_version_t* version);

/** Check layout, dtype, shape, stride and required fields of a cache
 *  descriptor (spec section 7.1); KVX_STATUS_INVALID_ARGUMENT on failure. */
KVX_API kvx_status_t kvx_validate_cache_desc(const kvx_cache_desc_t* cache);

/** Write num_tokens K/V rows into the cache at their slots; invalid slots are
 *  no-ops. io dimensions must match the cache descriptor. */
KVX_API kvx_status_t kvx_write_kv(const kvx_cache_desc_t* cache, const kvx_write_desc_t* write,
                                  void* stream);

/** Gather each sequence's cached K/V (at most max_seq_len tokens) through the
 *  block table into io. */
KVX_API kvx_status_t kvx_gather_kv(const kvx_cache_desc_t* cache, const kvx_gather_desc_t* gather,
                                   void* stream);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* KVX_ABI_H */
