"""The target model: loading and weight formats (target, q4_weights), the lean forward (lean_llama), tree attention,
sampling, a pass's cost by rows (step_cost), and the CPU kernels with their build (kernels/).

The bottom layer of the generation service: imports nothing of the other packages (tests/ops/test_layering.py).
"""
