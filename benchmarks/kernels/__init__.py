"""The CUDA kernels alone (add_lora's shrink and expand, paged decode attention): timed on a GPU, or
read from their compiled SASS without one."""
