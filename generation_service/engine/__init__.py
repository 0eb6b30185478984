"""The engine: runs the model for many requests at once on one model thread (model_thread, scheduler), one draft-tree
step at a time (steps, requests, effects), with calibration of the pass costs (calibrate, pass_costs), thread and
admission policies, and the output stream types every decoding mode emits (speculative).

Above model/ and drafting/ (the drafts it verifies); below the retrieval-augmented modes (tests/ops/test_layering.py).
"""
