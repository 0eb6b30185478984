"""gRPC plumbing shared by both services: wire encoding, health/reflection, graceful stop."""
