"""The runtime: devices (emulated, CUDA), host stores, the transformers adapter and the plan executor.

Import from the submodules (`lazytrain.runtime.executor`, `.device`, `.store`, `.hf`); `lazytrain`
re-exports `Executor`, `EmulatedDevice` and `CudaDevice` lazily.
"""
