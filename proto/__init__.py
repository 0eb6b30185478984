"""Generated gRPC stubs live here (make stubs); the .proto files are the contract."""
