"""The CPU kernels (block-quantized linears, the fused lean forward, the pass threads' claim pool): C++ sources and
build.py, which compiles them once per source hash and CPU and loads the extension."""
