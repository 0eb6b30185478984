"""The core library beneath both services (imports neither): draft trees and their wire form, tokenizer identity and
model files, the dense encoder, the kNN-LM store format, the gRPC server shell, the replicated client, the error
table, metrics and config plumbing. Map and rules: docs/ARCHITECTURE.md."""
