/* Internal interface between the generated registry (registry.c) and runtime.c. */
#ifndef SPARSEFORGE_REGISTRY_H
#define SPARSEFORGE_REGISTRY_H

#include <stdatomic.h>
#include <stdint.h>
#include <string.h>
#include <cuda_runtime.h>

typedef int (*sf_load_fn)(void);
typedef int (*sf_launch_fn)(const int64_t *words, cudaStream_t stream);

typedef struct {
    const char *name;
    sf_load_fn load;
    sf_launch_fn launch;
} sf_variant_entry;

extern const sf_variant_entry sf_registry[];
extern const int sf_registry_size;
/* Set once a variant's module is loaded (runtime.c). */
extern atomic_int sf_registry_loaded[];

/* Loads an exported module's embedded cubin into every device; returns a cudaError_t. */
typedef void (*sf_mlir_entry)(void **);
int sf_load_library(sf_mlir_entry init, sf_mlir_entry load_to_device, cudaLibrary_t *library);

static inline float sf_word_f32(int64_t word) {
    float value;
    uint32_t bits = (uint32_t)word;
    memcpy(&value, &bits, sizeof value);
    return value;
}

static inline int32_t sf_word_i32(int64_t word) { return (int32_t)word; }

#endif
