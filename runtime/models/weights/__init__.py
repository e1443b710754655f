"""Tensors in and out of memory: the only home of torch and safetensors.

This package owns how a bundle's shards become tensors. On the CPU it parses
the safetensors format itself (format.py) and copies every byte, with pread,
into memory the process owns (cpu.py): nothing stays mapped, so once a model is
loaded no change to the bundle's files (a rewrite, a truncation, another
version copied over it) can reach its answers or crash the process, and a
shard that changes while it is read fails the load (`open_weights`). On a
read-only filesystem, where no such change can happen, the shards are mapped
for the build instead, and only what the model keeps is copied out of them
once it is built (mapped.py): afterwards, too, nothing stays mapped. A CUDA
load goes through a pool of pinned staging buffers, copied to the device on a
stream of its own (staging.py); other devices load through safetensors
(device.py). Every path checks the chunk digests the fetch left to the load
(runtime/bundles/chunks.py) before a tensor leaves it.
Importing the framework, resolving the device and returning memory are
framework.py's; what the C allocator keeps of freed host memory is host.py's;
opening a bundle's tensors for its builder, verifying the chunks its fetch left
to the load, is loaded.py's. This module only re-exports.

Everything here imports torch lazily, so importing `runtime` (and serving
/healthz) never pays for it.
"""

from runtime.models.weights.format import MAX_HEADER_BYTES, check_header
from runtime.models.weights.framework import (
    device_memory_free,
    host_memory_limit,
    inference_mode,
    preload_framework,
    release,
    resolve_device,
)
from runtime.models.weights.loaded import Loaded, load_weights, open_weights, verified_stamps

__all__ = [
    "MAX_HEADER_BYTES",
    "Loaded",
    "check_header",
    "device_memory_free",
    "host_memory_limit",
    "inference_mode",
    "load_weights",
    "open_weights",
    "preload_framework",
    "release",
    "resolve_device",
    "verified_stamps",
]
