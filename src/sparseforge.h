/* sparseforge kernels: the C entry points of libsparseforge_kernels.so.
 *
 * The Python runtime (python/sparseforge/_library.py) is the only intended caller; the
 * argument words of each variant follow its family ABI in manifest.json. Every function
 * returns a cudaError_t value (0 = success) unless it returns a count or a name.
 */
#ifndef SPARSEFORGE_H
#define SPARSEFORGE_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define SF_ABI_VERSION 1
#define SF_API __attribute__((visibility("default")))

SF_API int sf_abi_version(void);
SF_API int sf_variant_count(void);
SF_API const char *sf_variant_name(int index);
/* Load the variant's cubin into every device (idempotent, thread-safe). Call it outside
 * CUDA-graph capture; sf_launch loads on first use otherwise. */
SF_API int sf_prepare(int index);
/* Launch on `stream` (a cudaStream_t); returns the launch's error code. */
SF_API int sf_launch(int index, const int64_t *words, void *stream);
SF_API const char *sf_error_name(int code);
SF_API const char *sf_error_string(int code);

#ifdef __cplusplus
}
#endif

#endif
