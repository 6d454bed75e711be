/* The stable C entry points: variant lookup, lazy module loading, launch. */
#include <pthread.h>

#include "sparseforge.h"
#include "sparseforge_registry.h"

#define SF_ERROR_BAD_VARIANT 100000

static pthread_mutex_t load_lock = PTHREAD_MUTEX_INITIALIZER;

int sf_load_library(sf_mlir_entry init, sf_mlir_entry load_to_device, cudaLibrary_t *library) {
    /* The same calls as the exported header's Module_Load, with errors returned. */
    cudaLibrary_t *library_ptr = library;
    cudaError_t ret = cudaSuccess;
    struct {
        cudaLibrary_t **library_ptr;
        cudaError_t *ret;
    } init_args = {&library_ptr, &ret};
    init((void **)&init_args);
    if (ret != cudaSuccess) return ret;
    int device_count = 0;
    ret = cudaGetDeviceCount(&device_count);
    if (ret != cudaSuccess) return ret;
    int32_t device_id = 0;
    struct {
        cudaLibrary_t **library_ptr;
        int32_t *device_id;
        cudaError_t *ret;
    } load_args = {&library_ptr, &device_id, &ret};
    for (int32_t i = 0; i < device_count; i++) {
        device_id = i;
        load_to_device((void **)&load_args);
        if (ret != cudaSuccess) return ret;
    }
    return cudaSuccess;
}

int sf_abi_version(void) { return SF_ABI_VERSION; }

int sf_variant_count(void) { return sf_registry_size; }

const char *sf_variant_name(int index) {
    if (index < 0 || index >= sf_registry_size) return 0;
    return sf_registry[index].name;
}

int sf_prepare(int index) {
    if (index < 0 || index >= sf_registry_size) return SF_ERROR_BAD_VARIANT;
    if (atomic_load_explicit(&sf_registry_loaded[index], memory_order_acquire)) return cudaSuccess;
    pthread_mutex_lock(&load_lock);
    int err = cudaSuccess;
    if (!atomic_load_explicit(&sf_registry_loaded[index], memory_order_relaxed)) {
        err = sf_registry[index].load();
        if (err == cudaSuccess) atomic_store_explicit(&sf_registry_loaded[index], 1, memory_order_release);
    }
    pthread_mutex_unlock(&load_lock);
    return err;
}

int sf_launch(int index, const int64_t *words, void *stream) {
    int err = sf_prepare(index);
    if (err != cudaSuccess) return err;
    return sf_registry[index].launch(words, (cudaStream_t)stream);
}

const char *sf_error_name(int code) {
    if (code == SF_ERROR_BAD_VARIANT) return "sfErrorBadVariant";
    return cudaGetErrorName((cudaError_t)code);
}

const char *sf_error_string(int code) {
    if (code == SF_ERROR_BAD_VARIANT) return "variant index out of range";
    return cudaGetErrorString((cudaError_t)code);
}
