"""What hosts a worker process (prefill or decode) around the engine: options and stats, the
runtime with its single model thread and chunk loop (`host.py`), the gRPC server, discovery
registration, engine watchdog and drain, its Prometheus metrics (`metrics.py`) and the
`KvEventService` (`kv_event_service.py`). The engine package itself (model, KV, kernels) imports
no gRPC, discovery or transfer code."""
