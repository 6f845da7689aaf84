"""The paged attention under transformers' attention interface: the step's metadata, the
SDPA and flash paths (paged.py), the Triton kernel (triton_kernel.py), the batch-invariant
path (invariant.py)."""
